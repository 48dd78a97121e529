"""Preemption: spot and queued TPU slices (and most schedulers) send SIGTERM some seconds before they kill a job.

Every training loop (the RL loop `dreamjax.loop.run.run_iterations`, policy SFT, DPO, M_exp SFT) asks
`Preemption.should_stop(step)` once after each step (iteration); when it says stop, the loop saves a checkpoint of
that step, waits until it is committed, closes its tracker (metrics.jsonl and the W&B run stay resumable) and raises
`Preempted`. The `dreamjax` CLI turns `Preempted` into exit status `PREEMPTED_EXIT` = 75 (EX_TEMPFAIL in sysexits.h:
a temporary failure, try again) after printing one line naming the step and the checkpoint folder: a launcher that
sees 75 reruns the same command, which resumes from that checkpoint. 0 is a finished run; 1 and 2 are errors
(`dreamjax.cli`). A stop asked for during the last step is not a preemption: the run finishes.

One process: while a `Preemption` is open (the run folder holds it, `dreamjax.loop.run.RunFolder`), SIGTERM runs a
handler that only sets a flag (the loop does the work at its next step boundary; a SIGTERM during set-up, e.g. model
loading, stops the run after its first step); the previous handler is put back when it closes. Signal handlers can
only be set from the main thread: a run started in another thread leaves SIGTERM alone.

Several processes: saving is a collective, so every process must stop at the same step. `jax.distributed.initialize`
starts JAX's preemption sync manager (`jax_enable_preemption_service`, on by default), which takes SIGTERM itself and
agrees on a step with the other processes; `should_stop` is then `multihost_utils.reached_preemption_sync_point(step)`
and no Python handler is set (it would replace JAX's). That call must be made by every process at every step from
the same first step, which the loops do. With several processes and the service off, SIGTERM is left alone (it
ends the process) and the run resumes from its last periodic checkpoint.

SIGKILL (or a SIGTERM past the grace period) cannot be caught: rerunning resumes from the last committed checkpoint
(`checkpoint_every`).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import jax

PREEMPTED_EXIT = 75  # the exit status of a preempted `dreamjax` command: rerun it to resume


class Preempted(Exception):
  """The run stopped on a preemption notice after a checkpoint of `step` was committed in `folder`."""

  def __init__(self, what: str, step: int, folder: str | Path):
    super().__init__(f"{what} preempted after step {step}: its checkpoint is committed in {folder}; rerun the same "
                     f"command to resume")
    self.step, self.folder = step, Path(folder)


class Preemption:
  """SIGTERM (one process) or JAX's preemption sync point (several) as a per-step `should_stop`; a context manager
  (module docstring)."""

  def __init__(self):
    self.requested = False
    self._sync = jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service
    self._previous = None
    self._installed = False

  def _handle(self, signum, frame) -> None:
    self.requested = True

  def open(self) -> Preemption:
    if not self._sync and jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
      self._installed = True
    return self

  def should_stop(self, step: int) -> bool:
    """Whether to checkpoint `step` and stop; called once per step, by every process."""
    if self._sync:
      from jax.experimental import multihost_utils

      return multihost_utils.reached_preemption_sync_point(int(step))
    return self.requested

  def close(self) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
      self._installed = False

  def __enter__(self) -> Preemption:
    return self.open()

  def __exit__(self, *exc) -> None:
    self.close()
