"""The policy learner every RL loop shares (real-env PPO/GRPO, S2R and DreamGym differ only in the env and the task
draw): its config, the seeded task draw, and `PolicyLearner`, which runs one iteration against any batched env.

One iteration (`PolicyLearner.iteration`):
1. roll out G episodes per task through the `RolloutEngine` (token-in/token-out turn rows, one fresh bounded prompt
   per turn, so memory does not grow with episode length);
2. score the rows the update will read under the frozen reference policy (the KL term; GRPO's zero-variance groups,
   which it drops, are not scored) and, for PPO, the critic's values;
3. build the `TokenBatch` (`rl_batch`: GRPO group-normalised returns, or GAE over turns for PPO; the invalid-action
   penalty subtracted from invalid turns); only sampled action tokens carry loss weight, never observation tokens;
4. update: `epochs` passes over the rows, each cut into optimizer steps of a fixed `rows_per_step` rows (balanced, the
   last padded with empty rows) and a length rounded up to `pad_to`, so the jitted step compiles once per length
   bucket; `micro_batches` splits a step for memory on long contexts (with `length_buckets`, into micro-batches of
   similar row length, each cut to its own length). PPO's separate critic then takes its own
   passes (its `epochs`, `rows_per_step`, or the policy's) with its own step and optimizer, its steps cut into
   micro-batches the same way. With `shared_prefix` the policy's step computes a prefix its rows share once per
   cluster of rows (`dreamjax.rl.update`, "Shared prefixes"): the same steps on the same rows, to float32 rounding;
   so does reference scoring (`LogpScorer`), while value scoring and the critic stay per row.
Its metrics include `env_steps`: answers that parsed and were sent to the env (`evaluate.unparsed_rows`; an
unparseable answer costs no env step). The loop counts them as real or synthetic transitions by the env's kind.

PPO's critic (`RLConfig.critic`, `dreamjax.rl.critic`). "separate" (the default, as verl): a value model initialised
from the policy's checkpoint, with its own optimizer (lr 1e-5), clipped value loss and `TrainState`, laid out like the
policy and checkpointed with it; the policy's objective then has no value term (`objective.vf_coef` is not used).
"shared_head": a value head on the policy trained through `objective.vf_coef` (the earlier behaviour). Either way the
iteration logs `value_explained_variance` of the values GAE used; the separate critic adds `vf_loss`,
`critic_grad_norm`, `critic_lr` and its own skip counts (`critic_skipped_updates`, `critic_nonfinite_streak`).
`as_ppo` gives an RLConfig PPO as the paper ran it (verl-agent's PPO on verl's defaults; configs/ppo_real_twx.py).

Non-finite updates. An optimizer step whose loss or gradient is not finite (a NaN advantage, an overflow) is skipped
inside the jitted step (`dreamjax.rl.update`): parameters and optimizer state stay as they were. The iteration's
metrics count them (`skipped_updates`, and `nonfinite_streak`, the skips in a row so far, carried across iterations
but not across a resume), its loss metrics are means over the applied steps only (NaN, written as null, when none was
applied), and `max_nonfinite_updates` skips in a row stop the run with a `NonFiniteUpdateError` naming the iteration.

GRPO groups whose G returns are all equal have zero advantage (`grpo_advantages`); they still carry the KL term. With
`drop_zero_variance_groups` (DAPO's dynamic-sampling filter) their rows are left out of the update, which saves their
compute; their fraction is logged either way.

GiGPO (`advantage="gigpo"`, algorithm grpo) adds a step advantage to GRPO's episode one (`rl_batch`): turns of a
group that started in the same env state are compared by their discounted returns-to-go, so where episodes pass
through the same states the action taken there gets its own credit. `step_group_shared_frac` logs the fraction of
updated turns whose state another turn of their group also reached (the turns a step advantage can reach).

Reproducibility: one root key from the seed, folded with (iteration, phase) for rollouts and updates
(`dreamjax.rl.keys`); NumPy draws are seeded with (seed, phase, ...). Several processes: every process runs the same
iteration on the same seeds and its own copy of the envs; `check_same` compares a digest of each rollout and fails
loudly if an env is not deterministic; sampling, scoring and the update are one SPMD program over the whole mesh.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.envs.base import BatchEnv, Task
from dreamjax.envs.registry import env_tasks, parse_env_kwargs
from dreamjax.loop.config import RunConfig
from dreamjax.loop.evaluate import evaluate, greedy_rollout, unparsed_rows
from dreamjax.loop.model import ModelSource, prepare_model
from dreamjax.loop.track import echo
from dreamjax.models import ModelConfig, tiny
from dreamjax.models.params import in_compute_dtype, sampling_copy
from dreamjax.parallel import TRAIN_RULES, check_same
from dreamjax.rl.batch import INVALID_CREDIT, TokenBatch, anchor_groups, rl_batch, step_advantages
from dreamjax.rl.critic import Critic, CriticConfig, critic_metrics, explained_variance
from dreamjax.rl.keys import PHASE_CRITIC, PHASE_EVAL, PHASE_ROLLOUT, PHASE_SHUFFLE, PHASE_UPDATE, phase_key
from dreamjax.rl.logprobs import LogpScorer
from dreamjax.rl.objectives import Objective, PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import SkipCounter, make_train_step
from dreamjax.rollout.agent import INVALID_ANSWER, AgentFormat, format_answer, user_text
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.sampling import speculation_rates
from dreamjax.text import Tokenizer

ALGORITHMS = {"grpo": ("grpo", "gigpo"), "ppo": ("gae_turn", "gae_token")}  # algorithm -> advantages it accepts


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """Tasks `start .. start + count - 1` of each game in one split, drawn by the env adapter's own tasks()."""

  games: tuple[str, ...] = ("coin",)
  split: str = "train"
  start: int = 0
  count: int = 64  # per game
  game_params: str = ""  # env-specific game settings (TWX: "numLocations=2, includeDoors=0")

  def tasks(self, env: str) -> list[Task]:
    if not self.games or self.count < 1:
      raise ValueError(f"TaskSpec: needs at least one game and count >= 1, got {self}")
    return [t for g in self.games for t in env_tasks(env, g, self.split, self.count, self.start, self.game_params)]


