"""PPO or GRPO against a real environment (the paper's real-env baselines and the S2R stage), with held-out evaluation.

One iteration (`RealEnvRL.iteration`):
1. draw B tasks from the training pool: a fixed shuffle of the pool per pass, so the draw depends only on the seed and
   the iteration and every task comes up once per pass;
2. roll out G episodes per task against the real env through the `RolloutEngine` (token-in/token-out turn rows, one
   fresh bounded prompt per turn, so memory does not grow with episode length);
3. score the rows under the frozen reference policy (GRPO's KL term) and, for PPO, the critic's values under the
   current policy;
4. build the `TokenBatch` (`rl_batch`: GRPO group-normalised returns, or GAE over turns for PPO; the invalid-action
   penalty subtracted from invalid turns); only sampled action tokens carry loss weight, never observation tokens;
5. update: `epochs` passes over the rows, each cut into optimizer steps of a fixed `rows_per_step` rows (balanced, the
   last padded with empty rows) and a length rounded up to `pad_to`, so the jitted step compiles once per length
   bucket; `micro_batches` splits a step for memory on long contexts;
6. log metrics; every `eval_every` iterations (and before the first and after the last) evaluate greedily on the
   held-out tasks, recording the real transitions consumed by training at that point. With `eval_sampled`, the same
   tasks are also run once each at the rollout temperature: the success of the stochastic policy RL optimises, which
   can rise while the greedy answer in some state has not yet flipped.

GRPO groups whose G returns are all equal have zero advantage (`grpo_advantages`); they still carry the KL term. With
`drop_zero_variance_groups` (DAPO's dynamic-sampling filter) their rows are left out of the update, which saves their
compute; their fraction is logged either way.

Real transitions: one per answer that parsed and was sent to the env (`evaluate.unparsed_rows`); unparseable answers
cost no env step. Only training rollouts count; evaluation episodes are reported separately.

Reproducibility: one root key from the seed, folded with (iteration, phase) for rollouts and updates; NumPy draws are
seeded with (seed, phase, ...). On CPU a rerun with the same seed logs identical metrics, timings aside (keys ending
in "_s").

Outputs in `out_dir`: config.json, metrics.jsonl (one row per iteration), evals.jsonl (each evaluation with per-task
outcomes), summary.json, learning_curve.svg (held-out success against iterations and real transitions), metrics.svg
(training curves), checkpoints/ (the last `keep_checkpoints`), and the final policy as an HF checkpoint folder `final/`.
With `track.wandb` "online" or "offline" the same metrics go to Weights & Biases (offline: under `out_dir/wandb`).

Several processes (multi-host: TPU pods, multi-GPU hosts). `run` first calls `dreamjax.parallel.initialize(
cfg.distributed)` (from the config or the usual launcher environment; a no-op for one process), so the mesh spans
every process's devices. Every process then runs this same host program on the same seeds and tasks: each steps its
own copy of the envs (text envs are cheap next to the model, and duplicated stepping keeps every process's prompts,
trajectories and batches identical without any host-to-host messages; `check_same` compares a digest of each rollout
and fails loudly if an env is not deterministic), sampling, scoring and the update are one SPMD program over the
whole mesh, and the sampler's and scorer's row-sharded outputs are gathered whole (`to_host`). Process 0 alone writes
the run folder's files (config, metrics, evals, summary, plots, the tiny init model, final/, W&B); checkpoints are
saved by every process (orbax: each writes its own shards, process 0 the metadata and commit marker). `out_dir` must
therefore be a filesystem every process sees.

Checkpoints and resume. Every `checkpoint_every` iterations (and after the last) `run` saves, with orbax
(`dreamjax.train.checkpoint`), the TrainState (parameters, optimizer state, step), the frozen reference, the root
key, and as JSON the iteration, the real transitions consumed, the evaluations so far and the tracker's run id.
Rerunning the same command with the same `out_dir` resumes from the latest committed checkpoint: rows logged after
it (a run killed between a log line and its checkpoint) are dropped from metrics.jsonl and evals.jsonl, and since
every draw depends only on (seed, iteration, phase), the resumed run ends with the same parameters, bit for bit, and
the same files, timings aside, as a run that was never interrupted. W&B continues the same run id.

  dreamjax rl --config configs/grpo_real_twx.py:tiny                                   # killed? rerun it to resume
  dreamjax rl --config configs/grpo_real_twx.py:tiny --set track.wandb=offline --set checkpoint_every=5
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dreamjax.data.collect import env_tasks, parse_env_kwargs
from dreamjax.envs.base import BatchEnv, SerialBatchEnv, Task
from dreamjax.envs.registry import make_env
from dreamjax.models import ModelConfig, tiny
from dreamjax.parallel import (
    TRAIN_RULES,
    DistributedConfig,
    MeshConfig,
    barrier,
    check_same,
    initialize,
    is_primary,
    make_mesh,
    spans_every_process,
    to_host,
)
from dreamjax.rl.batch import TokenBatch, rl_batch
from dreamjax.rl.logprobs import LogpScorer
from dreamjax.rl.objectives import Objective, PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.rollout.agent import INVALID_ANSWER, AgentFormat, format_answer, user_text
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.text import Tokenizer
from dreamjax.track import Tracker, TrackConfig, echo, progress, truncate_jsonl
from dreamjax.train.checkpoint import RunCheckpointer
from dreamjax.train.evaluate import evaluate, greedy_rollout, plot_learning_curve, unparsed_rows
from dreamjax.train.run import ModelSource, build_tiny_checkpoint, load_model, save_model, to_json

ALGORITHMS = {"grpo": ("grpo",), "ppo": ("gae_turn", "gae_token")}  # algorithm -> advantages it accepts
PHASE_ROLLOUT, PHASE_UPDATE, PHASE_SHUFFLE, PHASE_EVAL, PHASE_TASKS = range(5)


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
class RLConfig:
  # The policy: a warm-start HF folder (dreamjax train-policy's output), or empty for a tiny one built for the run.
  model: ModelSource = ModelSource(tiny=tiny("qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384,
                                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                             max_position_embeddings=1024))
  algorithm: str = "grpo"  # grpo | ppo
  # GRPO: clipped surrogate + low-variance KL to the frozen warm start. PPO: set vf_coef > 0 (critic on a value head).
  # Its temperature must equal rollout.temperature (ratios compare the distributions the rollout sampled from).
  objective: PolicyGradientConfig = PolicyGradientConfig(kl_coef=0.02, kl_kind="low_var_kl")
  advantage: str = "grpo"  # grpo (with algorithm grpo) | gae_turn | gae_token (with algorithm ppo)
  gamma: float = 1.0  # GAE discount per turn (gae_turn) or per token (gae_token)
  lam: float = 1.0
  normalize_std: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
  whiten_advantages: bool = False  # PPO: whiten advantages over the batch's action tokens
  invalid_penalty: float = 0.1  # subtracted from the reward of a turn whose action was invalid or unparseable
  drop_zero_variance_groups: bool = False  # GRPO: leave groups with equal returns out of the update
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
  epochs: int = 1  # passes over each iteration's rows (PPO epochs)
  pad_to: int = 128  # row lengths are rounded up to a multiple of this (one compilation per multiple)
  score_batch: int = 32  # rows per reference / value scoring call
  iterations: int = 100
  eval_every: int = 10  # 0: only before the first and after the last iteration
  eval_batch: int = 0  # episodes per evaluation batch; 0: B * G
  eval_sampled: bool = False  # also evaluate at the rollout temperature (one sampled episode per task)
  out_dir: str = "runs/rl_real"
  # Stop after the iteration that reaches this many real transitions (DreamGym-S2R's budget); 0: no budget.
  max_real_transitions: int = 0
  checkpoint_every: int = 10  # iterations between checkpoints (also after the last); 0: only after the last
  keep_checkpoints: int = 3  # the last N checkpoints are kept
  track: TrackConfig = TrackConfig()
  seed: int = 0
  mesh: MeshConfig = MeshConfig()
  devices: int = 0  # devices the mesh uses (the first ones); 0: all
  distributed: DistributedConfig = DistributedConfig()  # multi-process runs (default: from the environment)

  def __post_init__(self):
    if self.algorithm not in ALGORITHMS:
      raise ValueError(f"RLConfig.algorithm must be one of {sorted(ALGORITHMS)}, got {self.algorithm!r}")
    if self.advantage not in ALGORITHMS[self.algorithm]:
      raise ValueError(f"RLConfig.advantage {self.advantage!r} does not go with algorithm {self.algorithm!r} "
                       f"(expected one of {ALGORITHMS[self.algorithm]})")
    if self.algorithm == "ppo" and self.objective.vf_coef <= 0:
      raise ValueError("RLConfig: algorithm 'ppo' trains its critic through the value loss; set objective.vf_coef > 0")
    if self.rollout.temperature <= 0 or self.objective.temperature != self.rollout.temperature:
      raise ValueError(f"RLConfig: rollout.temperature ({self.rollout.temperature}) must be > 0 and equal to "
                       f"objective.temperature ({self.objective.temperature}); set both")
    for name in ("tasks_per_iteration", "rows_per_step", "micro_batches", "epochs", "pad_to", "score_batch",
                 "iterations"):
      if getattr(self, name) < 1:
        raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
    if min(self.eval_every, self.eval_batch, self.devices, self.checkpoint_every, self.max_real_transitions) < 0:
      raise ValueError("RLConfig: eval_every, eval_batch, devices, checkpoint_every and max_real_transitions must be "
                       ">= 0")
    if self.keep_checkpoints < 1:
      raise ValueError(f"RLConfig.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
    if self.rows_per_step % self.micro_batches:
      raise ValueError(f"RLConfig.rows_per_step ({self.rows_per_step}) must be a multiple of micro_batches "
                       f"({self.micro_batches})")
    parse_env_kwargs(self.env_kwargs)

  @property
  def rows(self) -> int:
    """Episodes stepped together: B * G for training, eval_batch for evaluation."""
    return max(self.tasks_per_iteration * self.rollout.group_size, self.eval_batch)


def phase_key(root: jax.Array, iteration: int, phase: int) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(root, iteration), phase)


def draw_tasks(pool: list[Task], n: int, iteration: int, seed: int) -> list[Task]:
  """Tasks n*i .. n*i + n - 1 of an endless sequence of seeded shuffles of the pool (one shuffle per pass)."""
  out = []
  for i in range(n * iteration, n * (iteration + 1)):
    order = np.random.default_rng((seed, PHASE_TASKS, i // len(pool))).permutation(len(pool))
    out.append(pool[order[i % len(pool)]])
  return out


def make_batch_env(cfg: RLConfig) -> BatchEnv:
  kwargs = parse_env_kwargs(cfg.env_kwargs)
  if cfg.num_workers <= 0:
    return SerialBatchEnv([make_env(cfg.env, **kwargs) for _ in range(cfg.rows)])
  from dreamjax.envs.pool import EnvPool

  return EnvPool(cfg.env, kwargs, cfg.num_workers)


def episode_returns(traj: Trajectories, invalid_penalty: float) -> np.ndarray:
  """float [N]: each episode's summed turn rewards with the invalid-action penalty, as the advantages see them."""
  turn = traj.reward - invalid_penalty * traj.invalid.astype(np.float32)
  out = np.zeros(traj.num_episodes, np.float32)
  np.add.at(out, traj.episode, turn)
  return out


