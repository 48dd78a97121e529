"""Policy, value, KL, entropy, SFT and DPO losses as pure functions over per-token arrays.

Per-token inputs are [B, T] with a `mask` [B, T] (bool, or float weights) that is 1 on the tokens the loss covers (the
policy's sampled action tokens, `Trajectories.loss_mask`). Each loss builds a per-token matrix and reduces it with
`aggregate`, whose modes carry verl's names (underscored; verl's hyphenated spellings are accepted too):

- `token_mean`: sum over all masked tokens / their count (DAPO's choice: every token weighs the same).
- `seq_mean_token_mean`: mean over each row's tokens, then mean over rows (GRPO as published).
- `seq_mean_token_sum`: sum over each row's tokens, then mean over rows.
- `seq_mean_token_sum_norm`: the previous divided by a constant horizon (Dr. GRPO; default the padded length T).

Rows with no masked token (padding rows of a fixed-shape batch) are left out of the row means, and an empty mask gives
0, never NaN (`safe_div` also keeps the gradient finite there). `denom` overrides the count (tokens for `token_mean`,
rows otherwise) so that gradient accumulation over micro-batches can divide by the whole batch's count.

Metrics are float32 scalars meant for logging; they are computed on the masked tokens regardless of the aggregation.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def safe_div(num: Array, den: Array) -> Array:
  """num / den where den > 0, else 0; the untaken branch divides by 1 so no NaN leaks into gradients."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def masked_mean(x: Array, mask: Array) -> Float[Array, ""]:
  """Mean of `x` over entries where `mask` > 0 (weighted by a float mask); 0 for an empty mask."""
  m = jnp.asarray(mask).astype(jnp.float32)
  return safe_div(jnp.sum(x * m), jnp.sum(m))


def _as_mask(mask: Array) -> Array:
  return jnp.asarray(mask).astype(jnp.float32)


def aggregate(
    x: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    mode: str = "token_mean",
    *,
    denom: Array | float | None = None,
    horizon: float | None = None,
) -> Float[Array, ""]:
  """Reduce a per-token loss matrix to a scalar (see the module docstring for the modes)."""
  mode = mode.replace("-", "_")
  if mode not in AGG_MODES:
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {list(AGG_MODES)}")
  m = _as_mask(mask)
  x = jnp.asarray(x, jnp.float32)
  if mode == "token_mean":
    return safe_div(jnp.sum(x * m), jnp.sum(m) if denom is None else jnp.asarray(denom, jnp.float32))
  tokens = jnp.sum(m, axis=-1)
  row_sum = jnp.sum(x * m, axis=-1)
  rows = (tokens > 0).astype(jnp.float32)
  per_row = safe_div(row_sum, tokens) if mode == "seq_mean_token_mean" else row_sum
  loss = safe_div(jnp.sum(per_row * rows), jnp.sum(rows) if denom is None else jnp.asarray(denom, jnp.float32))
  if mode == "seq_mean_token_sum_norm":
    loss = loss / (x.shape[-1] if horizon is None else horizon)
  return loss


