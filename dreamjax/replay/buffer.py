"""The durable replay buffer: transitions (dreamjax.data.records.Transition) on disk, seeded from offline data and
grown online during RL.

Folder layout:
  MANIFEST.json          the commit record: format version, records_per_segment, each segment's committed record count
                         and byte length, counts by origin, seed tags. Replaced atomically on every commit.
  segments/000000.jsonl  one transition per line: its fields as JSON (the task as Task.to_json, no history), keys
  segments/000001.jsonl  sorted, led by a "_crc" field (see Integrity). A segment rolls over after
                         `records_per_segment` records, so id i is line i % N + 1 of segment i // N.
  LOCK                   flock held by the one writer process (it holds the writer's pid, for the error message).

Commit protocol. `append(transitions)` streams the batch's lines past the committed end of the last segment (rolling
to new segment files as needed), fsyncs them (and the segments folder when a file was created), then commits by
writing the new manifest to a temporary file, fsyncing it, `os.replace`-ing it over MANIFEST.json and fsyncing the
folder. The manifest is the only source of truth: bytes past a segment's committed length and segment files it does not
list are debris of an append that never committed. So a batch is all-or-nothing, and a process killed at any point
(SIGKILL included) loses only its uncommitted batch. On open, the writer truncates torn tails and deletes uncommitted
segment files (with an UncommittedDataWarning); readers simply never look past the committed lengths. An exception
inside `append` (a bad transition, a full disk) rolls the files back to the last commit before it propagates.
`seed(records, tag)` appends offline data and records `tag` in the same manifest write, so re-seeding after a resume
is a no-op and a crash mid-seed leaves no partial seed.

One writer, many readers. Exactly one process appends (the RL trainer); a second writer is refused through the LOCK
flock, which the kernel releases when the writer dies. Any number of processes may open the folder with
`read_only=True` while the writer appends: committed bytes are never rewritten, and the manifest is replaced
atomically, so a reader always sees a consistent committed prefix; `refresh()` re-reads the manifest and indexes the
lines committed since. A multi-process DreamGym run works this way: process 0 writes, and the other processes (other
hosts, with the run folder on a shared filesystem) refresh their read-only view after a barrier that follows each
append. A refresh that finds a segment shorter than committed reopens it once before it fails, since a descriptor
opened before the append may report a stale size on network filesystems. `truncate` (a resumed run rewinding the
buffer) invalidates readers' views (a later `refresh` is an error): readers open the folder after it. Objects are not
thread-safe.

Integrity. A line is `{"_crc":"<8 hex digits>",` followed by the record's JSON less its opening brace, the digits being
the CRC-32 of that JSON (the line without its "_crc" field). So a line is still one JSON object with sorted keys, and an
edit that keeps the length (a reward flipped from 0 to 1, a flag rewritten) is caught: CRC-32 catches every change
confined to 32 consecutive bits and misses a wider one with probability 2^-32. Every read (`get`, `iter_from`, `verify`)
checks the checksum, then the fields and the outcome against the env contract (dreamjax.envs.base.outcome_problem:
binary rewards, 1 only on the step that ends a successful episode); `append` refuses a transition that breaks the contract, which no reader
would accept. A failure raises ValueError naming the segment file and line. The checksum guards against accidents (disk
faults, stray edits, tools rewriting a line), not against an editor who recomputes it. Format v1 wrote lines without
checksums, and v2 called a transition's origin its "source"; this version refuses both rather than serve lines it cannot
verify or convert silently (a buffer is rebuilt by running in a new output folder, which seeds it again).

A transition's history is not stored: retrieval shows M_exp each example as a lone step, so `append` refuses a
transition that carries one (flatten episodes with `transitions(records, max_history=0)`, as `seed` does) rather than
drop it.

Random access. Ids are consecutive integers in commit order. The buffer keeps, per segment, an array of line start
offsets (8 bytes per transition, rebuilt on open by scanning the committed bytes for newlines: no JSON parsing), and
`get(ids)` preads and parses each line on demand, so memory does not grow with the text held. Parsed transitions are
immutable, so an optional LRU cache (`cache_size`) keeps hot ones.

Measured on the 2-core CPU dev VM (ext4; shared with other jobs, so the best of several runs; busy runs were up to
2x slower): 100k transitions replicated from runs/collect/twx_500 (TextWorld-Express, 1.18 KB per line, 118 MB).
  append, batches of 2,048:  33k transitions/s (fsync cost 0 to 25%); seeding 200k in one batch: 30k/s
  open (index 200k lines):   0.23 s CPU;  refresh after 2,048 new lines: 2 ms
  get, 256 random ids:       7.3 ms per call, 28 us per transition: pread 1.4 us, json.loads 12 us, field checks and
                             Transition construction the rest (Task objects memoised: parsing them cost 10 us)
  get with the LRU cache:    0.26 us per hit
  iter_from, sequential:     42k transitions/s
So retrieval of k = 4 neighbours for 64 queries per turn costs about 7 ms uncached, small next to a sampler step:
cache_size defaults to 0; give it e.g. 100_000 when retrieval concentrates on hot transitions (1.4 KB each here).
The numbers came from a script that appends the 100k in batches of 2,048, then times 200 calls of get(256 ids).
They were taken with format v1; v2's checksum and outcome check add about 1 us per line to append and to every read
(the CRC-32 of a 1.3 KB line is 0.4 us; encode 9.4 -> 10.3 us, decode 8.0 -> 9.2 us, best of 15 on the same VM).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import operator
import os
import warnings
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dreamjax.data.jsonl import dumps
from dreamjax.data.records import ORIGINS, TrajectoryRecord, Transition, iter_trajectories, transitions
from dreamjax.envs.base import Task, outcome_problem

FORMAT = "dreamjax.replay.v3"
_OLDER = {"dreamjax.replay.v1": "whose lines carry no checksums",  # refused (see the module docstring)
          "dreamjax.replay.v2": "whose lines name a transition's origin 'source'"}
MANIFEST = "MANIFEST.json"
SEGMENTS = "segments"
LOCK = "LOCK"
DEFAULT_RECORDS_PER_SEGMENT = 65536
_SCAN_BYTES = 16 << 20  # chunk size for indexing a segment on open
_FLUSH_BYTES = 4 << 20  # append buffers this much before writing
_ITER_BLOCK = 4096  # records read by one pread in iter_from
_TASK_MEMO = 65536  # distinct tasks kept parsed
_CRC_OPEN = b'{"_crc":"'  # a line: _CRC_OPEN, 8 hex digits, b'",', then the record's JSON without its "{"
_OPEN, _CRC, _COMMA = slice(0, 9), slice(9, 17), slice(17, 19)  # where those parts lie in a line
_BODY = 19


class UncommittedDataWarning(UserWarning):
  """A writer found bytes or segment files of an append that never committed (a killed run) and removed them."""


@dataclasses.dataclass(frozen=True)
class BufferStats:
  total: int
  by_origin: dict[str, int]  # every name in ORIGINS, zero when absent
  segments: int
  bytes: int  # committed segment bytes
  seeds: dict[str, range]  # seed tag -> ids it appended


class _Segment:
  """One segment file: its extent and each line's start offset (offsets[records] is the end of the last line)."""

  __slots__ = ("path", "records", "nbytes", "offsets", "fd")

  def __init__(self, path: Path):
    self.path = path
    self.records = 0
    self.nbytes = 0
    self.offsets = array("q", [0])
    self.fd = -1  # read descriptor, opened on first read


