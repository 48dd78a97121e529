"""One writer per run folder: an exclusive lock every command takes before it writes anything in its output folder.

Two runs on one folder corrupt each other (both truncate and append metrics.jsonl, both write config.json and
checkpoints), so `lock_run_folder(folder)` takes `fcntl.flock(LOCK_EX | LOCK_NB)` on `folder/.lock` and writes the
holder (pid, host, start time, command line) into it; a second run is refused at once with `RunFolderLocked`, whose
one-line message names the folder and that holder. The CLI prints it and exits with code 2 (it is a ValueError: the
out_dir is a setting to change).

Stale locks. The kernel drops a flock when the last descriptor of its open file closes, so a holder that dies, even by
SIGKILL, leaves no lock: the next run takes it over, notes whose lock it was when the file still names a holder, and
rewrites the file. A clean release empties the file (it is never unlinked: a run that opened the old file could then
lock a different inode than the next one). The descriptor is close-on-exec and closed in forked children, so an env
worker or a subprocess never keeps a lock alive after its parent is gone.

In one process the lock is re-entrant (a count per folder): flock on two descriptors of one file conflicts even within
a process, and a command may run inside another one's lock (`reproduce` locks its folder once; its stages lock their
own subfolders, which are other folders, and `dreamgym` takes the lock before loading M_exp, which `Run` re-enters).

Several JAX processes (`dreamjax.parallel.initialize`): process 0 alone writes the run folder, so it alone takes the
lock; every process then receives its outcome (a collective, called the same number of times on every process, since
they run the same program), so all refuse together and none waits in a collective for a process that stopped. Until
`jax.distributed` is initialised the process counts as the only one (host-only commands never start a JAX backend).

Shared filesystems. flock is reliable on local disks. On NFS, Linux clients emulate it with byte-range locks that the
server arbitrates across hosts (NFSv4, or v3 with lockd); some filesystems (Lustre without its `flock` mount option,
some FUSE mounts) either refuse flock or lock only on the calling host. Where flock is refused (ENOLCK, ENOSYS,
EOPNOTSUPP) the file's holder is checked instead: a live pid on this host, or any pid on another host (it cannot be
checked from here), refuses the run; a dead local pid or an empty file is taken over. That fallback has a small race
window and cannot tell a crashed run on another host from a live one: delete the `.lock` file of a run known to be
gone. Where flock silently locks per host, runs started on different hosts are not kept apart.

Object stores. A URI (`gs://...`) is refused as a run folder, and a newly locked folder is probed for appends, exclusive
creates and directory renames (`dreamjax.storage`): a mount lacking one is refused before anything is written.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dreamjax.storage import check_posix_folder, require_local

LOCK_FILE = ".lock"
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_MESSAGE_BYTES = 2048  # the refusal broadcast from process 0 to the others


class RunFolderLocked(ValueError):
  """Another live process holds the folder's lock; the message names the folder and the holder."""


class _Held:
  def __init__(self, fd: int | None):
    self.fd, self.depth = fd, 1


_held: dict[str, _Held] = {}  # lock file (real path) -> what this process holds
_guard = threading.Lock()


def _close_in_child() -> None:
  """After a fork: the child drops its copies of the descriptors (the parent keeps the locks; a flock lives until its
  last descriptor closes, so a child outliving its parent would otherwise keep the folder locked)."""
  global _guard
  _guard = threading.Lock()  # another thread may have held it at the fork
  for held in _held.values():
    if held.fd is not None:
      os.close(held.fd)
      held.fd = None  # a RunLock the child inherited then releases nothing
  _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _processes() -> tuple[int, int]:
  """(this process's index, the process count): (0, 1) until `jax.distributed` joined several processes. JAX is not
  imported here when the command never did (collect, annotate): it could not have joined anything."""
  if "jax" not in sys.modules:
    return 0, 1
  import jax

  if not jax.distributed.is_initialized():
    return 0, 1
  return jax.process_index(), jax.process_count()


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _holder(fd: int, tries: int = 10) -> dict[str, Any]:
  """The holder the lock file names ({} when empty or unreadable); a holder that just took the lock may not have
  written it yet, so an empty or half-written file is read again for a moment."""
  for i in range(tries):
    size = os.fstat(fd).st_size
    try:
      info = json.loads(os.pread(fd, size, 0).decode()) if size else {}
      if isinstance(info, dict) and info:
        return info
    except (UnicodeDecodeError, json.JSONDecodeError):
      pass
    if i + 1 < tries:
      time.sleep(0.02)
  return {}


