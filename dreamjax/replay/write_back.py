"""DreamGym's replay write-back: the run's replay buffer (seeded with the offline data, grown with each iteration's
synthetic episodes) and a retrieval index kept equal to it, on every process and across resumes.

Marks are buffer positions: after the offline seed and after each iteration's write-back. A resumed run rewinds the
buffer to its checkpoint's last mark (dropping what iterations after the checkpoint wrote, which are redone) and
rebuilds the index in the chunks it was first built in, so retrieval answers exactly as in the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dreamjax.data.records import TrajectoryRecord, Transition, transitions
from dreamjax.parallel import barrier, check_same, is_primary
from dreamjax.replay.buffer import ReplayBuffer
from dreamjax.rollout.trajectory import Trajectories


def write_back_transitions(traj: Trajectories, unparsed: np.ndarray, iteration: int) -> list[Transition]:
  """The episodes' steps that reached M_exp, as synthetic replay transitions: not the turns whose answer did not parse
  (they never reached M_exp), nor a step on which the env failed (`traj.env_error`). Each keeps its step index."""
  skip = {(int(traj.episode[m]), int(traj.turn[m])) for m in np.flatnonzero(unparsed)}
  skip |= {(int(e), int(traj.num_turns[e]) - 1) for e in np.flatnonzero(traj.env_error)}
  return [t for e, record in enumerate(traj.records)
          for t in transitions([record], 0, "synthetic", policy_version=iteration) if (e, t.step) not in skip]


def open_replay(folder: Path, records: list[TrajectoryRecord], marks: list[int] | None, retrieve: bool
                ) -> tuple[ReplayBuffer, list[int]]:
  """The run's replay buffer and its marks (`marks` None: a fresh run, whose first mark is the end of the offline
  seed, or 0 when M_exp retrieves nothing). Process 0 is the one writer: it seeds the buffer and rewinds it to the
  last mark (dropping what iterations after the checkpoint wrote); the other processes open it read-only once that is
  committed, so every process reads the same transitions."""
  buffer = None
  if is_primary():
    buffer = ReplayBuffer(folder)
    if marks is None:
      marks = [buffer.seed(records, tag="offline").stop if retrieve else 0]
    buffer.truncate(marks[-1])
  barrier("replay.open")
  if buffer is None:
    buffer = ReplayBuffer(folder, read_only=True)
    if marks is None:
      seed = buffer.stats().seeds.get("offline")
      marks = [seed.stop if retrieve and seed is not None else 0]
  check_same("the replay buffer's marks and length", np.asarray([*marks, len(buffer)], np.int64))
  return buffer, marks


def rebuild_retriever(retriever, buffer: ReplayBuffer, marks: list[int]) -> None:
  """Adds the buffer's transitions to a fresh retriever in the chunks they were first added in (the offline seed,
  then one write-back per iteration), so a resumed run's index answers exactly as the uninterrupted run's did."""
  start = 0
  for end in marks:
    if end > start:
      retriever.add(list(buffer.iter_from(start, end)))
    start = end
