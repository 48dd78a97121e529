"""Policy SFT (behaviour cloning) on expert trajectories: the warm start for RL and the paper's SFT baseline.

One run: read offline `TrajectoryRecord` JSONL files, load the model (an HF checkpoint, or a tiny one built for the
run with a BPE trained on the run's own text), turn demonstration turns into per-turn rows identical in layout to
rollout rows (`dreamjax.train.policy_data`), train with the shared SFT objective (`make_objective("sft")`: token-mean
NLL over answer tokens) through the shared jitted `TrainStep`, evaluate the greedy policy's success in the REAL env on
held-out tasks (and optionally on training tasks) at the end and every `eval.every_steps` updates, and save an HF
checkpoint folder (RL's warm start) plus `summary.json`.

Tracking (`dreamjax.track.Tracker`, `track`): config.json, metrics.jsonl (fresh on every run: a rerun is a new run,
it does not append to the last one's rows), summary.json, and W&B when `track.wandb` is "online" or "offline"; a
progress bar over the update steps when stderr is a terminal.

Batches have fixed shapes so the step compiles once: every batch holds `batch_size` rows (the last batch of an epoch
is filled with empty rows, which the token-mean loss ignores) and, with `pad_to = 0`, every row is padded to the
longest row's length rounded up to 64. Rows are shuffled per epoch by `(seed, epoch)`, and the step's PRNG key is
`fold_in(key(seed), step)`, so a rerun repeats the run.

Evaluation is `dreamjax.train.evaluate.evaluate`: the rollout engine (the RL code path), greedy, one episode per
task, in batches of `eval.num_envs` episodes; success rates come with a 95% Wilson interval. Held-out tasks come from
the env's own held-out fold (`eval.split`), so none of them is in the demonstrations.

A tiny model is built in out_dir/init_model on the first run and reused by reruns in the same folder.

Several processes (multi-host), as `dreamjax rl` (see rl_real's docstring): `run` first calls
`dreamjax.parallel.initialize(cfg.distributed)`, every process runs the same program on the same data and seeds (each
evaluates on its own copy of the env; the sampler's rows are gathered whole), and process 0 alone writes the run
folder: config, metrics, summary, the tiny init model (the others load it after a barrier) and the final checkpoint
(after a gather of the parameters every process takes part in). The mesh must hold devices of every process, and
`out_dir` must be a filesystem every process sees.

Run: `dreamjax train-policy --config configs/train_policy_twx.py[:variant] [--set key=value ...]`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.data.collect import env_tasks, parse_env_kwargs
from dreamjax.data.records import TrajectoryRecord, read_trajectories
from dreamjax.envs.base import BatchEnv, SerialBatchEnv, Task
from dreamjax.envs.registry import make_env
from dreamjax.models import ModelConfig
from dreamjax.parallel import (
    TRAIN_RULES,
    DistributedConfig,
    MeshConfig,
    barrier,
    initialize,
    is_primary,
    make_mesh,
    spans_every_process,
    to_host,
)
from dreamjax.rl.batch import sft_batch
from dreamjax.rl.logprobs import score_len_for
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.text import Tokenizer
from dreamjax.track import Tracker, TrackConfig, echo, progress
from dreamjax.train.evaluate import evaluate, greedy_rollout
from dreamjax.train.policy_data import RowConfig, TurnRow, policy_texts, sft_rows
from dreamjax.train.run import ModelSource, build_tiny_checkpoint, load_model, save_model, to_json


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Where and how the policy's success is measured in the real env."""

  games: tuple[str, ...] = ("coin",)
  split: str = "dev"  # held-out tasks come from the env's own held-out fold
  num_tasks: int = 20  # per game
  task_start: int = 0
  game_params: str = ""  # env-specific game settings (TWX: "numLocations=2, includeDoors=0")
  train_tasks: int = 0  # also evaluate on this many tasks of the demonstrations (fit, not generalisation)
  every_steps: int = 0  # 0: only at the end
  at_start: bool = False  # also before the first update (the starting policy's success)
  num_envs: int = 4  # episodes run together (the sampler's batch)
  num_workers: int = 0  # 0: envs in this process; else an EnvPool of this many processes

  def __post_init__(self):
    if min(self.num_tasks, self.train_tasks, self.every_steps, self.task_start) < 0 or self.num_envs < 1:
      raise ValueError(f"EvalConfig: num_tasks, train_tasks, every_steps and task_start must be >= 0 and num_envs "
                       f">= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class PolicySftConfig:
  data: tuple[str, ...] = ("runs/collect/twx/trajectories.jsonl",)  # TrajectoryRecord JSONL files
  env: str = "textworld_express"
  env_kwargs: tuple[str, ...] = ("step_limit=50",)  # "key=value", as in CollectConfig
  agent: AgentFormat = AgentFormat(think=False)
  rows: RowConfig = RowConfig()
  # The RL run's rollout settings: rows are fitted to its largest prompt bucket and per-turn token budget, and
  # evaluation runs them greedily.
  rollout: RolloutConfig = RolloutConfig(max_turns=50, max_action_tokens=32, max_episode_tokens=1024,
                                         prompt_buckets=(512, 1024))
  model: ModelSource = ModelSource()
  optim: OptimConfig = OptimConfig(lr=1e-5, warmup_steps=10)
  batch_size: int = 32  # rows per update
  micro_batches: int = 1
  epochs: int = 1
  max_steps: int = 0  # 0: `epochs` decide; else stop after this many updates
  pad_to: int = 0  # row length multiple; 0: the longest row rounded up to 64 (one compilation)
  eval: EvalConfig = EvalConfig()
  mesh: MeshConfig = MeshConfig()
  devices: int = 0  # devices the mesh uses (the first ones); 0: all
  log_every: int = 10
  out_dir: str = "runs/policy_sft/twx"
  seed: int = 0
  track: TrackConfig = TrackConfig()
  distributed: DistributedConfig = DistributedConfig()  # multi-process runs; single-process by default

  def __post_init__(self):
    check_loop_settings(self, ("batch_size", "micro_batches", "epochs", "log_every"), ("max_steps", "pad_to", "devices"))


def check_loop_settings(cfg: Any, positive: Sequence[str], non_negative: Sequence[str]) -> None:
  """Refuses loop settings that cannot run, naming the field."""
  name = type(cfg).__name__
  for field in positive:
    if getattr(cfg, field) < 1:
      raise ValueError(f"{name}.{field} must be >= 1, got {getattr(cfg, field)}")
  for field in non_negative:
    if getattr(cfg, field) < 0:
      raise ValueError(f"{name}.{field} must be >= 0, got {getattr(cfg, field)}")


def mesh_of(cfg: MeshConfig, devices: int) -> jax.sharding.Mesh:
  if devices < 0:
    raise ValueError(f"devices must be >= 0, got {devices}")
  return spans_every_process(make_mesh(cfg, jax.devices()[:devices] if devices else None), "mesh, devices")


def read_records(paths: Sequence[str]) -> list[TrajectoryRecord]:
  if not paths:
    raise ValueError("data: no trajectory files given")
  records = []
  for path in paths:
    if not Path(path).is_file():
      raise ValueError(f"data: {path} does not exist (collect trajectories with `dreamjax collect` first)")
    records += read_trajectories(path)
  return records


def prepare_model(source: ModelSource, records: Sequence[TrajectoryRecord], fmt: AgentFormat, think: str, out: Path,
                  seed: int, mesh=None) -> tuple[ModelConfig, Any, Tokenizer, Path]:
  """(config, params, tokenizer, folder): the given checkpoint, or a tiny one built in out/init_model on the run's
  own text (system prompt, every turn's user message and answer)."""
  folder = Path(source.checkpoint) if source.checkpoint else out / "init_model"
  if not source.checkpoint:
    # Process 0 alone decides and writes; every process meets the barrier, then loads the folder.
    if is_primary() and not (folder / "config.json").is_file():
      build_tiny_checkpoint(source, policy_texts(records, fmt, think), folder, seed)
    barrier("policy_sft.init_model")
  cfg, params, tokenizer = load_model(folder, value_head=source.value_head, mesh=mesh, rules=TRAIN_RULES, seed=seed)
  return cfg, params, tokenizer, folder


def make_eval_env(env: str, env_kwargs: Sequence[str], cfg: EvalConfig) -> BatchEnv:
  kwargs = parse_env_kwargs(env_kwargs)
  if cfg.num_workers <= 0:
    return SerialBatchEnv([make_env(env, **kwargs) for _ in range(cfg.num_envs)])
  from dreamjax.envs.pool import EnvPool

  return EnvPool(env, kwargs, cfg.num_workers)


def held_out_tasks(env: str, cfg: EvalConfig) -> list[Task]:
  return [t for g in cfg.games for t in env_tasks(env, g, cfg.split, cfg.num_tasks, cfg.task_start, cfg.game_params)]


def training_tasks(records: Sequence[TrajectoryRecord], n: int) -> list[Task]:
  """The first n distinct tasks of `records`, in file order."""
  seen: dict[str, Task] = {}
  for r in records:
    if len(seen) >= n:
      break
    seen.setdefault(r.task.task_id, r.task)
  return list(seen.values())


class Evaluator:
  """Held-out (and training-task) success of a policy in the real env, through `dreamjax.train.evaluate.evaluate`
  (greedy, one episode per task); owns the env unless one is given."""

  def __init__(self, model_cfg: ModelConfig, tokenizer: Tokenizer, fmt: AgentFormat, rollout: RolloutConfig,
               env_name: str, env_kwargs: Sequence[str], cfg: EvalConfig, train_tasks: Sequence[Task],
               env: BatchEnv | None = None, mesh=None):
    self.engine = RolloutEngine(model_cfg, tokenizer, fmt, greedy_rollout(rollout), mesh=mesh)
    self.cfg, self.train_tasks = cfg, list(train_tasks)
    self.held_out = held_out_tasks(env_name, cfg) if cfg.num_tasks > 0 else []
    self._owned = env is None
    self.env = make_eval_env(env_name, env_kwargs, cfg) if env is None else env

  def __call__(self, params, key: jax.Array) -> dict[str, Any]:
    if self.engine.sampler.mesh is not None:  # sampling shards differently from training
      params = jax.device_put(params, self.engine.sampler.param_shardings())
    out = {}
    for side, tasks in (("held_out", self.held_out), ("train", self.train_tasks)):
      if tasks:
        out[side] = evaluate(self.engine, params, self.env, tasks, jax.random.fold_in(key, len(out)),
                             batch_size=self.cfg.num_envs)
    return out

  def close(self) -> None:
    if self._owned:
      self.env.close()


def flat_eval_metrics(result: dict[str, Any]) -> dict[str, float]:
  keys = ("success_rate", "ci_low", "ci_high", "episodes", "mean_turns", "parse_failure_rate", "invalid_rate",
          "truncated_rate")
  return {f"eval/{side}/{k}": r[k] for side, r in result.items() for k in keys}


def _batches(rows: Sequence[TurnRow], batch_size: int, rng: np.random.Generator) -> list[list[TurnRow]]:
  order = rng.permutation(len(rows))
  return [[rows[i] for i in order[s:s + batch_size]] for s in range(0, len(rows), batch_size)]


def padded_length(rows: Sequence[TurnRow], pad_to: int) -> int:
  longest = max(len(r.ids) for r in rows)
  return pad_to if pad_to > 0 else -(-longest // 64) * 64


def run(cfg: PolicySftConfig, env: BatchEnv | None = None) -> dict[str, Any]:
  """Trains, evaluates and saves; returns the summary (also written to out_dir/summary.json). `env` (not closed
  here) replaces the evaluation env built from the config."""
  initialize(cfg.distributed)  # before anything touches devices: after it, jax.devices() spans every process
  t_start = time.perf_counter()
  out = Path(cfg.out_dir)  # the tracker creates it (on process 0, the one writer)
  with Tracker(out, to_json(cfg), cfg.track) as tracker:
    return _train(cfg, env, out, tracker, t_start)


def _train(cfg: PolicySftConfig, env: BatchEnv | None, out: Path, tracker: Tracker, t_start: float) -> dict[str, Any]:
  mesh = mesh_of(cfg.mesh, cfg.devices)
  records = read_records(cfg.data)
  model_cfg, params, tokenizer, model_dir = prepare_model(cfg.model, records, cfg.agent, cfg.rows.think, out, cfg.seed,
                                                          mesh)
  rows, row_stats = sft_rows(records, tokenizer, cfg.agent, cfg.rows, cfg.rollout)
  if not rows:
    raise ValueError(f"data {list(cfg.data)}: no demonstration turns (row counts: {row_stats}); check rows.experts "
                     f"(policies present: {sorted({r.policy for r in records})}) and rows.successful_only")
  optimizer = make_optimizer(cfg.optim)
  step_fn = make_train_step(model_cfg, make_objective("sft"), optimizer, micro_batches=cfg.micro_batches, mesh=mesh)
  if cfg.batch_size % step_fn.row_multiple:
    raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of {step_fn.row_multiple} (micro_batches x "
                     f"data-parallel size)")
  steps_per_epoch = math.ceil(len(rows) / cfg.batch_size)
  total = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * steps_per_epoch
  length = padded_length(rows, cfg.pad_to)
  score_len = score_len_for([r.loss_mask for r in rows])  # one compilation for every batch
  demonstrated = {row.episode_id for row in rows}
  demo_tasks = training_tasks([r for r in records if r.episode_id in demonstrated], cfg.eval.train_tasks)
  evaluator = Evaluator(model_cfg, tokenizer, cfg.agent, cfg.rollout, cfg.env, cfg.env_kwargs, cfg.eval, demo_tasks,
                        env=env, mesh=mesh)
  key = jax.random.key(cfg.seed)
  state = create_train_state(model_cfg, params, optimizer, mesh)
  del params
  history, evals = [], []
  try:
    if cfg.eval.at_start:
      evals.append(evaluate_and_log(evaluator, state.params, key, 0, tracker))
    step, epoch, t_train = 0, 0, time.perf_counter()
    with progress(total, "policy_sft", unit="step", enabled=cfg.track.progress and tracker.primary) as bar:
      while step < total:
        for batch_rows in _batches(rows, cfg.batch_size, np.random.default_rng([cfg.seed, epoch])):
          if step >= total:
            break
          batch = sft_batch([r.ids for r in batch_rows], [r.loss_mask for r in batch_rows], pad_to=length,
                            row_multiple=cfg.batch_size)
          state, metrics = step_fn(state, batch, jax.random.fold_in(key, step), score_len)
          step += 1
          bar.update()
          if step % cfg.log_every == 0 or step == total or step == 1:
            history.append(tracker.log(step, jax.device_get(metrics), epoch=epoch))
            echo(f"policy_sft step {step}/{total}: loss {history[-1]['loss']:.4f}")
          if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total:
            evals.append(evaluate_and_log(evaluator, state.params, key, step, tracker))
        epoch += 1
    train_s = time.perf_counter() - t_train
    evals.append(evaluate_and_log(evaluator, state.params, key, step, tracker))
  finally:
    evaluator.close()
  checkpoint = save_final(state.params, model_cfg, model_dir, out / "checkpoint")
  summary = {
      "checkpoint": str(checkpoint), "init_model": str(model_dir), "rows": row_stats, "steps": step,
      "epochs": round(step / steps_per_epoch, 3), "row_length": length, "compilations": step_fn.compilations(),
      "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"], "train_seconds": round(train_s, 3),
      "eval": evals[-1]["result"], "eval_history": evals, "seconds": round(time.perf_counter() - t_start, 3),
  }
  tracker.summary(summary)
  echo(format_summary(summary))
  return summary


def save_final(params, model_cfg: ModelConfig, tokenizer_folder: str | Path, folder: Path) -> Path:
  """Saves the trained model as an HF folder: gathered on every process (a collective), written by process 0."""
  params = to_host(params)
  if is_primary():
    save_model(params, model_cfg, tokenizer_folder, folder)
  return folder


def evaluate_and_log(evaluator: Evaluator, params, key: jax.Array, step: int, tracker: Tracker) -> dict[str, Any]:
  result = evaluator(params, jax.random.fold_in(key, 1 << 30))  # apart from the train steps' keys
  if not result:  # no tasks to evaluate on
    return {"step": step, "result": result}
  tracker.log(step, flat_eval_metrics(result))
  echo(f"eval at step {step}: " + ", ".join(f"{side} success {r['success_rate']:.3f} ({r['successes']}/"
                                            f"{r['episodes']})" for side, r in result.items()))
  return {"step": step, "result": result}


def format_eval(result: dict[str, Any], prefix: str = "") -> list[str]:
  return [f"{prefix}{side}: success {r['success_rate']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] over "
          f"{r['episodes']} tasks, mean turns {r['mean_turns']:.1f}, invalid actions {r['invalid_rate']:.3f}, "
          f"unparsed answers {r['parse_failure_rate']:.3f}" for side, r in result.items()]


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"{summary['steps']} steps ({summary['epochs']} epochs) on {summary['rows']['rows']} rows: loss "
           f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f} in {summary['train_seconds']:.1f} s"]
  lines += format_eval(summary["eval"])
  lines.append(f"checkpoint: {summary['checkpoint']}")
  return "\n".join(lines)
