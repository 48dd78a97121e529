"""PPO's critic as verl runs it: a separate value model with its own optimizer, learning rate and jitted step.

Why separate. With the value head on the policy's backbone (`mode="shared_head"`, `PolicyGradientConfig.vf_coef`),
the head starts at zero and moves at the policy's learning rate (1e-6), so the values hardly move and GAE is close to
REINFORCE. verl (and verl-agent, which the paper follows) trains a critic model of its own: initialised from the same
checkpoint as the policy, with a scalar value head, AdamW at 1e-5 and the clipped value loss
(`critic.cliprange_value`). That is `mode="separate"`, the default for PPO.

The separate critic here is the policy's transformer (same `ModelConfig`: architecture, dtype, remat) with a value
head and no LM head: its forward stops at the final norm (`Transformer(values_only=True)`), so neither the vocabulary
projection nor the head's weights and optimizer moments exist for it (for untied embeddings, the largest matrix of the
model). Its parameters start as copies of the policy's backbone and, when the policy checkpoint has one, value head
(else a zero one: values start at 0, as the shared head's do). It is laid out on the mesh by the policy's rules
(`critic_abstract_params` names the same logical axes), and its step is the policy's `TrainStep` on the value loss
alone (`Objective("critic", ValueLossConfig)`): the same micro-batch accumulation, shardings and non-finite skip.

`explained_variance` is the diagnostic verl logs (critic/vf_explained_var): 1 - Var[R - V] / Var[R] over the loss
tokens, of the values the critic gave for the batch's GAE, computed exactly on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dreamjax.models.config import ModelConfig
from dreamjax.models.params import abstract_params
from dreamjax.parallel.sharding import TRAIN_RULES, Rules, tree_shardings
from dreamjax.rl.logprobs import LogpScorer
from dreamjax.rl.objectives import Objective, ValueLossConfig
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import TrainState, create_train_state
from dreamjax.rl.update import SkipCounter, make_train_step

CRITIC_MODES = ("separate", "shared_head")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """PPO's critic. "separate": a value model of its own (below). "shared_head": a value head on the policy, trained
  through the policy's loss with `PolicyGradientConfig.vf_coef` / `vf_clip` and the policy's optimizer
  (`OptimConfig.value_head_lr_multiplier`); the other fields here are then unused."""

  mode: str = "separate"  # separate | shared_head
  # verl's critic.optim: lr 1e-5, no warmup (lr_warmup_steps_ratio 0), constant, weight decay 0.01; grad_clip 1.0.
  optim: OptimConfig = OptimConfig(lr=1e-5, clip_norm=1.0, weight_decay=0.01)
  value_clip: float | None = 0.5  # verl's critic.cliprange_value; None: the plain squared error
  # 0: the policy's (verl's critic.ppo_epochs and ppo_mini_batch_size default to the actor's).
  epochs: int = 0  # passes over each iteration's rows
  rows_per_step: int = 0  # turn rows per optimizer step
  micro_batches: int = 0  # gradient accumulation inside a step (memory)

  def __post_init__(self):
    if self.mode not in CRITIC_MODES:
      raise ValueError(f"CriticConfig.mode must be one of {CRITIC_MODES}, got {self.mode!r}")
    for name in ("epochs", "rows_per_step", "micro_batches"):
      if getattr(self, name) < 0:
        raise ValueError(f"CriticConfig.{name} must be >= 0 (0: the policy's), got {getattr(self, name)}")
    if self.value_clip is not None and self.value_clip <= 0:
      raise ValueError(f"CriticConfig.value_clip must be > 0 or None, got {self.value_clip}")


def critic_model_config(policy_cfg: ModelConfig) -> ModelConfig:
  """The critic's model: the policy's, with a value head."""
  return policy_cfg.replace(value_head=True)


def critic_abstract_params(cfg: ModelConfig) -> Any:
  """The critic's parameter tree (boxed shapes with logical axes, as `abstract_params`): the model's without the LM
  head (a tied model keeps its embedding, which embeds the input)."""
  return {k: v for k, v in abstract_params(critic_model_config(cfg)).items() if k != "lm_head"}


def init_critic_params(policy_params: dict[str, Any], cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None,
                       rules: Rules = TRAIN_RULES) -> dict[str, Any]:
  """The critic's starting weights: fresh copies (the policy's own are donated by its step) of the policy's backbone
  and of its value head when it has one, else a zero value head, made where the critic's layout puts it."""
  abstract = critic_abstract_params(cfg)
  missing = sorted(set(abstract) - set(policy_params) - {"value_head"})
  if missing:
    raise ValueError(f"init_critic_params: the policy's parameters have no {missing} for the critic's backbone")
  params = {k: jax.tree.map(jnp.copy, policy_params[k]) for k in abstract if k in policy_params}
  if "value_head" not in params:
    head = nn.unbox(abstract["value_head"])
    if mesh is None:
      params["value_head"] = jnp.zeros(head.shape, head.dtype)
    else:  # created in its shards (every process: no host array to place)
      sharding = tree_shardings(abstract, mesh, rules)["value_head"]
      params["value_head"] = jax.jit(lambda: jnp.zeros(head.shape, head.dtype), out_shardings=sharding)()
  return params


