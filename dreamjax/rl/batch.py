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

Shared prefixes (`shared_prefix_batch`): rows that start with the same tokens (a GRPO group's turn-0 rows share their
whole prompt, every row of a task its system prompt and instruction) can have that prefix's layer work done once. The
batch is rebuilt on the host: the rows are clustered by their common prefixes (never into a loss token), each cluster
keeps one prefix row ([groups, P] `prefix_tokens` / `prefix_valid` of a `SharedPrefixBatch`) and each row keeps only
its suffix, the [B, T] arrays shifted left by its prefix length, with RoPE positions continuing the prefix's and
`prefix_index` naming its prefix row. `token_logps` runs the prefixes into a KV cache, gathers each row's and runs the
suffixes against it: the same log-probs, entropies and values on every token the loss reads, to float32 rounding, and
the same gradients (they flow into a prefix once per row, summed). Rows are reordered so that each cluster lies in one
micro-batch where it fits (a cluster split between micro-batches recomputes its prefix in each), and prefix rows are
laid out by stride like the rows, with `prefix_index` local to the micro-batch (as DPO's pair ids), so
`split_micro_batches` splits both. Losses are sums over rows, so the order and the micro-batch a row lands in change
nothing but rounding; DPO's pairs are not kept together, so it is for the per-row objectives (policy gradient, SFT).
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

ADVANTAGES = ("grpo", "gigpo", "gae_turn", "gae_token")
INVALID_CREDIT = ("episode", "turn")  # where GRPO puts the invalid-action penalty (rl_batch)


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
  # The tokens each token was drawn among (Trajectories.allowed), -1 padded; width 0 or None: drawn from the whole
  # vocabulary. Log-probs are renormalised over a token's allowed set wherever it has one (dreamjax.rl.logprobs).
  allowed: Int[Array, "B T A"] | None = flax.struct.field(default=None, kw_only=True)

  @property
  def prefix(self) -> tuple[Array, Array, Array] | None:
    """Shared prefixes for `token_logps` (`SharedPrefixBatch`); None: every row is whole."""
    return None

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def length(self) -> int:
    return int(self.tokens.shape[1])


@flax.struct.dataclass
class SharedPrefixBatch(TokenBatch):
  """A `TokenBatch` whose [B, T] arrays hold each row's suffix after a shared prefix (`shared_prefix_batch`)."""

  prefix_tokens: Int[Array, "Q P"]  # one row per prefix, valid slots first
  prefix_valid: Bool[Array, "Q P"]
  prefix_index: Int[Array, " B"]  # the row's prefix row, local to its micro-batch

  @property
  def prefix(self) -> tuple[Array, Array, Array]:
    return self.prefix_tokens, self.prefix_valid, self.prefix_index


GROUPED_WIDTH = 128  # width granularity of length-grouped batches: few compilations, little padding


def length_grouped(window: np.ndarray, lengths: np.ndarray, batch_size: int, rng: np.random.Generator
                   ) -> list[np.ndarray]:
  """The row indices of `window` sorted by `lengths` (stably), cut into batches of `batch_size` (the last may be
  short) and taken in a seeded random order: each batch holds rows of about one length, so it pads little, and the
  order of lengths is still random."""
  window = window[np.argsort(lengths[window], kind="stable")]
  batches = [window[i:i + batch_size] for i in range(0, len(window), batch_size)]
  return [batches[i] for i in rng.permutation(len(batches))]


def _round_up(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def _empty(rows: int, length: int) -> dict[str, np.ndarray]:
  f = lambda: np.zeros((rows, length), np.float32)  # noqa: E731
  return dict(tokens=np.zeros((rows, length), np.int32), positions=np.zeros((rows, length), np.int32),
              valid=np.zeros((rows, length), bool), loss_mask=f(), old_logp=f(), ref_logp=f(), advantages=f(),
              returns=f(), old_values=f(), pair=np.zeros((rows,), np.int32), chosen=np.zeros((rows,), bool),
              allowed=np.full((rows, length, 0), -1, np.int32))


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
    episode_weights: bool = False,
    invalid_credit: str = "episode",
    step_weight: float = 1.0,
    pad_to: int = 64,
    row_multiple: int = 1,
) -> TokenBatch:
  """A policy-gradient batch from rollouts; one batch row per turn row of `traj`.

  Turn rewards are the env's minus `invalid_penalty` on invalid turns (verl-agent's invalid-action penalty).
  - "grpo": each episode's return (sum of its turn rewards) is normalised within its group (`grpo_advantages`) and
    given to every action token of the episode's turns.
  - "gigpo" (GiGPO, verl-agent): "grpo"'s episode advantage plus `step_weight` times a step advantage
    (`step_advantages`): turns of one group that started in the same env state are compared by their discounted
    returns-to-go (`gamma` per turn), so the action taken there is credited, not only the episode.
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

  `invalid_credit` (grpo only): "episode" puts the invalid-action penalty in the episode's return, as above, so it
  reaches every turn of the episode through the group comparison. "turn" leaves it out of the return (the group
  compares env rewards only) and subtracts it from the advantage of the invalid turn alone: an immediate, turn-level
  REINFORCE term with baseline 0, so only invalid actions are pushed down, by `invalid_penalty` each. With episode
  credit an invalid turn is told apart from the valid turns of its episode only by chance; a policy whose failures
  are mostly invalid actions (a misspelled item it was asked to copy) gets no signal about which turn was wrong.

  `episode_weights`: each turn row's loss weight is scaled by 1 / (its episode's turn rows), times the mean number of
  rows per kept episode (so weights average 1 over rows): every episode weighs the same in the update, as every
  sequence does in single-turn GRPO. Without it an episode weighs as many turns as it took, and where success ends an
  episode early the long failed episodes outweigh the short successful ones.
  """
  if advantage not in ADVANTAGES:
    raise ValueError(f"rl_batch: unknown advantage {advantage!r}; expected one of {ADVANTAGES}")
  if invalid_credit not in INVALID_CREDIT or (invalid_credit == "turn" and advantage != "grpo"):
    raise ValueError(f"rl_batch: invalid_credit {invalid_credit!r} must be one of {INVALID_CREDIT} ('turn' with the "
                     f"grpo advantage only: GAE already credits the penalty to its turn), got advantage {advantage!r}")
  m, t = traj.tokens.shape
  if values is None and advantage.startswith("gae"):
    raise ValueError(f"rl_batch: advantage {advantage!r} needs critic `values` [M, T] for the trajectory rows")
  kept = ~traj.left_out
  loss_mask = np.asarray(traj.loss_mask, np.float32) * kept[traj.episode][:, None]
  turn_reward = np.asarray(traj.reward, np.float32) - invalid_penalty * np.asarray(traj.invalid, np.float32)
  values = None if values is None else _check_rows("values", values, (m, t))
  n = traj.num_episodes
  adv_rows = np.zeros((m, t), np.float32)
  ret_rows = np.zeros((m, t), np.float32)

  if advantage in ("grpo", "gigpo"):
    per_turn = invalid_credit == "turn"
    returns = np.zeros((n,), np.float32)
    np.add.at(returns, traj.episode, np.asarray(traj.reward, np.float32) if per_turn else turn_reward)
    adv = np.asarray(grpo_advantages(returns, traj.group, (traj.num_turns > 0) & kept,
                                     num_groups=int(traj.group.max()) + 1, normalize_std=normalize_std))
    row_adv = adv[traj.episode] - (invalid_penalty * np.asarray(traj.invalid, np.float32) if per_turn else 0.0)
    if advantage == "gigpo":
      row_adv = row_adv + step_weight * step_advantages(traj, turn_reward, gamma, normalize_std)
    adv_rows = row_adv[:, None] * loss_mask
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
  if episode_weights:  # the loss's weights only: the advantages above are per token, unweighted
    rows_per_episode = np.bincount(traj.episode, minlength=traj.num_episodes).astype(np.float32)
    kept_rows = rows_per_episode * kept
    scale = kept_rows.sum() / max(1, int((kept_rows > 0).sum()))
    d["loss_mask"][:m, :t] *= (scale / np.maximum(rows_per_episode, 1.0))[traj.episode][:, None]
  d["old_logp"][:m, :t] = traj.rollout_logp if old_logp is None else _check_rows("old_logp", old_logp, (m, t))
  if ref_logp is not None:
    d["ref_logp"][:m, :t] = _check_rows("ref_logp", ref_logp, (m, t))
  d["advantages"][:m, :t] = adv_rows
  d["returns"][:m, :t] = ret_rows
  if traj.allowed is not None and traj.allowed.shape[-1]:
    # The width rounded up to a power of two, so that a run's batches compile for a few widths.
    d["allowed"] = np.full((rows_out, length, 1 << (traj.allowed.shape[-1] - 1).bit_length()), -1, np.int32)
    d["allowed"][:m, :t, :traj.allowed.shape[-1]] = traj.allowed
  if values is not None:
    d["old_values"][:m, :t] = values
  return _finish(d)


def anchor_groups(traj: Trajectories) -> np.ndarray:
  """int32 [M]: each turn row's GiGPO step group, numbered in order of first appearance: the rows of one GRPO group
  (task) whose turns started in the same env state, told by the state's text and its admissible actions (the text
  alone can repeat in different states: "Nothing happens."). The states come from `traj.records`."""
  if len(traj.records) != traj.num_episodes:
    raise ValueError(f"anchor_groups: the trajectories hold {len(traj.records)} episode records for "
                     f"{traj.num_episodes} episodes; GiGPO's step groups read each turn's state from them")
  ids: dict[tuple, int] = {}
  out = np.empty(traj.num_rows, np.int32)
  for row, (e, k) in enumerate(zip(traj.episode.tolist(), traj.turn.tolist())):
    steps = traj.records[e].steps
    if k >= len(steps):
      raise ValueError(f"anchor_groups: turn row {row} is turn {k} of episode {e}, whose record has {len(steps)} steps")
    out[row] = ids.setdefault((int(traj.group[e]), steps[k].state, steps[k].admissible), len(ids))
  return out


def turn_returns(traj: Trajectories, turn_reward: np.ndarray, gamma: float) -> np.ndarray:
  """float32 [M]: each turn row's discounted return-to-go in its episode, sum over k >= t of gamma^(k - t) r_k."""
  on = traj.turn_rows >= 0
  rows = np.where(on, traj.turn_rows, 0)
  rewards = np.where(on, np.asarray(turn_reward, np.float32)[rows], 0.0)  # 0 past an episode's end
  out = np.zeros(traj.num_rows, np.float32)
  running = np.zeros(traj.num_episodes, np.float32)
  for k in reversed(range(rows.shape[1])):
    running = rewards[:, k] + np.float32(gamma) * running
    out[rows[on[:, k], k]] = running[on[:, k]]
  return out


def step_advantages(traj: Trajectories, turn_reward: np.ndarray, gamma: float, normalize_std: bool) -> np.ndarray:
  """float32 [M]: GiGPO's step advantage of each turn row, its return-to-go (`turn_returns`) normalised within its
  step group (`anchor_groups`) as GRPO normalises returns within a task's group. A state only one kept turn reached,
  or one whose turns all returned the same, gives 0; rows of left-out episodes get 0 and count in no group."""
  anchors = anchor_groups(traj)
  kept = ~traj.left_out[traj.episode]
  return np.asarray(grpo_advantages(turn_returns(traj, turn_reward, gamma), anchors, kept,
                                    num_groups=int(anchors.max(initial=0)) + 1, normalize_std=normalize_std))


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
              row_multiple: int = 1, allowed: Sequence[tuple[int, np.ndarray]] | None = None,
              allowed_width: int = 0) -> TokenBatch:
  """Rows of token ids with a 0/1 target mask (behaviour cloning; the experience model's Eq. 5 targets). `allowed`:
  per row, (position of its first token with an allowed set, [N, A] sets of the next N tokens, -1 padded), stored in
  a batch-wide width `allowed_width` (at least every row's A; fixed per run, so batches compile once), where the loss
  scores a token among its set alone (`TokenBatch.allowed`)."""
  if len(ids_list) != len(loss_mask_list):
    raise ValueError(f"sft_batch: {len(ids_list)} rows of ids but {len(loss_mask_list)} loss masks")
  rows = [_as_row(i, k, f"sft_batch row {r}") for r, (i, k) in enumerate(zip(ids_list, loss_mask_list))]
  length = _round_up(max([len(i) for i, _ in rows] + [1]), pad_to)
  d = _empty(_round_up(len(rows), row_multiple), length)
  for r, (ids, mask) in enumerate(rows):
    d["tokens"][r, :len(ids)] = ids
    d["valid"][r, :len(ids)] = True
    d["loss_mask"][r, :len(ids)] = mask
  if allowed is not None:
    if len(allowed) != len(rows):
      raise ValueError(f"sft_batch: {len(rows)} rows but {len(allowed)} allowed sets")
    d["allowed"] = np.full((*d["tokens"].shape, allowed_width), -1, np.int32)
    for r, (start, sets) in enumerate(allowed):
      if sets.shape[1] > allowed_width or start + len(sets) > len(rows[r][0]):
        raise ValueError(f"sft_batch row {r}: allowed sets {sets.shape} from position {start} do not fit a row of "
                         f"{len(rows[r][0])} tokens and allowed_width {allowed_width}")
      d["allowed"][r, start:start + len(sets), :sets.shape[1]] = sets
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


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
  m = min(len(a), len(b))
  diff = np.flatnonzero(a[:m] != b[:m])
  return int(diff[0]) if len(diff) else m


