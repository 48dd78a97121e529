"""The environment contract shared by real environments and the learned experience model (SyntheticEnv).

Everything the rollout engine sees is text: an abstract state (a compact rendering of the observation, the same for
real and synthetic rollouts), the admissible actions where the env has them, and an outcome reward. Adapters keep the
env's raw observation and its own score in `info`, never in the fields the agent or the experience model read.

Rewards follow the paper: binary and outcome-based, 1.0 only on the step that ends a successful episode. Invalid
actions are outcomes, not errors: the env's own feedback comes back with `invalid=True` (and, when the adapter is
configured so, the episode ends as a failure).

Env failures are a different thing, and every env reports them one way: `info[ENV_ERROR]` (a non-empty message) on a
result with done=True, reward 0, success and invalid False (`env_failure`). It means the env, not the agent, ended the
episode: its process or browser died, it hung or it raised.
Such an episode says nothing about the policy, so consumers leave it out: RL takes it out of the advantages and the
update, evaluation reruns or excludes it, collection drops it, and each counts it. The key is present only on a
failure. The batch envs (SerialBatchEnv here, EnvPool in worker processes) turn an exception raised by a row's env
into such a result and rebuild that env before its next use.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

ENV_ERROR = "error"  # StepResult.info key: the env itself failed (see the module docstring)


def _freeze(value: Any) -> Any:
  """JSON-like values as hashable tuples, so a Task can be a dict key and a static argument."""
  if isinstance(value, Mapping):
    return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
  if isinstance(value, list | tuple):
    return tuple(_freeze(v) for v in value)
  return value


def outcome_problem(reward: float, done: bool, success: bool, invalid: bool = False) -> str:
  """"" when (reward, done, success, invalid) is an outcome this contract allows, else what is wrong with it.

  Reward 0 or 1, success only with done, reward 1 exactly with success, and an invalid action (which changes nothing)
  never succeeds. The replay buffer checks every transition it writes and reads against it, and the experience model
  renders and parses only such outcomes."""
  if reward != 0.0 and reward != 1.0:
    return f"reward {reward!r} is not 0 or 1"
  if success and not done:
    return "success is true but done is false"
  if reward == 1.0 and not success:
    return "reward is 1 but success is false"
  if success and reward != 1.0:
    return "success is true but the reward is 0"
  if invalid and success:
    return "invalid is true but success is true"
  return ""


def normalize_action(text: str) -> str:
  """Text actions compared the way text envs match commands: whitespace collapsed, lower case."""
  return " ".join(text.split()).lower()


def state_line(line: str) -> tuple[str, str] | None:
  """(field, value) of an abstract state's "Field: value" line, None for a line that is not one. A qualifier after
  the field's name is not part of it: "Inventory (max 5): coin" is the field "Inventory"."""
  key, sep, value = line.partition(": ")
  return (key.split(" (")[0], value) if sep else None


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
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # raw observation, env score, ENV_ERROR, ...


def env_failure(observation: Observation, error: str) -> StepResult:
  """The result of a step on which the env itself failed: the episode is over and must not count for or against the
  agent."""
  return StepResult(observation, 0.0, True, False, False, {ENV_ERROR: error})


def env_failed(result: StepResult | None) -> bool:
  return result is not None and bool(result.info.get(ENV_ERROR))


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
  """Steps a list of Env instances one after the other in this process (the pool does the same across processes).

  An exception raised by a row's env (a JVM that died, a crashed browser, a bug in an adapter) is that row's env
  failure, not the batch's: the row ends with `env_failure` (a failed reset is reported on the next `step_batch`, as
  the pool does), the env is closed and, when `make_env` is given, replaced by a new one before its next reset.
  Without `make_env` the instance is kept and may fail again. `failures` and `restarts` count them.
  """

  def __init__(self, envs: Sequence[Env], make_env: Callable[[], Env] | None = None):
    self.envs: list[Env | None] = list(envs)
    self.make_env = make_env
    self.failures = self.restarts = 0
    self._last: list[StepResult | None] = [None] * len(self.envs)
    self._obs: list[Observation] = []
    self._unreported: list[bool] = []

  def reset_batch(self, tasks: Sequence[Task]) -> list[Observation]:
    if len(tasks) > len(self.envs):
      raise ValueError(f"reset_batch: {len(tasks)} tasks for {len(self.envs)} envs")
    self._last, self._unreported = [None] * len(tasks), [False] * len(tasks)
    self._obs = [Observation("", t.instruction) for t in tasks]
    for i, task in enumerate(tasks):
      try:
        if self.envs[i] is None:
          self.envs[i] = self.make_env()
          self.restarts += 1
        self._obs[i] = self.envs[i].reset(task)
      except Exception as e:  # any failure of the env is this row's outcome
        self._fail(i, "reset", e)
    return list(self._obs)

  def step_batch(self, actions: Sequence[str | None]) -> list[StepResult | None]:
    if len(actions) != len(self._last):
      raise ValueError(f"step_batch: {len(actions)} actions for {len(self._last)} episodes")
    for i, action in enumerate(actions):
      if self._unreported[i]:
        self._unreported[i] = False  # the reset failed: its failure is this step's result, whatever the action
        continue
      if action is not None:
        if self._last[i] is not None and self._last[i].done:
          raise ValueError(f"step_batch: row {i} is done; pass None for finished rows")
        try:
          self._last[i] = self.envs[i].step(action)
          self._obs[i] = self._last[i].observation
        except Exception as e:
          self._fail(i, "step", e)
          self._unreported[i] = False
    return list(self._last)

  def expert_actions(self, rows: Sequence[int] | None = None) -> list[str | None]:
    """Each live row's (or `rows`') `expert_action()`, None for finished rows and envs without an expert; as in
    EnvPool, a failure here ends the row and comes back on the next `step_batch`."""
    out: list[str | None] = [None] * len(self._last)
    for i in range(len(self._last)) if rows is None else rows:
      if self._unreported[i] or (self._last[i] is not None and self._last[i].done):
        continue
      try:
        out[i] = getattr(self.envs[i], "expert_action", lambda: None)()
      except Exception as e:
        self._fail(i, "expert_action", e)
    return out

  def _fail(self, i: int, op: str, error: Exception) -> None:
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" at {where.filename}:{where.lineno}" if where else ""
    message = f"row {i}: {op} raised {type(error).__name__}: {str(error)[:300]}{at}"
    warnings.warn(f"env failure, the episode ends and is left out: {message}", RuntimeWarning, stacklevel=3)
    self._last[i] = env_failure(self._obs[i], message)
    self._unreported[i] = True
    self.failures += 1
    env, self.envs[i] = self.envs[i], None
    if self.make_env is None:
      self.envs[i] = env  # nothing to rebuild it with: keep it
    elif env is not None:
      try:
        env.close()
      except Exception:  # it is already broken: closing is best effort
        pass

  def close(self) -> None:
    for env in self.envs:
      if env is not None:
        env.close()
