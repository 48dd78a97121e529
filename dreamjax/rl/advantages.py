"""Advantage estimators (GRPO group baselines, GAE) and masked whitening, as pure jit-able functions.

Everything here runs on fixed shapes: padded rows and steps are switched off by masks, group statistics are segment sums
over a static number of groups, and GAE is a reverse `lax.scan`. No value ever reaches Python control flow, so a batch
with a different mix of valid rows, group sizes or episode lengths reuses the same compiled program.

GRPO (docs/paper_map.md, "RL": A = (r - mean_G r) / std_G r). Two degenerate groups are defined to give exactly 0, with no
epsilon-sized noise: groups whose valid rewards are all equal (the sum-then-divide mean of equal float32 values need
not equal them bit for bit, so "centred reward is 0" is decided on max == min, not on the arithmetic) and groups with a
single valid row (nothing to compare against; verl would hand such a row its raw reward, which for outcome rewards
pushes up whatever a lone rollout did). The std is the unbiased one by default (`ddof=1`), as verl (`torch.std`) and
hence the verl-agent defaults the paper follows; the curriculum's reward variance (docs/paper_map.md, "Curriculum") is the
population one, which `ddof=0` gives. `normalize_std=False` is Dr. GRPO: the centred reward without the std division.

GAE runs along the second axis, which may be turns (one value per turn) or tokens. A masked-out step resets the
recursion, so the value after a row's last valid step is `bootstrap` (a truncated episode: the critic's estimate of
the state it stopped in) or 0 (the env ended the episode).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dreamjax.rl.losses import masked_mean, safe_div


def grpo_advantages(
    rewards: Float[Array, " N"],
    group: Int[Array, " N"],
    valid: Bool[Array, " N"],
    *,
    num_groups: int,
    normalize_std: bool = True,
    ddof: int = 1,
    eps: float = 1e-6,
) -> Float[Array, " N"]:
  """Group-relative advantages over valid rows; invalid rows get 0. `group` ids of valid rows must lie in
  [0, num_groups) (ids of invalid rows are ignored)."""
  rewards = jnp.asarray(rewards, jnp.float32)
  group = jnp.asarray(group, jnp.int32)
  valid = jnp.asarray(valid, bool)
  v = valid.astype(jnp.float32)
  # Invalid rows may carry any id (e.g. -1 padding); point them at group 0 and weight them out.
  gid = jnp.where(valid, jnp.clip(group, 0, num_groups - 1), 0)

  def seg_sum(x: Array) -> Array:
    return jax.ops.segment_sum(x, gid, num_segments=num_groups)

  count = seg_sum(v)
  hi = jax.ops.segment_max(jnp.where(valid, rewards, -jnp.inf), gid, num_segments=num_groups)
  lo = jax.ops.segment_min(jnp.where(valid, rewards, jnp.inf), gid, num_segments=num_groups)
  degenerate = (hi <= lo) | (count < 2)
  # Shifting by the group minimum before summing (exact for nearby floats) and centring before squaring keep float32
  # accurate when rewards differ by little or sit far from 0.
  shifted = jnp.where(valid & ~degenerate[gid], rewards - lo[gid], 0.0)
  centred = (shifted - safe_div(seg_sum(shifted), count)[gid]) * v
  var = safe_div(seg_sum(centred * centred), count - ddof)
  std = jnp.sqrt(jnp.maximum(var, 0.0))
  adv = centred / (std[gid] + eps) if normalize_std else centred
  return jnp.where(valid & ~degenerate[gid], adv, 0.0)


def gae_advantages(
    rewards: Float[Array, "N L"],
    values: Float[Array, "N L"],
    mask: Bool[Array, "N L"],
    *,
    gamma: float,
    lam: float,
    bootstrap: Float[Array, " N"] | None = None,
) -> tuple[Float[Array, "N L"], Float[Array, "N L"]]:
  """(advantages, returns = advantages + values), both 0 where `mask` is off.

  `mask` is a contiguous valid prefix per row (a later gap would start a new segment that also ends in `bootstrap`).
  `bootstrap[n]` is the value of the state after row n's last valid step: V(s_last) for an episode cut short by the
  turn or token budget, 0 (or None for all rows) for one the env ended. `gamma` and `lam` may be traced scalars."""
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  mask = jnp.asarray(mask, bool)
  n = rewards.shape[0]
  boot = jnp.zeros((n,), jnp.float32) if bootstrap is None else jnp.asarray(bootstrap, jnp.float32)

  def step(carry, xs):
    next_value, next_adv = carry
    r, v, m = xs
    delta = r + gamma * next_value - v
    adv = delta + gamma * lam * next_adv
    # Off steps restart the recursion so the last on step of a row sees the bootstrap value and no later advantage.
    carry = (jnp.where(m, v, boot), jnp.where(m, adv, 0.0))
    return carry, jnp.where(m, adv, 0.0)

  init = (boot, jnp.zeros((n,), jnp.float32))
  _, adv_t = jax.lax.scan(step, init, (rewards.T, values.T, mask.T), reverse=True)
  adv = adv_t.T
  return adv, jnp.where(mask, adv + values, 0.0)


def whiten(
    x: Float[Array, "..."], mask: Bool[Array, "..."], eps: float = 1e-8, shift_mean: bool = True, ddof: int = 1
) -> Float[Array, "..."]:
  """Normalise `x` to zero mean and unit variance over the masked entries of the whole batch (verl's masked_whiten:
  unbiased variance, eps inside the square root). `shift_mean=False` keeps the original mean (only rescales).
  Masked-out entries are 0; an empty mask gives all zeros."""
  x = jnp.asarray(x, jnp.float32)
  m = jnp.asarray(mask).astype(jnp.float32)
  mean = masked_mean(x, m)
  centred = (x - mean) * m
  count = jnp.sum(m)
  var = safe_div(jnp.sum(centred * centred), count - ddof)
  out = centred * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(m > 0, out, 0.0)


ADVANTAGES: dict[str, Callable[..., Array | tuple[Array, Array]]] = {
    "grpo": grpo_advantages,
    "gae": gae_advantages,
}


def get_advantage(name: str) -> Callable[..., Array | tuple[Array, Array]]:
  """The advantage estimator registered under `name`."""
  if name not in ADVANTAGES:
    raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}")
  return ADVANTAGES[name]
