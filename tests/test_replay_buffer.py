"""Replay buffer: round trip, ids, segments, seeding once per tag, readers beside a writer, errors, per-line checksums
and outcome checks, and recovery from SIGKILL at random moments of a real writer process."""

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from dreamjax.data.jsonl import JsonlWriter, dumps
from dreamjax.data.records import StepRecord, TrajectoryRecord, Transition, transitions
from dreamjax.envs.base import Task
from dreamjax.replay import buffer as buffer_module
from dreamjax.replay.buffer import FORMAT, MANIFEST, ReplayBuffer, UncommittedDataWarning, transition_json
from tests import replay_writer_child as child

ROOT = Path(__file__).resolve().parents[1]


def _t(i: int, origin: str = "synthetic") -> Transition:
  """Episodes of 4 steps; every other one succeeds (reward 1 on its last step), the others fail at their last."""
  task = Task.make("alfworld", f"pick/{i % 3}", "Put a mug in the sink.", seed=i, split="train", extra={"a": [1, 2]})
  win = i % 8 == 3
  return Transition(f"ep{i // 4}", i % 4, task, "Put a mug in the sink. é", f"You see a mug {i}.\n\tTab",
                    f"take mug {i}", f"You hold mug {i} ✓", float(win), i % 4 == 3, win, i % 5 == 0 and not win,
                    origin, 2 if origin != "offline" else -1)


def _record(i: int, n: int) -> TrajectoryRecord:
  task = Task.make("textworld_express", f"coin/train/{i}", "Find the coin.", game="coin", seed=i)
  steps = tuple(StepRecord(f"room {j}", f"move {j}", f"room {j + 1}", float(j == n - 1), j == n - 1, j == n - 1,
                           False, ("move", "look"), "expert") for j in range(n))
  return TrajectoryRecord(f"expert:coin/{i}", "textworld_express", task, "Find the coin.", "expert", i, steps, True, n,
                          1.0)


def _segment_lines(folder: Path) -> list[bytes]:
  return [line for p in sorted((folder / "segments").iterdir()) for line in p.read_bytes().splitlines()]


def _line(body: str | bytes) -> bytes:
  """The committed form of a record's JSON: its CRC-32 spliced in as a leading "_crc" field (no newline)."""
  body = body.encode() if isinstance(body, str) else body
  return b'{"_crc":"%08x",' % zlib.crc32(body) + body[1:]


def _lines(items: list[Transition]) -> list[bytes]:
  return [_line(dumps(transition_json(t))) for t in items]


@pytest.mark.parametrize("small_io", [False, True])
def test_round_trip_ids_segments_and_stats(tmp_path, monkeypatch, small_io):
  if small_io:  # exercise chunked scanning, partial flushes and block reads with the same data
    for name, value in [("_SCAN_BYTES", 7), ("_FLUSH_BYTES", 100), ("_ITER_BLOCK", 3)]:
      monkeypatch.setattr(buffer_module, name, value)
  items = [_t(i, ("offline", "synthetic", "real_online")[i % 3]) for i in range(11)]
  with ReplayBuffer(tmp_path / "b", records_per_segment=4) as buf:
    assert len(buf) == 0 and list(buf.iter_from(0)) == [] and buf.append([]) == range(0, 0)
    assert buf.append(items[:3]) == range(0, 3)
    assert buf.append(iter(items[3:10])) == range(3, 10)  # any iterable, rolling over two segment boundaries
    assert buf.append(items[10:]) == range(10, 11)
    assert buf.get([5, 0, 10, 5]) == [items[5], items[0], items[10], items[5]]
    assert buf.get(np.arange(11, dtype=np.int32)) == items
    assert list(buf.iter_from(3)) == items[3:] and list(buf.iter_from(2, 9)) == items[2:9]
  # The committed form is exactly the contract's JSON (keys sorted, one line each) led by its checksum, in id order
  # across segments; each line is still one JSON object.
  assert sorted(p.name for p in (tmp_path / "b/segments").iterdir()) == ["000000.jsonl", "000001.jsonl", "000002.jsonl"]
  assert _segment_lines(tmp_path / "b") == _lines(items)
  assert [json.loads(line) for line in _segment_lines(tmp_path / "b")] == [
      {"_crc": f"{zlib.crc32(dumps(transition_json(t)).encode()):08x}", **transition_json(t)} for t in items]
  with ReplayBuffer(tmp_path / "b", read_only=True) as again:
    assert len(again) == 11 and list(again.iter_from(0)) == items and again.verify() == 11
    s = again.stats()
    assert (s.total, s.segments, s.seeds) == (11, 3, {})
    assert s.by_origin == {"offline": 4, "synthetic": 4, "real_online": 3}
    assert s.bytes == sum(p.stat().st_size for p in (tmp_path / "b/segments").iterdir())
  with ReplayBuffer(tmp_path / "b") as buf:  # reopened for writing: ids go on from the committed end
    assert buf.append(items[:2]) == range(11, 13) and buf.get([12]) == [items[1]]


