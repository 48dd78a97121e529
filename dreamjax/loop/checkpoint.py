"""Run checkpoints: one pytree of arrays plus one JSON document per step, saved with orbax, the last N kept.

A training loop's resumable state splits in two:
- `arrays`: any pytree of jax (or NumPy) arrays: the TrainState (parameters, optimizer state, step), a frozen
  reference model, the root PRNG key, a `CurriculumState`. Saved with orbax's StandardCheckpointHandler, so each
  process writes its own shards and a restore lays every leaf out as the caller's `like` tree says (a run resumed on
  the 8-device mesh gets its layout back; a different mesh reshards on load).
- `meta`: a JSON document: counters, the task pool (`TaskPool.to_json`), the replay buffer's position, the tracker's
  run id, NumPy Generator states (`generator_state` / `restore_generator`), evaluation rows so far.

Typed PRNG keys cannot be serialised as such: their raw `key_data` is saved and a small JSON item records which
leaves were keys and of which implementation; restore wraps them back (a key restored onto a non-key leaf, or one of
another implementation, is a mismatch).

Atomicity. Orbax writes each step in place and marks it finished with a `commit_success.txt` written last (its
COMMIT_FILE mode; rename-based atomicity cannot tell a half-written `7/` from a finished one). A step directory without
that marker (a process killed mid-save) is ignored by `steps`, `latest_step` and `restore`, and removed when the next
checkpointer opens the folder. Saves are asynchronous: `save` returns once the arrays are copied off the devices, so
the train step may donate them at once; `wait` (also done by `latest_step`, `restore` and `close`) blocks until the
files are committed.

Unreadable steps. A committed step can still be unreadable: a corrupted file, a folder copied in part, a junk folder
named like a step with a commit marker in it. `latest_step` returns the newest committed step whose items open (the
JSON items, the array tree's metadata, orbax's per-process array metadata: cheap reads, no array data); each newer
step that does not is moved aside to `<step>.unreadable` (which orbax ignores, so it neither collides with a later save
nor takes one of the `keep` slots) with a `CheckpointWarning` naming the folder and the error's first line. When no
committed step opens, `latest_step` raises a `CheckpointError` naming the folder and moves nothing. `restore(None)`
goes further back the same way when the array data itself fails to read; `restore(step)` and `meta(step)` of a named
step that fails raise a one-line `StepUnreadable` (a `CheckpointError`) naming the step folder and the previous
committed step; the caller may `set_aside` the step and use that one (the RL loop does: `dreamjax.loop.run`). Orbax keeps no checksum of array data: a flipped byte inside a chunk is not always an
error, it can restore as wrong numbers. A state that went bad in training never reaches the disk: `save` refuses arrays
holding a NaN or an infinity (naming the leaf), so `keep` rotation never pushes the last good step out for a bad one.

The folder may be a URI (`gs://bucket/run/checkpoints`, `dreamjax.storage`): orbax reaches it through etils.epath
and TensorStore, and commits with its marker file, which object stores allow; only `set_aside`'s rename becomes a copy
and a delete there.

Restoring onto a tree that does not match the checkpoint (other leaves, shapes or dtypes) raises a ValueError naming
the folder, the step and the first differing paths, rather than orbax's silent dtype casts or deep tracebacks.

Several processes (`dreamjax.parallel.initialize`): every process calls `save`, `restore`, `wait` and `close` at the
same points (orbax's saves and restores are collectives; it writes the JSON items, the commit marker and NumPy leaves
from process 0 only, each process writes its own array shards into the one shared folder, and a save's background
thread returns on every process only after process 0 committed, behind orbax's own barrier, so `wait` and `latest_step`
never see a step early on any process). A process-local jax.Array (one living on a single device of each process, e.g.
a root PRNG key every process holds alike) is one orbax refuses to save; it is saved as a global array replicated over
every device (process 0's copy is written), and restored back onto the target's local device.
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from dreamjax.parallel import barrier, is_primary
from dreamjax.rl.train_state import nonfinite_leaves
from dreamjax.storage import is_uri, storage_path

_COMMIT = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
_SHOWN = 5  # mismatching paths named in an error


class CheckpointError(ValueError):
  """A committed checkpoint step cannot be read (the message is one line naming the folder)."""


class StepUnreadable(CheckpointError):
  """The named committed `step` cannot be read (`problem`); `earlier` is the committed step before it (None: none)."""

  def __init__(self, message: str, step: int, problem: str, earlier: int | None):
    super().__init__(message)
    self.step, self.problem, self.earlier = step, problem, earlier


class CheckpointWarning(UserWarning):
  """A committed checkpoint step could not be read and an earlier one is used instead."""


class _Unreadable(Exception):
  def __init__(self, problem: str):
    super().__init__(problem)
    self.problem = problem


def _first_line(e: BaseException, limit: int = 300) -> str:
  """`Type: first non-empty line of the message` of the innermost cause (orbax wraps TensorStore's error, which names
  the file, in one that prints a page of spec), cut to `limit` characters."""
  while (e.__cause__ or e.__context__) is not None:
    e = e.__cause__ or e.__context__
  line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
  line = f"{type(e).__name__}: {line}" if line else type(e).__name__
  return line if len(line) <= limit else line[:limit - 3] + "..."


def _reading(fn: Callable[[], Any]) -> Any:
  """`fn()`, any failure turned into `_Unreadable` with its first line. Orbax's other reads of the step, still in
  flight when the first one failed, each raise again when their coroutine is finalised (at once, or whenever the
  collector reaches it), with a page of TensorStore spec apiece: those reports are filtered out from then on."""
  try:
    return fn()
  except Exception as e:  # orbax, TensorStore and JSON errors alike: the step cannot be read
    problem = _first_line(e)
  if not isinstance(sys.unraisablehook, _QuietOrbaxReads):
    sys.unraisablehook = _QuietOrbaxReads(sys.unraisablehook)
  gc.collect()
  raise _Unreadable(problem)


class _QuietOrbaxReads:
  """An unraisable-exception hook that drops the leftovers of a failed orbax read (its coroutines' errors, and its
  TensorStore futures completing into the event loop orbax already closed) and passes every other report on."""

  def __init__(self, report: Callable[[Any], None]):
    self.report = report

  def __call__(self, unraisable: Any) -> None:
    code = getattr(unraisable.object, "cr_code", None)
    orbax = code is not None and "/orbax/" in code.co_filename.replace("\\", "/")
    closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    if not (orbax or closed):
      self.report(unraisable)


def _name(entry: Any) -> str:
  """One key-path entry as orbax names it in a checkpoint's tree (dict keys, attribute names, list indices)."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _path(path: tuple) -> str:
  return "/".join(_name(e) for e in path)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data_like(x: Any) -> jax.ShapeDtypeStruct:
  """Where a typed key leaf's raw data goes on restore: same devices, trailing key dimensions unsharded."""
  if isinstance(x, jax.Array):
    data = jax.random.key_data(x)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)
  shape = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
  extra = len(shape.shape) - len(x.shape)
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *[None] * (len(x.shape) - len(
        sharding.spec) + extra)))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding or SingleDeviceSharding(jax.local_devices()[0]))