def ppo_clip_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"] | Float[Array, " B"],
    mask: Float[Array, "B T"],
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    denom: Array | float | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
  """PPO's pessimistic clipped surrogate, max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per token.

  `clip_high > clip_low` is DAPO's clip-higher. `dual_clip` (> 1, Ye et al. 2020) caps the loss of negative-advantage
  tokens at -A * dual_clip, so a token whose ratio exploded cannot dominate the batch. Advantages of shape [B] (one
  per row, as GRPO gives) broadcast over the row's tokens."""
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"ppo_clip_loss: dual_clip must be > 1 (got {dual_clip})")
  logp = jnp.asarray(logp, jnp.float32)
  adv = jnp.asarray(advantages, jnp.float32)
  if adv.ndim == logp.ndim - 1:
    adv = adv[..., None]
  m = _as_mask(mask)
  # Clamping the log-ratio (as verl does) keeps exp finite for tokens whose probability collapsed between rollout and
  # update; such tokens are clipped anyway, so the surrogate is unchanged.
  log_ratio = jnp.clip(logp - jnp.asarray(old_logp, jnp.float32), -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  per_token = jnp.maximum(unclipped, clipped)
  metrics = {"clip_frac": masked_mean((clipped > unclipped).astype(jnp.float32), m)}
  if dual_clip is not None:
    bound = -adv * dual_clip
    lower = (adv < 0) & (per_token > bound)
    per_token = jnp.where(lower, bound, per_token)
    metrics["dual_clip_frac"] = masked_mean(lower.astype(jnp.float32), m)
  loss = aggregate(per_token, m, agg, denom=denom)
  metrics["approx_kl"] = masked_mean(ratio - 1.0 - log_ratio, m)  # k3 estimate of KL(old || new)
  metrics["ratio_mean"] = masked_mean(ratio, m)
  metrics["ratio_max"] = jnp.max(jnp.where(m > 0, ratio, 0.0))  # ratios are > 0, so 0 marks an empty mask
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _k1(d: Array) -> Array:
  return d


def _k2(d: Array) -> Array:
  return 0.5 * d * d


def _k3(d: Array) -> Array:
  return jnp.exp(-d) + d - 1.0


def _low_var_kl(d: Array) -> Array:
  # verl's low_var_kl: clamp the log-ratio before exp, then the estimate, so one runaway token cannot blow up the loss.
  return jnp.clip(_k3(jnp.clip(d, -20.0, 20.0)), -10.0, 10.0)


# Estimators of KL(pi || pi_ref) from samples of pi, each a function of d = logp - ref_logp (Schulman's k1, k2, k3).
KL_KINDS: dict[str, Callable[[Array], Array]] = {"k1": _k1, "k2": _k2, "k3": _k3, "low_var_kl": _low_var_kl}


def kl_penalty(
    logp: Float[Array, "B T"], ref_logp: Float[Array, "B T"], kind: str = "low_var_kl"
) -> Float[Array, "B T"]:
  """Per-token KL estimate: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1,
  low_var_kl = k3 with the log-ratio clamped to [-20, 20] and the result to [-10, 10]."""
  if kind not in KL_KINDS:
    raise ValueError(f"unknown KL kind {kind!r}; known: {list(KL_KINDS)}")
  return KL_KINDS[kind](jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32))


def kl_loss(
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    *,
    kind: str = "low_var_kl",
    agg: str = "token_mean",
    denom: Array | float | None = None,
) -> Float[Array, ""]:
  """Aggregated KL penalty to the reference policy (the caller adds coef * it)."""
  return aggregate(kl_penalty(logp, ref_logp, kind), mask, agg, denom=denom)


def entropy_from_logits(logits: Float[Array, "B T V"]) -> Float[Array, "B T"]:
  """Entropy of softmax(logits) per position: logsumexp(z) - sum(p z), in float32. Entries of -inf (masked vocab)
  contribute 0 rather than 0 * inf."""
  z = jnp.asarray(logits, jnp.float32)
  # Entropy is shift invariant; subtracting the row max first keeps lse and sum(p z) small, so their difference does
  # not cancel catastrophically when logits are large.
  top = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  z = z - jnp.where(jnp.isfinite(top), top, 0.0)
  lse = jax.nn.logsumexp(z, axis=-1)
  p = jnp.exp(z - lse[..., None])
  return lse - jnp.sum(p * jnp.where(jnp.isfinite(z), z, 0.0), axis=-1)


def entropy_loss(
    entropy: Float[Array, "B T"], mask: Float[Array, "B T"], agg: str = "token_mean", *, denom=None
) -> Float[Array, ""]:
  """Aggregated entropy (a bonus: the caller subtracts coef * it)."""
  return aggregate(entropy, mask, agg, denom=denom)


