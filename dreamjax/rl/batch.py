"""Fixed-shape token batches for the update step, built on the host from rollouts (RL), target masks (SFT) or DPO pairs.

Every objective reads one `TokenBatch`: rows of token ids with per-token arrays aligned as in
`dreamjax.rl.logprobs` (entry t belongs to token t, scored from the logits at t - 1). Fields an objective does not use
stay zero. `loss_mask` is 1 on the tokens the loss covers; it is always 0 at t = 0 (no context to score it from).

Shapes come from a small set, so the jitted step compiles a handful of times per run: the length is padded up to a
multiple of `pad_to` and the rows up to a multiple of `row_multiple` (use micro-batches x data-parallel size) with
empty rows (no valid token, zero masks).

Micro-batch layout: the update splits a batch of B rows into k micro-batches by stride, micro-batch j holding rows
j, j + k, j + 2k, ... (`split_micro_batches`). Rows are sharded over the data axes in contiguous blocks, so a strided
split gives every micro-batch rows on every device. `dpo_batch` places each pair's rows inside one micro-batch, since
its loss couples rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dreamjax.rl.advantages import gae_advantages, grpo_advantages, whiten
from dreamjax.rl.logprobs import row_positions
from dreamjax.rollout.trajectory import Trajectories

ADVANTAGES = ("grpo", "gae_turn", "gae_token")


@flax.struct.dataclass
class TokenBatch:
  tokens: Int[Array, "B T"]
  positions: Int[Array, "B T"]
  valid: Bool[Array, "B T"]
  loss_mask: Float[Array, "B T"]
  old_logp: Float[Array, "B T"]  # rollout (behaviour) policy log-probs, for PPO/GRPO ratios
  ref_logp: Float[Array, "B T"]  # reference policy log-probs, for the KL term and DPO
  advantages: Float[Array, "B T"]
  returns: Float[Array, "B T"]  # value targets (PPO)
  old_values: Float[Array, "B T"]  # critic values at rollout time (PPO value clipping)
  pair: Int[Array, " B"]  # DPO pair id, local to the row's micro-batch
  chosen: Bool[Array, " B"]  # DPO: the row belongs to the chosen trajectory

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def length(self) -> int:
    return int(self.tokens.shape[1])


def _round_up(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def _empty(rows: int, length: int) -> dict[str, np.ndarray]:
  f = lambda: np.zeros((rows, length), np.float32)  # noqa: E731
  return dict(tokens=np.zeros((rows, length), np.int32), positions=np.zeros((rows, length), np.int32),
              valid=np.zeros((rows, length), bool), loss_mask=f(), old_logp=f(), ref_logp=f(), advantages=f(),
              returns=f(), old_values=f(), pair=np.zeros((rows,), np.int32), chosen=np.zeros((rows,), bool))


def _finish(d: dict[str, np.ndarray]) -> TokenBatch:
  d["positions"] = row_positions(d["valid"])
  d["loss_mask"] = np.where(d["valid"], d["loss_mask"], 0.0).astype(np.float32)
  d["loss_mask"][:, 0] = 0.0
  return TokenBatch(**d)


def split_micro_batches(batch: TokenBatch, k: int) -> TokenBatch:
  """[B, ...] leaves -> [k, B / k, ...], micro-batch j holding rows j, j + k, ... (works on NumPy and traced arrays)."""
  if batch.num_rows % k:
    raise ValueError(f"a batch of {batch.num_rows} rows does not split into {k} micro-batches; build it with "
                     f"row_multiple a multiple of {k}")
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def _check_rows(name: str, arr, shape: tuple[int, ...]) -> np.ndarray:
  arr = np.asarray(arr, np.float32)
  if arr.shape != shape:
    raise ValueError(f"rl_batch: {name} has shape {arr.shape}, expected {shape} (the trajectories' token rows)")
  return arr


def rl_batch(
    traj: Trajectories,
    *,
    advantage: str = "grpo",
    values: np.ndarray | None = None,
    old_logp: np.ndarray | None = None,
    ref_logp: np.ndarray | None = None,
    invalid_penalty: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    normalize_std: bool = True,
    whiten_advantages: bool = False,
    pad_to: int = 64,
    row_multiple: int = 1,
) -> TokenBatch:
  """A policy-gradient batch from rollouts; one batch row per turn row of `traj`.

  Turn rewards are the env's minus `invalid_penalty` on invalid turns (verl-agent's invalid-action penalty).
  - "grpo": each episode's return (sum of its turn rewards) is normalised within its group (`grpo_advantages`) and
    given to every action token of the episode's turns.
  - "gae_turn": GAE over turns (`gamma`, `lam` per turn) with the critic's value of each turn's state (`values` at the
    turn's first action token, i.e. the value head at its last prompt token); turn t's advantage goes to all its
    action tokens, and its return (advantage + value) is the value target of those tokens.
  - "gae_token": GAE over the episode's action tokens in order, each turn's reward on its last action token.
  Episodes the env failed on, or an exact env-step budget cut before their last answer was executed
  (`traj.left_out`), are left out: no loss on their tokens, and not part of their group's statistics. Episodes the
  env ended are terminal; an episode cut short by its turn or token budget bootstraps with the critic's value of its
  last turn (gae_turn) or last action token (gae_token): the state after it has no row, so that value is the nearest
  estimate. `values` [M, T] are aligned values from `LogpScorer(with_values=True)` on the trajectory rows.
  `old_logp` defaults to the rollout's own log-probs; `ref_logp` to zeros (no KL term).
  """
  if advantage not in ADVANTAGES:
    raise ValueError(f"rl_batch: unknown advantage {advantage!r}; expected one of {ADVANTAGES}")
  m, t = traj.tokens.shape
  if values is None and advantage != "grpo":
    raise ValueError(f"rl_batch: advantage {advantage!r} needs critic `values` [M, T] for the trajectory rows")
  kept = ~traj.left_out
  loss_mask = np.asarray(traj.loss_mask, np.float32) * kept[traj.episode][:, None]
  turn_reward = np.asarray(traj.reward, np.float32) - invalid_penalty * np.asarray(traj.invalid, np.float32)
  values = None if values is None else _check_rows("values", values, (m, t))
  n = traj.num_episodes
  adv_rows = np.zeros((m, t), np.float32)
  ret_rows = np.zeros((m, t), np.float32)

  if advantage == "grpo":
    returns = np.zeros((n,), np.float32)
    np.add.at(returns, traj.episode, turn_reward)
    adv = np.asarray(grpo_advantages(returns, traj.group, (traj.num_turns > 0) & kept,
                                     num_groups=int(traj.group.max()) + 1, normalize_std=normalize_std))
    adv_rows = adv[traj.episode][:, None] * loss_mask
  elif advantage == "gae_turn":
    turn_rows = traj.turn_rows
    on = turn_rows >= 0
    rows = np.where(on, turn_rows, 0)
    first = np.minimum(traj.prompt_lengths, t - 1)  # first action token of each row
    turn_value = values[np.arange(m), first]
    v = np.where(on, turn_value[rows], 0.0)
    r = np.where(on, turn_reward[rows], 0.0)
    last = rows[np.arange(n), np.maximum(traj.num_turns - 1, 0)]
    boot = np.where(traj.ended, 0.0, turn_value[last])
    adv, ret = (np.asarray(x) for x in gae_advantages(r, v, on, gamma=gamma, lam=lam, bootstrap=boot))
    adv_rows[rows[on]] = adv[on][:, None] * loss_mask[rows[on]]
    ret_rows[rows[on]] = ret[on][:, None] * loss_mask[rows[on]]
  else:
    adv_rows, ret_rows = _token_gae(traj, turn_reward, values, loss_mask, gamma, lam, pad_to)
  if whiten_advantages:
    adv_rows = np.asarray(whiten(adv_rows, loss_mask > 0))

  rows_out, length = _round_up(m, row_multiple), _round_up(t, pad_to)
  d = _empty(rows_out, length)
  valid = np.arange(t)[None, :] < np.asarray(traj.lengths)[:, None]
  d["tokens"][:m, :t] = np.where(valid, traj.tokens, 0)
  d["valid"][:m, :t] = valid
  d["loss_mask"][:m, :t] = loss_mask
  d["old_logp"][:m, :t] = traj.rollout_logp if old_logp is None else _check_rows("old_logp", old_logp, (m, t))
  if ref_logp is not None:
    d["ref_logp"][:m, :t] = _check_rows("ref_logp", ref_logp, (m, t))
  d["advantages"][:m, :t] = adv_rows
  d["returns"][:m, :t] = ret_rows
  if values is not None:
    d["old_values"][:m, :t] = values
  return _finish(d)


def _token_gae(traj: Trajectories, turn_reward, values, loss_mask, gamma, lam, pad_to):
  """GAE along each episode's action tokens (all its turns concatenated in order)."""
  m, t = traj.tokens.shape
  n = traj.num_episodes
  places = []  # per episode: (rows, cols) of its action tokens in order
  for e in range(n):
    rows = traj.turn_rows[e, :traj.num_turns[e]]
    rr, cc = [], []
    for row in rows:
      cols = np.flatnonzero(loss_mask[row])
      rr.append(np.full(len(cols), row))
      cc.append(cols)
    places.append((np.concatenate(rr + [np.zeros(0, int)]).astype(int), np.concatenate(cc + [np.zeros(0, int)])))
  width = _round_up(max([len(r) for r, _ in places] + [1]), pad_to)
  r = np.zeros((n, width), np.float32)
  v = np.zeros((n, width), np.float32)
  on = np.zeros((n, width), bool)
  boot = np.zeros((n,), np.float32)
  for e, (rows, cols) in enumerate(places):
    k = len(rows)
    if not k:
      continue
    on[e, :k] = True
    v[e, :k] = values[rows, cols]
    turn_end = np.append(rows[1:] != rows[:-1], True)  # last action token of each turn
    r[e, :k][turn_end] = turn_reward[rows[turn_end]]
    boot[e] = 0.0 if traj.ended[e] else v[e, k - 1]
  adv, ret = (np.asarray(x) for x in gae_advantages(r, v, on, gamma=gamma, lam=lam, bootstrap=boot))
  adv_rows = np.zeros((m, t), np.float32)
  ret_rows = np.zeros((m, t), np.float32)
  for e, (rows, cols) in enumerate(places):
    adv_rows[rows, cols] = adv[e, :len(rows)]
    ret_rows[rows, cols] = ret[e, :len(rows)]
  return adv_rows, ret_rows


def _as_row(ids, mask, where: str) -> tuple[np.ndarray, np.ndarray]:
  ids = np.asarray(ids)
  mask = np.asarray(mask)
  if ids.ndim != 1 or mask.shape != ids.shape:
    raise ValueError(f"{where}: token ids {ids.shape} and loss mask {mask.shape} must be 1-D of equal length")
  if not len(ids):
    raise ValueError(f"{where}: empty row")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError(f"{where}: loss mask must hold only 0 and 1")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{where}: token ids must be integers, got {ids.dtype}")
  return ids.astype(np.int32), mask.astype(np.float32)


def sft_batch(ids_list: Sequence[Sequence[int]], loss_mask_list: Sequence[Sequence[int]], *, pad_to: int = 64,
              row_multiple: int = 1) -> TokenBatch:
  """Rows of token ids with a 0/1 target mask (behaviour cloning; the experience model's Eq. 5 targets)."""
  if len(ids_list) != len(loss_mask_list):
    raise ValueError(f"sft_batch: {len(ids_list)} rows of ids but {len(loss_mask_list)} loss masks")
  rows = [_as_row(i, k, f"sft_batch row {r}") for r, (i, k) in enumerate(zip(ids_list, loss_mask_list))]
  length = _round_up(max([len(i) for i, _ in rows] + [1]), pad_to)
  d = _empty(_round_up(len(rows), row_multiple), length)
  for r, (ids, mask) in enumerate(rows):
    d["tokens"][r, :len(ids)] = ids
    d["valid"][r, :len(ids)] = True
    d["loss_mask"][r, :len(ids)] = mask
  return _finish(d)


Row = tuple[Sequence[int], Sequence[int]]  # (token ids, 0/1 loss mask)


def dpo_batch(pairs: Sequence[tuple[Sequence[Row], Sequence[Row]]], *, micro_batches: int = 1, pad_to: int = 64,
              row_multiple: int = 1) -> TokenBatch:
  """Preference pairs (chosen rows, rejected rows); a trajectory may span several rows (one per turn), all carrying
  its pair id and chosen flag. Each pair lands whole in one micro-batch (balanced by row count) with a pair id local
  to it; `row_multiple` must be a multiple of `micro_batches`. `ref_logp` is left at zero: fill it with
  `batch.replace(ref_logp=...)` from a `LogpScorer` on the reference policy."""
  if not pairs:
    raise ValueError("dpo_batch: no pairs")
  if row_multiple % micro_batches:
    raise ValueError(f"dpo_batch: row_multiple {row_multiple} must be a multiple of micro_batches {micro_batches}")
  buckets: list[list[tuple[int, bool, np.ndarray, np.ndarray]]] = [[] for _ in range(micro_batches)]
  counts = [0] * micro_batches
  for p, (chosen_rows, rejected_rows) in enumerate(pairs):
    if not chosen_rows or not rejected_rows:
      raise ValueError(f"dpo_batch pair {p}: needs at least one chosen and one rejected row")
    j = int(np.argmin([len(b) for b in buckets]))
    local = counts[j]
    counts[j] += 1
    for flag, rows in ((True, chosen_rows), (False, rejected_rows)):
      for r, (ids, mask) in enumerate(rows):
        where = f"dpo_batch pair {p} {'chosen' if flag else 'rejected'} row {r}"
        buckets[j].append((local, flag, *_as_row(ids, mask, where)))
  per_micro = _round_up(max(len(b) for b in buckets), row_multiple // micro_batches)
  length = _round_up(max([len(row[2]) for b in buckets for row in b] + [1]), pad_to)
  d = _empty(per_micro * micro_batches, length)
  for j, bucket in enumerate(buckets):
    for i, (local, flag, ids, mask) in enumerate(bucket):
      r = i * micro_batches + j
      d["tokens"][r, :len(ids)] = ids
      d["valid"][r, :len(ids)] = True
      d["loss_mask"][r, :len(ids)] = mask
      d["pair"][r], d["chosen"][r] = local, flag
  return _finish(d)