@dataclasses.dataclass(frozen=True)
class RLConfig(RunConfig):
  # The policy: a warm-start HF folder (dreamjax train-policy's output), or empty for a tiny one built for the run.
  model: ModelSource = ModelSource(tiny=tiny("qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384,
                                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                             max_position_embeddings=1024))
  algorithm: str = "grpo"  # grpo | ppo
  # GRPO: clipped surrogate + low-variance KL to the frozen warm start. PPO with a shared-head critic: set vf_coef > 0
  # (a separate critic has its own loss; vf_coef is then not used).
  # Its temperature must equal rollout.temperature (ratios compare the distributions the rollout sampled from).
  objective: PolicyGradientConfig = PolicyGradientConfig(kl_coef=0.02, kl_kind="low_var_kl")
  critic: CriticConfig = CriticConfig()  # PPO only: a separate value model (default) or a head on the policy
  advantage: str = "grpo"  # grpo | gigpo (with algorithm grpo) | gae_turn | gae_token (with algorithm ppo)
  # GAE's discount per turn (gae_turn) or per token (gae_token); GiGPO's per turn, for its step returns-to-go
  gamma: float = 1.0
  step_advantage_weight: float = 1.0  # GiGPO: the step advantage's weight beside the episode's (rl_batch)
  lam: float = 1.0
  normalize_std: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
  whiten_advantages: bool = False  # PPO: whiten advantages over the batch's action tokens
  invalid_penalty: float = 0.1  # subtracted from the reward of a turn whose action was invalid or unparseable
  drop_zero_variance_groups: bool = False  # GRPO: leave groups with equal returns out of the update
  episode_weights: bool = False  # every episode weighs the same in the loss, however many turns it took (rl_batch)
  # GRPO: where the invalid-action penalty goes (rl_batch): "episode" (its return) or "turn" (the invalid turn only)
  invalid_credit: str = "episode"
  env: str = "textworld_express"
  env_kwargs: tuple[str, ...] = ("step_limit=20",)  # "key=value"; values parsed as JSON where they parse
  num_workers: int = 0  # EnvPool worker processes; 0: envs in this process (TWX is fast in-process)
  train_tasks: TaskSpec = TaskSpec(split="train", count=256)
  eval_tasks: TaskSpec = TaskSpec(split="dev", count=100)
  agent: AgentFormat = AgentFormat(think=False)
  rollout: RolloutConfig = RolloutConfig(group_size=8, max_turns=15, max_action_tokens=32, max_episode_tokens=512,
                                         prompt_buckets=(512, 768), temperature=1.0)
  tasks_per_iteration: int = 16  # B
  optim: OptimConfig = OptimConfig(lr=1e-6, clip_norm=1.0)
  rows_per_step: int = 64  # turn rows per optimizer step
  micro_batches: int = 1  # gradient accumulation inside a step (memory)
  # The update and the reference scoring run a prefix their rows share (a group's turn-0 prompt, a task's instruction)
  # once per cluster of rows, not once per row: the same loss and gradients to float32 rounding (dreamjax.rl.update,
  # "Shared prefixes").
  # Unrolled layers only (ModelSource.scan_layers off). rollout.group_prefill is the sampler's counterpart.
  shared_prefix: bool = False
  # Each micro-batch of a step holds rows of similar length and is cut to its own longest row (rounded up to pad_to):
  # the same update to float32 rounding, with less padding where row lengths vary (multi-turn rows), and one
  # compilation per length (dreamjax.rl.update, TrainStep._bucketed). Needs micro_batches > 1 to gain anything.
  length_buckets: bool = False
  epochs: int = 1  # passes over each iteration's rows (PPO epochs)
  pad_to: int = 128  # row lengths are rounded up to a multiple of this (one compilation per multiple)
  score_batch: int = 32  # rows per reference / value scoring call
  iterations: int = 100
  eval_every: int = 10  # 0: only before the first and after the last iteration
  eval_batch: int = 0  # episodes per evaluation batch; 0: B * G
  eval_sampled: bool = False  # also evaluate at the rollout temperature (one sampled episode per task)
  out_dir: str = "runs/rl_real"
  # Real transitions the run may spend in training (DreamGym-S2R's budget, real-env RL's); 0: no budget. Exact: the
  # iteration that reaches it steps only what is left, and the run stops there.
  max_real_transitions: int = 0
  # The same for synthetic transitions, when the env is M_exp (DreamGym): the reproduce tables give DreamGym as many
  # transitions as real-env RL, so the two rows learn from the same amount of experience.
  max_synthetic_transitions: int = 0
  checkpoint_every: int = 10  # iterations between checkpoints (also after the last); 0: only after the last
  keep_checkpoints: int = 3  # the last N checkpoints are kept
  # Optimizer steps skipped in a row for a non-finite loss or gradient before the run stops with an error.
  max_nonfinite_updates: int = 3

  def __post_init__(self):
    if self.algorithm not in ALGORITHMS:
      raise ValueError(f"RLConfig.algorithm must be one of {sorted(ALGORITHMS)}, got {self.algorithm!r}")
    if self.advantage not in ALGORITHMS[self.algorithm]:
      raise ValueError(f"RLConfig.advantage {self.advantage!r} does not go with algorithm {self.algorithm!r} "
                       f"(expected one of {ALGORITHMS[self.algorithm]})")
    if self.invalid_credit not in INVALID_CREDIT or (self.invalid_credit == "turn" and self.advantage != "grpo"):
      raise ValueError(f"RLConfig.invalid_credit must be one of {INVALID_CREDIT} ('turn' with advantage 'grpo' only), "
                       f"got {self.invalid_credit!r} with advantage {self.advantage!r}")
    if not 0.0 < self.gamma <= 1.0 or self.step_advantage_weight < 0:
      raise ValueError(f"RLConfig: gamma must lie in (0, 1] and step_advantage_weight be >= 0, got {self.gamma} and "
                       f"{self.step_advantage_weight}")
    if self.algorithm == "ppo" and self.critic.mode == "shared_head" and self.objective.vf_coef <= 0:
      raise ValueError("RLConfig: a shared-head critic (critic.mode 'shared_head') trains through the policy's value "
                       "loss; set objective.vf_coef > 0")
    if self.rollout.temperature <= 0 or self.objective.temperature != self.rollout.temperature:
      raise ValueError(f"RLConfig: rollout.temperature ({self.rollout.temperature}) must be > 0 and equal to "
                       f"objective.temperature ({self.objective.temperature}); set both")
    for name in ("tasks_per_iteration", "rows_per_step", "micro_batches", "epochs", "pad_to", "score_batch",
                 "iterations", "max_nonfinite_updates"):
      if getattr(self, name) < 1:
        raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
    if min(self.eval_every, self.eval_batch, self.checkpoint_every, self.max_real_transitions,
           self.max_synthetic_transitions) < 0:
      raise ValueError("RLConfig: eval_every, eval_batch, checkpoint_every, max_real_transitions and "
                       "max_synthetic_transitions must be >= 0")
    if self.keep_checkpoints < 1:
      raise ValueError(f"RLConfig.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
    if self.rows_per_step % self.micro_batches:
      raise ValueError(f"RLConfig.rows_per_step ({self.rows_per_step}) must be a multiple of micro_batches "
                       f"({self.micro_batches})")
    if self.separate_critic:
      rows, micro = self.critic.rows_per_step or self.rows_per_step, self.critic.micro_batches or self.micro_batches
      if rows % micro:
        raise ValueError(f"RLConfig.critic: rows_per_step ({rows}) must be a multiple of micro_batches ({micro}) "
                         "(0 takes the policy's)")
    parse_env_kwargs(self.env_kwargs)

  @property
  def rows(self) -> int:
    """Episodes stepped together: B * G for training (at most rollout.max_rows), eval_batch for evaluation."""
    return max(self.rollout.rows_at_once(self.tasks_per_iteration * self.rollout.group_size), self.eval_batch)

  @property
  def separate_critic(self) -> bool:
    """PPO with a value model of its own (`critic.mode` "separate")."""
    return self.algorithm == "ppo" and self.critic.mode == "separate"

  @property
  def shared_head(self) -> bool:
    """PPO with the value head on the policy (`critic.mode` "shared_head")."""
    return self.algorithm == "ppo" and self.critic.mode == "shared_head"


def as_ppo(rl: RLConfig, **overrides) -> RLConfig:
  """`rl`'s env, tasks, agent format, rollout, batch sizes and policy optimizer with PPO as the paper ran it: the
  paper reports no PPO hyperparameters and follows verl-agent, whose PPO examples (examples/ppo_trainer/
  run_alfworld.sh, run_webshop.sh) run verl's PPO defaults (verl/trainer/config/ppo_trainer.yaml) with the overrides
  noted below. `overrides` replace any RLConfig field after that (e.g. out_dir). configs/ppo_real_twx.py is this on
  the GRPO config's env; `dreamjax reproduce` can take its PPO rows from it."""
  ppo = dict(
      algorithm="ppo",
      # actor.clip_ratio 0.2 both ways (verl; no clip-higher); loss_agg_mode token-mean; the examples set
      # actor.use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type=low_var_kl (and use_kl_in_reward=False). No entropy
      # bonus, as the GRPO config (verl-agent's yaml has entropy_coeff 0.001, which neither config takes).
      objective=PolicyGradientConfig(clip_low=0.2, clip_high=0.2, kl_coef=0.01, kl_kind="low_var_kl",
                                     entropy_coef=0.0, agg="token_mean", temperature=rl.rollout.temperature),
      # algorithm.adv_estimator=gae with verl's algorithm.gamma = algorithm.lam = 1.0 (the examples keep them). Over
      # turns, one value per turn (at its last prompt token): this repo's choice for turn rows; gae_token is per token.
      advantage="gae_turn",
      gamma=1.0,
      lam=1.0,
      whiten_advantages=True,  # verl's compute_gae_advantage_return whitens the advantages over the batch
      drop_zero_variance_groups=False,  # GRPO's filter; PPO's GAE has no groups
      # actor.ppo_epochs 1 (verl's default; the examples and the paper set none); the critic follows it.
      epochs=1,
      # A separate critic from the same checkpoint: critic.optim.lr=1e-5 (the examples; verl's default too),
      # weight decay 0.01, no warmup, grad_clip 1.0, cliprange_value 0.5 (verl's defaults); critic_warmup 0.
      critic=CriticConfig(mode="separate", optim=OptimConfig(lr=1e-5, clip_norm=1.0, weight_decay=0.01),
                          value_clip=0.5),
  )
  return dataclasses.replace(rl, **{**ppo, **overrides})


def episode_returns(traj: Trajectories, invalid_penalty: float) -> np.ndarray:
  """float [N]: each episode's summed turn rewards with the invalid-action penalty, as the advantages see them."""
  turn = traj.reward - invalid_penalty * traj.invalid.astype(np.float32)
  out = np.zeros(traj.num_episodes, np.float32)
  np.add.at(out, traj.episode, turn)
  return out


def zero_variance_groups(traj: Trajectories, returns: np.ndarray) -> np.ndarray:
  """bool [num groups]: all episodes of the group have the same return (GRPO gives them zero advantage), counting
  only episodes the update keeps (`traj.left_out`: a group with fewer than two such episodes compares nothing either)."""
  groups = int(traj.group.max()) + 1
  ok = ~traj.left_out
  hi = np.full(groups, -np.inf)
  lo = np.full(groups, np.inf)
  np.maximum.at(hi, traj.group[ok], returns[ok])
  np.minimum.at(lo, traj.group[ok], returns[ok])
  return (hi == lo) | (np.bincount(traj.group[ok], minlength=groups) < 2)


def silent_groups(traj: Trajectories, invalid_penalty: float, invalid_credit: str, advantage: str = "grpo",
                  gamma: float = 1.0) -> np.ndarray:
  """bool [num groups]: groups whose GRPO update is zero on every row. With episode credit, those of equal returns;
  with turn credit, those of equal env returns with no invalid turn (each carries its own penalty, rl_batch). GiGPO:
  those of equal returns whose step advantages are all 0 too (all its episodes may succeed, in different turns)."""
  if advantage == "gigpo":
    turn = traj.reward - invalid_penalty * traj.invalid.astype(np.float32)
    moving = step_advantages(traj, turn, gamma, normalize_std=False) != 0
    stepped = np.bincount(traj.group[traj.episode[moving]], minlength=int(traj.group.max()) + 1) > 0
    return zero_variance_groups(traj, episode_returns(traj, invalid_penalty)) & ~stepped
  if invalid_credit == "episode" or not invalid_penalty:
    return zero_variance_groups(traj, episode_returns(traj, invalid_penalty))
  invalid = traj.invalid & ~traj.left_out[traj.episode]
  has_invalid = np.bincount(traj.group[traj.episode[invalid]], minlength=int(traj.group.max()) + 1) > 0
  return zero_variance_groups(traj, episode_returns(traj, 0.0)) & ~has_invalid


def _mean(x: np.ndarray) -> float:
  return float(x.mean()) if x.size else 0.0


def take_rows(batch: TokenBatch, rows: np.ndarray, num_rows: int, pad_to: int) -> TokenBatch:
  """`rows` of a host batch in a fresh batch of `num_rows` rows (the rest empty), cut to the rows' longest length
  rounded up to `pad_to`."""
  valid = np.asarray(batch.valid)[rows]
  longest = int(valid.sum(-1).max(initial=1))
  length = min(batch.length, max(pad_to, -(-longest // pad_to) * pad_to))

  def take(x):
    x = np.asarray(x)
    out = np.full((num_rows, *x.shape[1:]), -1 if x.ndim == 3 else 0, x.dtype)  # [B, T, A]: `allowed`, -1 padded
    out[:len(rows)] = x[rows]
    return out[:, :length] if x.ndim >= 2 else out

  return jax.tree.map(take, batch)


def value_metrics(batch: TokenBatch) -> dict[str, float]:
  """How well the values GAE used (`old_values`) explain the returns, over the batch's loss tokens."""
  return {"value_explained_variance": explained_variance(batch.returns, batch.old_values, batch.loss_mask)}


def update_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
  """An iteration's update metrics from its steps': means (over the applied steps; over all when every step was
  skipped, so a NaN loss shows), the first step's loss parts, the last loss, the largest gradient norm."""
  applied = [m for m in per_step if not m.get("skipped")] or per_step
  out = {k: float(np.mean([m[k] for m in applied])) for k in per_step[0] if k != "skipped"}
  out.update({f"{k}_first": applied[0][k] for k in ("loss", "kl", "vf_loss") if k in per_step[0]})
  out.update(update_steps=len(per_step), loss_last=applied[-1]["loss"],
             grad_norm_max=max(m["grad_norm"] for m in applied))
  return out


def tokenizer_texts(fmt: AgentFormat, env: BatchEnv, tasks: list[Task], rows: int) -> list[str]:
  """Prompt and answer texts for training a tokenizer from scratch: first observations of some training tasks."""
  texts = [fmt.system_text(), INVALID_ANSWER]
  for first in range(0, min(len(tasks), 4 * rows), rows):
    chunk = tasks[first:first + rows]
    for task, obs in zip(chunk, env.reset_batch(chunk)):
      texts.append(user_text(fmt, obs.instruction or task.instruction, 0, [], obs.state, obs.admissible))
      texts += [format_answer(a) for a in obs.admissible]
  return texts


class PolicyLearner:
  """The policy side of every RL loop: policy state, frozen reference, rollout and evaluation engines, scorers and the
  jitted step. It rolls out against whatever env it is given, real or synthetic."""

  def __init__(self, cfg: RLConfig, model_cfg: ModelConfig, params, tokenizer: Tokenizer, mesh=None):
    self.cfg, self.model_cfg, self.tokenizer, self.mesh = cfg, model_cfg, tokenizer, mesh
    # A separate critic carries the value loss; the policy's objective has none.
    self.objective = Objective(cfg.algorithm, dataclasses.replace(cfg.objective, vf_coef=0.0)
                               if cfg.separate_critic else cfg.objective)
    optimizer = make_optimizer(cfg.optim)
    self.step = make_train_step(model_cfg, self.objective, optimizer, micro_batches=cfg.micro_batches, mesh=mesh,
                                shared_prefix=cfg.shared_prefix, pad_to=cfg.pad_to, length_buckets=cfg.length_buckets)
    if cfg.rows_per_step % self.step.row_multiple:
      raise ValueError(f"RLConfig.rows_per_step ({cfg.rows_per_step}) must be a multiple of micro_batches x "
                       f"data-parallel size ({self.step.row_multiple})")
    # A copy (the train step donates the state's buffers, which must not be the reference's), in the compute dtype:
    # frozen, it gives the same log-probs at half the bytes in a bfloat16 run (`in_compute_dtype`).
    self.ref_params = in_compute_dtype(params, model_cfg) if self.objective.config.kl_coef else None
    # The critic copies the policy's initial weights (the same checkpoint) before the policy's state takes them.
    self.critic = Critic(cfg.critic, model_cfg, params, agg=cfg.objective.agg, epochs=cfg.critic.epochs or cfg.epochs,
                         rows_per_step=cfg.critic.rows_per_step or cfg.rows_per_step,
                         micro_batches=cfg.critic.micro_batches or cfg.micro_batches, score_batch=cfg.score_batch,
                         pad_to=cfg.pad_to, length_buckets=cfg.length_buckets,
                         max_nonfinite_updates=cfg.max_nonfinite_updates, mesh=mesh) \
        if cfg.separate_critic else None
    self.state = create_train_state(model_cfg, params, optimizer, mesh)
    self.engine = RolloutEngine(model_cfg, tokenizer, cfg.agent, cfg.rollout, mesh=mesh)
    # One jitted sampler serves rollouts and evaluation, so evaluation batches of B * G rows reuse its compilation.
    self.eval_engine = RolloutEngine(model_cfg, tokenizer, cfg.agent, greedy_rollout(cfg.rollout), mesh=mesh,
                                     sampler=self.engine.sampler)
    self.sampled_eval_engine = RolloutEngine(model_cfg, tokenizer, cfg.agent,
                                             dataclasses.replace(cfg.rollout, group_size=1), mesh=mesh,
                                             sampler=self.engine.sampler)
    score = dict(temperature=cfg.rollout.temperature, pad_to=cfg.pad_to, mesh=mesh, rules=TRAIN_RULES)
    self.ref_scorer = LogpScorer(model_cfg, cfg.score_batch, shared_prefix=cfg.shared_prefix, **score) \
        if self.ref_params is not None else None
    self.value_scorer = LogpScorer(model_cfg, cfg.score_batch, with_values=True, **score) if cfg.shared_head else None
    self.root = jax.random.key(cfg.seed)
    self.skips = SkipCounter(cfg.max_nonfinite_updates, "RL update")

  @property
  def params(self):
    return self.state.params

  def checkpoint_arrays(self) -> dict[str, Any]:
    """The learner's arrays a checkpoint holds: train state, frozen reference (when the KL term has one), the separate
    critic's train state (PPO), root key."""
    arrays = {"state": self.state, "root": self.root}
    if self.ref_params is not None:
      arrays["ref_params"] = self.ref_params
    if self.critic is not None:
      arrays["critic"] = self.critic.state
    return arrays

  def load_checkpoint_arrays(self, arrays: dict[str, Any]) -> None:
    """Takes back what `checkpoint_arrays` gave (restored onto its layout, so the jitted step's shardings hold)."""
    self.state, self.root = arrays["state"], arrays["root"]
    if self.ref_params is not None:
      self.ref_params = arrays["ref_params"]
    if self.critic is not None:
      self.critic.state = arrays["critic"]

  def sampling_params(self):
    """The policy's parameters as the sampler wants them (`sampling_copy`): unrolled, in the compute dtype and laid
    out for sampling (which may shard differently from training). With float32 compute, unrolled layers and one
    layout these are the state's own arrays, no copy."""
    shardings = None if self.mesh is None else self.engine.sampler.param_shardings()
    return sampling_copy(self.state.params, self.model_cfg, shardings)

  def build_batch(self, traj: Trajectories, rows: np.ndarray | None = None) -> tuple[TokenBatch, dict[str, float]]:
    """The update's batch for a rollout: reference log-probs and critic values scored here, advantages by config.
    `rows` (default: all) are the rows the update will read: only they get reference log-probs (the others keep 0),
    which spares the scoring of GRPO's zero-variance groups, often half of an iteration's rows."""
    cfg, times = self.cfg, {}
    valid = np.arange(traj.tokens.shape[1])[None] < traj.lengths[:, None]
    ref_logp = values = None
    if self.ref_scorer is not None:
      t0 = time.perf_counter()
      rows = np.arange(traj.num_rows) if rows is None else np.asarray(rows)
      ref_logp = np.zeros(traj.tokens.shape, np.float32)
      if len(rows):
        ref_logp[rows], _ = self.ref_scorer(self.ref_params, traj.tokens[rows], None, valid[rows],
                                            mask=traj.loss_mask[rows],
                                            allowed=None if traj.allowed is None else traj.allowed[rows])
      times["ref_s"] = time.perf_counter() - t0
    if self.value_scorer is not None:
      t0 = time.perf_counter()
      # GAE reads values on the loss tokens only, and no log-probs: an all-zero mask skips the vocabulary projection.
      _, values = self.value_scorer(self.state.params, traj.tokens, None, valid, mask=np.zeros_like(valid))
      times["values_s"] = time.perf_counter() - t0
    elif self.critic is not None:
      t0 = time.perf_counter()
      values = self.critic.values(traj.tokens, valid)
      times["values_s"] = time.perf_counter() - t0
    batch = rl_batch(traj, advantage=cfg.advantage, values=values, ref_logp=ref_logp,
                     invalid_penalty=cfg.invalid_penalty, gamma=cfg.gamma, lam=cfg.lam,
                     normalize_std=cfg.normalize_std, whiten_advantages=cfg.whiten_advantages,
                     episode_weights=cfg.episode_weights, invalid_credit=cfg.invalid_credit,
                     step_weight=cfg.step_advantage_weight, pad_to=cfg.pad_to)
    return batch, times

  def minibatches(self, batch: TokenBatch, rows: np.ndarray, iteration: int, epochs: int, rows_per_step: int):
    """`epochs` passes over `rows` of `batch`, each in a seeded order cut into balanced steps of `rows_per_step` rows
    (so the policy and a critic with the same settings see the same steps)."""
    cfg = self.cfg
    for epoch in range(epochs if len(rows) else 0):
      order = np.random.default_rng((cfg.seed, PHASE_SHUFFLE, iteration, epoch)).permutation(rows)
      for part in np.array_split(order, -(-len(order) // rows_per_step)):
        yield take_rows(batch, part, rows_per_step, cfg.pad_to)

  def update(self, batch: TokenBatch, rows: np.ndarray, iteration: int) -> dict[str, float]:
    """`epochs` passes over `rows` of `batch` in balanced optimizer steps of `rows_per_step` rows; mean metrics."""
    cfg = self.cfg
    key = phase_key(self.root, iteration, PHASE_UPDATE)
    per_step: list[dict[str, float]] = []
    for mb in self.minibatches(batch, rows, iteration, cfg.epochs, cfg.rows_per_step):
      self.state, metrics = self.step(self.state, mb, jax.random.fold_in(key, len(per_step)))
      per_step.append({k: float(v) for k, v in jax.device_get(metrics).items()})
      if per_step[-1]["skipped"]:
        echo(f"iteration {iteration + 1}: update step {len(per_step)} skipped: non-finite loss "
             f"{per_step[-1]['loss']} or gradient norm {per_step[-1]['grad_norm']}; parameters unchanged")
      self.skips.add(metrics, f"iteration {iteration + 1}, update step {len(per_step)}")
      self.skips.check()
    if not per_step:
      return {"update_steps": 0}
    return {**update_metrics(per_step), "skipped_updates": int(sum(m["skipped"] for m in per_step)),
            "nonfinite_streak": self.skips.streak}

  def update_critic(self, batch: TokenBatch, rows: np.ndarray, iteration: int) -> dict[str, float]:
    """The separate critic's passes over `rows` of `batch` (its epochs and step size) on the value loss; metrics.
    Non-finite steps are skipped and counted as the policy's are, on the critic's own counter."""
    critic = self.critic
    key = phase_key(self.root, iteration, PHASE_CRITIC)
    per_step: list[dict[str, float]] = []
    for mb in self.minibatches(batch, rows, iteration, critic.epochs, critic.rows_per_step):
      critic.state, metrics = critic.step(critic.state, mb, jax.random.fold_in(key, len(per_step)))
      per_step.append({k: float(v) for k, v in jax.device_get(metrics).items()})
      if per_step[-1]["skipped"]:
        echo(f"iteration {iteration + 1}: critic step {len(per_step)} skipped: non-finite value loss "
             f"{per_step[-1]['loss']} or gradient norm {per_step[-1]['grad_norm']}; critic unchanged")
      critic.skips.add(metrics, f"iteration {iteration + 1}, critic step {len(per_step)}")
      critic.skips.check()
    if not per_step:
      return {"critic_update_steps": 0}
    return {**critic_metrics(per_step), "critic_nonfinite_streak": critic.skips.streak}

  def iteration(self, env: BatchEnv, tasks: list[Task], iteration: int, max_env_steps: int = 0
                ) -> tuple[dict[str, Any], Trajectories]:
    """Rolls out G episodes of each task against `env` (real or synthetic), updates; (metrics, the rollout).
    `max_env_steps` (0: none) caps the rollout's env steps exactly (`RolloutEngine.run`): a budget's last iteration."""
    cfg, t_start = self.cfg, time.perf_counter()
    traj = self.engine.run(self.sampling_params(), env, tasks, phase_key(self.root, iteration, PHASE_ROLLOUT),
                           iteration, max_env_steps=max_env_steps)
    stats = traj.stats
    # Each process stepped its own envs; the update below assumes they all hold this same rollout.
    check_same(f"the rollout of iteration {iteration}", traj.tokens, traj.reward, traj.done, traj.invalid)
    unparsed = unparsed_rows(traj, self.tokenizer)
    returns = episode_returns(traj, cfg.invalid_penalty)
    flat = silent_groups(traj, cfg.invalid_penalty, cfg.invalid_credit, cfg.advantage, cfg.gamma)
    keep = ~traj.left_out[traj.episode]  # rl_batch gives them no loss anyway; this spares their compute
    if cfg.drop_zero_variance_groups and cfg.algorithm == "grpo":
      keep &= ~flat[traj.group[traj.episode]]
    kept = np.flatnonzero(keep)
    batch, times = self.build_batch(traj, kept)
    t0 = time.perf_counter()
    metrics = self.update(batch, kept, iteration)
    times["update_s"] = time.perf_counter() - t0
    if self.critic is not None:
      t0 = time.perf_counter()
      metrics.update(self.update_critic(batch, kept, iteration))
      times["critic_update_s"] = time.perf_counter() - t0
    if cfg.algorithm == "ppo":
      metrics.update(value_metrics(batch))
    if cfg.advantage == "gigpo":
      anchors = anchor_groups(traj)[kept]
      metrics["step_group_shared_frac"] = _mean(np.bincount(anchors)[anchors] >= 2)
    ok = ~traj.left_out  # episodes the env failed on or the budget cut measure nothing: rates are over the others
    metrics.update(
        rollout_success=_mean(traj.success[ok]), rollout_reward=_mean(traj.episode_reward[ok]),
        rollout_return=_mean(returns[ok]), zero_variance_group_frac=float(flat.mean()),
        # groups none of whose kept episodes succeeded: the silent ones GRPO and GiGPO cannot learn from
        failed_group_frac=float((np.bincount(traj.group[ok & traj.success], minlength=len(flat)) == 0).mean()),
        env_errors=int(traj.env_error.sum()), budget_cut_episodes=int(traj.budget_cut.sum()),
        rows=traj.num_rows, rows_updated=int(keep.sum()), mean_turns=float(traj.num_turns.mean()),
        invalid_rate=float((traj.invalid & ~unparsed).sum() / max(1, (~unparsed).sum())),
        parse_failure_rate=float(unparsed.mean()), truncated_rate=float(1 - traj.ended.mean()),
        sampled_tokens=int(stats["sampled_tokens"]), batch_tokens=int(traj.lengths.sum()),
        env_steps=int((~unparsed).sum()), rollout_s=stats["total_s"], sample_s=stats["sample_s"],
        env_s=stats["env_s"], iteration_s=time.perf_counter() - t_start, **speculation_rates(stats), **times)
    return metrics, traj

  def evaluate(self, env: BatchEnv, tasks: list[Task]) -> dict[str, Any]:
    """Greedy held-out results; with `eval_sampled`, the sampled ones under "sampled". The keys are the same at every
    evaluation, so the sampled results differ between evaluations only through the policy."""
    params, key, size = self.sampling_params(), phase_key(self.root, 0, PHASE_EVAL), self.cfg.eval_batch or self.cfg.rows
    result = evaluate(self.eval_engine, params, env, tasks, key, batch_size=size)
    if self.cfg.eval_sampled:
      result["sampled"] = evaluate(self.sampled_eval_engine, params, env, tasks, jax.random.fold_in(key, 1),
                                   batch_size=size)
    return result


def load_policy(cfg: RLConfig, out: Path, resuming: bool, env: BatchEnv, pool: list[Task], mesh
                ) -> tuple[Path, ModelConfig, Any, Tokenizer]:
  """(HF folder, model config, params, tokenizer) of the policy: `cfg.model.checkpoint`, or a tiny model built in
  out/init_model with a tokenizer trained on the tasks' first observations (a fresh run builds it anew; a resumed run
  loads the one it first built). PPO with a shared-head critic adds a zero-initialised value head where the checkpoint
  has none (a separate critic adds its own, `dreamjax.rl.critic`)."""
  return prepare_model(cfg.model, out / "init_model", lambda: tokenizer_texts(cfg.agent, env, pool, cfg.rows),
                       seed=cfg.seed, mesh=mesh, value_head=cfg.shared_head, rebuild=not resuming,
                       overrides=cfg.model.overrides())
