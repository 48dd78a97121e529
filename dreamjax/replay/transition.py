"""The replay buffer's unit: one transition with the context M_exp is grounded on, and where it came from.

JSON form (one object per line in the buffer's segment files; keys sorted):
  {"episode_id": "...", "step": 3, "task": {Task.to_json()}, "instruction": "...", "state": "...", "action": "...",
   "next_state": "...", "reward": 0.0, "done": false, "success": false, "invalid": false,
   "source": "offline" | "synthetic" | "real_online", "policy_version": 0}
`policy_version` is the policy update count that produced the action (-1 for offline data, whose actions came from
experts and random policies).
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


def from_trajectories(records: Iterable[TrajectoryRecord], source: str = "offline",
                      policy_version: int = -1) -> Iterator[ReplayTransition]:
  """Flattens episode records (offline collections, or rollouts written back) into replay transitions."""
  for r in records:
    for j, s in enumerate(r.steps):
      yield ReplayTransition(r.episode_id, j, r.task, r.instruction, s.state, s.action, s.next_state, s.reward,
                             s.done, s.success, s.invalid, source, policy_version)