@pytest.mark.parametrize("n", [9, 8, 5, 0])
def test_truncate_rewinds_to_a_position_and_appends_go_on_from_it(tmp_path, n):
  items = [_t(i, ("offline", "synthetic")[i % 2]) for i in range(11)]
  with ReplayBuffer(tmp_path / "b", records_per_segment=4) as buf:
    buf.append(items)
    assert buf.truncate(n) == 11 - n and len(buf) == n and buf.truncate(n) == 0
    assert buf.append(items[n:][::-1]) == range(n, 11)  # the redone iterations write other episodes
  expected = items[:n] + items[n:][::-1]
  assert _segment_lines(tmp_path / "b") == _lines(expected)
  with ReplayBuffer(tmp_path / "b", read_only=True) as again:
    assert list(again.iter_from(0)) == expected and again.verify() == 11
    assert again.stats().by_origin == {"offline": 6, "synthetic": 5, "real_online": 0}
  with ReplayBuffer(tmp_path / "b") as buf:
    buf.seed([_record(0, 2)], tag="offline")
    with pytest.raises(ValueError, match="would cut seed 'offline'"):
      buf.truncate(12)
    with pytest.raises(IndexError, match="cannot truncate to 20"):
      buf.truncate(20)
  with ReplayBuffer(tmp_path / "b", read_only=True) as reader, pytest.raises(PermissionError):
    reader.truncate(1)


def test_cache_returns_the_same_transitions_and_stays_bounded(tmp_path):
  items = [_t(i) for i in range(20)]
  with ReplayBuffer(tmp_path / "b", records_per_segment=8, cache_size=5) as buf:
    buf.append(items)
    ids = [3, 17, 3, 9, 0, 12, 19, 3, 4, 5, 6, 7]
    assert buf.get(ids) == [items[i] for i in ids] and buf.get(ids) == [items[i] for i in ids]
    assert len(buf._cache) == 5 and list(buf._cache) == [3, 4, 5, 6, 7]


def test_seed_once_per_tag_from_a_file_or_records(tmp_path):
  records = [_record(i, n) for i, n in enumerate([3, 1, 4])]
  path = tmp_path / "trajectories.jsonl"
  with JsonlWriter(path) as w:
    for r in records:
      w.write(r.to_json())
  expected = list(transitions(records, 0))
  with ReplayBuffer(tmp_path / "b", records_per_segment=3) as buf:
    assert buf.seed(path, "twx") == range(0, 8)
    assert buf.seed(path, "twx") == range(0, 8) and len(buf) == 8
    online = [_t(i) for i in range(2)]
    buf.append(online)
    assert buf.seed(records[:1], "mine", origin="real_online", policy_version=4) == range(10, 13)
    assert buf.seed([_t(5, "offline")], "one transition") == range(13, 14)
    assert buf.seed([], "empty") == range(14, 14)
  path.unlink()  # a committed tag is a no-op that reads nothing, also after a resume
  with ReplayBuffer(tmp_path / "b") as buf:
    assert buf.seed(path, "twx") == range(0, 8) and buf.seed([_record(9, 2)], "mine") == range(10, 13)
    assert buf.seed([], "empty") == range(14, 14) and len(buf) == 14
    assert list(buf.iter_from(0)) == expected + online + [
        dataclasses.replace(t, origin="real_online", policy_version=4) for t in expected[:3]] + [_t(5, "offline")]
    s = buf.stats()
    assert s.seeds == {"twx": range(0, 8), "mine": range(10, 13), "one transition": range(13, 14),
                       "empty": range(14, 14)}
    assert s.by_origin == {"offline": 9, "synthetic": 2, "real_online": 3}
    with pytest.raises(ValueError, match="seed tag must be a non-empty string"):
      buf.seed(records, "")


