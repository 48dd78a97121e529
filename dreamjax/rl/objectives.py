"""Training objectives over a `TokenBatch`: PPO and GRPO (one policy-gradient loss, different terms), SFT and DPO.

Each objective is a frozen config plus a pure loss function `(params, batch, rng, cfg, *, model_cfg, score_len) ->
(loss, metrics)` that runs the model once (`token_logps`; over shared prefixes and row suffixes when the batch has
them, `dreamjax.rl.batch.shared_prefix_batch`, which the policy-gradient and SFT losses read like whole rows) and
combines the per-token losses of `dreamjax.rl.losses`.
`Objective` binds the two and adds `normalizer(batch)`: the count the loss averages over (loss tokens for
`token_mean`, rows with a loss token for the seq-mean modes, complete pairs for DPO). The update weighs each
micro-batch's loss by its share of that count, which makes k accumulated micro-batches exactly one big batch
(see `dreamjax.rl.update`).

PPO = clipped surrogate + value loss through the model's value head (`vf_coef` > 0, the shared-head critic), usually
without a KL term; GRPO = clipped surrogate + KL to the reference policy (`kl_coef` > 0, low-variance KL), no critic.
`critic` = the value loss alone, for PPO's separate value model (`dreamjax.rl.critic`: a model with a value head and no
LM head, trained by its own step and optimizer, as verl's critic). The registry holds them with verl-agent-like
defaults (docs/paper_map.md, "RL"); override fields with `make_objective(name, **fields)`.
`rng` is unused by these objectives (the model has no dropout); it is part of the signature for objectives that sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from dreamjax.models.config import ModelConfig
from dreamjax.rl.batch import TokenBatch
from dreamjax.rl.logprobs import token_logps, token_values
from dreamjax.rl.losses import (
    AGG_MODES,
    KL_KINDS,
    dpo_loss,
    entropy_loss,
    kl_loss,
    masked_mean,
    ppo_clip_loss,
    safe_div,
    sft_loss,
    value_loss,
)

Metrics = dict[str, Float[Array, ""]]
# Metrics aggregated like the loss (weighted by `Objective.normalizer` across micro-batches); the others are means
# over `Objective.metric_normalizer`, except maxima.
LOSS_METRICS = frozenset({"loss", "pg_loss", "kl", "entropy", "vf_loss", "nll", "dpo_loss"})


def _check_agg(agg: str, where: str) -> None:
  if agg.replace("-", "_") not in AGG_MODES:
    raise ValueError(f"{where}.agg must be one of {AGG_MODES}, got {agg!r}")


@dataclasses.dataclass(frozen=True)
class PolicyGradientConfig:
  clip_low: float = 0.2
  clip_high: float = 0.2  # > clip_low is DAPO's clip-higher
  dual_clip: float | None = None
  kl_coef: float = 0.0
  kl_kind: str = "low_var_kl"
  entropy_coef: float = 0.0
  log_entropy: bool = True  # report the policy's entropy even when it is not in the loss
  vf_coef: float = 0.0  # > 0: value loss through the value head (PPO)
  vf_clip: float | None = 0.5
  agg: str = "token_mean"
  temperature: float = 1.0  # the rollout's sampling temperature, so ratios compare the same distributions
  chunk_size: int | None = None  # positions per vocabulary-projection chunk (see token_logps)

  def __post_init__(self):
    _check_agg(self.agg, "PolicyGradientConfig")
    if self.kl_kind not in KL_KINDS:
      raise ValueError(f"PolicyGradientConfig.kl_kind must be one of {list(KL_KINDS)}, got {self.kl_kind!r}")
    if self.temperature <= 0:
      raise ValueError(f"PolicyGradientConfig.temperature must be > 0 (greedy rollouts have no ratios), got "
                       f"{self.temperature}")


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
  """PPO's separate critic: its clipped value loss (verl's critic.cliprange_value, 0.5) and aggregation."""

  clip: float | None = 0.5  # None: the plain squared error
  agg: str = "token_mean"

  def __post_init__(self):
    _check_agg(self.agg, "ValueLossConfig")
    if self.clip is not None and self.clip <= 0:
      raise ValueError(f"ValueLossConfig.clip must be > 0 or None, got {self.clip}")


@dataclasses.dataclass(frozen=True)
class SftConfig:
  agg: str = "token_mean"
  chunk_size: int | None = None

  def __post_init__(self):
    _check_agg(self.agg, "SftConfig")


@dataclasses.dataclass(frozen=True)
class DpoLossConfig:
  beta: float = 0.1
  label_smoothing: float = 0.0
  sft_coef: float = 0.0  # adds the chosen trajectories' per-token NLL (RPO), averaged over pairs
  chunk_size: int | None = None


def _logps(model_cfg: ModelConfig, params, batch: TokenBatch, score_len: int | None, **kw):
  """The model's log-probs of the batch's tokens; only of its loss tokens when the caller gives their `score_len`."""
  return token_logps(model_cfg, params, batch.tokens, batch.positions, batch.valid,
                     score_mask=None if score_len is None else batch.loss_mask, score_len=score_len,
                     prefix=batch.prefix, allowed=batch.allowed, **kw)


def policy_gradient_objective(params, batch: TokenBatch, rng: jax.Array, cfg: PolicyGradientConfig, *,
                              model_cfg: ModelConfig, score_len: int | None = None) -> tuple[Float[Array, ""], Metrics]:
  del rng
  use_entropy = cfg.entropy_coef != 0 or cfg.log_entropy
  out = _logps(model_cfg, params, batch, score_len, with_entropy=use_entropy, with_values=cfg.vf_coef != 0,
               temperature=cfg.temperature, chunk_size=cfg.chunk_size)
  mask = batch.loss_mask
  pg, metrics = ppo_clip_loss(out.logp, batch.old_logp, batch.advantages, mask, clip_low=cfg.clip_low,
                              clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.agg)
  metrics["pg_loss"] = pg
  loss = pg
  if cfg.kl_coef != 0:
    kl = kl_loss(out.logp, batch.ref_logp, mask, kind=cfg.kl_kind, agg=cfg.agg)
    loss = loss + cfg.kl_coef * kl
    metrics["kl"] = kl
  if use_entropy:
    entropy = out.entropy if cfg.entropy_coef != 0 else jax.lax.stop_gradient(out.entropy)
    ent = entropy_loss(entropy, mask, cfg.agg)
    loss = loss - cfg.entropy_coef * ent
    metrics["entropy"] = ent
  if cfg.vf_coef != 0:
    vf, vf_metrics = value_loss(out.values, batch.old_values, batch.returns, mask, clip=cfg.vf_clip, agg=cfg.agg)
    loss = loss + cfg.vf_coef * vf
    metrics.update(vf_metrics, vf_loss=vf)
  metrics["loss"] = loss
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def value_objective(params, batch: TokenBatch, rng: jax.Array, cfg: ValueLossConfig, *,
                    model_cfg: ModelConfig, score_len: int | None = None) -> tuple[Float[Array, ""], Metrics]:
  """The critic's value loss on the batch's loss tokens, against `returns`, clipped around `old_values`."""
  del rng, score_len  # a critic projects nothing onto the vocabulary
  if batch.prefix is not None:
    raise ValueError("the critic's value loss takes rows whole (no shared prefixes)")
  values = token_values(model_cfg, params, batch.tokens, batch.positions, batch.valid)
  loss, metrics = value_loss(values, batch.old_values, batch.returns, batch.loss_mask, clip=cfg.clip, agg=cfg.agg)
  metrics.update(vf_loss=loss, loss=loss)
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def sft_objective(params, batch: TokenBatch, rng: jax.Array, cfg: SftConfig, *,
                  model_cfg: ModelConfig, score_len: int | None = None) -> tuple[Float[Array, ""], Metrics]:
  del rng
  logp = _logps(model_cfg, params, batch, score_len, chunk_size=cfg.chunk_size).logp
  loss = sft_loss(logp, batch.loss_mask, cfg.agg)
  return loss, {"loss": jax.lax.stop_gradient(loss), "nll": jax.lax.stop_gradient(loss)}


def _pair_sums(batch: TokenBatch, row_values: Float[Array, " B"]):
  """Per-pair sums over chosen and over rejected rows, and which pairs have both (padding rows count for none)."""
  b = batch.tokens.shape[0]
  present = jnp.any(batch.valid, axis=-1)
  pair = jnp.clip(batch.pair, 0, b - 1)

  def seg(x, flag):
    return jax.ops.segment_sum(jnp.where(present & flag, x, 0.0), pair, num_segments=b)

  chosen, rejected = batch.chosen, ~batch.chosen
  complete = (seg(jnp.ones((b,)), chosen) > 0) & (seg(jnp.ones((b,)), rejected) > 0)
  return seg(row_values, chosen), seg(row_values, rejected), complete


def dpo_objective(params, batch: TokenBatch, rng: jax.Array, cfg: DpoLossConfig, *,
                  model_cfg: ModelConfig, score_len: int | None = None) -> tuple[Float[Array, ""], Metrics]:
  """DPO on trajectory log-probs: token log-probs summed over the loss tokens of every row of a trajectory."""
  del rng
  if batch.prefix is not None:
    raise ValueError("DPO couples rows of a pair, which shared-prefix batches do not keep together")
  logp = _logps(model_cfg, params, batch, score_len, chunk_size=cfg.chunk_size).logp
  mask = batch.loss_mask
  chosen, rejected, complete = _pair_sums(batch, jnp.sum(logp * mask, -1))
  ref_chosen, ref_rejected, _ = _pair_sums(batch, jnp.sum(batch.ref_logp * mask, -1))
  loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta,
                           label_smoothing=cfg.label_smoothing, mask=complete)
  metrics["dpo_loss"] = loss
  if cfg.sft_coef != 0:
    chosen_tokens, _, _ = _pair_sums(batch, jnp.sum(mask, -1))
    nll = masked_mean(-safe_div(chosen, chosen_tokens), complete)
    loss = loss + cfg.sft_coef * nll
    metrics["nll"] = nll
  metrics["loss"] = loss
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


ObjectiveConfig = PolicyGradientConfig | ValueLossConfig | SftConfig | DpoLossConfig
_LOSS_FNS: dict[type, Callable[..., tuple[Array, Metrics]]] = {
    PolicyGradientConfig: policy_gradient_objective,
    ValueLossConfig: value_objective,
    SftConfig: sft_objective,
    DpoLossConfig: dpo_objective,
}


@dataclasses.dataclass(frozen=True)
class Objective:
  """A named objective: its config and the loss and normalizer the update step needs. Hashable (a static argument)."""

  name: str
  config: ObjectiveConfig

  def loss(self, model_cfg: ModelConfig, params, batch: TokenBatch, rng: jax.Array, *,
           score_len: int | None = None) -> tuple[Array, Metrics]:
    """`score_len` (static, `score_len_for(batch.loss_mask)`): score the loss tokens only (see token_logps)."""
    return _LOSS_FNS[type(self.config)](params, batch, rng, self.config, model_cfg=model_cfg, score_len=score_len)

  def normalizer(self, batch: TokenBatch) -> Float[Array, ""]:
    """What the loss averages over on this batch; the update weighs micro-batches by it."""
    if isinstance(self.config, DpoLossConfig):
      return jnp.sum(_pair_sums(batch, jnp.zeros(batch.tokens.shape[:1]))[2].astype(jnp.float32))
    tokens = jnp.sum(batch.loss_mask, axis=-1)
    if self.config.agg.replace("-", "_") == "token_mean":
      return jnp.sum(tokens)
    return jnp.sum((tokens > 0).astype(jnp.float32))

  def metric_normalizer(self, batch: TokenBatch) -> Float[Array, ""]:
    """What the other metrics average over (the losses' metrics are means over loss tokens; DPO's over pairs)."""
    if isinstance(self.config, DpoLossConfig):
      return self.normalizer(batch)
    return jnp.sum(batch.loss_mask)

  def check(self, model_cfg: ModelConfig) -> None:
    """Refuses model/objective combinations that cannot work, before anything compiles."""
    if isinstance(self.config, PolicyGradientConfig) and self.config.vf_coef != 0 and not model_cfg.value_head:
      raise ValueError(f"objective {self.name!r} has a value loss (vf_coef={self.config.vf_coef}) but the model has "
                       "no value head (ModelConfig.value_head=False)")
    if isinstance(self.config, ValueLossConfig) and not model_cfg.value_head:
      raise ValueError(f"objective {self.name!r} trains a critic but the model has no value head "
                       "(ModelConfig.value_head=False)")


OBJECTIVES: dict[str, Objective] = {
    "ppo": Objective("ppo", PolicyGradientConfig(vf_coef=0.5, vf_clip=0.5)),
    "grpo": Objective("grpo", PolicyGradientConfig(kl_coef=0.02, kl_kind="low_var_kl")),
    "critic": Objective("critic", ValueLossConfig()),
    "sft": Objective("sft", SftConfig()),
    "dpo": Objective("dpo", DpoLossConfig()),
}


def make_objective(name: str, **overrides) -> Objective:
  """The registered objective `name` with config fields replaced by `overrides`."""
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
  base = OBJECTIVES[name]
  try:
    return Objective(name, dataclasses.replace(base.config, **overrides))
  except TypeError as e:
    raise ValueError(f"objective {name!r}: {e}") from None
