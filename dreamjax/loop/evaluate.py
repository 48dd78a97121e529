"""Held-out evaluation of a policy against a real environment: success rate with a 95% Wilson interval, and why
episodes failed (invalid actions, unparseable answers, budgets).

`evaluate` drives a `RolloutEngine` built for evaluation (`greedy_rollout(cfg)`: group size 1, temperature 0, so one
episode per task and the policy's most likely answer each turn; group size 1 at a temperature above 0 measures the
stochastic policy instead) over the tasks in batches of one fixed size, so its
sampler compiles once per prompt bucket however many tasks there are: a short last batch is filled up with copies of
its last task whose episodes are run and thrown away. The env must take that many rows (a SerialBatchEnv needs that
many envs; an EnvPool takes any number).

Counting. A turn is one sampled answer. An answer that does not parse never reaches the env (a parse failure); one
that parses is an env step, i.e. one real transition, whether the env accepts the action or rejects it as invalid.
So `env_steps = turns - parse_failures`, and the invalid-action rate is over env steps while the parse-failure rate
is over turns. Parse failures are found from the stored tokens with the engine's own rule (`unparsed_rows`), never
from the engine's per-run stats, which would include the filler episodes.

Env failures (dreamjax.envs.base.ENV_ERROR) are rerun once, then left out and named (`evaluate`).

Per-game breakdown: the game is the first path component of the task id (TWX "coin[numLocations=2]", ALFWorld task
types, MiniWoB task names), so it needs no env-specific code.

`Evaluator` is the evaluation the supervised commands (policy SFT, DPO) run during and after training: held-out
tasks of the env's own held-out fold (`EvalConfig`) and optionally some of the demonstrations' tasks (fit, not
generalisation); the RL loops call `evaluate` through their learner.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dreamjax.data.records import TrajectoryRecord
from dreamjax.envs.base import BatchEnv, Task
from dreamjax.envs.registry import env_tasks, make_batch_env
from dreamjax.loop.track import Tracker, echo
from dreamjax.models import ModelConfig
from dreamjax.models.params import sampling_copy
from dreamjax.rollout.agent import AgentFormat, parse_answer
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.text import Tokenizer


def greedy_rollout(cfg: RolloutConfig) -> RolloutConfig:
  """The evaluation variant of a rollout config: one greedy episode per task, same budgets and buckets."""
  return dataclasses.replace(cfg, group_size=1, temperature=0.0)


def unparsed_rows(traj: Trajectories, tokenizer: Tokenizer) -> np.ndarray:
  """bool [M]: the turn's answer did not parse, so the env was not stepped (the engine's rule: the stop token is not
  part of the answer text; a truncated answer is decoded whole)."""
  out = np.zeros(traj.num_rows, bool)
  for m in range(traj.num_rows):
    ids = traj.tokens[m, traj.prompt_lengths[m]:traj.lengths[m]]
    text = tokenizer.decode(ids if traj.truncated[m] else ids[:-1])
    out[m] = parse_answer(text).action is None
  return out


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """95% Wilson score interval of a success rate: sensible at small n and at rates of 0 or 1, unlike mean +- 2 SE."""
  if n == 0:
    return 0.0, 1.0
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return max(0.0, centre - half), min(1.0, centre + half)


def task_family(task: Task) -> str:
  """The per-game key of evaluation results: the task id's first path component (TWX "coin[numLocations=2]", ALFWorld
  task types, MiniWoB task names), so it needs no env-specific code."""
  return task.task_id.split("/", 1)[0]


def rate_with_interval(successes: int, n: int) -> dict[str, float | int]:
  low, high = wilson_interval(successes, n)
  return {"episodes": n, "successes": successes, "success_rate": successes / n if n else 0.0, "ci_low": low,
          "ci_high": high}


def paired_gain(before: list, after: list, resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
  """After's success rate minus before's over the tasks both evaluated (each an `outcomes` list of `evaluate`:
  (task id, success, turns)), with a 95% percentile bootstrap interval over tasks: the two policies are compared on
  the same tasks, so the interval is that of the per-task differences: where the two agree on most tasks, far
  narrower than an unpaired comparison of the two rates.
  `won`/`lost`: tasks solved only after/only before; `unpaired`: tasks only one side has (env failures left out)."""
  b = {t: bool(ok) for t, ok, *_ in before}
  a = {t: bool(ok) for t, ok, *_ in after}
  tasks = [t for t in b if t in a]
  if not tasks:
    raise ValueError("paired_gain: the two evaluations share no task")
  diff = np.array([int(a[t]) - int(b[t]) for t in tasks], np.float64)
  draws = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
  means = diff[draws].mean(axis=1)
  return {"tasks": len(tasks), "gain": float(diff.mean()), "ci_low": float(np.percentile(means, 2.5)),
          "ci_high": float(np.percentile(means, 97.5)), "won": int((diff > 0).sum()), "lost": int((diff < 0).sum()),
          "unpaired": len(set(a) ^ set(b)), "resamples": resamples}


_RERUN = 2**31 - 1  # folded into the key of the rerun of episodes the env failed on


def _episodes(engine: RolloutEngine, params, env: BatchEnv, tasks: Sequence[Task], key: jax.Array,
              batch_size: int, progress: bool = False) -> list[dict[str, Any]]:
  """One episode per task, in batches of exactly `batch_size` rows; each task's outcome and its turn counts. With
  `progress`, a line per batch (a 200-game evaluation runs for many minutes)."""
  out, start = [], time.perf_counter()
  for b, first in enumerate(range(0, len(tasks), batch_size)):
    chunk = list(tasks[first:first + batch_size])
    n = len(chunk)
    traj = engine.run(params, env, chunk + [chunk[-1]] * (batch_size - n), jax.random.fold_in(key, b))
    bad_parse = unparsed_rows(traj, engine.tokenizer)
    for e in range(n):
      rows = traj.episode == e
      out.append({"success": bool(traj.success[e]), "reward": float(traj.episode_reward[e]),
                  "turns": int(traj.num_turns[e]), "ended": bool(traj.ended[e]), "env_error": bool(traj.env_error[e]),
                  "unparsed": int((bad_parse & rows).sum()), "invalid": int((traj.invalid & ~bad_parse & rows).sum()),
                  "record": traj.records[e]})
    if progress:
      echo(f"evaluation: {len(out)}/{len(tasks)} episodes, {sum(r['success'] for r in out)} won, "
           f"{time.perf_counter() - start:.0f} s")
  return out


def evaluate(engine: RolloutEngine, params, env: BatchEnv, tasks: Sequence[Task], key: jax.Array, *,
             batch_size: int | None = None, keep_records: bool = False, progress: bool = False) -> dict[str, Any]:
  """One episode per task; returns success (with interval), turn and failure statistics, per-game results and the
  per-task outcomes (task id, success, turns) in task order. `batch_size` defaults to the number of tasks. With
  `keep_records`, also `records`: the episodes themselves (TrajectoryRecords, in the same order; not JSON), so a
  caller can show what the policy did. With `progress`, a line per batch of episodes.

  An episode the env failed on (dreamjax.envs.base.ENV_ERROR: its process died, it raised) measures nothing: its task
  is run once more (the batch env rebuilds a failed env), and a task whose rerun fails too is left out of every
  rate and named in `env_error_tasks`; `env_error_reruns` counts the reruns."""
  if engine.cfg.group_size != 1:
    raise ValueError(f"evaluate: the engine has group_size {engine.cfg.group_size}; evaluation runs one episode per "
                     f"task (build the engine with greedy_rollout(cfg))")
  if not tasks:
    raise ValueError("evaluate: no tasks")
  batch_size = len(tasks) if batch_size is None else batch_size
  if batch_size < 1:
    raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
  start = time.perf_counter()
  results = _episodes(engine, params, env, tasks, key, batch_size, progress)
  failed = [i for i, r in enumerate(results) if r["env_error"]]
  if failed:
    echo(f"evaluation: the env failed on {len(failed)} of {len(tasks)} episodes; running those tasks once more")
    again = _episodes(engine, params, env, [tasks[i] for i in failed], jax.random.fold_in(key, _RERUN), batch_size)
    for i, r in zip(failed, again):
      results[i] = r
  kept = [(t, r) for t, r in zip(tasks, results) if not r["env_error"]]
  lost = [t.task_id for t, r in zip(tasks, results) if r["env_error"]]
  if lost:
    echo(f"evaluation: the env failed twice on {len(lost)} tasks, left out of the rates: {', '.join(lost[:5])}"
         + (" ..." if len(lost) > 5 else ""))
  n = len(kept)
  total_turns = sum(r["turns"] for _, r in kept)
  parse_failures, env_invalid = sum(r["unparsed"] for _, r in kept), sum(r["invalid"] for _, r in kept)
  env_steps = total_turns - parse_failures
  by_game: dict[str, list[bool]] = defaultdict(list)
  for task, r in kept:
    by_game[task_family(task)].append(r["success"])
  return {
      **rate_with_interval(sum(r["success"] for _, r in kept), n),
      "mean_reward": float(np.mean([r["reward"] for _, r in kept])) if n else 0.0,
      "mean_turns": total_turns / n if n else 0.0,
      "turns": total_turns,
      "env_steps": env_steps,
      "parse_failures": parse_failures,
      "env_invalid": env_invalid,
      "parse_failure_rate": parse_failures / total_turns if total_turns else 0.0,
      "invalid_rate": env_invalid / env_steps if env_steps else 0.0,
      "truncated_rate": 1.0 - float(np.mean([r["ended"] for _, r in kept])) if n else 0.0,
      "env_error_reruns": len(failed),
      "env_error_tasks": lost,
      "temperature": engine.cfg.temperature,
      "per_game": {g: rate_with_interval(int(sum(v)), len(v)) for g, v in sorted(by_game.items())},
      "outcomes": [[t.task_id, r["success"], r["turns"]] for t, r in kept],
      "eval_s": time.perf_counter() - start,
  } | ({"records": [r["record"] for _, r in kept]} if keep_records else {})


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
  """Held-out (and training-task) success of a policy in the real env, through `evaluate`
  (greedy, one episode per task); owns the env unless one is given."""

  def __init__(self, model_cfg: ModelConfig, tokenizer: Tokenizer, fmt: AgentFormat, rollout: RolloutConfig,
               env_name: str, env_kwargs: Sequence[str], cfg: EvalConfig, train_tasks: Sequence[Task],
               env: BatchEnv | None = None, mesh=None):
    self.engine = RolloutEngine(model_cfg, tokenizer, fmt, greedy_rollout(rollout), mesh=mesh)
    self.model_cfg, self.cfg, self.train_tasks = model_cfg, cfg, list(train_tasks)
    self.held_out = held_out_tasks(env_name, cfg) if cfg.num_tasks > 0 else []
    self._owned = env is None
    self.env = make_batch_env(env_name, env_kwargs, cfg.num_envs, cfg.num_workers) if env is None else env

  def __call__(self, params, key: jax.Array) -> dict[str, Any]:
    # Unrolled, in the compute dtype, and in the sampling layout (which shards differently from training).
    shardings = None if self.engine.sampler.mesh is None else self.engine.sampler.param_shardings()
    params = sampling_copy(params, self.model_cfg, shardings)
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
