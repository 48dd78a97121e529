"""The offline trajectory record: one real-env episode as collected, the unit of the JSONL files and the TFDS dataset.

JSON form (one object per JSONL line; keys sorted on write):
  {"format": "dreamjax.trajectory.v1", "episode_id": "expert:cookingworld/train/3", "env": "textworld_express",
   "task": {Task.to_json()}, "instruction": "...", "policy": "expert" | "random" | "eps0.3", "seed": 123,
   "success": true, "num_steps": 7, "score": 1.0 | null,
   "steps": [{"state": "...", "action": "...", "next_state": "...", "reward": 0.0, "done": false, "success": false,
              "invalid": false, "admissible": ["...", ...],
              "source": "expert" | "explorer" | "random" | "fallback" | "stale" | "policy"}, ...]}
`admissible` lists the actions admissible in `state` (before the action). `source` says who picked the action:
the env's expert, the observation-only TWX explorer ("explorer", dreamjax.envs.twx_explorer), the random policy, the
random policy standing in because the expert or explorer had no action ("fallback"), an action an earlier state of
the episode admitted and this one does not ("stale", dreamjax.data.collect), or the learning agent ("policy",
episodes recorded by the rollout engine).
`score` is the env's own score at the end (info["score"]) when the adapter reports one.

Reading is strict: a missing, unknown or mistyped field raises ValueError naming the source (file:line) and the
field path, e.g. "data.jsonl:12: field 'steps[3].reward': expected a finite number, got 'x'".

Every episode id is read once: an id already read, on an earlier line of the file or in an earlier file of the same
read (`iter_trajectory_files`), is an error naming both places. The one writer, `dreamjax collect`, appends each
episode once (a resumed run skips the episodes the file holds; with several processes only process 0 writes), so a
repeat means the data was written twice over, e.g. by several processes appending to one shared folder, and training
on it would weigh those episodes twice. Two files holding one id are a duplicate too: the same collection passed
twice, or two collections of one plan (ids are "<policy>:<task_id>", equal in both), so merge files of different
tasks only.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dreamjax.data.jsonl import read_jsonl
from dreamjax.envs.base import Task

FORMAT = "dreamjax.trajectory.v1"
ACTION_SOURCES = ("expert", "explorer", "random", "fallback", "stale", "policy")  # who picked a step's action
ORIGINS = ("offline", "synthetic", "real_online")  # where a transition came from: offline data, M_exp, a real env


@dataclasses.dataclass(frozen=True)
class StepRecord:
  state: str
  action: str
  next_state: str
  reward: float
  done: bool
  success: bool
  invalid: bool
  admissible: tuple[str, ...]  # admissible in `state`
  source: str  # "expert" | "explorer" | "random" | "fallback" | "stale" | "policy"

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["admissible"] = list(self.admissible)
    return d


@dataclasses.dataclass(frozen=True)
class TrajectoryRecord:
  episode_id: str
  env: str
  task: Task
  instruction: str
  policy: str
  seed: int
  steps: tuple[StepRecord, ...]
  success: bool
  num_steps: int
  score: float | None

  def to_json(self) -> dict[str, Any]:
    return {"format": FORMAT, "episode_id": self.episode_id, "env": self.env, "task": self.task.to_json(),
            "instruction": self.instruction, "policy": self.policy, "seed": self.seed,
            "steps": [s.to_json() for s in self.steps], "success": self.success, "num_steps": self.num_steps,
            "score": self.score}

  @classmethod
  def from_json(cls, d: Any, source: str = "record") -> TrajectoryRecord:
    return _parse_record(d, source)


# Validation. Every check names `source` and the field path, so a bad line in a 100 MB file is found at once.

_STEP_FIELDS = {f.name: f for f in dataclasses.fields(StepRecord)}
_RECORD_KEYS = {"format"} | {f.name for f in dataclasses.fields(TrajectoryRecord)}


def _fail(source: str, field: str, msg: str) -> ValueError:
  return ValueError(f"{source}: field {field!r}: {msg}")


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _check_keys(d: Any, expected: set[str], source: str, where: str) -> None:
  if not isinstance(d, dict):
    raise _fail(source, where or "<record>", f"expected a JSON object, got {type(d).__name__}")
  prefix = f"{where}." if where else ""
  missing = sorted(expected - d.keys())
  if missing:
    raise _fail(source, prefix + missing[0], "missing")
  unknown = sorted(d.keys() - expected)
  if unknown:
    raise _fail(source, prefix + unknown[0], "unknown field")


def _str(v: Any, source: str, field: str) -> str:
  if not isinstance(v, str):
    raise _fail(source, field, f"expected a string, got {_show(v)}")
  return v


def _bool(v: Any, source: str, field: str) -> bool:
  if not isinstance(v, bool):
    raise _fail(source, field, f"expected true or false, got {_show(v)}")
  return v


def _int(v: Any, source: str, field: str) -> int:
  if isinstance(v, bool) or not isinstance(v, int):
    raise _fail(source, field, f"expected an integer, got {_show(v)}")
  return v


def _float(v: Any, source: str, field: str) -> float:
  if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
    raise _fail(source, field, f"expected a finite number, got {_show(v)}")
  return float(v)


def _parse_step(d: Any, source: str, where: str) -> StepRecord:
  _check_keys(d, set(_STEP_FIELDS), source, where)
  admissible = d["admissible"]
  if not isinstance(admissible, list):
    raise _fail(source, f"{where}.admissible", f"expected a list of strings, got {_show(admissible)}")
  step = StepRecord(
      state=_str(d["state"], source, f"{where}.state"),
      action=_str(d["action"], source, f"{where}.action"),
      next_state=_str(d["next_state"], source, f"{where}.next_state"),
      reward=_float(d["reward"], source, f"{where}.reward"),
      done=_bool(d["done"], source, f"{where}.done"),
      success=_bool(d["success"], source, f"{where}.success"),
      invalid=_bool(d["invalid"], source, f"{where}.invalid"),
      admissible=tuple(_str(a, source, f"{where}.admissible[{j}]") for j, a in enumerate(admissible)),
      source=_str(d["source"], source, f"{where}.source"),
  )
  if step.source not in ACTION_SOURCES:
    raise _fail(source, f"{where}.source", f"expected one of {', '.join(ACTION_SOURCES)}, got {_show(step.source)}")
  return step


def _parse_task(d: Any, source: str) -> Task:
  if not isinstance(d, dict):
    raise _fail(source, "task", f"expected a JSON object, got {_show(d)}")
  for key in ("env", "task_id"):
    if key not in d:
      raise _fail(source, f"task.{key}", "missing")
  for key in ("env", "task_id", "instruction"):
    if key in d:
      _str(d[key], source, f"task.{key}")
  unknown = sorted(d.keys() - {"env", "task_id", "instruction", "params"})
  if unknown:
    raise _fail(source, f"task.{unknown[0]}", "unknown field")
  if not isinstance(d.get("params", {}), dict):
    raise _fail(source, "task.params", f"expected a JSON object, got {_show(d['params'])}")
  return Task.from_json(d, source=source)


def _parse_record(d: Any, source: str) -> TrajectoryRecord:
  _check_keys(d, _RECORD_KEYS, source, "")
  if d["format"] != FORMAT:
    raise _fail(source, "format", f"expected {FORMAT!r}, got {_show(d['format'])}")
  steps = d["steps"]
  if not isinstance(steps, list):
    raise _fail(source, "steps", f"expected a list of steps, got {_show(steps)}")
  env = _str(d["env"], source, "env")
  task = _parse_task(d["task"], source)
  if task.env != env:
    raise _fail(source, "task.env", f"{task.env!r} differs from the record's env {env!r}")
  score = d["score"]
  record = TrajectoryRecord(
      episode_id=_str(d["episode_id"], source, "episode_id"),
      env=env,
      task=task,
      instruction=_str(d["instruction"], source, "instruction"),
      policy=_str(d["policy"], source, "policy"),
      seed=_int(d["seed"], source, "seed"),
      steps=tuple(_parse_step(s, source, f"steps[{j}]") for j, s in enumerate(steps)),
      success=_bool(d["success"], source, "success"),
      num_steps=_int(d["num_steps"], source, "num_steps"),
      score=None if score is None else _float(score, source, "score"),
  )
  if record.num_steps != len(record.steps):
    raise _fail(source, "num_steps", f"{record.num_steps} but the record has {len(record.steps)} steps")
  return record


def _repeated(where: str, episode_id: str, first: str) -> ValueError:
  return ValueError(f"{where}: field 'episode_id': episode {episode_id!r} was already read at {first}; an episode is "
                    f"recorded once (was the data written twice, e.g. by several processes appending to one folder?)")


def iter_numbered_trajectories(path: str | Path) -> Iterator[tuple[int, TrajectoryRecord]]:
  """(line number, validated record) of a JSONL file, in file order (a partial last line is skipped with a warning);
  an episode id seen on an earlier line is an error naming both lines."""
  first: dict[str, int] = {}
  for number, value in read_jsonl(path):
    record = TrajectoryRecord.from_json(value, source=f"{path}:{number}")
    if record.episode_id in first:
      raise _repeated(f"{path}:{number}", record.episode_id, f"line {first[record.episode_id]}")
    first[record.episode_id] = number
    yield number, record


def iter_trajectories(path: str | Path) -> Iterator[TrajectoryRecord]:
  """Validated records of a JSONL file, in file order (`iter_numbered_trajectories`)."""
  for _, record in iter_numbered_trajectories(path):
    yield record


def read_trajectories(path: str | Path) -> list[TrajectoryRecord]:
  return list(iter_trajectories(path))


def iter_trajectory_files(paths: Sequence[str | Path]) -> Iterator[TrajectoryRecord]:
  """Validated records of several JSONL files, file after file; an episode id already read, in this file or an
  earlier one, is an error naming both places."""
  first: dict[str, str] = {}
  for path in paths:
    for number, record in iter_numbered_trajectories(path):
      if record.episode_id in first:
        raise _repeated(f"{path}:{number}", record.episode_id, first[record.episode_id])
      first[record.episode_id] = f"{path}:{number}"
      yield record


def read_trajectory_files(paths: Sequence[str | Path], field: str = "data", max_episodes: int = 0,
                          max_transitions: int = 0) -> list[TrajectoryRecord]:
  """The records of several JSONL files in order: the first `max_episodes` (0: all), then whole episodes while their
  steps total at most `max_transitions` (0: no cap; an offline data budget: an episode that would cross it is left
  out with every one after it, so the records are a prefix of the files). No files or a missing file is an error
  naming `field` (the config field that gave the paths); an episode id read twice, one naming both places."""
  if not paths:
    raise ValueError(f"{field}: no trajectory files given (collect some with `dreamjax collect`)")
  for path in paths:
    if not Path(path).is_file():
      raise ValueError(f"{field}: {path} does not exist (collect trajectories with `dreamjax collect` first)")
  records = list(iter_trajectory_files(paths))
  records = records[:max_episodes] if max_episodes else records
  if max_transitions:
    steps = list(itertools.accumulate(r.num_steps for r in records))
    records = records[:bisect.bisect_right(steps, max_transitions)]
  return records


def game_of(task: Task) -> str:
  """The grouping key for per-game statistics: the task's "game" parameter where the env has games."""
  return str(task.param.get("game", task.env))