def test_reader_sees_the_committed_prefix_and_refresh_catches_up(tmp_path):
  items = [_t(i) for i in range(10)]
  with ReplayBuffer(tmp_path / "b", records_per_segment=3) as w:
    w.append(items[:2])
    r = ReplayBuffer(tmp_path / "b", read_only=True)
    assert len(r) == 2 and r.refresh() == 0
    w.append(items[2:7])
    assert len(r) == 2 and r.get([1]) == [items[1]]
    with pytest.raises(IndexError, match="id 2 out of range"):
      r.get([2])
    assert r.refresh() == 5 and len(r) == 7 and list(r.iter_from(0)) == items[:7]
    w.append(items[7:])
    w.seed([_t(0, "offline")], "late")
    assert r.refresh() == 4 and r.get([9, 2]) == [items[9], items[2]] and r.stats().seeds == {"late": range(10, 11)}
    with pytest.raises(PermissionError, match="opened read_only"):
      r.append(items)
    r.close()


def test_failed_append_rolls_back_and_names_the_item(tmp_path):
  items = [_t(i) for i in range(6)]
  with ReplayBuffer(tmp_path / "b", records_per_segment=2) as buf:
    buf.append(items[:3])
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "b/segments").iterdir()}
    nan = dataclasses.replace(items[4], reward=float("nan"))
    with pytest.raises(ValueError, match=r"append item 3 \(episode 'ep1' step 0\): field 'reward': expected a finite"):
      buf.append(items[3:] + [nan])  # the bad item comes after two segment rolls were written
    with pytest.raises(TypeError, match="append item 1: expected a Transition, got dict"):
      buf.append([items[0], transition_json(items[1])])
    with pytest.raises(ValueError, match=r"append item 0 \(episode 'ep0' step 0\): carries a history, which the buffer "
                                         "does not store"):
      buf.append([dataclasses.replace(items[0], history=(("room", "look"),))])
    np_param = dataclasses.replace(items[0], task=Task.make("alfworld", "x", seed=np.int64(3)))
    with pytest.raises(ValueError, match="append item 0 .*not JSON-serialisable"):
      buf.append([np_param])

    def boom():
      yield items[3]
      raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
      buf.append(boom())
    assert len(buf) == 3 and {p.name: p.stat().st_size for p in (tmp_path / "b/segments").iterdir()} == sizes
    assert buf.append(items[3:]) == range(3, 6) and list(buf.iter_from(0)) == items


def _corrupt(folder: Path, segment: str, line: int, text: str | bytes, checksum: bool = False) -> Path:
  """Rewrites one committed line in place keeping its length, as disk corruption or a stray edit would; with
  `checksum`, `text` is a record's JSON and gets a valid checksum (what a writer without the outcome check would
  leave), so the checks behind the checksum are reached."""
  p = folder / "segments" / segment
  lines = p.read_bytes().split(b"\n")
  old = lines[line - 1]
  text = text.encode() if isinstance(text, str) else text
  if checksum:
    assert len(text) <= len(old) - 18, "the line's checksum field takes 18 more bytes"
    text = _line(text.ljust(len(old) - 18, b" "))
  lines[line - 1] = text.ljust(len(old), b" ")[:len(old)]
  assert len(lines[line - 1]) == len(old)
  p.write_bytes(b"\n".join(lines))
  return p


