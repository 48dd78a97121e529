"""The replay buffer's unit: one transition with the context M_exp is grounded on, and where it came from.

JSON form (keys sorted; the buffer's segment files hold one per line, led by a "_crc" checksum field):
  {"episode_id": "...", "step": 3, "task": {Task.to_json()}, "instruction": "...", "state": "...", "action": "...",
   "next_state": "...", "reward": 0.0, "done": false, "success": false, "invalid": false,
   "source": "offline" | "synthetic" | "real_online", "policy_version": 0}
`policy_version` is the policy update count that produced the action (-1 for offline data, whose actions came from
experts and random policies).

The outcome follows the env contract (dreamjax.envs.base: binary rewards, 1 only on the step that ends a successful
episode), which every adapter, the rollout engine and the experience model's parser keep: `outcome_problem` says
whether (reward, done, success, invalid) is such an outcome. The replay buffer refuses to write or read any other, so a
flipped reward or flag is an error rather than a transition retrieval shows M_exp as an example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from dreamjax.data.records import TrajectoryRecord
from dreamjax.envs.base import Task

SOURCES = ("offline", "synthetic", "real_online")


@dataclasses.dataclass(frozen=True)
class ReplayTransition:
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
  source: str  # one of SOURCES
  policy_version: int = -1

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"replay transition {self.episode_id}:{self.step}: source {self.source!r} not in {SOURCES}")

  def to_json(self) -> dict[str, Any]:
    # Shallow on purpose: dataclasses.asdict deep-copies the task and was 3/4 of the replay buffer's append time.
    d = {f.name: getattr(self, f.name) for f in _FIELDS}
    d["task"] = self.task.to_json()
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any], where: str = "transition") -> ReplayTransition:
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in d and n != "policy_version"]
    if missing:
      raise ValueError(f"{where}: field {missing[0]!r}: missing")
    unknown = sorted(set(d) - set(names))
    if unknown:
      raise ValueError(f"{where}: field {unknown[0]!r}: unknown field")
    values = {n: d[n] for n in names if n in d}
    values["task"] = Task.from_json(d["task"], source=where)
    return cls(**values)


_FIELDS = dataclasses.fields(ReplayTransition)


def outcome_problem(reward: float, done: bool, success: bool, invalid: bool) -> str:
  """"" when the four values are a consistent binary outcome, else what is wrong with them.

  The same rule as the experience model's `check_outcome` (dreamjax.experience.format), kept here because the replay
  layer must not import the text stack: reward 0 or 1, success only with done, reward 1 exactly with success, and an
  invalid action (which changes nothing) never succeeds."""
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


def from_trajectories(records: Iterable[TrajectoryRecord], source: str = "offline",
                      policy_version: int = -1) -> Iterator[ReplayTransition]:
  """Flattens episode records (offline collections, or rollouts written back) into replay transitions."""
  for r in records:
    for j, s in enumerate(r.steps):
      yield ReplayTransition(r.episode_id, j, r.task, r.instruction, s.state, s.action, s.next_state, s.reward,
                             s.done, s.success, s.invalid, source, policy_version)
