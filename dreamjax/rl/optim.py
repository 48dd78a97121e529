"""The optimizer: AdamW with warmup + schedule, global-norm clipping, and an optional value-head learning-rate factor.

Built as an explicit optax chain rather than `optax.adamw` so that (1) clipping sees the raw accumulated gradient,
(2) weight decay skips vectors (norm scales, biases, the value head), as is usual for transformers, (3) the PPO value
head, which starts at zero and must learn values of order 1 while the policy moves by 1e-6 per step, can get its own
learning-rate factor, and (4) the learning rate sits in the optimizer state (`inject_hyperparams`), so the train step
reports the rate it actually used (`current_learning_rate`) without knowing the schedule.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

_SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"  # constant | cosine | linear (decay after warmup, to `end_lr_factor * lr`)
  total_steps: int = 0  # warmup included; needed by cosine and linear
  end_lr_factor: float = 0.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  clip_norm: float | None = 1.0  # global-norm clipping of the gradient; None or <= 0 disables
  value_head_lr_multiplier: float = 1.0  # factor on the value head's step (PPO critic)

  def __post_init__(self):
    if self.schedule not in _SCHEDULES:
      raise ValueError(f"OptimConfig.schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
    if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
      raise ValueError(f"OptimConfig: schedule {self.schedule!r} needs total_steps ({self.total_steps}) > "
                       f"warmup_steps ({self.warmup_steps})")
    if self.lr < 0 or self.warmup_steps < 0:
      raise ValueError(f"OptimConfig: lr ({self.lr}) and warmup_steps ({self.warmup_steps}) must be >= 0")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  """Linear warmup from 0 over `warmup_steps`, then constant, cosine or linear decay until `total_steps`."""
  end = cfg.lr * cfg.end_lr_factor
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(cfg.lr, cfg.total_steps - cfg.warmup_steps, alpha=cfg.end_lr_factor)
  else:
    after = optax.linear_schedule(cfg.lr, end, cfg.total_steps - cfg.warmup_steps)
  if cfg.warmup_steps == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), after], [cfg.warmup_steps])


def _is_value_head(path) -> bool:
  return any(getattr(k, "key", None) == "value_head" for k in path)


def _decay_mask(params):
  # Matrices only: decaying norm scales pulls them towards 0 (not 1), and the value head towards a constant.
  return jax.tree_util.tree_map_with_path(lambda p, x: x.ndim >= 2 and not _is_value_head(p), params)


def _value_head_mask(params):
  return jax.tree_util.tree_map_with_path(lambda p, _: _is_value_head(p), params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  parts = []
  if cfg.clip_norm is not None and cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
  if cfg.weight_decay:
    parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask))
  if cfg.value_head_lr_multiplier != 1.0:
    parts.append(optax.masked(optax.scale(cfg.value_head_lr_multiplier), _value_head_mask))
  parts.append(optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=make_schedule(cfg)))
  return optax.chain(*parts)


def current_learning_rate(opt_state) -> jax.Array | None:
  """The learning rate of the last update (None when the optimizer was not built by `make_optimizer`)."""
  last = opt_state[-1] if isinstance(opt_state, tuple) and opt_state else None
  hyperparams = getattr(last, "hyperparams", None)
  return None if hyperparams is None else hyperparams.get("learning_rate")
