"""Choosing the next token from logits: greedy, temperature, top-p and top-k, per row, without sorting the vocabulary.

Sorting 32k logits per row costs more than the model's forward pass on CPU, so truncation finds each row's cut-off by
bisection on the int32 bit pattern of -log p (monotone for non-negative floats): the kept set is exactly the one a sort
would give (ties at the cut-off are kept together). Sampling inside the kept set uses one uniform per row and an
inverse CDF over 128-wide blocks, instead of a Gumbel variate per vocabulary entry.
All settings are arrays, so changing them never recompiles.

`verify_draft` is the same processing applied to a speculative verify step (several positions per row): the
speculative-sampling acceptance rule with a point-mass draft, so the tokens it yields follow exactly the distribution
`choose_tokens` samples from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_BLOCK = 128


def _bisect(keys: Int[Array, "B V"], hi: Int[Array, " B"], enough) -> Int[Array, " B"]:
  """Smallest M in [0, hi] per row with enough(keys <= M) true (enough is monotone in M)."""

  def body(carry):
    lo, hi = carry
    mid = lo + (hi - lo) // 2
    ok = enough(keys <= mid[:, None])
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  lo, hi = jax.lax.while_loop(lambda c: jnp.any(c[0] < c[1]), body, (jnp.zeros_like(hi), hi))
  return hi


def truncation_mask(
    logp: Float[Array, "B V"], top_p: Float[Array, " B"], top_k: Int[Array, " B"]
) -> jax.Array:
  """Tokens kept by top-p (smallest set of most likely tokens with mass >= top_p) and top-k (k most likely); k <= 0 and
  p >= 1 disable each."""
  keys = jax.lax.bitcast_convert_type(-logp, jnp.int32)  # -logp >= 0, so the bit pattern orders like the value
  keys = jnp.maximum(keys, 0)  # -0.0 has the sign bit set
  hi = jnp.max(keys, axis=-1)
  probs = jnp.exp(logp)
  p = jnp.minimum(top_p, 1.0)[:, None]
  cut_p = jax.lax.cond(
      jnp.any(top_p < 1.0),
      lambda: _bisect(keys, hi, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), -1) >= p[:, 0] * (1 - 1e-6)),
      lambda: hi,
  )
  k = jnp.where(top_k > 0, top_k, keys.shape[-1])
  cut_k = jax.lax.cond(
      jnp.any(top_k > 0),
      lambda: _bisect(keys, hi, lambda kept: jnp.sum(kept, -1) >= k),
      lambda: hi,
  )
  # The most likely token is always kept, so a zero top_p or a cut-off lost to rounding still leaves one candidate.
  cut = jnp.maximum(jnp.minimum(cut_p, cut_k), jnp.min(keys, axis=-1))
  return keys <= cut[:, None]


def _inverse_cdf(weights: Float[Array, "B V"], u: Float[Array, " B"]) -> Int[Array, " B"]:
  """Index i with P(i) proportional to weights[i] >= 0, from one uniform per row; two small cumsums, not one long one."""
  b, v = weights.shape
  pad = (-v) % _BLOCK
  w = jnp.pad(weights, ((0, 0), (0, pad))).reshape(b, -1, _BLOCK)
  block_cum = jnp.cumsum(jnp.sum(w, -1), -1)  # [B, nb]
  target = u * block_cum[:, -1]
  nonzero_blocks = block_cum > jnp.concatenate([jnp.zeros((b, 1)), block_cum[:, :-1]], -1)
  last_block = w.shape[1] - 1 - jnp.argmax(nonzero_blocks[:, ::-1], -1)
  j = jnp.minimum(jnp.sum(block_cum <= target[:, None], -1), last_block)  # rounding must never pick an empty block
  before = jnp.where(j > 0, jnp.take_along_axis(block_cum, jnp.maximum(j - 1, 0)[:, None], -1)[:, 0], 0.0)
  inside = jnp.take_along_axis(w, j[:, None, None], 1)[:, 0]  # [B, 128]
  inside_cum = jnp.cumsum(inside, -1)
  last = _BLOCK - 1 - jnp.argmax((inside > 0)[:, ::-1], -1)
  i = jnp.minimum(jnp.sum(inside_cum <= (target - before)[:, None], -1), last)
  return j * _BLOCK + i


def choose_tokens(
    logits: Float[Array, "B V"],
    u: Float[Array, " B"],
    temperature: Float[Array, " B"],
    top_p: Float[Array, " B"],
    top_k: Int[Array, " B"],
) -> tuple[Int[Array, " B"], Float[Array, " B"]]:
  """Next token per row (drawn with the row's uniform `u`) and its log-probability under softmax(logits / temperature)
  before truncation.

  The returned log-prob is what PPO/GRPO importance ratios need: the trainer recomputes it from the same logits and
  temperature, which it could not do for a truncated distribution. Rows with temperature <= 0 are greedy (log-prob at
  temperature 1).
  """
  greedy = temperature <= 0
  t = jnp.where(greedy, 1.0, temperature)[:, None]
  logp = jax.nn.log_softmax(logits / t, axis=-1)
  argmax = jnp.argmax(logits, axis=-1)

  def sample():
    kept = truncation_mask(logp, jnp.where(greedy, 1.0, top_p), jnp.where(greedy, 0, top_k))
    weights = jnp.where(kept, jnp.exp(logp), 0.0)
    drawn = _inverse_cdf(weights, u)
    return jnp.where(greedy, argmax, drawn)

  tokens = jax.lax.cond(jnp.all(greedy), lambda: argmax, sample).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]


def verify_draft(
    logits: Float[Array, "B T V"],
    draft: Int[Array, "B T"],
    has_draft: Bool[Array, "B T"],
    u_accept: Float[Array, "B T"],
    u_sample: Float[Array, "B T"],
    temperature: Float[Array, " B"],
    top_p: Float[Array, " B"],
    top_k: Int[Array, " B"],
) -> tuple[Int[Array, "B T"], Float[Array, "B T"], Bool[Array, "B T"]]:
  """Checks draft tokens against the model's distribution at each position: (token, its log-prob, accepted).

  `logits[:, j]` is the model's next-token distribution given the draft up to position j. Where `has_draft`, draft
  token d is accepted with probability p(d) (speculative sampling's min(1, p/q) with the draft a point mass q = 1 at
  d), and on rejection the token is drawn from the residual norm(max(0, p - q)), which is p with d removed and
  renormalised; positions without a draft draw from p. Either way P(token = x) = p(d) [x = d] + (1 - p(d)) p(x) [x != d]
  / (1 - p(d)) = p(x): exactly `choose_tokens`' distribution (same temperature, top-k and top-p; the same draw from p
  where there is no draft). Greedy rows accept iff the draft is the argmax, and their token is the argmax.
  A caller keeps each row's tokens up to its first rejection, which it includes (the correction, or after all drafts
  accepted the bonus token from the position after them).
  """
  b, t, v = logits.shape
  greedy = temperature <= 0
  temp = jnp.where(greedy, 1.0, temperature)[:, None, None]
  logp = jax.nn.log_softmax(logits / temp, axis=-1)
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  greedy_accept = has_draft & (argmax == draft)

  def sample():
    # Row settings repeated for each of the row's positions.
    kept = truncation_mask(logp.reshape(b * t, v), jnp.repeat(jnp.where(greedy, 1.0, top_p), t),
                           jnp.repeat(jnp.where(greedy, 0, top_k), t))
    weights = jnp.where(kept.reshape(b, t, v), jnp.exp(logp), 0.0)
    p_draft = jnp.take_along_axis(weights, draft[..., None], -1)[..., 0] / jnp.sum(weights, -1)
    accept = has_draft & (u_accept < p_draft)
    residual = jnp.where((jnp.arange(v) == draft[..., None]) & has_draft[..., None], 0.0, weights)
    # An all-zero residual (p(d) = 1) is never used, since then the draft is always accepted; clip its index anyway.
    drawn = jnp.minimum(_inverse_cdf(residual.reshape(b * t, v), u_sample.reshape(b * t)), v - 1).reshape(b, t)
    g = greedy[:, None]
    return jnp.where(g, argmax, jnp.where(accept, draft, drawn)), jnp.where(g, greedy_accept, accept)

  tokens, accepted = jax.lax.cond(jnp.all(greedy), lambda: (argmax, greedy_accept), sample)
  return tokens, jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0], accepted