def explained_variance(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> float:
  """1 - Var[returns - values] / Var[returns] over the entries where `mask` > 0 (population variances, float64);
  0 when the returns there do not vary (nothing to explain), as `value_loss` reports it."""
  on = np.asarray(mask) > 0
  r = np.asarray(returns, np.float64)[on]
  v = np.asarray(values, np.float64)[on]
  var = float(r.var()) if r.size else 0.0
  return float(1.0 - (r - v).var() / var) if var > 0 else 0.0


def critic_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
  """An iteration's critic metrics from its steps': means over the applied steps (over all when every one was
  skipped, so a NaN shows), the first and last value loss, the largest gradient norm, the last learning rate."""
  applied = [m for m in per_step if not m["skipped"]] or per_step
  mean = lambda k: float(np.mean([m[k] for m in applied]))  # noqa: E731
  return {"vf_loss": mean("vf_loss"), "vf_loss_first": applied[0]["vf_loss"], "vf_loss_last": applied[-1]["vf_loss"],
          "vf_clip_frac": mean("vf_clip_frac"), "critic_grad_norm": mean("grad_norm"),
          "critic_grad_norm_max": max(m["grad_norm"] for m in applied), "critic_lr": applied[-1]["learning_rate"],
          "critic_update_steps": len(per_step), "critic_skipped_updates": int(sum(m["skipped"] for m in per_step))}


class Critic:
  """The separate critic: its model config, train state (`state`, checkpointed with the run), jitted step and value
  scorer. `epochs` and `rows_per_step` are the resolved settings (the config's, or the policy's where 0)."""

  def __init__(self, cfg: CriticConfig, policy_cfg: ModelConfig, policy_params: dict[str, Any], *, agg: str,
               epochs: int, rows_per_step: int, micro_batches: int, score_batch: int, pad_to: int,
               length_buckets: bool, max_nonfinite_updates: int, mesh: jax.sharding.Mesh | None = None,
               rules: Rules = TRAIN_RULES):
    if cfg.mode != "separate":
      raise ValueError(f"Critic: a {cfg.mode!r} critic lives on the policy; only 'separate' builds one")
    self.cfg, self.epochs, self.rows_per_step = cfg, epochs, rows_per_step
    self.model_cfg = critic_model_config(policy_cfg)
    abstract = critic_abstract_params(self.model_cfg)
    optimizer = make_optimizer(cfg.optim)
    objective = Objective("critic", ValueLossConfig(clip=cfg.value_clip, agg=agg))
    # `length_buckets` as the policy's step (`TrainStep._bucketed`): PPO's multi-turn rows vary in length, and
    # without it every micro-batch of a critic step was padded to the step's longest row.
    self.step = make_train_step(self.model_cfg, objective, optimizer, micro_batches=micro_batches, mesh=mesh,
                                rules=rules, abstract=abstract, pad_to=pad_to, length_buckets=length_buckets)
    if rows_per_step % self.step.row_multiple:
      raise ValueError(f"critic rows_per_step ({rows_per_step}) must be a multiple of micro_batches x data-parallel "
                       f"size ({self.step.row_multiple})")
    self.state: TrainState = create_train_state(self.model_cfg, init_critic_params(policy_params, self.model_cfg,
                                                                                   mesh, rules),
                                                optimizer, mesh, rules, abstract)
    self.scorer = LogpScorer(self.model_cfg, score_batch, values_only=True, pad_to=pad_to, mesh=mesh, rules=rules)
    self.skips = SkipCounter(max_nonfinite_updates, "critic update")

  @property
  def params(self) -> dict[str, Any]:
    return self.state.params

  def values(self, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """float [M, T]: the critic's aligned values of the rows (`token_values`), on the host."""
    return self.scorer(self.state.params, tokens, None, valid)[1]
