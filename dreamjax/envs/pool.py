"""EnvPool: real environments in worker processes behind the BatchEnv protocol, robust to crashes and hangs.

Rows map to workers round-robin: row i lives in worker `i % num_workers`, in that worker's env slot
`i // num_workers`. More rows than workers is allowed; a worker then holds several env instances (one per slot, built
on first use and kept) and steps its rows one after the other, while different workers run in parallel. So B*G rows
need no more than a handful of processes, at the cost of that many env instances (JVMs, browsers) per worker.

Failures are outcomes, never exceptions: a worker that dies (its JVM or browser crashed, it was killed) or does not
answer within `step_timeout_s` per row (`reset_timeout_s` for resets, which include building the env) is killed with
everything it started and restarted, and every live episode it held ends as an env failure (`env_failure` of
dreamjax.envs.base: done, reward 0, `info[ENV_ERROR]` saying what happened). An exception raised inside the env ends
that row the same way. A row whose reset failed gets an empty observation; its failure comes back on the next
`step_batch`, whatever action it is given. Resets get one retry on a fresh worker when theirs died or hung (no episode was in progress yet). Only
contract violations by the caller (wrong number of actions, an action for a row already reported done) raise
ValueError, as in SerialBatchEnv. `expert_actions()` asks each live row's env for `expert_action()`, so collectors
can run experts through the pool.

Requests are numbered; replies to a request the caller abandoned (an exception such as KeyboardInterrupt while
waiting) are dropped, so a later call never reads them as its own.

Speed: each step is a pipe round trip per worker and one reply per row (about 0.5 ms of overhead on a 2-core
machine). That is noise for browsers and ALFWorld, but TextWorld-Express steps in about 0.5-1 ms in-process, so the
pool gains little there unless there are idle cores (experiments/bench/envs.py measures it).

Workers are started with the "spawn" context so a parent that has initialised JAX (threads, accelerator handles) is
never forked. Each worker starts its own session and tags its environment (DREAMJAX_POOL_TAG), which its children
inherit; killing a worker kills its process group and every process carrying its tag, which also catches children
that detach into their own session (Playwright's browsers do) or were orphaned by a crash.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from dreamjax.envs.base import Observation, StepResult, Task, env_failure

TAG_VAR = "DREAMJAX_POOL_TAG"


def _worker_main(conn, env_name: str, env_kwargs: dict[str, Any], tag: str) -> None:
  """Serves (op, seq, [(slot, arg), ...]) requests with op "reset", "step" or "expert", one (kind, seq, slot,
  payload) reply per item, until "close" or EOF."""
  os.setsid()  # own process group: the pool can kill the env's children (JVM, browser) together with us
  os.environ[TAG_VAR] = tag
  from dreamjax.envs.registry import make_env

  envs: dict[int, Any] = {}
  try:
    while True:
      try:
        op, seq, items = conn.recv()
      except (EOFError, OSError):  # the parent is gone
        break
      if op == "close":
        break
      for slot, arg in items:
        try:
          if op == "reset":
            if slot not in envs:
              envs[slot] = make_env(env_name, **env_kwargs)
            reply = ("ok", seq, slot, envs[slot].reset(arg))
          elif op == "step":
            reply = ("ok", seq, slot, envs[slot].step(arg))
          elif op == "expert":
            expert = getattr(envs[slot], "expert_action", None)
            reply = ("ok", seq, slot, expert() if expert is not None else None)
          else:
            reply = ("error", seq, slot, f"unknown request {op!r}")
        except Exception as e:  # noqa: BLE001 - any env failure ends the episode, the worker lives on
          reply = ("error", seq, slot, f"{op} raised {type(e).__name__}: {e}")
          _close_quietly(envs.pop(slot, None))  # its state is unknown now; the next reset builds a fresh one
        try:
          conn.send(reply)
        except (TypeError, AttributeError, ValueError) as e:  # unpicklable payload; nothing was written yet
          conn.send(_picklable(reply, e))
  finally:
    for env in envs.values():
      _close_quietly(env)


def _close_quietly(env) -> None:
  if env is None:
    return
  try:
    env.close()
  except Exception:  # noqa: BLE001 - closing a broken env must not stop the worker
    pass


def _picklable(reply: tuple, error: Exception) -> tuple:
  kind, seq, slot, payload = reply
  if isinstance(payload, StepResult):
    info = {str(k): repr(v) for k, v in payload.info.items()}
    return kind, seq, slot, dataclasses.replace(payload, info=info)
  return "error", seq, slot, f"reply could not be sent ({type(error).__name__}: {error})"


def _tagged_pids(tag: str) -> list[int]:
  """Processes whose environment carries this tag (Linux /proc; empty elsewhere or where unreadable)."""
  needle = f"{TAG_VAR}={tag}".encode()
  pids = []
  try:
    entries = os.listdir("/proc")
  except OSError:
    return pids
  for name in entries:
    if not name.isdigit() or int(name) == os.getpid():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          pids.append(int(name))
    except OSError:
      continue
  return pids


def _describe_exit(code: int | None) -> str:
  if code is None:
    return "did not exit"
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


class _Workers:
  """The worker processes. Kept apart from EnvPool so the finalizer can close them without holding the pool alive."""

  def __init__(self, env_name: str, env_kwargs: Mapping[str, Any], num_workers: int, start_method: str,
               close_timeout_s: float):
    self.ctx = mp.get_context(start_method)
    self.env_name, self.env_kwargs = env_name, dict(env_kwargs)
    self.close_timeout_s = close_timeout_s
    self.prefix = uuid.uuid4().hex[:12]
    self.generation = 0
    self.procs: list[Any] = [None] * num_workers
    self.conns: list[Any] = [None] * num_workers
    self.tags: list[str] = [""] * num_workers
    self.closed = False
    for w in range(num_workers):
      self.start(w)

  def start(self, w: int) -> None:
    self.generation += 1
    tag = f"{self.prefix}-{w}-{self.generation}"
    parent, child = self.ctx.Pipe()
    proc = self.ctx.Process(target=_worker_main, args=(child, self.env_name, self.env_kwargs, tag),
                            name=f"dreamjax-env-{self.env_name}-{w}", daemon=False)
    proc.start()
    child.close()
    self.procs[w], self.conns[w], self.tags[w] = proc, parent, tag

  def dead(self, w: int) -> bool:
    return bool(mpc.wait([self.procs[w].sentinel], timeout=0))

  def kill(self, w: int) -> str:
    """Kills worker w, its process group and its tagged descendants; returns how it had ended."""
    proc = self.procs[w]
    was_dead = self.dead(w)
    # Signal before reaping: an unreaped worker keeps its pid (and group id) from being reused.
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
      try:
        kill()
      except (ProcessLookupError, PermissionError):
        pass
    for pid in _tagged_pids(self.tags[w]):
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    proc.join(timeout=5)
    self.conns[w].close()
    return _describe_exit(proc.exitcode) if was_dead else "killed by the pool"

  def close(self) -> None:
    if self.closed:
      return
    self.closed = True
    for conn in self.conns:
      try:
        conn.send(("close", 0, []))
      except (OSError, ValueError):
        pass
    deadline = time.monotonic() + self.close_timeout_s
    for w, proc in enumerate(self.procs):
      mpc.wait([proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
      self.kill(w)  # also for workers that exited cleanly: their envs may have left children behind


class EnvPool:
  """BatchEnv over `num_workers` processes, each building envs with `make_env(env_name, **env_kwargs)`."""

  def __init__(self, env_name: str, env_kwargs: Mapping[str, Any] | None = None, num_workers: int = 2,
               step_timeout_s: float = 60.0, reset_timeout_s: float = 180.0, close_timeout_s: float = 10.0,
               start_method: str = "spawn"):
    if num_workers < 1:
      raise ValueError(f"EnvPool: num_workers must be >= 1, got {num_workers}")
    if start_method == "fork":
      raise ValueError("EnvPool: the 'fork' start method would fork JAX's threads; use 'spawn' or 'forkserver'")
    self.name = env_name
    self.num_workers = num_workers
    self.step_timeout_s, self.reset_timeout_s = step_timeout_s, reset_timeout_s
    self._workers = _Workers(env_name, env_kwargs or {}, num_workers, start_method, close_timeout_s)
    self._finalizer = weakref.finalize(self, self._workers.close)  # on close(), garbage collection and exit
    self._last: list[StepResult | None] = []
    self._obs: list[Observation] = []
    self._unreported: list[bool] = []  # failures the pool recorded that step_batch has not returned yet
    self.restarts = 0
    self.failures = 0  # episodes ended by a crash, hang or env exception
    self._seq = 0  # request number: replies to a request the caller abandoned (e.g. KeyboardInterrupt) are dropped

  @property
  def pids(self) -> list[int]:
    """The worker processes' ids (they change when a worker is restarted)."""
    return [p.pid for p in self._workers.procs]

  def worker_of(self, row: int) -> int:
    return row % self.num_workers

  # BatchEnv protocol.

  def reset_batch(self, tasks: Sequence[Task]) -> list[Observation]:
    self._check_open()
    for w in range(self.num_workers):  # a worker that died between episodes costs no episode: restart it first
      if self._workers.dead(w):
        self._restart(w)
    n = len(tasks)
    self._last, self._unreported = [None] * n, [False] * n
    self._obs = [Observation("", t.instruction) for t in tasks]
    replies, lost = self._run("reset", dict(enumerate(tasks)), self.reset_timeout_s)
    if lost:  # nothing was in progress yet, so the rows of a worker that died or hung get one try on its successor
      retry = {i: t for i, t in enumerate(tasks) if self.worker_of(i) in lost and i not in replies}
      again, lost = self._run("reset", retry, self.reset_timeout_s)
      replies.update(again)
    for i, (kind, payload) in replies.items():
      if kind == "ok":
        self._obs[i] = payload
      else:
        self._fail(i, payload)
    self._fail_lost(lost)
    return list(self._obs)

  def step_batch(self, actions: Sequence[str | None]) -> list[StepResult | None]:
    self._check_open()
    if len(actions) != len(self._last):
      raise ValueError(f"step_batch: {len(actions)} actions for {len(self._last)} episodes")
    todo = {}
    for i, action in enumerate(actions):
      if self._unreported[i]:
        continue  # the pool ended this episode (e.g. its reset failed); the failure is returned now
      if action is None:
        continue  # not stepped this call (finished, or the caller skips it)
      if self._last[i] is not None and self._last[i].done:
        raise ValueError(f"step_batch: row {i} is done; pass None for finished rows")
      else:
        todo[i] = action
    for w in {self.worker_of(i) for i in todo}:  # found dead while idle: its episodes are lost already
      if self._workers.dead(w):
        self._fail_lost({w: f"worker {w} (pid {self._workers.procs[w].pid}) {self._restart(w)} between steps"})
    todo = {i: a for i, a in todo.items() if not self._is_done(i)}
    replies, lost = self._run("step", todo, self.step_timeout_s)
    for i, (kind, payload) in replies.items():
      if kind == "ok":
        self._last[i], self._obs[i] = payload, payload.observation
      else:
        self._fail(i, payload)
    self._fail_lost(lost)
    self._unreported = [False] * len(self._last)
    return list(self._last)

  def expert_actions(self, rows: Sequence[int] | None = None) -> list[str | None]:
    """The env expert's next action for each live row (or for `rows`); None for finished rows and where the env's
    expert has none. A failure here ends the row; its failure comes back on the next step_batch."""
    self._check_open()
    wanted = range(len(self._last)) if rows is None else rows
    todo = {i: None for i in wanted if not self._is_done(i)}
    replies, lost = self._run("expert", todo, self.step_timeout_s)
    out: list[str | None] = [None] * len(self._last)
    for i, (kind, payload) in replies.items():
      if kind == "ok":
        out[i] = payload
      else:
        self._fail(i, payload)
    self._fail_lost(lost)
    return out

  def close(self) -> None:
    self._finalizer()

  def __enter__(self) -> EnvPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # Internals.

  def _check_open(self) -> None:
    if self._workers.closed:
      raise ValueError("EnvPool is closed")

  def _is_done(self, i: int) -> bool:
    return self._last[i] is not None and self._last[i].done

  def _fail(self, i: int, error: str) -> None:
    self._last[i] = env_failure(self._obs[i], error)
    self._unreported[i] = True
    self.failures += 1

  def _fail_lost(self, lost: Mapping[int, str]) -> None:
    """Ends every live episode held by the workers in `lost` (worker -> what happened to it)."""
    for i in range(len(self._last)):
      w = self.worker_of(i)
      if w in lost and not self._is_done(i):
        self._fail(i, lost[w])

  def _restart(self, w: int) -> str:
    how = self._workers.kill(w)
    self._workers.start(w)
    self.restarts += 1
    return how

  def _run(self, op: str, args: Mapping[int, Any], timeout_s: float) -> tuple[dict[int, tuple[str, Any]], dict]:
    """Sends each worker its rows' requests, then gathers one reply per row, each within timeout_s of the previous
    one. Returns (row -> (kind, payload), worker -> error for workers that died or hung and were restarted)."""
    workers = self._workers
    self._seq += 1
    seq = self._seq
    queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    for i in args:
      queues[self.worker_of(i)].append(i)
    replies: dict[int, tuple[str, Any]] = {}
    lost: dict[int, str] = {}
    for w, rows in list(queues.items()):
      try:
        workers.conns[w].send((op, seq, [(i // self.num_workers, args[i]) for i in rows]))
      except (OSError, ValueError) as e:
        lost[w] = f"worker {w} (pid {workers.procs[w].pid}) could not take {op} ({e}); {self._restart(w)}"
        del queues[w]
    deadlines = {w: time.monotonic() + timeout_s for w in queues}
    while queues:
      handles = {}
      for w in queues:
        handles[workers.conns[w]] = w
        handles[workers.procs[w].sentinel] = w
      wait_s = max(0.0, min(deadlines.values()) - time.monotonic())
      ready = set(mpc.wait(list(handles), timeout=wait_s))
      for w in list(queues):
        conn, pid, row = workers.conns[w], workers.procs[w].pid, queues[w][0]
        error = None
        if conn in ready:
          try:
            kind, reply_seq, slot, payload = conn.recv()
          except (EOFError, OSError):
            error = f"worker {w} (pid {pid}) died during {op}"
          else:
            if reply_seq != seq:
              continue
            replies[queues[w].popleft()] = (kind, payload)
            deadlines[w] = time.monotonic() + timeout_s
            if not queues[w]:
              del queues[w], deadlines[w]
            continue
        elif workers.procs[w].sentinel in ready:
          error = f"worker {w} (pid {pid}) died during {op}"
        elif time.monotonic() >= deadlines[w]:
          error = f"worker {w} (pid {pid}) timed out: {op} of row {row} took over {timeout_s:g} s"
        if error is not None:
          lost[w] = f"{error} ({self._restart(w)}; worker restarted)"
          del queues[w], deadlines[w]
    return replies, lost