def _describe(info: dict[str, Any]) -> str:
  if not info.get("pid"):
    return "another process (its lock file names no holder)"
  return (f"pid {info['pid']} on host {info.get('host', '?')}, started {info.get('started', '?')}"
          + (f" ({info['command']})" if info.get("command") else ""))


def _refusal(folder: Path, info: dict[str, Any]) -> RunFolderLocked:
  return RunFolderLocked(f"run folder {folder} is in use by {_describe(info)}; wait for that run to end or use "
                         f"another out_dir")


def _write_holder(fd: int) -> None:
  info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
          "command": " ".join(sys.argv)[:300]}
  data = json.dumps(info).encode()
  os.pwrite(fd, data, 0)  # over the old text, then cut: a reader never sees an empty file in between
  os.ftruncate(fd, len(data))
  os.fsync(fd)


def _take_over_note(folder: Path, info: dict[str, Any]) -> None:
  if info.get("pid"):
    print(f"run folder {folder}: taking over the lock left by {_describe(info)}, which ended without releasing it",
          file=sys.stderr, flush=True)


def _lock_file(folder: Path, path: Path) -> int:
  """Opens and locks `path`, writes this process as its holder; returns the descriptor. Raises RunFolderLocked."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _refusal(folder, _holder(fd)) from None
    except OSError as e:
      if e.errno not in _UNSUPPORTED:
        raise
      _check_holder(folder, _holder(fd, tries=1))  # no flock here: the pid in the file is all there is
    _take_over_note(folder, _holder(fd, tries=1))  # a holder still named: it died without releasing
    _write_holder(fd)
  except BaseException:
    os.close(fd)
    raise
  return fd


def _check_holder(folder: Path, info: dict[str, Any]) -> None:
  """The fallback where flock is refused: a named holder that may still run refuses the run."""
  pid = info.get("pid")
  if pid and (info.get("host") != socket.gethostname() or _alive(int(pid))):
    raise _refusal(folder, info)


def _acquire(folder: Path, path: Path) -> tuple[str, _Held | None]:
  """Process 0's part: the lock taken (or re-entered); returns (refusal message or "", what was taken)."""
  key = os.path.realpath(path)
  with _guard:
    if key in _held:
      _held[key].depth += 1
      return "", _held[key]
    try:
      held = _Held(_lock_file(folder, path))
    except RunFolderLocked as e:
      return str(e), None
    try:  # a folder on storage that cannot hold a run is refused before anything is written into it
      check_posix_folder(folder)
    except ValueError:
      os.ftruncate(held.fd, 0)  # names no holder, as a released lock
      os.close(held.fd)
      raise
    _held[key] = held
    return "", held


def _broadcast(message: str) -> str:
  """Process 0's message on every process (a collective)."""
  from jax.experimental import multihost_utils

  data = message.encode()[:_MESSAGE_BYTES]
  buf = np.frombuffer(data.ljust(_MESSAGE_BYTES, b"\0"), np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").decode(errors="replace")


class RunLock:
  """A held run folder lock (`lock_run_folder`): `release()` it, or use it as a context manager."""

  def __init__(self, folder: Path, path: Path, held: _Held | None):
    self.folder, self.path, self._held = folder, path, held

  def release(self) -> None:
    held, self._held = self._held, None
    if held is None:
      return
    with _guard:
      held.depth -= 1
      if held.depth or held.fd is None:
        return
      _held.pop(os.path.realpath(self.path), None)
      try:
        os.ftruncate(held.fd, 0)  # a released lock names no holder
      finally:
        os.close(held.fd)  # drops the flock
      held.fd = None

  def __enter__(self) -> RunLock:
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def lock_run_folder(folder: str | Path) -> RunLock:
  """Takes the exclusive lock of `folder` (created if missing) for this run, before anything in it is written; raises
  RunFolderLocked naming the holder when another live process holds it. In a multi-process run only process 0 locks
  (and creates the folder); every process must call this at the same point, and all raise when process 0 is refused."""
  folder = require_local(folder, "run folder")
  path = folder / LOCK_FILE
  index, count = _processes()
  message, held = "", None
  if index == 0:
    try:
      message, held = _acquire(folder, path)
    except Exception as e:  # the other processes still wait for process 0's outcome
      if count == 1:
        raise
      message = f"run folder {folder}: could not take its lock ({type(e).__name__}: {e})"
  if count > 1:
    message = _broadcast(message)
  if message:  # process 0 holds nothing new then
    raise RunFolderLocked(message if index == 0 else f"{message} (refused on process 0)")
  return RunLock(folder, path, held)