def test_errors_name_file_and_line(tmp_path):
  folder = tmp_path / "b"
  with ReplayBuffer(folder, records_per_segment=3) as buf:
    buf.append([_t(i) for i in range(6)])
  p = _corrupt(folder, "000001.jsonl", 2, '{"oops')
  with ReplayBuffer(folder, read_only=True) as r:
    assert r.get([3, 5]) == [_t(3), _t(5)]  # open only indexes; the bad line fails when read
    with pytest.raises(ValueError, match=rf"^{p}:2: no checksum"):
      r.get([4])
    with pytest.raises(ValueError, match=rf"^{p}:2: no checksum"):
      r.verify()
  good = dumps(transition_json(_t(4)))
  for bad, message in [('{"oops', "not valid JSON"),
                       (good.replace('"reward":0.0', '"reward":"0"'), "field 'reward': expected a finite number"),
                       (good.replace('"done":false', '"done":0'), "field 'done': expected true or false"),
                       (good.replace('"origin":"synthetic"', '"origin":"dream"'), "field 'origin': expected one of offline, synthetic"),
                       (good.replace('"action":', '"actio":'), "field 'action': missing")]:
    _corrupt(folder, "000001.jsonl", 2, bad, checksum=True)
    with ReplayBuffer(folder, read_only=True) as r, pytest.raises(ValueError, match=rf"^{p}:2: .*{message}"):
      r.get([4])


@pytest.mark.parametrize("i", [0, 4, 5])  # the first line, one inside, and the last committed line
def test_a_silently_edited_line_fails_its_checksum(tmp_path, i):
  folder = tmp_path / "b"
  items = [_t(k) for k in range(6)]
  with ReplayBuffer(folder, records_per_segment=3) as buf:
    buf.append(items)
  segment, line = f"{i // 3:06d}.jsonl", i % 3 + 1
  raw = (folder / "segments" / segment).read_bytes().split(b"\n")[line - 1]
  # The edit of the issue: a failed step's reward turned into a win, same length, fields still well-typed.
  assert b'"reward":0.0,' in raw and b'"success":false' in raw
  p = _corrupt(folder, segment, line, raw.replace(b'"reward":0.0,', b'"reward":1.0,'))
  with ReplayBuffer(folder, read_only=True) as r:
    others = [k for k in range(6) if k != i]
    assert r.get(others) == [items[k] for k in others]
    for read in (lambda: r.get([i]), lambda: list(r.iter_from(0)), r.verify):
      with pytest.raises(ValueError, match=rf"^{p}:{line}: checksum mismatch: the line was changed"):
        read()
  # The writer reads through the same checks, and so does a line whose stored checksum was edited instead.
  _corrupt(folder, segment, line, raw[:9] + bytes(reversed(raw[9:17])) + raw[17:])
  with ReplayBuffer(folder) as w, pytest.raises(ValueError, match=rf"^{p}:{line}: checksum mismatch"):
    w.verify()
  _corrupt(folder, segment, line, raw)
  with ReplayBuffer(folder, read_only=True) as r:
    assert r.verify() == 6 and list(r.iter_from(0)) == items


def test_outcomes_must_follow_the_env_contract(tmp_path):
  folder = tmp_path / "b"
  items = [_t(k) for k in range(8)]  # 3: a success, 7: a failure at the last step, 0: invalid
  with ReplayBuffer(folder, records_per_segment=3) as buf:
    buf.append(items[:6])
    sizes = {p.name: p.stat().st_size for p in (folder / "segments").iterdir()}
    for k, change, problem in [(4, {"reward": 1.0}, "reward is 1 but success is false"),
                               (4, {"success": True}, "success is true but done is false"),
                               (7, {"success": True}, "success is true but the reward is 0"),
                               (3, {"invalid": True}, "invalid is true but success is true"),
                               (7, {"reward": 0.5}, "reward 0.5 is not 0 or 1")]:
      bad = dataclasses.replace(items[k], **change)
      with pytest.raises(ValueError, match=rf"append item 1 \(episode 'ep\d' step \d\): inconsistent outcome: "
                                           rf"{problem} \(rewards are binary outcomes"):
        buf.append([items[6], bad])
      assert len(buf) == 6 and {p.name: p.stat().st_size for p in (folder / "segments").iterdir()} == sizes
  # A line with a valid checksum but an outcome no env gives (a writer without the check): refused on every read.
  good = dumps(transition_json(items[4]))
  for bad, problem in [(good.replace('"reward":0.0', '"reward":1.0'), "reward is 1 but success is false"),
                       (good.replace('"success":false', '"success":true'), "success is true but done is false"),
                       (good.replace('"reward":0.0', '"reward":0.5'), "reward 0.5 is not 0 or 1")]:
    p = _corrupt(folder, "000001.jsonl", 2, bad, checksum=True)
    with ReplayBuffer(folder, read_only=True) as r:
      for read in (lambda: r.get([4]), r.verify):
        with pytest.raises(ValueError, match=rf"^{p}:2: inconsistent outcome: {problem}"):
          read()