def value_loss(
    values: Float[Array, "B T"],
    old_values: Float[Array, "B T"],
    returns: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    *,
    clip: float | None = 0.2,
    agg: str = "token_mean",
    denom: Array | float | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
  """0.5 * max((V - R)^2, (V_clipped - R)^2) with V_clipped = V_old + clip(V - V_old, -clip, clip) (PPO value
  clipping; `clip=None` is the plain squared error). explained_variance = 1 - Var(R - V) / Var(R) on masked entries
  (0 when the returns do not vary)."""
  v = jnp.asarray(values, jnp.float32)
  ret = jnp.asarray(returns, jnp.float32)
  m = _as_mask(mask)
  err = (v - ret) ** 2
  if clip is None:
    per_token, clipped_frac = err, jnp.zeros((), jnp.float32)
  else:
    old = jnp.asarray(old_values, jnp.float32)
    err_clipped = (old + jnp.clip(v - old, -clip, clip) - ret) ** 2
    per_token = jnp.maximum(err, err_clipped)
    clipped_frac = masked_mean((err_clipped > err).astype(jnp.float32), m)
  loss = 0.5 * aggregate(per_token, m, agg, denom=denom)

  def var(x: Array) -> Array:
    c = (x - masked_mean(x, m)) * m
    return safe_div(jnp.sum(c * c), jnp.sum(m))

  var_ret = var(ret)
  explained = jnp.where(var_ret > 0, 1.0 - safe_div(var(ret - v), var_ret), 0.0)
  metrics = {"vf_clip_frac": clipped_frac, "explained_variance": explained}
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def sft_loss(
    logp: Float[Array, "B T"], mask: Float[Array, "B T"], agg: str = "token_mean", *, denom=None
) -> Float[Array, ""]:
  """Negative log-likelihood of the masked target tokens."""
  return -aggregate(logp, mask, agg, denom=denom)


def dpo_loss(
    chosen_logp: Float[Array, " P"],
    rejected_logp: Float[Array, " P"],
    ref_chosen_logp: Float[Array, " P"],
    ref_rejected_logp: Float[Array, " P"],
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    mask: Float[Array, " P"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
  """DPO over per-pair sequence log-prob sums: -log sigmoid(r_chosen - r_rejected) with the implicit rewards
  r = beta * (logp - ref_logp); `label_smoothing` eps mixes in the flipped label (conservative DPO). `mask` switches
  off padding pairs. Metrics (means over pairs): reward_accuracy (r_chosen > r_rejected), margin (r_chosen -
  r_rejected), chosen_reward, rejected_reward."""
  chosen_r = beta * (jnp.asarray(chosen_logp, jnp.float32) - jnp.asarray(ref_chosen_logp, jnp.float32))
  rejected_r = beta * (jnp.asarray(rejected_logp, jnp.float32) - jnp.asarray(ref_rejected_logp, jnp.float32))
  z = chosen_r - rejected_r
  per_pair = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
  m = jnp.ones_like(z) if mask is None else _as_mask(mask)
  metrics = {
      "reward_accuracy": masked_mean((chosen_r > rejected_r).astype(jnp.float32), m),
      "margin": masked_mean(z, m),
      "chosen_reward": masked_mean(chosen_r, m),
      "rejected_reward": masked_mean(rejected_r, m),
  }
  return masked_mean(per_pair, m), jax.tree.map(jax.lax.stop_gradient, metrics)


LOSSES: dict[str, Callable[..., Array | tuple[Array, dict[str, Array]]]] = {
    "ppo_clip": ppo_clip_loss,
    "kl": kl_loss,
    "entropy": entropy_loss,
    "value": value_loss,
    "sft": sft_loss,
    "dpo": dpo_loss,
}


def get_loss(name: str) -> Callable[..., Array | tuple[Array, dict[str, Array]]]:
  """The loss registered under `name`."""
  if name not in LOSSES:
    raise ValueError(f"unknown loss {name!r}; known: {sorted(LOSSES)}")
  return LOSSES[name]