def _abstract(x: Any) -> Any:
  """A restore target leaf: NumPy arrays stay NumPy; everything else becomes a ShapeDtypeStruct with a sharding."""
  if isinstance(x, np.ndarray | np.generic):
    return np.zeros(np.shape(x), np.asarray(x).dtype)
  if _is_key(x):
    return _key_data_like(x)
  sharding = getattr(x, "sharding", None) or SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _everywhere() -> NamedSharding:
  """Replicated over every device of every process."""
  return NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()), ("all",)), PartitionSpec())


def _process_local(x: Any) -> bool:
  """A jax.Array (or restore target) living only on this process's devices while other processes exist."""
  sharding = getattr(x, "sharding", None)
  return jax.process_count() > 1 and sharding is not None and sharding.is_fully_addressable


def _to_global(x: Any) -> Any:
  """A process-local jax.Array as one replicated over all processes' devices, which orbax can save; the processes
  hold the same value (they run the same program), and orbax writes process 0's copy."""
  if not (isinstance(x, jax.Array) and _process_local(x)):
    return x
  value = np.asarray(x)
  return jax.make_array_from_callback(x.shape, _everywhere(), lambda index: value[index])


def generator_state(rng: np.random.Generator) -> dict[str, Any]:
  """A NumPy Generator's state as JSON (for `meta`)."""
  return {"bit_generator": type(rng.bit_generator).__name__, "state": rng.bit_generator.state}