def zero_variance_groups(traj: Trajectories, returns: np.ndarray) -> np.ndarray:
  """bool [num groups]: all episodes of the group have the same return (GRPO gives them zero advantage)."""
  groups = int(traj.group.max()) + 1
  hi = np.full(groups, -np.inf)
  lo = np.full(groups, np.inf)
  np.maximum.at(hi, traj.group, returns)
  np.minimum.at(lo, traj.group, returns)
  return hi == lo


def take_rows(batch: TokenBatch, rows: np.ndarray, num_rows: int, pad_to: int) -> TokenBatch:
  """`rows` of a host batch in a fresh batch of `num_rows` rows (the rest empty), cut to the rows' longest length
  rounded up to `pad_to`."""
  valid = np.asarray(batch.valid)[rows]
  longest = int(valid.sum(-1).max(initial=1))
  length = min(batch.length, max(pad_to, -(-longest // pad_to) * pad_to))

  def take(x):
    x = np.asarray(x)
    out = np.zeros((num_rows, *x.shape[1:]), x.dtype)
    out[:len(rows)] = x[rows]
    return out[:, :length] if x.ndim == 2 else out

  return jax.tree.map(take, batch)


def tokenizer_texts(fmt: AgentFormat, env: BatchEnv, tasks: list[Task], rows: int) -> list[str]:
  """Prompt and answer texts for training a tokenizer from scratch: first observations of some training tasks."""
  texts = [fmt.system_text(), INVALID_ANSWER]
  for first in range(0, min(len(tasks), 4 * rows), rows):
    chunk = tasks[first:first + rows]
    for task, obs in zip(chunk, env.reset_batch(chunk)):
      texts.append(user_text(fmt, obs.instruction or task.instruction, 0, [], obs.state, obs.admissible))
      texts += [format_answer(a) for a in obs.admissible]
  return texts


class RealEnvRL:
  """The learner: policy state, frozen reference, rollout and evaluation engines, scorers and the jitted step."""

  def __init__(self, cfg: RLConfig, model_cfg: ModelConfig, params, tokenizer: Tokenizer, mesh=None):
    self.cfg, self.model_cfg, self.tokenizer, self.mesh = cfg, model_cfg, tokenizer, mesh
    self.objective = Objective(cfg.algorithm, cfg.objective)
    optimizer = make_optimizer(cfg.optim)
    self.step = make_train_step(model_cfg, self.objective, optimizer, micro_batches=cfg.micro_batches, mesh=mesh)
    if cfg.rows_per_step % self.step.row_multiple:
      raise ValueError(f"RLConfig.rows_per_step ({cfg.rows_per_step}) must be a multiple of micro_batches x "
                       f"data-parallel size ({self.step.row_multiple})")
    # A copy: the train step donates the state's buffers, which must not be the reference's.
    self.ref_params = jax.tree.map(jnp.copy, params) if self.objective.config.kl_coef else None
    self.state = create_train_state(model_cfg, params, optimizer, mesh)
    self.engine = RolloutEngine(model_cfg, tokenizer, cfg.agent, cfg.rollout, mesh=mesh)
    self.eval_engine = RolloutEngine(model_cfg, tokenizer, cfg.agent, greedy_rollout(cfg.rollout), mesh=mesh)
    # Same model, budget and pad id, and the temperature is a runtime argument: one jitted sampler serves both, so
    # evaluation batches of B * G rows reuse the rollout's compilation.
    self.eval_engine.sampler = self.engine.sampler
    self.sampled_eval_engine = RolloutEngine(model_cfg, tokenizer, cfg.agent,
                                             dataclasses.replace(cfg.rollout, group_size=1), mesh=mesh)
    self.sampled_eval_engine.sampler = self.engine.sampler
    score = dict(temperature=cfg.rollout.temperature, pad_to=cfg.pad_to, mesh=mesh, rules=TRAIN_RULES)
    self.ref_scorer = LogpScorer(model_cfg, cfg.score_batch, **score) if self.ref_params is not None else None
    self.value_scorer = LogpScorer(model_cfg, cfg.score_batch, with_values=True, **score) \
        if cfg.algorithm == "ppo" else None
    self.root = jax.random.key(cfg.seed)
    self.real_transitions = 0

  @property
  def params(self):
    return self.state.params

  def checkpoint_arrays(self) -> dict[str, Any]:
    """The learner's arrays a checkpoint holds: train state, frozen reference (when the KL term has one), root key."""
    arrays = {"state": self.state, "root": self.root}
    if self.ref_params is not None:
      arrays["ref_params"] = self.ref_params
    return arrays

  def load_checkpoint_arrays(self, arrays: dict[str, Any]) -> None:
    """Takes back what `checkpoint_arrays` gave (restored onto its layout, so the jitted step's shardings hold)."""
    self.state, self.root = arrays["state"], arrays["root"]
    if self.ref_params is not None:
      self.ref_params = arrays["ref_params"]

  def sampling_params(self):
    """The policy's parameters laid out as the sampler wants them (sampling may shard differently from training)."""
    if self.mesh is None:
      return self.state.params
    return jax.device_put(self.state.params, self.engine.sampler.param_shardings())

  def build_batch(self, traj: Trajectories) -> tuple[TokenBatch, dict[str, float]]:
    """The update's batch for a rollout: reference log-probs and critic values scored here, advantages by config."""
    cfg, times = self.cfg, {}
    valid = np.arange(traj.tokens.shape[1])[None] < traj.lengths[:, None]
    ref_logp = values = None
    if self.ref_scorer is not None:
      t0 = time.perf_counter()
      ref_logp, _ = self.ref_scorer(self.ref_params, traj.tokens, None, valid, mask=traj.loss_mask)
      times["ref_s"] = time.perf_counter() - t0
    if self.value_scorer is not None:
      t0 = time.perf_counter()
      # GAE reads values on the loss tokens only, and no log-probs: an all-zero mask skips the vocabulary projection.
      _, values = self.value_scorer(self.state.params, traj.tokens, None, valid, mask=np.zeros_like(valid))
      times["values_s"] = time.perf_counter() - t0
    batch = rl_batch(traj, advantage=cfg.advantage, values=values, ref_logp=ref_logp,
                     invalid_penalty=cfg.invalid_penalty, gamma=cfg.gamma, lam=cfg.lam,
                     normalize_std=cfg.normalize_std, whiten_advantages=cfg.whiten_advantages, pad_to=cfg.pad_to)
    return batch, times

  def update(self, batch: TokenBatch, rows: np.ndarray, iteration: int) -> dict[str, float]:
    """`epochs` passes over `rows` of `batch` in balanced optimizer steps of `rows_per_step` rows; mean metrics."""
    cfg = self.cfg
    key = phase_key(self.root, iteration, PHASE_UPDATE)
    per_step: list[dict[str, float]] = []
    for epoch in range(cfg.epochs if len(rows) else 0):
      order = np.random.default_rng((cfg.seed, PHASE_SHUFFLE, iteration, epoch)).permutation(rows)
      for part in np.array_split(order, -(-len(order) // cfg.rows_per_step)):
        mb = take_rows(batch, part, cfg.rows_per_step, cfg.pad_to)
        self.state, metrics = self.step(self.state, mb, jax.random.fold_in(key, len(per_step)))
        per_step.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    if not per_step:
      return {"update_steps": 0}
    out = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
    out.update({f"{k}_first": per_step[0][k] for k in ("loss", "kl", "vf_loss") if k in per_step[0]})
    out.update(update_steps=len(per_step), loss_last=per_step[-1]["loss"],
               grad_norm_max=max(m["grad_norm"] for m in per_step))
    return out

  def iteration(self, env: BatchEnv, tasks: list[Task], iteration: int) -> tuple[dict[str, Any], Trajectories]:
    """Rolls out G episodes of each task against `env` (real or synthetic), updates; (metrics, the rollout)."""
    cfg, t_start = self.cfg, time.perf_counter()
    traj = self.engine.run(self.sampling_params(), env, tasks, phase_key(self.root, iteration, PHASE_ROLLOUT),
                           iteration)
    stats = self.engine.stats
    # Each process stepped its own envs; the update below assumes they all hold this same rollout.
    check_same(f"the rollout of iteration {iteration}", traj.tokens, traj.reward, traj.done, traj.invalid)
    unparsed = unparsed_rows(traj, self.tokenizer)
    self.real_transitions += int((~unparsed).sum())
    batch, times = self.build_batch(traj)
    returns = episode_returns(traj, cfg.invalid_penalty)
    flat = zero_variance_groups(traj, returns)
    keep = np.ones(traj.num_rows, bool)
    if cfg.drop_zero_variance_groups and cfg.algorithm == "grpo":
      keep = ~flat[traj.group[traj.episode]]
    t0 = time.perf_counter()
    metrics = self.update(batch, np.flatnonzero(keep), iteration)
    times["update_s"] = time.perf_counter() - t0
    metrics.update(
        rollout_success=float(traj.success.mean()), rollout_reward=float(traj.episode_reward.mean()),
        rollout_return=float(returns.mean()), zero_variance_group_frac=float(flat.mean()),
        rows=traj.num_rows, rows_updated=int(keep.sum()), mean_turns=float(traj.num_turns.mean()),
        invalid_rate=float((traj.invalid & ~unparsed).sum() / max(1, (~unparsed).sum())),
        parse_failure_rate=float(unparsed.mean()), truncated_rate=float(1 - traj.ended.mean()),
        sampled_tokens=int(stats["sampled_tokens"]), batch_tokens=int(traj.lengths.sum()),
        real_transitions=self.real_transitions, rollout_s=stats["total_s"], sample_s=stats["sample_s"],
        env_s=stats["env_s"], iteration_s=time.perf_counter() - t_start, **times)
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


def _eval_row(iteration: int, real_transitions: int, result: dict[str, Any]) -> dict[str, Any]:
  """An evaluation without its per-task outcomes (those go to evals.jsonl only)."""
  row = {"iteration": iteration, "real_transitions": real_transitions,
         **{k: v for k, v in result.items() if k not in ("outcomes", "sampled")}}
  if "sampled" in result:
    row["sampled"] = {k: v for k, v in result["sampled"].items() if k != "outcomes"}
  return row


# Training curves drawn into metrics.svg (those a run logs; PPO adds vf_loss, GRPO kl).
CURVES = ("loss", "kl", "vf_loss", "entropy", "grad_norm", "rollout_success", "rollout_return", "invalid_rate",
          "parse_failure_rate", "zero_variance_group_frac", "real_transitions", "iteration_s")


def _config_changes(saved: Any, current: Any, prefix: str = "") -> list[str]:
  """Dotted names of the config fields that differ between the checkpointed run and this one."""
  if not (isinstance(saved, dict) and isinstance(current, dict)):
    return [] if saved == current else [prefix.rstrip(".") or "config"]
  return [c for k in sorted(set(saved) | set(current)) for c in _config_changes(saved.get(k), current.get(k),
                                                                                 f"{prefix}{k}.")]


def open_checkpoints(cfg: RLConfig, out: Path) -> tuple[RunCheckpointer, int | None]:
  """The run's checkpointer and the iteration to resume after (None: a fresh run); a checkpoint beyond
  `cfg.iterations` is an error (the run would have nothing to do but could not say so)."""
  ckpt = RunCheckpointer(out / "checkpoints", keep=cfg.keep_checkpoints)
  resume = ckpt.latest_step()
  if resume is not None and resume > cfg.iterations:
    ckpt.close()
    raise ValueError(f"RLConfig.iterations is {cfg.iterations} but {out / 'checkpoints'} holds iteration {resume}; "
                     f"raise iterations or use another out_dir")
  return ckpt, resume


def load_policy(cfg: RLConfig, out: Path, resuming: bool, env: BatchEnv, pool: list[Task], mesh
                ) -> tuple[Path, ModelConfig, Any, Tokenizer]:
  """(HF folder, model config, params, tokenizer) of the policy: `cfg.model.checkpoint`, or a tiny model built in
  out/init_model with a tokenizer trained on the tasks' text (a resumed run loads the one it first built)."""
  init_model = out / "init_model"
  if cfg.model.checkpoint:
    folder = Path(cfg.model.checkpoint)
  elif resuming and (init_model / "config.json").is_file():
    folder = init_model
  else:
    folder = init_model
    texts = tokenizer_texts(cfg.agent, env, pool, cfg.rows)  # every process: it steps the envs alike
    if is_primary():  # one writer; the others load the folder after the barrier
      build_tiny_checkpoint(dataclasses.replace(cfg.model, value_head=cfg.model.value_head or cfg.algorithm == "ppo"),
                            texts, init_model, cfg.seed)
    barrier("rl_real.init_model")
  model_cfg, params, tok = load_model(folder, value_head=cfg.algorithm == "ppo", mesh=mesh, seed=cfg.seed,
                                      overrides=cfg.model.overrides())
  return folder, model_cfg, params, tok


def run(cfg: RLConfig, env: BatchEnv | None = None) -> dict[str, Any]:
  """The `dreamjax rl` command: trains (resuming from the latest checkpoint in `out_dir` when there is one),
  evaluates, writes the run folder; returns the summary. `env` may be any BatchEnv taking `cfg.rows` rows (it is not
  closed here); by default one is made from the config."""
  initialize(cfg.distributed)  # before anything touches devices: after it, jax.devices() spans every process
  out = Path(cfg.out_dir)
  devices = jax.devices()[:cfg.devices] if cfg.devices else None
  mesh = spans_every_process(make_mesh(cfg.mesh, devices), "RLConfig.mesh, devices")
  train_pool, eval_pool = cfg.train_tasks.tasks(cfg.env), cfg.eval_tasks.tasks(cfg.env)
  shared = {t.task_id for t in train_pool} & {t.task_id for t in eval_pool}
  if shared:
    raise ValueError(f"RLConfig: train_tasks and eval_tasks share {len(shared)} tasks (e.g. {sorted(shared)[0]!r}); "
                     f"evaluation must be on held-out tasks")
  ckpt, resume = open_checkpoints(cfg, out)
  owned = env is None
  env = make_batch_env(cfg) if owned else env
  evals: list[dict[str, Any]] = []
  train_curve: list[tuple[int, int, float]] = []  # (iteration, real transitions, rollout success)
  meta: dict[str, Any] = {}
  tracker = None
  start = time.perf_counter()
  try:
    folder, model_cfg, params, tok = load_policy(cfg, out, resume is not None, env, train_pool, mesh)
    learner = RealEnvRL(cfg, model_cfg, params, tok, mesh)
    if resume is not None:
      arrays, meta = ckpt.restore(resume, like=learner.checkpoint_arrays())
      learner.load_checkpoint_arrays(arrays)
      learner.real_transitions = int(meta["real_transitions"])
      evals = list(meta["evals"])
      train_curve = [tuple(r) for r in meta["train_curve"]]
      changed = _config_changes(meta.get("config", {}), to_json(cfg))
      echo(f"resuming {out} after iteration {resume}" + (f" (config changed: {', '.join(changed)})" if changed else ""))
    first = resume or 0
    tracker = Tracker(out, to_json(cfg), cfg.track, run_id=meta.get("tracker_run_id"), resume_step=resume)
    evals_path = out / "evals.jsonl" if tracker.primary else Path(os.devnull)  # one process writes the files
    if resume is None:
      evals_path.write_text("")
    elif tracker.primary:  # evaluations logged after the checkpoint are run again
      truncate_jsonl(evals_path, lambda row: row["iteration"] <= resume)

    def plots() -> None:
      if not tracker.primary:
        return
      plot_learning_curve(evals, out / "learning_curve.svg", train=train_curve,
                          title=f"{cfg.algorithm.upper()} on {cfg.env}: held-out success (95% CI)")
      tracker.plot_metrics(CURVES, title=f"{cfg.algorithm.upper()} on {cfg.env}: training")

    with open(evals_path, "a", encoding="utf-8") as eval_file, \
        progress(cfg.iterations, "rl", initial=first, unit="iter", enabled=cfg.track.progress and tracker.primary) \
        as bar:

      def do_eval(iteration: int) -> None:
        result = learner.evaluate(env, eval_pool)
        row = _eval_row(iteration, learner.real_transitions, result)
        evals.append(row)
        outcomes = {"outcomes": result["outcomes"]}
        if "sampled" in result:
          outcomes["sampled_outcomes"] = result["sampled"]["outcomes"]
        eval_file.write(json.dumps({**row, **outcomes}, sort_keys=True) + "\n")
        eval_file.flush()
        tracker.log(iteration, {"eval": row}, jsonl=False)
        sampled = row.get("sampled")
        echo(f"eval @ iteration {iteration} ({learner.real_transitions} real transitions): greedy success "
             f"{row['success_rate']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]" +
             (f", sampled {sampled['success_rate']:.3f} [{sampled['ci_low']:.3f}, {sampled['ci_high']:.3f}]"
              if sampled else "") + f" over {row['episodes']} tasks")

      def checkpoint(iteration: int) -> None:
        ckpt.save(iteration, learner.checkpoint_arrays(), {
            "iteration": iteration, "real_transitions": learner.real_transitions, "evals": evals,
            "train_curve": train_curve, "tracker_run_id": tracker.run_id, "config": to_json(cfg)})
        plots()

      def spent() -> bool:
        return bool(cfg.max_real_transitions) and learner.real_transitions >= cfg.max_real_transitions

      if resume is None:
        do_eval(0)
      last = first
      for it in range(first, cfg.iterations):
        if spent():  # a resumed run whose budget ran out before its last checkpoint
          break
        last = it + 1
        metrics, _ = learner.iteration(env, draw_tasks(train_pool, cfg.tasks_per_iteration, it, cfg.seed), it)
        tracker.log(it + 1, metrics)
        train_curve.append((it + 1, metrics["real_transitions"], metrics["rollout_success"]))
        bar.update()
        update = f"loss {metrics['loss']:.4f}" if "loss" in metrics else "no update (no group with unequal returns)"
        echo(f"iteration {it + 1}: {update}, rollout success {metrics['rollout_success']:.3f}, zero-variance groups "
             f"{metrics['zero_variance_group_frac']:.2f} ({metrics['iteration_s']:.1f} s)")
        final = it + 1 == cfg.iterations or spent()
        if (cfg.eval_every and (it + 1) % cfg.eval_every == 0) or final:
          do_eval(it + 1)
        if (cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0) or final:
          checkpoint(it + 1)
        if final:
          break
    final_params = to_host(learner.params)  # a collective: every process gathers, one writes
    if tracker.primary:
      save_model(final_params, model_cfg, folder, out / "final")
    summary = {"algorithm": cfg.algorithm, "iterations": last, "real_transitions": learner.real_transitions,
               "initial": evals[0], "final": evals[-1], "evals": evals, "seconds": time.perf_counter() - start,
               "checkpoint": str(out / "final"), "resumed_from": resume, "run_id": tracker.run_id}
    tracker.summary(summary)
    plots()
  finally:
    if owned:
      env.close()
    ckpt.close()
    if tracker is not None:
      tracker.close()
  return summary
