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

Per-game breakdown: the game is the first path component of the task id (TWX "coin[numLocations=2]", ALFWorld task
types, MiniWoB task names), so it needs no env-specific code.

`plot_learning_curve` draws evaluation results over a run as a self-contained SVG (success with its interval against
iterations and against real transitions), written by hand so that runs need no plotting package.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.envs.base import BatchEnv, Task
from dreamjax.rollout.agent import parse_answer
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.text import Tokenizer
from dreamjax.train.run import wilson_interval


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


def game_of(task: Task) -> str:
  return task.task_id.split("/", 1)[0]


def rate_with_interval(successes: int, n: int) -> dict[str, float | int]:
  low, high = wilson_interval(successes, n)
  return {"episodes": n, "successes": successes, "success_rate": successes / n if n else 0.0, "ci_low": low,
          "ci_high": high}


def evaluate(engine: RolloutEngine, params, env: BatchEnv, tasks: Sequence[Task], key: jax.Array, *,
             batch_size: int | None = None) -> dict[str, Any]:
  """One episode per task; returns success (with interval), turn and failure statistics, per-game results and the
  per-task outcomes (task id, success, turns) in task order. `batch_size` defaults to the number of tasks."""
  if engine.cfg.group_size != 1:
    raise ValueError(f"evaluate: the engine has group_size {engine.cfg.group_size}; evaluation runs one episode per "
                     f"task (build the engine with greedy_rollout(cfg))")
  if not tasks:
    raise ValueError("evaluate: no tasks")
  batch_size = len(tasks) if batch_size is None else batch_size
  if batch_size < 1:
    raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
  start = time.perf_counter()
  success, reward, turns, unparsed, invalid, ended = [], [], [], [], [], []
  for b, first in enumerate(range(0, len(tasks), batch_size)):
    chunk = list(tasks[first:first + batch_size])
    n = len(chunk)
    traj = engine.run(params, env, chunk + [chunk[-1]] * (batch_size - n), jax.random.fold_in(key, b))
    rows = traj.episode < n
    bad_parse = unparsed_rows(traj, engine.tokenizer)
    success += traj.success[:n].tolist()
    reward += traj.episode_reward[:n].tolist()
    turns += traj.num_turns[:n].tolist()
    ended += traj.ended[:n].tolist()
    unparsed.append(int((bad_parse & rows).sum()))
    invalid.append(int((traj.invalid & ~bad_parse & rows).sum()))
  total_turns = int(sum(turns))
  parse_failures, env_invalid = sum(unparsed), sum(invalid)
  env_steps = total_turns - parse_failures
  by_game: dict[str, list[bool]] = defaultdict(list)
  for task, ok in zip(tasks, success):
    by_game[game_of(task)].append(ok)
  return {
      **rate_with_interval(int(sum(success)), len(tasks)),
      "mean_reward": float(np.mean(reward)),
      "mean_turns": total_turns / len(tasks),
      "turns": total_turns,
      "env_steps": env_steps,
      "parse_failures": parse_failures,
      "env_invalid": env_invalid,
      "parse_failure_rate": parse_failures / total_turns if total_turns else 0.0,
      "invalid_rate": env_invalid / env_steps if env_steps else 0.0,
      "truncated_rate": 1.0 - float(np.mean(ended)),
      "temperature": engine.cfg.temperature,
      "per_game": {g: rate_with_interval(int(sum(v)), len(v)) for g, v in sorted(by_game.items())},
      "outcomes": [[t.task_id, bool(s), int(k)] for t, s, k in zip(tasks, success, turns)],
      "eval_s": time.perf_counter() - start,
  }


def _panel(x0: float, x_label: str, xs: list[float], series: Sequence[tuple[str, list[dict[str, Any]]]],
           train: Sequence[tuple[float, float]], w: float = 380, h: float = 260) -> list[str]:
  """One plot: held-out success series (color, evals) with interval bars, and the rollouts' success (dashed)."""
  left, top, pw, ph = x0 + 50, 40, w - 70, h - 80
  hi = max([*xs, *(x for x, _ in train), 1e-9])
  px = lambda x: left + pw * x / hi  # noqa: E731
  py = lambda y: top + ph * (1 - y)  # noqa: E731
  out = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
  for y in (0, 0.25, 0.5, 0.75, 1):
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#eee"/>'
               f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
  for x in np.linspace(0, hi, 5):
    out.append(f'<text x="{px(x):.1f}" y="{top + ph + 16}" text-anchor="middle">{x:.4g}</text>')
  out.append(f'<text x="{left + pw / 2}" y="{top + ph + 36}" text-anchor="middle">{x_label}</text>')
  if train:
    pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in train)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#e08020" stroke-dasharray="4 3"/>')
  for color, evals in series:
    pts = " ".join(f"{px(x):.1f},{py(e['success_rate']):.1f}" for x, e in zip(xs, evals))
    out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
    for x, e in zip(xs, evals):
      out.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{py(e["ci_low"]):.1f}" y2="{py(e["ci_high"]):.1f}" '
                 f'stroke="{color}"/><circle cx="{px(x):.1f}" cy="{py(e["success_rate"]):.1f}" r="3" fill="{color}"/>')
  return out


def plot_learning_curve(evals: Sequence[dict[str, Any]], path: str | Path, *,
                        train: Sequence[tuple[int, int, float]] = (), title: str = "",
                        transitions: str = "real_transitions") -> Path:
  """An SVG of held-out success (with its 95% interval) against iteration and against training transitions; `evals`
  rows hold iteration, `transitions` (real_transitions, or synthetic_transitions for DreamGym), success_rate, ci_low,
  ci_high (greedy) and optionally "sampled" with the same rates; `train` rows are (iteration, transitions, rollout
  success), drawn dashed."""
  evals = list(evals)
  series = [("#2060c0", evals)]
  legend = ['<text x="60" y="292" fill="#2060c0">held-out, greedy (bars: 95% Wilson interval)</text>']
  if evals and all("sampled" in e for e in evals):
    series.append(("#20a040", [e["sampled"] for e in evals]))
    legend.append('<text x="330" y="292" fill="#20a040">held-out, sampled</text>')
  legend.append('<text x="500" y="292" fill="#e08020">training rollouts (sampled)</text>')
  parts = [f'<text x="400" y="20" text-anchor="middle" font-size="14">{title}</text>',
           *_panel(0, "iteration", [e["iteration"] for e in evals], series, [(i, s) for i, _, s in train]),
           *_panel(400, f"{transitions.replace('_', ' ')} (training)", [e[transitions] for e in evals], series,
                   [(r, s) for _, r, s in train]), *legend]
  svg = ('<svg xmlns="http://www.w3.org/2000/svg" width="800" height="300" font-family="sans-serif" font-size="11">'
         '<rect width="800" height="300" fill="white"/>' + "".join(parts) + "</svg>\n")
  path = Path(path)
  path.write_text(svg, encoding="utf-8")
  return path