def restore_generator(state: Mapping[str, Any]) -> np.random.Generator:
  bit_generator = getattr(np.random, state["bit_generator"])()
  bit_generator.state = state["state"]
  return np.random.Generator(bit_generator)


class RunCheckpointer:
  """`save(step, arrays, meta)` / `restore(step, like)` over an orbax CheckpointManager in `folder`, keeping `keep`
  steps (None: all)."""

  def __init__(self, folder: str | Path, keep: int | None = 3):
    if keep is not None and keep < 1:
      raise ValueError(f"RunCheckpointer: keep must be >= 1 (or None for all), got {keep}")
    # A local folder (made absolute: orbax wants that) or a URI such as gs://bucket/run/checkpoints.
    self.folder = storage_path(folder if is_uri(folder) else Path(folder).absolute())
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                           atomicity_options=_COMMIT)
    handlers = {"arrays": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "keys": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.folder, options=options, item_handlers=handlers)
    self._opens: set[int] = set()  # steps `_problem` found readable (a committed step's files do not change)

  def steps(self) -> list[int]:
    """Committed steps, oldest first."""
    self.wait()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step that opens (None: no committed step); newer ones that do not are moved aside with a
    warning; a CheckpointError when there are committed steps and none opens (module docstring)."""
    steps = self.steps()
    bad: list[tuple[int, str]] = []
    for step in reversed(steps):
      problem = self._problem(step)
      if problem is None:
        for s, p in bad:
          self.set_aside(s, p, step)
        return step
      bad.append((step, problem))
    if bad:
      raise CheckpointError(f"RunCheckpointer: no committed checkpoint in {self.folder} can be read (" +
                            "; ".join(f"step {s}: {p}" for s, p in bad) + "); move the folder away to start afresh")
    return None

  def _problem(self, step: int) -> str | None:
    """None when `step`'s items open (JSON items, array tree metadata, per-process array metadata), else why not."""
    if step in self._opens:
      return None
    try:
      items = _reading(lambda: self._manager.item_metadata(step))
      if items.get("arrays") is None:
        return "it has no arrays item"
      _reading(lambda: self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                                            keys=ocp.args.JsonRestore())))
      for f in sorted((self.folder / str(step) / "arrays" / "array_metadatas").glob("*")):
        _reading(lambda f=f: json.loads(f.read_text()))
    except _Unreadable as e:
      return e.problem
    self._opens.add(step)
    return None

  def set_aside(self, step: int, problem: str, fallback: int) -> None:
    """Moves an unreadable committed step out of orbax's sight with a warning naming `problem` and the `fallback`
    step used instead (process 0 moves it; every process meets the barrier)."""
    target = self.folder / f"{step}.unreadable"
    for n in range(1, 1000):
      if not target.exists():
        break
      target = self.folder / f"{step}.unreadable-{n}"
    warnings.warn(f"RunCheckpointer: cannot read checkpoint {self.folder / str(step)} ({problem}); moved it to "
                  f"{target.name} and using step {fallback}", CheckpointWarning, stacklevel=2)
    self._opens.discard(step)
    if is_primary():
      (self.folder / str(step)).rename(target)
    barrier(f"checkpoint_set_aside_{step}")
    self._manager.reload()

  def save(self, step: int, arrays: Any, meta: Mapping[str, Any] | None = None) -> None:
    """Starts saving `arrays` and `meta` as `step` (a new step; the oldest beyond `keep` are deleted once it commits)."""
    step = int(step)
    try:
      meta = json.loads(json.dumps(dict(meta or {})))
    except (TypeError, ValueError) as e:
      raise ValueError(f"RunCheckpointer.save (step {step} in {self.folder}): meta is not JSON: {e}") from None
    if step in self.steps():
      raise ValueError(f"RunCheckpointer.save: step {step} is already committed in {self.folder}")
    # A non-finite state saved here would rotate the last good step out (`keep`), and resuming would restore NaNs.
    bad = nonfinite_leaves(arrays)
    if bad:
      raise ValueError(f"RunCheckpointer.save (step {step} in {self.folder}): refusing to save non-finite values: "
                       f"{bad[0]!r} holds NaN or infinity" + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1
                                                              else ""))
    flat, _ = jax.tree_util.tree_flatten_with_path(arrays)
    other = next((_path(p) for p, x in flat if not isinstance(x, jax.Array | np.ndarray | np.generic)), None)
    if other is not None:
      raise ValueError(f"RunCheckpointer.save (step {step} in {self.folder}): leaf {other!r} is not an array; "
                       f"put Python values in meta")
    keys = {_path(p): str(jax.random.key_impl(x)) for p, x in flat if _is_key(x)}
    data = jax.tree.map(lambda x: _to_global(jax.random.key_data(x) if _is_key(x) else x), arrays)
    self._manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(data), meta=ocp.args.JsonSave(meta),
                                                     keys=ocp.args.JsonSave(keys)))

  def wait(self) -> None:
    """Blocks until every started save is committed."""
    self._manager.wait_until_finished()

  def meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON document of `step` (None: the latest readable), without touching the arrays."""
    step = self._committed(step)
    try:
      out = _reading(lambda: self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())))
    except _Unreadable as e:
      raise self._error(step, e.problem) from None
    return dict(out["meta"] or {})

  def restore(self, step: int | None = None, like: Any = None) -> tuple[Any, dict[str, Any]]:
    """(arrays, meta) of `step` (None: the latest readable, going back a step, with a warning, while the arrays fail
    to read). `like` is a tree of the saved structure, concrete arrays or ShapeDtypeStructs whose shardings the
    restored leaves take; None restores the saved tree as nested dicts and lists with the saved shardings (inspection
    on the same devices). A `like` that does not match the checkpoint is a ValueError, never a reason to go back."""
    if step is not None:
      step = self._committed(step)
      try:
        return self._restore(step, like)
      except _Unreadable as e:
        raise self._error(step, e.problem) from None
    while True:
      step = self._committed(None)
      try:
        return self._restore(step, like)
      except _Unreadable as e:
        earlier = [s for s in self.steps() if s < step]
        if not earlier:
          raise self._error(step, e.problem) from None
        self.set_aside(step, e.problem, earlier[-1])

  def _error(self, step: int, problem: str) -> StepUnreadable:
    earlier = [s for s in self.steps() if s < step]
    hint = (f"; move that folder away to resume from step {earlier[-1]}" if earlier else
            "; no earlier committed step: move the checkpoints folder away to start afresh")
    return StepUnreadable(f"RunCheckpointer: cannot read checkpoint {self.folder / str(step)} ({problem}){hint}", step,
                          problem, earlier[-1] if earlier else None)

  def _restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
    keys = _reading(lambda: self._manager.restore(step, args=ocp.args.Composite(keys=ocp.args.JsonRestore())))
    keys = keys["keys"] or {}
    local: dict[str, Any] = {}  # path -> the process-local sharding a leaf goes back to (several processes only)
    if like is None:
      target = ocp.args.StandardRestore()
    else:
      abstract = jax.tree.map(_abstract, like)
      self._check(step, like, abstract, keys)

      def globalise(path, t):
        if not (isinstance(t, jax.ShapeDtypeStruct) and _process_local(t)):
          return t
        local[_path(path)] = t.sharding
        return jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=_everywhere())

      target = ocp.args.StandardRestore(jax.tree_util.tree_map_with_path(globalise, abstract))
    out = _reading(lambda: self._manager.restore(step, args=ocp.args.Composite(arrays=target,
                                                                               meta=ocp.args.JsonRestore())))

    def wrap(path, x):
      if _path(path) in local:
        x = jax.device_put(x.addressable_data(0), local[_path(path)])
      impl = keys.get(_path(path))
      return jax.random.wrap_key_data(x, impl=impl) if impl is not None else x

    return jax.tree_util.tree_map_with_path(wrap, out["arrays"]), dict(out["meta"] or {})

  def _committed(self, step: int | None) -> int:
    if step is None:
      latest = self.latest_step()
      if latest is None:
        raise FileNotFoundError(f"RunCheckpointer: no committed checkpoint in {self.folder}")
      return latest
    steps = self.steps()
    if step not in steps:
      raise FileNotFoundError(f"RunCheckpointer: step {step} is not a committed checkpoint in {self.folder} "
                              f"(committed: {steps})")
    return int(step)

  def _check(self, step: int, like: Any, target: Any, keys: Mapping[str, str]) -> None:
    """Raises a ValueError listing how `like` differs from the checkpoint: leaves missing on either side, shapes,
    dtypes, and typed keys (of another implementation, or where the checkpoint has plain data)."""
    stored = _reading(lambda: self._manager.item_metadata(step))["arrays"]
    stored = getattr(stored, "tree", stored)
    have = {_path(p): (tuple(m.shape), np.dtype(m.dtype)) for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    want = {_path(p): (tuple(np.shape(t)), np.dtype(t.dtype)) for p, t in jax.tree_util.tree_flatten_with_path(
        target)[0]}
    problems = [f"{p}: missing from the checkpoint" for p in want if p not in have]
    problems += [f"{p}: in the checkpoint but not in the restore target" for p in have if p not in want]
    problems += [f"{p}: checkpoint has shape {have[p][0]} {have[p][1]}, target {want[p][0]} {want[p][1]}"
                 for p in want if p in have and have[p] != want[p]]
    for p, x in jax.tree_util.tree_flatten_with_path(like)[0]:
      name, saved = _path(p), keys.get(_path(p))
      if _is_key(x) != (saved is not None):
        problems.append(f"{name}: {'a PRNG key' if _is_key(x) else 'an array'} in the target, "
                        f"{'a PRNG key' if saved else 'plain data'} in the checkpoint")
      elif saved is not None and isinstance(x, jax.Array) and str(jax.random.key_impl(x)) != saved:
        problems.append(f"{name}: PRNG key implementation {jax.random.key_impl(x)} in the target, {saved} saved")
    if problems:
      more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
      raise ValueError(f"RunCheckpointer.restore: step {step} in {self.folder} does not match the restore target: "
                       + "; ".join(problems[:_SHOWN]) + more)

  def close(self) -> None:
    self.wait()
    # orbax (0.12) removes a folder's unfinished steps in a thread it starts when the manager opens, and waits for it
    # only before a save: a run that closed without saving (a config error, a finished run read again) left it
    # running into the interpreter's shutdown, which printed a RuntimeError traceback after the command's own output.
    cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
    if cleanup is not None:
      cleanup.result()
    self._manager.close()

  def __enter__(self) -> RunCheckpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