def test_refuses_other_formats_foreign_folders_second_writers_and_lost_data(tmp_path):
  folder = tmp_path / "b"
  with ReplayBuffer(folder, records_per_segment=3) as buf:
    buf.append([_t(i) for i in range(5)])
    with pytest.raises(RuntimeError, match=rf"already open for writing by process {os.getpid()}"):
      ReplayBuffer(folder)
    with pytest.raises(ValueError, match="records_per_segment is 3; cannot open it with 4"):
      ReplayBuffer(folder, read_only=True, records_per_segment=4)
    with pytest.raises(IndexError, match="id -1 out of range"):
      buf.get([-1])
  manifest = json.loads((folder / MANIFEST).read_text())
  (folder / MANIFEST).write_text(json.dumps({**manifest, "format": "dreamjax.replay.v9"}))
  for read_only in (True, False):
    with pytest.raises(ValueError, match=rf"{folder / MANIFEST}: written in format 'dreamjax.replay.v9', this "
                                         rf"dreamjax reads '{FORMAT}'; refusing"):
      ReplayBuffer(folder, read_only=read_only)
  # Older formats are refused, saying why, rather than read unverified or converted silently.
  for old, why in [("v1", "whose lines carry no checksums"), ("v2", "whose lines name a transition's origin 'source'")]:
    (folder / MANIFEST).write_text(json.dumps({**manifest, "format": f"dreamjax.replay.{old}"}))
    for read_only in (True, False):
      with pytest.raises(ValueError, match=rf"{folder / MANIFEST}: written in format 'dreamjax.replay.{old}', {why}; "
                                           rf"this dreamjax reads '{FORMAT}' and refuses it"):
        ReplayBuffer(folder, read_only=read_only)
  segments = [{"records": 3, "bytes": "1"}] + manifest["segments"][1:]
  for bad in [{"total": 6}, {"segments": segments}, {"seeds": {"a": [4, 2]}}, {"by_origin": {"offline": 5}}]:
    (folder / MANIFEST).write_text(json.dumps({**manifest, **bad}))
    with pytest.raises(ValueError, match=rf"{folder / MANIFEST}: malformed manifest"):
      ReplayBuffer(folder, read_only=True)
  (folder / MANIFEST).write_text("{")
  with pytest.raises(ValueError, match=rf"{folder / MANIFEST}: not valid JSON"):
    ReplayBuffer(folder)
  (folder / MANIFEST).write_text(json.dumps(manifest))
  seg = folder / "segments/000001.jsonl"
  seg.write_bytes(seg.read_bytes()[:-10])
  with pytest.raises(ValueError, match=rf"{seg}: holds \d+ bytes but the manifest commits \d+: committed data was lost"):
    ReplayBuffer(folder)
  (tmp_path / "other").mkdir()
  (tmp_path / "other/notes.txt").write_text("x")
  with pytest.raises(FileExistsError, match="holds 'notes.txt' but no MANIFEST.json: not a replay buffer"):
    ReplayBuffer(tmp_path / "other")
  with pytest.raises(FileNotFoundError, match="MANIFEST.json: missing: not a replay buffer"):
    ReplayBuffer(tmp_path / "none", read_only=True)