def _plan(seqs: list[np.ndarray], lengths: list[int], k: int, per: int, dp: int, pad_to: int
          ) -> tuple[list[list[tuple[int, list[int]]]], int, int]:
  """The cheapest layout of rows 0 .. n - 1 (lengths `lengths`, prefix candidates `seqs`): (per micro-batch a list
  of (prefix length, rows), prefix length P, suffix length S).

  Every row fits in one prefix row of P slots plus its suffix of S slots, so the step's token slots are those of
  k x Q prefix rows of P plus B rows of S (Q prefix rows per micro-batch). For each S (multiples of `pad_to` from the
  longest a row's loss needs), rows sorted lexicographically are cut greedily into the fewest clusters whose common
  prefix (the least of neighbours' common prefixes: rows with long common prefixes are neighbours once sorted) leaves
  every member's suffix within S: a cluster that fits stays one when shortened, so the greedy cut is minimal. A lone
  row is a cluster of its own whole candidate. The S with the fewest slots wins. Clusters then fill micro-batch 0,
  then 1, ... in sorted order, a cluster that does not fit being split (each part recomputes the prefix)."""
  n = len(seqs)
  order = sorted(range(n), key=lambda i: tuple(seqs[i].tolist()))
  link = [_lcp(seqs[order[i]], seqs[order[i + 1]]) for i in range(n - 1)]
  shortest = _round_up(max(lengths[i] - len(seqs[i]) for i in range(n)), pad_to)
  best = None
  for slen in range(shortest, _round_up(max(lengths), pad_to) + 1, pad_to):
    clusters, start = [], 0  # (common prefix, longest row, sorted positions)
    shared, longest = len(seqs[order[0]]), lengths[order[0]]
    for i in range(1, n + 1):
      if i < n:
        s2, l2 = min(shared, link[i - 1]), max(longest, lengths[order[i]])  # a link is at most either candidate
        if s2 >= l2 - slen:
          shared, longest = s2, l2
          continue
      clusters.append((shared, longest, order[start:i]))
      if i < n:
        start, shared, longest = i, len(seqs[order[i]]), lengths[order[i]]
    plen = _round_up(max(longest - slen for _, longest, _ in clusters), pad_to)
    micro: list[list[tuple[int, list[int]]]] = [[] for _ in range(k)]
    j = used = 0
    for shared, _, members in clusters:
      while members:
        if used == per:
          j, used = j + 1, 0
        part, members = members[:per - used], members[per - used:]
        micro[j].append((min(shared, plen), part))
        used += len(part)
    q = max(len(m) for m in micro)
    q = _round_up(1 << (q - 1).bit_length(), dp)
    cost = q * k * plen + k * per * slen
    if best is None or cost < best[0]:
      best = (cost, micro, plen, slen)
  return best[1:]