def _segment_name(index: int) -> str:
  return f"{index:06d}.jsonl"


def _fsync_dir(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


_KEYS = frozenset(f.name for f in dataclasses.fields(Transition)) - {"history"}
_STRINGS = ("episode_id", "instruction", "state", "action", "next_state", "origin")
_BOOLS = ("done", "success", "invalid")


def _check_fields(d: Mapping[str, Any], where: str) -> None:
  """Types of a transition's JSON form (present fields only; `_decode` reports missing and unknown ones)."""
  def fail(name: str, expected: str) -> ValueError:
    return ValueError(f"{where}: field {name!r}: expected {expected}, got {_show(d[name])}")

  for name in _STRINGS:
    if name in d and not isinstance(d[name], str):
      raise fail(name, "a string")
  if d.get("origin", ORIGINS[0]) not in ORIGINS:
    raise fail("origin", f"one of {', '.join(ORIGINS)}")
  for name in _BOOLS:
    if name in d and not isinstance(d[name], bool):
      raise fail(name, "true or false")
  for name in ("step", "policy_version"):
    if name in d and (isinstance(d[name], bool) or not isinstance(d[name], int)):
      raise fail(name, "an integer")
  r = d.get("reward", 0.0)
  if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
    raise fail("reward", "a finite number")
  if "task" in d and not (isinstance(d["task"], dict) and isinstance(d["task"].get("params", {}), dict)):
    raise fail("task", "a task object")


def transition_json(t: Transition) -> dict[str, Any]:
  """A transition's JSON form in a segment line (before its checksum): every field but the history."""
  # Shallow on purpose: dataclasses.asdict deep-copies the task and was 3/4 of the append time.
  d = {name: getattr(t, name) for name in _KEYS}
  d["task"] = t.task.to_json()
  return d


def _check_outcome(t: Transition, where: str) -> None:
  problem = outcome_problem(t.reward, t.done, t.success, t.invalid)
  if problem:
    raise ValueError(f"{where}: inconsistent outcome: {problem} (rewards are binary outcomes, 1 only on the step "
                     "that ends a successful episode)")


def _encode(t: Any, where: str) -> bytes:
  if not isinstance(t, Transition):
    raise TypeError(f"{where}: expected a Transition, got {type(t).__name__}")
  where = f"{where} (episode {t.episode_id!r} step {t.step})"
  if t.history:
    raise ValueError(f"{where}: carries a history, which the buffer does not store (flatten with max_history=0)")
  d = transition_json(t)
  _check_fields(d, where)
  _check_outcome(t, where)  # a committed line no reader accepts would break every later verify()
  try:
    body = dumps(d).encode("utf-8")
  except (TypeError, ValueError, RecursionError) as e:
    raise ValueError(f"{where}: not JSON-serialisable: {e}") from None
  return b"%s%08x\",%s\n" % (_CRC_OPEN, zlib.crc32(body), body[1:])


def _decode(raw: bytes, where: str, tasks: dict[str, Task]) -> Transition:
  """Checks and parses one committed line (without its newline); `tasks` memoises Task objects (an episode's steps
  share one, and parsing it costs as much as the rest of the transition)."""
  if raw[_OPEN] != _CRC_OPEN or raw[_COMMA] != b'",':
    raise ValueError(f"{where}: no checksum: the line does not start with {_CRC_OPEN.decode()}<8 hex digits>\", "
                     f"(damaged, or not written by this buffer): {_show(raw[:40])}")
  body = b"{" + raw[_BODY:]
  crc = b"%08x" % zlib.crc32(body)
  if crc != raw[_CRC]:
    raise ValueError(f"{where}: checksum mismatch: the line was changed after it was written (it stores "
                     f"{raw[_CRC].decode('ascii', 'replace')}, its bytes give {crc.decode()})")
  try:
    d = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise ValueError(f"{where}: not valid JSON ({e})") from None
  _check_fields(d, where)  # d is a dict: the body starts with "{"
  if d.keys() != _KEYS:
    missing, unknown = sorted(_KEYS - d.keys()), sorted(d.keys() - _KEYS)
    raise ValueError(f"{where}: field {(missing or unknown)[0]!r}: {'missing' if missing else 'unknown field'}")
  key = repr(d["task"])  # keys are sorted on write, so equal tasks have equal text
  task = tasks.get(key)
  if task is None:
    if len(tasks) >= _TASK_MEMO:
      tasks.clear()
    task = tasks[key] = Task.from_json(d["task"], source=where)
  d["task"] = task
  t = Transition(**d)
  _check_outcome(t, where)
  return t


class ReplayBuffer:
  """A replay buffer folder opened for appending (the one writer) or `read_only` (any number of readers).

  `records_per_segment` applies when the folder is created; an existing buffer keeps its own (a different explicit
  value is an error). `fsync=False` skips the fsyncs: commits still survive a killed process, not a power loss.
  """

  def __init__(self, folder: str | Path, *, read_only: bool = False, records_per_segment: int | None = None,
               fsync: bool = True, cache_size: int = 0):
    self.folder = Path(folder)
    self.read_only = read_only
    self.fsync = fsync
    self.cache_size = cache_size
    self._cache: OrderedDict[int, Transition] = OrderedDict()
    self._tasks: dict[str, Task] = {}
    self._segments: list[_Segment] = []
    self._lock_fd = -1
    self._wfd = -1  # write descriptor of the last segment, kept across appends
    self._broken = False
    self._manifest_path = self.folder / MANIFEST
    self._seg_dir = self.folder / SEGMENTS
    self._manifest: dict[str, Any] = {"segments": []}
    self._total = 0
    try:
      if read_only:
        if not self._manifest_path.is_file():
          raise FileNotFoundError(f"{self._manifest_path}: missing: not a replay buffer (a writer creates it)")
      else:
        self._open_writer(records_per_segment or DEFAULT_RECORDS_PER_SEGMENT)
      self._load(self._read_manifest(), initial=True)
      if records_per_segment is not None and records_per_segment != self.records_per_segment:
        raise ValueError(f"{self._manifest_path}: records_per_segment is {self.records_per_segment}; "
                         f"cannot open it with {records_per_segment}")
      if not read_only:
        self._drop_uncommitted()
    except BaseException:
      self.close()  # releases the writer's lock at once, not when the object is collected
      raise

  # Opening, manifest, recovery.

  def _open_writer(self, records_per_segment: int) -> None:
    if records_per_segment < 1:
      raise ValueError(f"records_per_segment must be positive, got {records_per_segment}")
    self.folder.mkdir(parents=True, exist_ok=True)
    self._lock_fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
      raise RuntimeError(f"{self.folder}: already open for writing by process {holder or '?'} "
                         "(one writer per buffer; open it with read_only=True to read)") from None
    os.ftruncate(self._lock_fd, 0)
    os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)
    if not self._manifest_path.exists():
      stray = sorted(p.name for p in self.folder.iterdir() if p.name not in (LOCK, SEGMENTS, MANIFEST + ".tmp"))
      stray += [f"{SEGMENTS}/{p.name}" for p in (self._seg_dir.iterdir() if self._seg_dir.is_dir() else ())]
      if stray:
        raise FileExistsError(f"{self.folder}: holds {stray[0]!r} but no {MANIFEST}: not a replay buffer, refusing "
                              "to write into it")
      self._seg_dir.mkdir(exist_ok=True)
      self._replace_manifest({"format": FORMAT, "records_per_segment": records_per_segment, "total": 0,
                              "segments": [], "by_origin": dict.fromkeys(ORIGINS, 0), "seeds": {}})
      if self.fsync:
        _fsync_dir(self.folder)

  def _read_manifest(self) -> dict[str, Any]:
    path = self._manifest_path
    try:
      m = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or "format" not in m:
      raise ValueError(f"{path}: no 'format' field: not a dreamjax replay buffer manifest")
    if m["format"] in _OLDER:
      raise ValueError(f"{path}: written in format {m['format']!r}, {_OLDER[m['format']]}; this dreamjax reads "
                       f"{FORMAT!r} and refuses it rather than serve transitions it cannot verify (start the run in "
                       "a new output folder, which seeds a new buffer, or use the dreamjax version that wrote it)")
    if m["format"] != FORMAT:
      raise ValueError(f"{path}: written in format {_show(m['format'])}, this dreamjax reads {FORMAT!r}; "
                       "refusing to open it (use the dreamjax version that wrote it, or convert it)")
    try:
      n, total = m["records_per_segment"], m["total"]
      segs = [(s["records"], s["bytes"]) for s in m["segments"]]
      seeds = [tuple(v) for v in m["seeds"].values()]
      counts = [m["by_origin"][k] for k in ORIGINS]
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
    numbers = [n, total, *counts, *(x for pair in segs + seeds for x in pair)]
    ok = (all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in numbers) and n > 0
          and sum(r for r, _ in segs) == total == sum(counts) and all(r == n for r, _ in segs[:-1])
          and all(len(v) == 2 and v[0] + v[1] <= total for v in seeds))
    if not ok:
      raise ValueError(f"{path}: malformed manifest (segment, origin and seed counts must be non-negative integers "
                       "that agree)")
    return m

  def _load(self, m: dict[str, Any], initial: bool = False) -> int:
    """Indexes the lines `m` commits beyond those already indexed; returns how many."""
    if not initial and (m["records_per_segment"] != self.records_per_segment or m["total"] < self._total):
      raise ValueError(f"{self._manifest_path}: the buffer shrank or changed its segment size under a reader")
    before = self._manifest.get("total", 0)
    for index, s in enumerate(m["segments"]):
      if index == len(self._segments):
        self._segments.append(_Segment(self._seg_dir / _segment_name(index)))
      self._scan(self._segments[index], s["records"], s["bytes"])
    self._manifest = m
    self.records_per_segment: int = m["records_per_segment"]
    self._total: int = m["total"]
    return self._total - before

  def _scan(self, seg: _Segment, records: int, nbytes: int) -> None:
    """Extends `seg`'s offsets to its committed extent by finding the newlines of the newly committed bytes."""
    if (records, nbytes) == (seg.records, seg.nbytes):
      return
    fd = self._read_fd(seg)
    size = os.fstat(fd).st_size
    if size < nbytes and self.read_only:
      # A reader on a shared filesystem (NFS and the like) may see a stale size through a descriptor opened before
      # the writer's last append; a fresh open revalidates it (close-to-open consistency).
      os.close(fd)
      seg.fd = -1
      fd = self._read_fd(seg)
      size = os.fstat(fd).st_size
    if size < nbytes or nbytes < seg.nbytes:
      raise ValueError(f"{seg.path}: holds {size} bytes but the manifest commits {nbytes}: committed data was lost "
                       "or rewritten outside this buffer")
    found, pos = [], seg.nbytes
    while pos < nbytes:
      chunk = os.pread(fd, min(_SCAN_BYTES, nbytes - pos), pos)
      found.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + (pos + 1))
      pos += len(chunk)
    ends = np.concatenate(found) if found else np.zeros(0, np.int64)
    if len(ends) != records - seg.records or (len(ends) and ends[-1] != nbytes):
      line = seg.records + len(ends) + 1
      raise ValueError(f"{seg.path}:{line}: the manifest commits {records} lines in {nbytes} bytes, the file's first "
                       f"{nbytes} bytes hold {seg.records + len(ends)} complete lines")
    seg.offsets.frombytes(ends.tobytes())
    seg.records, seg.nbytes = records, nbytes

  def _drop_uncommitted(self) -> None:
    """Writer only: cuts bytes past the committed lengths and removes segment files the manifest does not list."""
    dropped = []
    for seg in self._segments:
      size = seg.path.stat().st_size
      if size > seg.nbytes:
        os.truncate(seg.path, seg.nbytes)
        dropped.append(f"{seg.path}: {size - seg.nbytes} bytes past line {seg.records}")
    listed = {_segment_name(i) for i in range(len(self._segments))}
    for p in sorted(self._seg_dir.iterdir()):
      if p.name not in listed and p.name.endswith(".jsonl") and p.name[:-6].isdigit():
        dropped.append(f"{p}: uncommitted segment ({p.stat().st_size} bytes)")
        p.unlink()
    (self.folder / (MANIFEST + ".tmp")).unlink(missing_ok=True)
    if dropped:
      warnings.warn(f"{self.folder}: removed data of an append that never committed: {'; '.join(dropped)}",
                    UncommittedDataWarning, stacklevel=3)

  def _replace_manifest(self, m: dict[str, Any]) -> None:
    """The commit point: MANIFEST.json becomes `m` at once (the folder's fsync, which makes it durable, follows)."""
    tmp = self.folder / (MANIFEST + ".tmp")
    with open(tmp, "wb") as f:
      f.write(json.dumps(m, sort_keys=True).encode())
      f.flush()
      if self.fsync:
        os.fsync(f.fileno())
    os.replace(tmp, self._manifest_path)

  # Appending.

  def append(self, items: Iterable[Transition]) -> range:
    """Writes and commits one batch (streamed, so it may be large); returns the ids it was given."""
    return self._append(items, tag=None)

  def seed(self, records_or_path: str | Path | Iterable[TrajectoryRecord | Transition], tag: str, *,
           origin: str = "offline", policy_version: int = -1) -> range:
    """Appends offline data once per `tag`: a TrajectoryRecord JSONL file (streamed), records or transitions.

    Returns the ids of the seed; with a tag already committed it reads nothing and returns the earlier ids."""
    if not isinstance(tag, str) or not tag:
      raise ValueError(f"seed tag must be a non-empty string, got {_show(tag)}")
    if tag in self._manifest["seeds"]:
      first, count = self._manifest["seeds"][tag]
      return range(first, first + count)
    items = iter_trajectories(records_or_path) if isinstance(records_or_path, str | Path) else records_or_path

    def flatten():
      for item in items:
        if isinstance(item, TrajectoryRecord):
          yield from transitions([item], 0, origin, policy_version)
        else:
          yield item

    return self._append(flatten(), tag=tag)

  def _append(self, items: Iterable[Transition], tag: str | None) -> range:
    if self.read_only:
      raise PermissionError(f"{self.folder}: opened read_only; only the writer appends")
    if self._broken or self._lock_fd < 0:
      raise RuntimeError(f"{self.folder}: the buffer is closed or a failed append could not be rolled back; reopen it")
    first, n_segments = self._total, len(self._segments)
    counts = dict(self._manifest["by_origin"])
    try:
      n = self._write(items, counts)
      if n or tag is not None:
        if self.fsync and len(self._segments) > n_segments:
          _fsync_dir(self._seg_dir)
        seeds = dict(self._manifest["seeds"])
        if tag is not None:
          seeds[tag] = [first, n]
        m = {"format": FORMAT, "records_per_segment": self.records_per_segment, "total": first + n,
             "segments": [{"records": s.records, "bytes": s.nbytes} for s in self._segments],
             "by_origin": counts, "seeds": seeds}
        self._replace_manifest(m)
        self._manifest, self._total = m, first + n
    except BaseException:
      self._rollback()
      raise
    if self.fsync and (n or tag is not None):
      _fsync_dir(self.folder)  # after the commit point: a failure here must not roll back what readers may see
    return range(first, first + n)

  def _write(self, items: Iterable[Transition], counts: dict[str, int]) -> int:
    cap, buf, n = self.records_per_segment, bytearray(), 0
    seg = self._segments[-1] if self._segments and self._segments[-1].records < cap else None
    for k, t in enumerate(items):
      line = _encode(t, f"{self.folder}: append item {k}")
      if seg is None or seg.records == cap:
        if seg is not None:
          self._flush(seg, buf)
        seg = self._new_segment()
      buf += line
      seg.records += 1
      seg.nbytes += len(line)
      seg.offsets.append(seg.nbytes)
      counts[t.origin] += 1
      n += 1
      if len(buf) >= _FLUSH_BYTES:
        self._flush(seg, buf, sync=False)
    if seg is not None:
      self._flush(seg, buf)
    return n

  def _new_segment(self) -> _Segment:
    if self._wfd >= 0:
      os.close(self._wfd)
      self._wfd = -1
    seg = _Segment(self._seg_dir / _segment_name(len(self._segments)))
    self._segments.append(seg)
    self._wfd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    return seg

  def _flush(self, seg: _Segment, buf: bytearray, sync: bool = True) -> None:
    """Writes `buf`, the tail of `seg`'s staged lines, at its place in the file (fsynced unless `sync` is False)."""
    if self._wfd < 0:
      self._wfd = os.open(seg.path, os.O_WRONLY)
    view, pos = memoryview(buf), seg.nbytes - len(buf)
    while view:
      written = os.pwrite(self._wfd, view, pos)
      view, pos = view[written:], pos + written
    del view
    buf.clear()
    if sync and self.fsync:
      os.fsync(self._wfd)

  def _rollback(self) -> None:
    """Brings files and index back to the last commit after a failed append."""
    try:
      if self._wfd >= 0:
        os.close(self._wfd)
        self._wfd = -1
      committed = self._manifest["segments"]
      for seg in self._segments[len(committed):]:
        if seg.fd >= 0:
          os.close(seg.fd)
        seg.path.unlink(missing_ok=True)
      del self._segments[len(committed):]
      for seg, s in zip(self._segments, committed):
        if (seg.records, seg.nbytes) != (s["records"], s["bytes"]):
          seg.records, seg.nbytes = s["records"], s["bytes"]
          del seg.offsets[seg.records + 1:]
          os.truncate(seg.path, seg.nbytes)
    except BaseException:
      self._broken = True
      raise

  def truncate(self, n: int) -> int:
    """Writer only: drops transitions n.. (a resumed run rewinds the buffer to its checkpoint's position, so the
    iterations it redoes do not write their episodes twice). The new manifest commits first; the bytes past it are
    then cut as any uncommitted tail would be. Seeds must lie wholly before `n`. Returns how many were dropped."""
    if self.read_only or self._broken or self._lock_fd < 0:
      raise PermissionError(f"{self.folder}: only an open writer truncates")
    if not 0 <= n <= self._total:
      raise IndexError(f"{self.folder}: cannot truncate to {n} (the buffer holds {self._total} transitions)")
    cut = [tag for tag, (first, count) in self._manifest["seeds"].items() if first + count > n]
    if cut:
      raise ValueError(f"{self.folder}: truncating to {n} would cut seed {cut[0]!r}")
    dropped = self._total - n
    if not dropped:
      return 0
    counts = dict(self._manifest["by_origin"])
    for t in self.iter_from(n):
      counts[t.origin] -= 1
    cap = self.records_per_segment
    keep = -(-n // cap)
    if self._wfd >= 0:
      os.close(self._wfd)
      self._wfd = -1
    for seg in self._segments[keep:]:
      if seg.fd >= 0:
        os.close(seg.fd)
    del self._segments[keep:]
    if self._segments:
      last = self._segments[-1]
      last.records = n - (keep - 1) * cap
      last.nbytes = last.offsets[last.records]
      del last.offsets[last.records + 1:]
    m = {**self._manifest, "total": n, "by_origin": counts,
         "segments": [{"records": s.records, "bytes": s.nbytes} for s in self._segments]}
    self._replace_manifest(m)
    self._manifest, self._total = m, n
    if self.fsync:
      _fsync_dir(self.folder)
    self._cache.clear()
    with warnings.catch_warnings():  # the cut tail is expected here, not debris of a crash
      warnings.simplefilter("ignore", UncommittedDataWarning)
      self._drop_uncommitted()
    return dropped

  # Reading.

  def __len__(self) -> int:
    return self._total

  def _read_fd(self, seg: _Segment) -> int:
    if seg.fd < 0:
      seg.fd = os.open(seg.path, os.O_RDONLY)
    return seg.fd

  def get(self, ids: Iterable[int]) -> list[Transition]:
    """The transitions with these ids (any order, repeats allowed; NumPy integer arrays work)."""
    out, cap = [], self.records_per_segment
    for i in ids:
      i = operator.index(i)
      if not 0 <= i < self._total:
        raise IndexError(f"{self.folder}: id {i} out of range (the buffer holds {self._total} transitions)")
      t = self._cache.get(i)
      if t is None:
        seg, j = self._segments[i // cap], i % cap
        start = seg.offsets[j]
        raw = os.pread(self._read_fd(seg), seg.offsets[j + 1] - start - 1, start)  # without the newline
        t = _decode(raw, f"{seg.path}:{j + 1}", self._tasks)
        if self.cache_size > 0:
          self._cache[i] = t
          if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
      elif self.cache_size > 0:
        self._cache.move_to_end(i)
      out.append(t)
    return out

  def iter_from(self, start: int = 0, stop: int | None = None) -> Iterator[Transition]:
    """Transitions start..stop-1 in id order (stop defaults to the length now), read in large sequential blocks."""
    stop = self._total if stop is None else stop
    if not 0 <= start <= stop <= self._total:
      raise IndexError(f"{self.folder}: range {start}..{stop} out of 0..{self._total}")
    return self._iter(start, stop)

  def _iter(self, start: int, stop: int) -> Iterator[Transition]:
    cap, i = self.records_per_segment, start
    while i < stop:
      seg, j = self._segments[i // cap], i % cap
      hi = min(j + _ITER_BLOCK, stop - (i - j), cap)
      data = os.pread(self._read_fd(seg), seg.offsets[hi] - seg.offsets[j], seg.offsets[j])
      for k, raw in enumerate(data.split(b"\n")[:-1]):
        yield _decode(raw, f"{seg.path}:{j + k + 1}", self._tasks)
      i += hi - j

  def refresh(self) -> int:
    """Readers: re-reads the manifest and indexes what the writer committed since; returns how many new ids."""
    if not self.read_only:
      return 0
    return self._load(self._read_manifest())

  def stats(self) -> BufferStats:
    m = self._manifest
    return BufferStats(self._total, dict(m["by_origin"]), len(m["segments"]), sum(s["bytes"] for s in m["segments"]),
                       {k: range(a, a + c) for k, (a, c) in m["seeds"].items()})

  def verify(self) -> int:
    """Checks and parses every committed line: checksum, fields and outcome, as every read does (errors name
    file:line); returns how many. Open only indexes, it does not read the lines."""
    return sum(1 for _ in self.iter_from(0))

  # Lifetime.

  def close(self) -> None:
    for seg in self._segments:
      if seg.fd >= 0:
        os.close(seg.fd)
        seg.fd = -1
    for name in ("_wfd", "_lock_fd"):
      fd = getattr(self, name)
      if fd >= 0:
        os.close(fd)  # closing the lock descriptor releases the flock
        setattr(self, name, -1)
    self._cache.clear()

  def __enter__(self) -> ReplayBuffer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    mode = "read_only" if self.read_only else "writer"
    return f"ReplayBuffer({str(self.folder)!r}, {mode}, {self._total} transitions)"
