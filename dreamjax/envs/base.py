"""The environment contract shared by real environments and the learned experience model (SyntheticEnv).

Everything the rollout engine sees is text: an abstract state (a compact rendering of the observation, the same for
real and synthetic rollouts), the admissible actions where the env has them, and an outcome reward. Adapters keep the
env's raw observation and its own score in `info`, never in the fields the agent or the experience model read.

Rewards follow the paper: binary and outcome-based, 1.0 only on the step that ends a successful episode. Invalid
actions are outcomes, not errors: the env's own feedback comes back with `invalid=True` (and, when the adapter is
configured so, the episode ends as a failure).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


def _freeze(value: Any) -> Any:
  """JSON-like values as hashable tuples, so a Task can be a dict key and a static argument."""
  if isinstance(value, Mapping):
    return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
  if isinstance(value, list | tuple):
    return tuple(_freeze(v) for v in value)
  return value


def normalize_action(text: str) -> str:
  """Text actions compared the way text envs match commands: whitespace collapsed, lower case."""
  return " ".join(text.split()).lower()


@dataclasses.dataclass(frozen=True)
class Task:
  """One episode's specification: which env, which game/seed/goal, and the instruction the agent is given."""

  env: str  # adapter name: "textworld_express", "alfworld", "miniwob", "webshop", ...
  task_id: str  # unique within the env, stable across runs (e.g. "cookingworld/train/17")
  instruction: str = ""  # may be empty until reset fills it from the env (TextWorld-Express describes its own goal)
  params: tuple[tuple[str, Any], ...] = ()  # env-specific settings (seed, game, split, ...), frozen key-value pairs

  @classmethod
  def make(cls, env: str, task_id: str, instruction: str = "", **params) -> Task:
    return cls(env, task_id, instruction, _freeze(params))

  @property
  def param(self) -> dict[str, Any]:
    return dict(self.params)

  def to_json(self) -> dict[str, Any]:
    return {"env": self.env, "task_id": self.task_id, "instruction": self.instruction,
            "params": _thaw(self.params)}

  @classmethod
  def from_json(cls, d: Mapping[str, Any], source: str = "task") -> Task:
    missing = [k for k in ("env", "task_id") if k not in d]
    if missing:
      raise ValueError(f"{source}: task record lacks {', '.join(missing)}")
    return cls.make(d["env"], d["task_id"], d.get("instruction", ""), **dict(d.get("params", {})))

  def dumps(self) -> str:
    return json.dumps(self.to_json(), sort_keys=True)


def _thaw(params: tuple) -> dict[str, Any]:
  def thaw(v):
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
      return {k: thaw(x) for k, x in v}
    if isinstance(v, tuple):
      return [thaw(x) for x in v]
    return v

  return {k: thaw(v) for k, v in params}


@dataclasses.dataclass(frozen=True)
class Observation:
  state: str  # the abstract state text: what the agent and the experience model read
  instruction: str  # the task instruction (repeated here because some envs only reveal it on reset)
  admissible: tuple[str, ...] = ()  # admissible actions when the env lists them, else empty


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: Observation
  reward: float  # outcome reward: 1.0 on the step that ends in success, else 0.0
  done: bool  # the episode is over (success, failure, step limit, dead worker)
  success: bool
  invalid: bool = False  # the action was not understood or not admissible; the observation holds the env's feedback
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # raw observation, env score, errors, ...


@runtime_checkable
class Env(Protocol):
  """One environment instance: one episode at a time.

  Real adapters also implement `expert_action() -> str | None`: the next action of the env's privileged expert (gold
  path, planner, scripted solver) from the current state, None when it has none. Collectors build expert, random and
  epsilon-noisy policies from it and from `Observation.admissible`.
  """

  name: str

  def reset(self, task: Task) -> Observation: ...

  def step(self, action: str) -> StepResult: ...

  def close(self) -> None: ...


@runtime_checkable
class BatchEnv(Protocol):
  """Many episodes stepped together.

  A row given `None` is not stepped: its entry is its last result unchanged, or None if it was never stepped. Finished
  rows must get None; live rows may (the rollout engine skips rows whose answer did not parse).
  """

  def reset_batch(self, tasks: Sequence[Task]) -> list[Observation]: ...

  def step_batch(self, actions: Sequence[str | None]) -> list[StepResult | None]: ...

  def close(self) -> None: ...


class SerialBatchEnv:
  """Steps a list of Env instances one after the other in this process (the pool does the same across processes)."""

  def __init__(self, envs: Sequence[Env]):
    self.envs = list(envs)
    self._last: list[StepResult | None] = [None] * len(self.envs)

  def reset_batch(self, tasks: Sequence[Task]) -> list[Observation]:
    if len(tasks) > len(self.envs):
      raise ValueError(f"reset_batch: {len(tasks)} tasks for {len(self.envs)} envs")
    self._last = [None] * len(tasks)
    return [env.reset(task) for env, task in zip(self.envs, tasks)]

  def step_batch(self, actions: Sequence[str | None]) -> list[StepResult | None]:
    if len(actions) != len(self._last):
      raise ValueError(f"step_batch: {len(actions)} actions for {len(self._last)} episodes")
    for i, action in enumerate(actions):
      if action is not None:
        if self._last[i] is not None and self._last[i].done:
          raise ValueError(f"step_batch: row {i} is done; pass None for finished rows")
        self._last[i] = self.envs[i].step(action)
    return list(self._last)

  def close(self) -> None:
    for env in self.envs:
      env.close()
