"""Append-only JSONL files that survive interruption.

One record is one line, written with a single write and flushed (optionally fsynced), and it counts only once its
newline is on disk. A run killed mid-write therefore leaves at most one partial last line: readers skip it with a
warning, and a writer reopening the file cuts it off before appending, so a resumed run loses only that record.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class PartialRecordWarning(UserWarning):
  """The last line of a JSONL file was cut off mid-write; it was ignored."""


def dumps(record: Mapping[str, Any]) -> str:
  # sort_keys: identical records give identical bytes; allow_nan=False: NaN/Infinity are not JSON.
  return json.dumps(record, ensure_ascii=False, sort_keys=True, allow_nan=False, separators=(",", ":"))


class JsonlWriter:
  """Appends JSON objects to `path`, one per line, flushed per record."""

  def __init__(self, path: str | Path, fsync: bool = False):
    self.path = Path(path)
    self.fsync = fsync
    self.path.parent.mkdir(parents=True, exist_ok=True)
    drop_partial_tail(self.path)
    self._file = open(self.path, "ab")

  def write(self, record: Mapping[str, Any]) -> None:
    self._file.write((dumps(record) + "\n").encode("utf-8"))
    self._file.flush()
    if self.fsync:
      os.fsync(self._file.fileno())

  def close(self) -> None:
    self._file.close()

  def __enter__(self) -> JsonlWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def drop_partial_tail(path: str | Path) -> int:
  """Cuts an unterminated last line off `path` (with a warning); returns the number of bytes removed."""
  path = Path(path)
  if not path.is_file():
    return 0
  with open(path, "rb+") as f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return 0
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return 0
    # Walk back to the last complete line; records are small, so read the tail in blocks.
    end, block = size, 1 << 16
    keep = 0
    while end > 0:
      start = max(0, end - block)
      f.seek(start)
      chunk = f.read(end - start)
      at = chunk.rfind(b"\n")
      if at >= 0:
        keep = start + at + 1
        break
      end = start
    f.seek(0)
    line = f.read(keep).count(b"\n") + 1
    f.truncate(keep)
  warnings.warn(f"{path}:{line}: dropped a partial last record ({size - keep} bytes, cut off mid-write)",
                PartialRecordWarning, stacklevel=2)
  return size - keep


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
  """Yields (line number, parsed JSON) per record; blank lines are skipped and an unterminated last line is
  ignored with a PartialRecordWarning. Raises ValueError naming the file and line for anything else malformed."""
  path = Path(path)
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      if not raw.endswith(b"\n"):
        warnings.warn(f"{path}:{number}: ignored a partial last record ({len(raw)} bytes, cut off mid-write)",
                      PartialRecordWarning, stacklevel=2)
        return
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{number}: not UTF-8 ({e.reason} at byte {e.start})") from None
      if not text.strip():
        continue
      try:
        value = json.loads(text)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
      yield number, value
