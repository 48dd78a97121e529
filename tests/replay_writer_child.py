"""A replay buffer writer for the kill test: appends a fixed, deterministic sequence of batches until killed.

Batch b holds `batch_size(b)` transitions with ids boundary(b)..boundary(b + 1) - 1, and transition i's content is
`expected(i)`, so a test can check any recovered buffer against the sequence exactly. On start the child resumes after
the batches already committed (the buffer's length must be a batch boundary) and prints each new committed length on
its own line, flushed, once `append` has returned: a printed length must survive any later kill.

Usage: python tests/replay_writer_child.py FOLDER RECORDS_PER_SEGMENT MAX_BATCHES
"""

from __future__ import annotations

import bisect
import itertools
import sys

from dreamjax.envs.base import Task
from dreamjax.data.records import ORIGINS, Transition


def batch_size(b: int) -> int:
  return 1 + (b * 7919) % 23


BOUNDARIES = list(itertools.accumulate((batch_size(b) for b in range(5000)), initial=0))


def batch_of(i: int) -> int:
  return bisect.bisect_right(BOUNDARIES, i) - 1


def expected(i: int) -> Transition:
  b = batch_of(i)
  j = i - BOUNDARIES[b]
  # Lines of 0.2 to 6 KB, so a kill often lands inside a write or an fsync.
  body = f"room {i} ✓ \"quoted\"\nline two " + "abcdefgh" * ((i * 37) % 700)
  task = Task.make("textworld_express", f"coin/train/{b}", f"Find coin {b}.", game="coin", seed=b, nested={"k": [b]})
  last = j == batch_size(b) - 1  # every batch is an episode that succeeds on its last step
  return Transition(f"batch{b}", j, task, f"Find coin {b}.", body, f"move {i}", f"next {i} " + body[:50],
                    float(last), last, last, i % 5 == 0 and not last, ORIGINS[b % 3], b)


def batch(b: int) -> list[Transition]:
  return [expected(i) for i in range(BOUNDARIES[b], BOUNDARIES[b + 1])]


def main(folder: str, records_per_segment: int, max_batches: int) -> None:
  from dreamjax.replay.buffer import ReplayBuffer

  with ReplayBuffer(folder, records_per_segment=records_per_segment) as buf:
    start = len(buf)
    if start not in BOUNDARIES:
      sys.exit(f"{folder}: length {start} is not a batch boundary: a partial batch was committed")
    for b in range(BOUNDARIES.index(start), max_batches):
      ids = buf.append(batch(b))
      assert ids == range(BOUNDARIES[b], BOUNDARIES[b + 1]), ids
      print(ids.stop, flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
