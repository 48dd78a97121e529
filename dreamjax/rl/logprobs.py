"""Per-token log-probabilities, entropies and values of given token rows, for the update and for frozen policies.

Alignment (the contract of `dreamjax.rollout.trajectory`): `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`, read
from the logits at t - 1; it is 0 at t = 0 and wherever token t or token t - 1 is not valid (a token with no valid
context has no defined probability). `entropy[b, t]` is the entropy of that same predictive distribution, and
`values[b, t]` is the value head at t - 1: the value of the state in which token t was chosen. So one mask (the loss
mask over sampled tokens) selects matching log-probs, entropies and values, and the value at a turn's first action
token is the value of the turn's state (its last prompt token).

Memory: the model's own output holds [B, T, V] float32 logits (about 4 GB per row of 8k tokens over a 128k
vocabulary, more with gradients). Here the model returns its final hidden states instead (`return_hidden`; the unused
logits are dead code that XLA drops) and the vocabulary projection runs in chunks of positions under `lax.map`, each
chunk keeping only a logsumexp and the picked logit, with `jax.checkpoint` so the backward pass recomputes a chunk's
logits instead of storing them. The projection repeats the model's own head einsum (same dtypes,
float32 accumulation), which keeps these log-probs equal to the sampler's (tested to 1e-5).

Scored positions: the losses and the reference scores read log-probs on the loss tokens only (a rollout row's sampled
action tokens; its prompt, often most of the row, is context). With `score_mask` (and a static `score_len` from
`score_len_for`), the hidden states that predict those tokens are gathered into [B, score_len] first and only they are
projected: a third of the vocabulary matmuls on 128-token prompts with 64 sampled tokens, where the head is ~40% of the
standard benchmark model's FLOPs. Log-probs (and entropies) are then 0 outside the mask; values are not affected.

`temperature` divides the logits as the sampler does, so importance ratios compare like with like. `allowed` (a token's
allowed set, from a rollout that drew its answers among the admissible actions) sets the logits outside the set to
-inf after the temperature, as the sampler did, so the log-probs and entropies are those of the distribution the
token was drawn from.

Shared prefixes (`prefix`, built by `dreamjax.rl.batch.shared_prefix_batch`): each prefix row is run once into a
KV cache (the cache path of the same `Transformer`, differentiable), each row gathers its prefix's keys and values
and runs only its suffix against them, with positions continuing the prefix's. A query sees the same valid keys at
the same RoPE positions as in the whole row, so every output equals the per-row forward's up to float32 rounding
(softmax sums in another order); the suffix's first token has no in-row predecessor and is not scored, which is why
prefixes stop before the token that predicts a row's first loss token. Stacked layers (`scan_layers`) serve
cache-free forwards only, so they are refused here.

Critic values: `token_values` reads the same aligned values from a model with a value head but no LM head (PPO's
separate critic, `dreamjax.rl.critic`), and `LogpScorer(values_only=True)` scores them in the scorer's batches.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dreamjax.models.config import ModelConfig
from dreamjax.models.transformer import KVCache, ModelOutput, Transformer
from dreamjax.parallel.distributed import to_devices, to_host
from dreamjax.parallel.sharding import TRAIN_RULES, Rules, constrain, named_sharding
from dreamjax.rl.losses import entropy_from_logits

# Above this many logits per forward (256 MB in float32, counted over the global batch), the projection is chunked
# over positions. Measured on CPU (B=4, T=1024, V=32k, gradient): 984 MiB of temporaries in one piece, 407 MiB in
# chunks of 128 positions (a plain log_softmax over the model's logits: 1238 MiB).
MAX_LOGITS = 1 << 26


@flax.struct.dataclass
class TokenLogps:
  logp: Float[Array, "B T"]
  entropy: Float[Array, "B T"] | None
  values: Float[Array, "B T"] | None


def _head(cfg: ModelConfig, params) -> Array:
  return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def _project(hidden, head, targets, allowed, *, cfg: ModelConfig, temperature: float, with_entropy: bool):
  """Log-prob of `targets` and entropy under the logits of `hidden` ([B, C, E] -> [B, C] each), renormalised over
  `allowed` ([B, C, A], -1 padded) at positions that have an allowed set."""
  dt = jnp.dtype(cfg.dtype)
  logits = jnp.einsum("bte,ev->btv", hidden, head.astype(dt), preferred_element_type=jnp.float32)
  logits = constrain(logits, ("batch", "seq", "act_vocab"))
  if temperature != 1.0:
    logits = logits / temperature
  if allowed.shape[-1]:  # the sampler's restriction: -inf outside the set (out-of-range ids are dropped)
    b, c, _ = allowed.shape
    ids = jnp.where(allowed >= 0, allowed, logits.shape[-1])
    member = jnp.zeros(logits.shape, bool).at[jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None], ids].set(
        True, mode="drop")
    logits = jnp.where(member | ~jnp.any(allowed >= 0, -1)[..., None], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  # A compare-and-select instead of a gather: it fuses with the reduction and stays local when the vocabulary is
  # sharded over `tensor`.
  vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
  entropy = entropy_from_logits(logits) if with_entropy else jnp.zeros_like(lse)
  return picked - lse, entropy


def _project_positions(project, hidden, targets, allowed, chunk_size: int | None, vocab: int):
  """`project` over [B, C] positions, in chunks of positions when B x C x V logits would exceed MAX_LOGITS."""
  b, t = targets.shape
  if chunk_size is None:
    chunk_size = t if b * t * vocab <= MAX_LOGITS else max(1, MAX_LOGITS // (b * vocab))
  if chunk_size >= t:
    return project(hidden, targets=targets, allowed=allowed)
  n = -(-t // chunk_size)
  pad = n * chunk_size - t
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk_size, -1).swapaxes(0, 1)
  g = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk_size).swapaxes(0, 1)
  a = jnp.pad(allowed, ((0, 0), (0, pad), (0, 0)), constant_values=-1).reshape(b, n, chunk_size, -1).swapaxes(0, 1)
  lp, ent = jax.lax.map(jax.checkpoint(lambda xs: project(xs[0], targets=xs[1], allowed=xs[2])), (h, g, a))
  return tuple(x.swapaxes(0, 1).reshape(b, -1)[:, :t] for x in (lp, ent))


def most_scored(masks) -> int:
  """The largest number of scored (nonzero) tokens in one row of `masks` ([B, T], or a sequence of 1-D rows)."""
  return max((int(np.count_nonzero(m)) for m in masks), default=0)


def score_len_for(masks) -> int:
  """The static `score_len` for `token_logps(score_mask=...)` covering every row of `masks` ([B, T], or a sequence
  of 1-D rows, e.g. a whole dataset's): `most_scored` rounded up to a power of two (at least 64), so that batches
  share a few compilations; 0 when nothing is scored."""
  most = most_scored(masks)
  return 0 if most == 0 else max(64, 1 << (most - 1).bit_length())


Prefix = tuple[Int[Array, "Q P"], Bool[Array, "Q P"], Int[Array, " B"]]  # prefix tokens, valid, each row's prefix row


def forward_hidden(cfg: ModelConfig, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                   valid: Bool[Array, "B T"], prefix: Prefix | None = None) -> ModelOutput:
  """The model's final hidden states (and values) over the rows, or over their suffixes after shared `prefix`es
  (see the module docstring)."""
  model = Transformer(cfg)
  if prefix is None:
    return model.apply({"params": params}, tokens, positions, valid, return_hidden=True)
  if cfg.scan_layers:
    raise ValueError("shared prefixes run a KV-cache forward, which stacked layers (ModelConfig.scan_layers) do not "
                     "serve; train with unrolled layers or leave shared_prefix off")
  prefix_tokens, prefix_valid, index = prefix
  q, p = prefix_tokens.shape
  s = tokens.shape[1]
  # Prefix slots 0 .. P - 1, suffix slots P .. P + S - 1: slots only order the causal mask (every prefix slot comes
  # before every suffix slot), the RoPE positions are the rows' own.
  prefix_positions = jnp.maximum(jnp.cumsum(prefix_valid, -1) - 1, 0)
  key_valid = jnp.concatenate([prefix_valid, jnp.zeros((q, s), bool)], -1)
  # last_only: the prefix's logits and values are never read (XLA drops the head), only its keys and values.
  cache = model.apply({"params": params}, prefix_tokens, prefix_positions, key_valid,
                      cache=KVCache.zeros(cfg, q, p + s), cache_index=0, last_only=True).cache
  cache = jax.tree.map(lambda x: jnp.take(x, index, axis=0), cache)
  key_valid = jnp.concatenate([jnp.take(prefix_valid, index, axis=0), valid], -1)
  return model.apply({"params": params}, tokens, positions, key_valid, cache=cache, cache_index=p, return_hidden=True)


def token_logps(
    cfg: ModelConfig,
    params,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    *,
    with_entropy: bool = False,
    with_values: bool = False,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    score_mask: Array | None = None,
    score_len: int | None = None,
    prefix: Prefix | None = None,
    allowed: Int[Array, "B T A"] | None = None,
) -> TokenLogps:
  """Log-probs (and optionally entropies and values) of every token given its prefix; see the module docstring.

  `chunk_size` is the number of positions per vocabulary-projection chunk (None: all at once when B * T * V is at
  most MAX_LOGITS, else the largest chunk under it). `score_mask` [B, T] (nonzero: scored) limits log-probs and
  entropies to those tokens; it needs `score_len` >= its largest row count (`score_len_for`), a static int.
  `prefix`: the rows are suffixes after shared prefixes (`TokenBatch.prefix`; see the module docstring).
  `allowed` [B, T, A] (-1 padded): the tokens token t was drawn among (`Trajectories.allowed`); where a token has
  any, its log-prob and entropy are those of the model's distribution renormalised over them, as the sampler drew it
  with `choices`. None or A = 0: the whole vocabulary everywhere."""
  if with_values and not cfg.value_head:
    raise ValueError("token_logps(with_values=True) needs a model with a value head (ModelConfig.value_head=True)")
  if (score_mask is None) != (score_len is None):
    raise ValueError("token_logps: score_mask and score_len go together (score_len = score_len_for(score_mask))")
  b, t = tokens.shape
  if allowed is None:
    allowed = jnp.full((b, t, 0), -1, jnp.int32)
  out = forward_hidden(cfg, params, tokens, positions, valid, prefix)
  hidden = out.hidden  # [B, T, E], after the final norm
  project = functools.partial(_project, head=_head(cfg, params), cfg=cfg, temperature=temperature,
                              with_entropy=with_entropy)
  # Token t is scored from the hidden state at t - 1: only where both are valid (a token with no context has no
  # defined probability).
  scored = jnp.concatenate([jnp.zeros((b, 1), bool), valid[:, 1:] & valid[:, :-1]], axis=1)

  def shift(x):  # value at position t - 1 moved to t, 0 where token t is not scored
    return jnp.where(scored, jnp.concatenate([jnp.zeros((b, 1), x.dtype), x[:, :-1]], axis=1), 0.0)

  if score_mask is None or score_len >= t:
    # Position t predicts token t + 1; the last position predicts nothing (its target is a dummy, masked by shift).
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1).astype(jnp.int32)
    allowed_next = jnp.concatenate([allowed[:, 1:], jnp.full_like(allowed[:, :1], -1)], axis=1)
    lp_next, ent_next = _project_positions(project, hidden, targets, allowed_next, chunk_size, cfg.vocab_size)
    logp, entropy = shift(lp_next), shift(ent_next)
    if score_mask is not None:
      logp, entropy = (jnp.where(score_mask != 0, x, 0.0) for x in (logp, entropy))
  elif score_len == 0:
    logp = entropy = jnp.zeros((b, t), jnp.float32)
  else:
    want = scored & (score_mask != 0)
    # Each row's scored token positions, left-aligned in score_len slots (the unused slots point at token 0).
    idx = jax.vmap(lambda m: jnp.nonzero(m, size=score_len, fill_value=0)[0])(want)
    slot = jnp.arange(score_len)[None] < jnp.sum(want, axis=-1, keepdims=True)
    h = jnp.take_along_axis(hidden, jnp.maximum(idx - 1, 0)[..., None], axis=1)  # [B, K, E]: the predicting states
    lp, ent = _project_positions(project, h, jnp.take_along_axis(tokens, idx, axis=1).astype(jnp.int32),
                                 jnp.take_along_axis(allowed, idx[..., None], axis=1), chunk_size, cfg.vocab_size)
    rows = jnp.arange(b)[:, None]

    def place(x):  # [B, K] slots back to their [B, T] token positions
      return jnp.zeros((b, t), x.dtype).at[rows, idx].add(jnp.where(slot, x, 0.0))

    logp, entropy = place(lp), place(ent)
  return TokenLogps(logp=logp, entropy=entropy if with_entropy else None,
                    values=shift(out.values) if with_values else None)


def token_values(cfg: ModelConfig, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                 valid: Bool[Array, "B T"]) -> Float[Array, "B T"]:
  """`token_logps(...).values` of a critic: the value head at t - 1 at each token t (0 where t is not scored), from
  a forward that skips the LM head (`Transformer(values_only=True)`), so `params` need no `lm_head`."""
  b = tokens.shape[0]
  values = Transformer(cfg).apply({"params": params}, tokens, positions, valid, values_only=True).values
  scored = jnp.concatenate([jnp.zeros((b, 1), bool), valid[:, 1:] & valid[:, :-1]], axis=1)
  return jnp.where(scored, jnp.concatenate([jnp.zeros((b, 1), values.dtype), values[:, :-1]], axis=1), 0.0)


def row_positions(valid: np.ndarray) -> np.ndarray:
  """RoPE positions of right- or left-padded rows, as the sampler assigns them: 0, 1, ... over the valid tokens."""
  valid = np.asarray(valid, bool)
  return np.maximum(np.cumsum(valid, axis=-1) - 1, 0).astype(np.int32)


def row_ends(valid: np.ndarray) -> np.ndarray:
  """int [B]: one past each row's last valid token (0 for an empty row); what follows is padding."""
  valid = np.asarray(valid, bool)
  return np.where(valid.any(-1), valid.shape[-1] - np.argmax(valid[:, ::-1], -1), 0)


class LogpScorer:
  """Scores token rows under frozen parameters (reference policy, old policy, critic values) in fixed-size batches.

  Rows are scored shortest first, so that rows of similar length share a batch: each batch is padded to `batch_size`
  rows and cut to its longest row rounded up to a multiple of `pad_to` (one compilation per multiple). On multi-turn
  rows, whose lengths vary by turn, that skips most of the padding a whole call's width would cost. Host in, host out:
  returns NumPy arrays of the caller's shape.
  `values_only` scores a critic's values (`token_values`; its log-probs come back as zeros).
  `shared_prefix` (log-probs under a `mask` only, no values) runs the prefixes each batch's rows share once
  (`dreamjax.rl.batch.shared_prefix_layout`; see the module docstring) and puts the suffixes' log-probs back in the
  caller's rows: the same values to float32 rounding. Each batch's layout is a shape of its own (a few per run).
  """

  def __init__(self, cfg: ModelConfig, batch_size: int, *, with_values: bool = False, temperature: float = 1.0,
               pad_to: int = 64, chunk_size: int | None = None, mesh: jax.sharding.Mesh | None = None,
               rules: Rules = TRAIN_RULES, values_only: bool = False, shared_prefix: bool = False):
    with_values = with_values or values_only
    if with_values and not cfg.value_head:
      raise ValueError("LogpScorer(with_values=True) needs a model with a value head (ModelConfig.value_head=True)")
    if shared_prefix and (with_values or cfg.scan_layers):
      # Values are read before the loss tokens (a turn's state), which a prefix would hold.
      raise ValueError("LogpScorer(shared_prefix=True) scores log-probs only (no values), with unrolled layers")
    self.cfg, self.batch_size, self.pad_to, self.mesh, self.rules = cfg, batch_size, pad_to, mesh, rules
    self.with_values, self.shared_prefix = with_values, shared_prefix
    if values_only:
      self._fn = jax.jit(lambda p, tok, pos, val, mask, allowed, score_len: TokenLogps(
          logp=jnp.zeros(tok.shape, jnp.float32), entropy=None, values=token_values(cfg, p, tok, pos, val)),
                         static_argnums=6)
      return
    fn = functools.partial(token_logps, cfg, with_values=with_values, temperature=temperature, chunk_size=chunk_size)
    # `mask` is ignored unless score_len is set (then mask is the score mask).
    self._fn = jax.jit(lambda p, tok, pos, val, mask, allowed, score_len: fn(
        p, tok, pos, val, score_mask=None if score_len is None else mask, score_len=score_len, allowed=allowed),
                       static_argnums=6)
    self._prefix_fn = jax.jit(lambda p, tok, pos, val, mask, allowed, ptok, pval, pidx, score_len: fn(
        p, tok, pos, val, score_mask=mask, score_len=score_len, prefix=(ptok, pval, pidx), allowed=allowed),
                              static_argnums=9)

  def __call__(self, params, tokens: np.ndarray, positions: np.ndarray | None, valid: np.ndarray,
               mask: np.ndarray | None = None, allowed: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """(logp [M, T], values [M, T] or None) for rows `tokens` [M, T]; positions default to `row_positions(valid)`.
    With `mask` [M, T], only the masked tokens are scored (the others' log-probs are 0; see token_logps). With
    `allowed` [M, T, A] (`Trajectories.allowed`), log-probs are renormalised over each token's allowed set."""
    tokens = np.asarray(tokens, np.int32)
    valid = np.asarray(valid, bool)
    if tokens.shape != valid.shape or tokens.ndim != 2:
      raise ValueError(f"LogpScorer: tokens {tokens.shape} and valid {valid.shape} must be equal [rows, length]")
    if mask is not None and np.shape(mask) != tokens.shape:
      raise ValueError(f"LogpScorer: mask {np.shape(mask)} must have the tokens' shape {tokens.shape}")
    if allowed is not None and np.shape(allowed)[:2] != tokens.shape:
      raise ValueError(f"LogpScorer: allowed {np.shape(allowed)} must be [rows, length, A] of the tokens' "
                       f"{tokens.shape}")
    allowed = np.full((*tokens.shape, 0), -1, np.int32) if allowed is None else np.asarray(allowed, np.int32)
    positions = row_positions(valid) if positions is None else np.asarray(positions, np.int32)
    # One score_len for the whole call, so its batches share one compilation.
    score_len = None if mask is None else score_len_for(mask)
    m, t = tokens.shape
    # A row's tokens past its last valid one are padding (they score 0), so a batch ends at its longest row.
    ends = row_ends(valid)
    order = np.argsort(ends, kind="stable")
    logp = np.zeros((m, t), np.float32)
    values = np.zeros((m, t), np.float32) if self.with_values else None
    for start in range(0, m, self.batch_size):
      rows = order[start:start + self.batch_size]
      n, longest = len(rows), int(ends[rows].max())
      width = max(self.pad_to, -(-longest // self.pad_to) * self.pad_to)
      w = min(t, width)
      arrays = []
      for x in (tokens, positions, valid, valid if mask is None else np.asarray(mask) != 0, allowed):
        buf = np.full((self.batch_size, width, *x.shape[2:]), -1 if x.ndim == 3 else 0, x.dtype)
        buf[:n, :w] = x[rows, :w]
        arrays.append(buf)
      if self.shared_prefix and score_len is not None:
        logp[rows, :w] = self._shared(params, arrays, score_len)[:n, :w]
        continue
      out = to_host(self._run(params, arrays, score_len))  # rows sharded over every process's devices: gathered whole
      logp[rows, :w] = out.logp[:n, :w]
      if values is not None:
        values[rows, :w] = out.values[:n, :w]
    return logp, values

  def _shared(self, params, arrays: list[np.ndarray], score_len: int) -> np.ndarray:
    """One batch's log-probs [batch_size, width] through shared prefixes: suffixes scored, put back in place."""
    from dreamjax.rl.batch import TokenBatch, shared_prefix_layout  # batch imports this module

    tokens, positions, valid, mask, allowed = arrays
    if (np.where(valid, positions, 0) != row_positions(valid) * valid).any():
      raise ValueError("LogpScorer(shared_prefix=True): positions must be row_positions(valid) (a prefix's continue)")
    zeros = np.zeros(tokens.shape, np.float32)
    rows = np.zeros(tokens.shape[:1], np.int32)
    batch = TokenBatch(tokens=tokens, positions=positions, valid=valid, loss_mask=mask.astype(np.float32),
                       old_logp=zeros, ref_logp=zeros, advantages=zeros, returns=zeros, old_values=zeros, pair=rows,
                       chosen=rows.astype(bool), allowed=allowed)
    shared, source, offset = shared_prefix_layout(batch, pad_to=self.pad_to)
    prefix = [shared.prefix_tokens, shared.prefix_valid, shared.prefix_index]
    suffix = [shared.tokens, shared.positions, shared.valid, shared.loss_mask != 0, shared.allowed]
    if self.mesh is None:
      out = self._prefix_fn(params, *suffix, *prefix, score_len)
    else:
      shard = lambda x: named_sharding(("batch",) + (None,) * (x.ndim - 1), x.shape, self.mesh, self.rules)  # noqa: E731
      placed = to_devices(tuple(suffix + prefix), tuple(shard(x) for x in suffix + prefix))
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
        out = self._prefix_fn(params, *placed, score_len)
    suffix_logp = to_host(out.logp)
    logp = np.zeros(tokens.shape, np.float32)
    for row in np.flatnonzero(source >= 0):
      n = int(shared.valid[row].sum())
      logp[source[row], offset[row]:offset[row] + n] = suffix_logp[row, :n]
    return logp

  def _run(self, params, arrays: list[np.ndarray], score_len: int | None) -> TokenLogps:
    if self.mesh is None:
      return self._fn(params, *arrays, score_len)
    rows = named_sharding(("batch", None), arrays[0].shape, self.mesh, self.rules)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return self._fn(params, *to_devices(tuple(arrays), (rows,) * len(arrays)), score_len)