def shared_prefix_batch(batch: TokenBatch, *, micro_batches: int = 1, row_multiple: int = 1, pad_to: int = 64
                        ) -> SharedPrefixBatch:
  """`batch` (host, rows whole) with shared prefixes (see the module docstring); rows may come in any order.

  A row's prefix is at most its tokens before the one that predicts its first loss token (its whole row less one
  token when it has none), so every token the loss reads, and the value at a turn's first action token, is computed
  in the suffix. The clusters and both lengths are chosen for the fewest token slots (`_plan`). Shapes: the rows stay
  `batch.num_rows` (a multiple of `row_multiple`, micro-batches x data-parallel size), the prefix rows per
  micro-batch are rounded up to a power of two and a multiple of the data-parallel size, and both lengths up to a
  multiple of `pad_to`, so a stream of batches compiles a few times."""
  return shared_prefix_layout(batch, micro_batches=micro_batches, row_multiple=row_multiple, pad_to=pad_to)[0]


def shared_prefix_layout(batch: TokenBatch, *, micro_batches: int = 1, row_multiple: int = 1, pad_to: int = 64
                         ) -> tuple[SharedPrefixBatch, np.ndarray, np.ndarray]:
  """`shared_prefix_batch`, and where each of its rows came from: (batch, source row [B] (-1: an empty row), prefix
  length [B]), so that a suffix's per-token output goes back to source row r at columns offset.. (`LogpScorer`)."""
  if batch.prefix is not None:
    raise ValueError("shared_prefix_batch: the batch already has shared prefixes")
  if row_multiple % micro_batches or batch.num_rows % row_multiple:
    raise ValueError(f"shared_prefix_batch: {batch.num_rows} rows, micro_batches {micro_batches} and row_multiple "
                     f"{row_multiple}: need rows a multiple of row_multiple, a multiple of micro_batches")
  host = {f: np.asarray(getattr(batch, f)) for f in _empty(0, 0) if f != "allowed"}
  host["allowed"] = np.full((*host["tokens"].shape, 0), -1, np.int32) if batch.allowed is None else \
      np.asarray(batch.allowed)
  valid, loss_mask, tokens = host["valid"], host["loss_mask"], host["tokens"]
  b, t = tokens.shape
  lengths = valid.sum(-1)
  if not (valid == (np.arange(t)[None] < lengths[:, None])).all():
    raise ValueError("shared_prefix_batch: each row's valid tokens must come first (rows as rl_batch builds them)")
  rows = [r for r in range(b) if lengths[r]] or [0]  # an all-empty batch still gets the layout
  seqs = []
  for r in rows:
    loss = np.flatnonzero(loss_mask[r])
    seqs.append(tokens[r, :max(int(loss[0]) - 1 if len(loss) else int(lengths[r]) - 1, 0)])
  k = micro_batches
  micro, plen, slen = _plan(seqs, [int(lengths[r]) for r in rows], k, b // k, row_multiple // k, pad_to)
  q = _round_up(1 << (max(len(m) for m in micro) - 1).bit_length(), row_multiple // k)

  d = _empty(b, slen)
  d["allowed"] = np.full((b, slen, host["allowed"].shape[-1]), -1, np.int32)
  d.update(prefix_tokens=np.zeros((q * k, plen), np.int32), prefix_valid=np.zeros((q * k, plen), bool),
           prefix_index=np.zeros((b,), np.int32))
  source, offset = np.full((b,), -1, np.int32), np.zeros((b,), np.int32)
  for j, entries in enumerate(micro):
    i = 0
    for e, (p, part) in enumerate(entries):
      first = rows[part[0]]
      d["prefix_tokens"][e * k + j, :p] = tokens[first, :p]
      d["prefix_valid"][e * k + j, :p] = True
      for x in part:
        r = rows[x]
        row, n = i * k + j, int(lengths[r]) - p
        for f in ("tokens", "valid", "loss_mask", "old_logp", "ref_logp", "advantages", "returns", "old_values",
                  "allowed"):
          d[f][row, :n] = host[f][r, p:p + n]
        d["positions"][row, :n] = p + np.arange(n)
        d["pair"][row], d["chosen"][row], d["prefix_index"][row] = host["pair"][r], host["chosen"][r], e
        source[row], offset[row] = (r, p) if lengths[r] else (-1, 0)
        i += 1
  d["loss_mask"] = np.where(d["valid"], d["loss_mask"], 0.0).astype(np.float32)
  return SharedPrefixBatch(**d), source, offset


def prefix_stats(batch: SharedPrefixBatch, micro_batches: int = 1) -> dict[str, float]:
  """How much of a `shared_prefix_batch`'s (built with `micro_batches`) row tokens its prefixes cover:
  `shared_frac` = 1 - tokens computed (prefix rows' + suffixes') / the rows' own tokens, and `slot_ratio` = token
  slots of the padded shapes (prefix rows x P + rows x S) over those of `rows x longest row` (the per-row batch's
  shape before its length is rounded up)."""
  valid, pvalid = np.asarray(batch.valid), np.asarray(batch.prefix_valid)
  k = micro_batches
  idx = np.asarray(batch.prefix_index) * k + np.arange(valid.shape[0]) % k  # the rows' prefix rows, global
  suffix, prefix = valid.sum(-1), pvalid.sum(-1)
  live = suffix > 0
  row_tokens = int((suffix + prefix[idx])[live].sum())
  computed = int(suffix.sum() + prefix[np.unique(idx[live])].sum())
  longest = int((suffix + prefix[idx])[live].max(initial=1))
  return dict(rows=int(live.sum()), prefixes=int((prefix[np.unique(idx[live])] > 0).sum()), row_tokens=row_tokens,
              computed_tokens=computed, shared_frac=1 - computed / max(row_tokens, 1),
              slot_ratio=(pvalid.size + valid.size) / (valid.shape[0] * longest))