def summarize(records: Mapping[str, TrajectoryRecord] | list[TrajectoryRecord]) -> dict[str, Any]:
  """Episodes, success rate and steps per policy, and per policy and game."""
  items = list(records.values()) if isinstance(records, Mapping) else list(records)
  out: dict[str, Any] = {}
  for r in items:
    for key in (r.policy, f"{r.policy}/{game_of(r.task)}"):
      s = out.setdefault(key, {"episodes": 0, "successes": 0, "steps": 0, "fallback_steps": 0})
      s["episodes"] += 1
      s["successes"] += int(r.success)
      s["steps"] += r.num_steps
      s["fallback_steps"] += sum(step.source == "fallback" for step in r.steps)
  for s in out.values():
    s["success_rate"] = s["successes"] / s["episodes"]
    s["mean_steps"] = s["steps"] / s["episodes"]
  return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class Transition:
  """One step with its context, the unit the experience model learns ((task, history, s, a) -> (s', r, done)) and
  the replay buffer stores and retrieves (without history: a retrieved example is shown as a lone step)."""

  episode_id: str
  step: int  # index in its episode
  task: Task
  instruction: str
  state: str
  action: str
  next_state: str
  reward: float
  done: bool
  success: bool
  invalid: bool
  origin: str = "offline"  # one of ORIGINS
  policy_version: int = -1  # the policy update count that produced the action; -1 for offline data
  history: tuple[tuple[str, str], ...] = ()  # (state, action) of the earlier steps shown with it, oldest first

  def __post_init__(self):
    if self.origin not in ORIGINS:
      raise ValueError(f"transition {self.episode_id}:{self.step}: origin {self.origin!r} not in {ORIGINS}")


def transitions(records: Iterable[TrajectoryRecord], max_history: int | None = None, origin: str = "offline",
                policy_version: int = -1) -> Iterator[Transition]:
  """Flattens episodes into transitions; `max_history` keeps only the most recent (state, action) pairs (0 for none,
  as the replay buffer stores them)."""
  for r in records:
    pairs = [(s.state, s.action) for s in r.steps]
    for j, s in enumerate(r.steps):
      start = 0 if max_history is None else max(0, j - max_history)
      yield Transition(r.episode_id, j, r.task, r.instruction, s.state, s.action, s.next_state, s.reward, s.done,
                       s.success, s.invalid, origin, policy_version, tuple(pairs[start:j]))