def test_uncommitted_tail_and_segments_are_ignored_by_readers_and_removed_by_the_writer(tmp_path):
  folder = tmp_path / "b"
  items = [_t(i) for i in range(5)]
  with ReplayBuffer(folder, records_per_segment=3) as buf:
    buf.append(items[:4])
  seg1, seg2 = folder / "segments/000001.jsonl", folder / "segments/000002.jsonl"
  committed = seg1.read_bytes()
  # What a writer killed mid-append leaves: complete and torn lines past the committed end, and a new segment file.
  seg1.write_bytes(committed + (dumps(transition_json(items[4])) + "\n").encode() + b'{"episode_id": "to')
  seg2.write_bytes(b'{"torn')
  with ReplayBuffer(folder, read_only=True) as r:
    assert len(r) == 4 and list(r.iter_from(0)) == items[:4] and seg1.read_bytes() != committed
  with pytest.warns(UncommittedDataWarning, match=r"000001.jsonl: \d+ bytes past line 1.*000002.jsonl: uncommitted"):
    buf = ReplayBuffer(folder)
  assert seg1.read_bytes() == committed and not seg2.exists() and len(buf) == 4
  assert buf.append(items[4:]) == range(4, 5) and list(buf.iter_from(0)) == items
  buf.close()


def _child(folder: Path, max_batches: int) -> subprocess.Popen:
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  return subprocess.Popen([sys.executable, str(ROOT / "tests/replay_writer_child.py"), str(folder), "5",
                           str(max_batches)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _torn(folder: Path) -> bool:
  """Whether the folder holds uncommitted bytes or segment files (the kill landed inside an append)."""
  m = json.loads((folder / MANIFEST).read_text())
  files = sorted((folder / "segments").iterdir())
  return len(files) > len(m["segments"]) or any(p.stat().st_size > s["bytes"] for p, s in zip(files, m["segments"]))


def test_sigkill_at_random_moments_loses_no_committed_batch(tmp_path, monkeypatch):
  folder, rng = tmp_path / "b", random.Random(0)
  acknowledged, torn, kills = 0, 0, 8
  reader = None
  for trial in range(kills):
    proc = _child(folder, max_batches=100_000)
    printed: list[int] = []
    pump = threading.Thread(target=lambda p=proc, out=printed: out.extend(int(x) for x in p.stdout), daemon=True)
    pump.start()
    try:
      deadline = time.monotonic() + 20
      while len(printed) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
      assert proc.poll() is None, proc.stderr.read()
      # A reader in this process follows the writer: every refresh shows whole batches, exactly as sent.
      if reader is None:
        reader = ReplayBuffer(folder, read_only=True)
      seen = len(reader)
      stop_at = time.monotonic() + rng.uniform(0.0, 0.25)
      while time.monotonic() < stop_at:
        reader.refresh()
        assert len(reader) in child.BOUNDARIES and reader.get(range(seen, len(reader))) == [
            child.expected(i) for i in range(seen, len(reader))]
        seen = len(reader)
      time.sleep(rng.uniform(0.0, 0.004))
    finally:
      proc.send_signal(signal.SIGKILL)  # also when a check above failed: never leave the writer running
      proc.wait()
      pump.join()
    acknowledged = max([acknowledged] + printed)
    torn += _torn(folder)
    with ReplayBuffer(folder, read_only=True) as r:
      n = len(r)
      assert n >= acknowledged, f"trial {trial}: committed {acknowledged} but only {n} recovered"
      assert n in child.BOUNDARIES, f"trial {trial}: {n} ends inside a batch"
      assert list(r.iter_from(0)) == [child.expected(i) for i in range(n)]
    reader.refresh()
    assert len(reader) == n
  reader.close()
  # The writer returns after a recovery that dropped whatever the last kill left, and appends the next batch.
  with pytest.warns(UncommittedDataWarning) if _torn(folder) else contextlib.nullcontext():
    buf = ReplayBuffer(folder, records_per_segment=5)
  with buf:
    b = child.BOUNDARIES.index(len(buf))
    assert buf.append(child.batch(b)) == range(child.BOUNDARIES[b], child.BOUNDARIES[b + 1])
    assert buf.verify() == len(buf) and buf.get([len(buf) - 1]) == [child.expected(len(buf) - 1)]
    print(f"{kills} kills, {torn} inside an append; {len(buf)} transitions in {buf.stats().segments} segments")
  # Kills land inside appends most of the time (the fsyncs dominate an append); the tail handling is exercised.
  assert torn >= 1
