"""Offline data: record validation, JSONL interruption, collection on real TextWorld-Express, resume, TFDS."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from dreamjax.data.collect import CollectConfig, collect, parse_policies, parse_policy, plan_episodes
from dreamjax.data.jsonl import JsonlWriter, PartialRecordWarning, read_jsonl
from dreamjax.data.records import (StepRecord, TrajectoryRecord, read_trajectories, read_trajectory_files,
                                   transitions)
from dreamjax.envs.base import Task


def _record(i: int, n_steps: int = 2) -> TrajectoryRecord:
  task = Task.make("textworld_express", f"coin/train/{i}", "Find the coin.", game="coin", seed=i, split="train")
  steps = tuple(StepRecord(f"Location: room {j}\nYou see: é", f"move {j}", f"Location: room {j + 1}", 0.1 * j,
                           j == n_steps - 1, False, j == 0, tuple(f"act {k}" for k in range(j + 1)),
                           ("expert", "random", "fallback")[j % 3]) for j in range(n_steps))
  return TrajectoryRecord(f"random:coin/train/{i}", "textworld_express", task, "Find the coin ✓.", "random",
                          2**40 + i, steps, i % 2 == 0, n_steps, None if i % 2 else 1 / 3)


def _write(path, values):
  path.write_text("".join(json.dumps(v) + "\n" for v in values))


# Records and JSONL.

def _set(d, path, value):
  keys = path.split(".")
  for k in keys[:-1]:
    d = d[int(k)] if isinstance(d, list) else d[k]
  if value is KeyError:
    del d[keys[-1]]
  else:
    d[keys[-1]] = value


@pytest.mark.parametrize("path, value, message", [
    ("steps.1.reward", "x", "field 'steps[1].reward': expected a finite number"),
    ("steps.0.done", 1, "field 'steps[0].done': expected true or false"),
    ("steps.1.admissible", "act", "field 'steps[1].admissible': expected a list"),
    ("steps.0.source", "oracle", "field 'steps[0].source': expected one of"),
    ("steps.0.state", KeyError, "field 'steps[0].state': missing"),
    ("episode_id", KeyError, "field 'episode_id': missing"),
    ("num_steps", 3, "field 'num_steps': 3 but the record has 2 steps"),
    ("seed", 1.5, "field 'seed': expected an integer"),
    ("score", True, "field 'score': expected a finite number"),
    ("format", "v0", "field 'format': expected"),
    ("extra", 1, "field 'extra': unknown field"),
    ("task.task_id", KeyError, "field 'task.task_id': missing"),
    ("task.env", "alfworld", "field 'task.env': 'alfworld' differs"),
])
def test_record_errors_name_file_line_and_field(tmp_path, path, value, message):
  good = _record(0).to_json()
  bad = json.loads(json.dumps(good))
  _set(bad, path, value)
  f = tmp_path / "t.jsonl"
  _write(f, [_record(1).to_json(), _record(2).to_json(), bad])  # episodes are recorded once each
  with pytest.raises(ValueError) as e:
    read_trajectories(f)
  assert str(e.value).startswith(f"{f}:3: ") and message in str(e.value)


def test_records_round_trip_through_jsonl_and_bad_json_names_the_line(tmp_path):
  records = [_record(i, n) for i, n in enumerate([0, 1, 3])]
  f = tmp_path / "t.jsonl"
  with JsonlWriter(f) as w:
    for r in records:
      w.write(r.to_json())
  assert read_trajectories(f) == records
  f.write_text(f.read_text().replace("\n", "\n{oops\n", 1))
  with pytest.raises(ValueError, match=rf"^{f}:2: not valid JSON"):
    read_trajectories(f)


def test_offline_budgets_take_whole_episodes_in_file_order(tmp_path):
  """An offline transition budget keeps the longest prefix of whole episodes within it (an episode that would cross
  it is left out with every one after it, even a shorter later one), across files."""
  files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
  for f, lengths in zip(files, ([3, 2], [1, 4])):
    with JsonlWriter(f) as w:
      for i, n in enumerate(lengths):
        w.write(_record(10 * len(f.name) + i + (0 if f.name == "a.jsonl" else 5), n).to_json())

  def steps(**kw):
    return [r.num_steps for r in read_trajectory_files(files, **kw)]

  assert steps() == [3, 2, 1, 4] and steps(max_transitions=6) == [3, 2, 1] and steps(max_transitions=5) == [3, 2]
  assert steps(max_transitions=4) == [3] and steps(max_transitions=2) == [] and steps(max_transitions=10) == [3, 2, 1, 4]
  assert steps(max_episodes=3, max_transitions=100) == [3, 2, 1]


def test_a_repeated_episode_id_is_refused_naming_the_file_and_both_lines(tmp_path):
  """Every reader refuses an episode read twice (data written twice over, e.g. by several processes appending to one
  folder), in one file or across the files of one read."""
  from dreamjax.data.tfds_dataset import build_dataset

  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  at = {path: re.escape(str(path)) for path in (a, b)}
  _write(a, [_record(0).to_json(), _record(1).to_json(), _record(0).to_json()])
  twice = rf"^{at[a]}:3: field 'episode_id': episode 'random:coin/train/0' was already read at line 1; "
  with pytest.raises(ValueError, match=twice):
    read_trajectories(a)
  with pytest.raises(ValueError, match=twice):
    read_trajectory_files([a])
  with pytest.raises(ValueError, match=twice):
    build_dataset([a], tmp_path / "tfds")
  resumed = tmp_path / "collect"
  resumed.mkdir()
  (resumed / "trajectories.jsonl").write_bytes(a.read_bytes())
  with pytest.raises(ValueError, match=rf"^{re.escape(str(resumed))}/trajectories.jsonl:3: .* at line 1; "):
    collect(_config(resumed, build_tfds=False), episodes=[], batch=object())  # a resumed collection reads its file
  _write(a, [_record(0).to_json(), _record(1).to_json()])
  _write(b, [_record(2).to_json(), _record(1).to_json()])
  across = rf"^{at[b]}:2: field 'episode_id': episode 'random:coin/train/1' was already read at {at[a]}:2; "
  with pytest.raises(ValueError, match=across):
    read_trajectory_files([a, b])
  with pytest.raises(ValueError, match=across):
    build_dataset([a, b], tmp_path / "tfds")
  with pytest.raises(ValueError, match=rf"^{at[a]}:1: .* already read at {at[a]}:1; "):  # one file passed twice
    read_trajectory_files([a, a])


def test_partial_last_line_is_ignored_and_cut_before_appending(tmp_path):
  f = tmp_path / "t.jsonl"
  with JsonlWriter(f) as w:
    w.write({"a": 1})
    w.write({"a": 2})
  with open(f, "a") as h:
    h.write('{"a": 3, "b": "cut off he')
  with pytest.warns(PartialRecordWarning, match=r"t.jsonl:3"):
    assert [v for _, v in read_jsonl(f)] == [{"a": 1}, {"a": 2}]
  with pytest.warns(PartialRecordWarning, match="dropped a partial last record"):
    w = JsonlWriter(f)
  w.write({"a": 4})
  w.close()
  assert [(n, v) for n, v in read_jsonl(f)] == [(1, {"a": 1}), (2, {"a": 2}), (3, {"a": 4})]


def test_transitions_view():
  records = [_record(0, 3), _record(1, 0), _record(2, 2)]
  rows = list(transitions(records))
  assert len(rows) == 5
  third = rows[2]
  assert (third.episode_id, third.step, third.state, third.action) == (records[0].episode_id, 2,
                                                                       records[0].steps[2].state, "move 2")
  assert third.history == ((records[0].steps[0].state, "move 0"), (records[0].steps[1].state, "move 1"))
  assert third.task == records[0].task and third.instruction == records[0].instruction
  assert (third.next_state, third.reward, third.done) == (records[0].steps[2].next_state, 0.2, True)
  assert [len(r.history) for r in transitions(records, max_history=1)] == [0, 1, 1, 0, 1]


def test_policies_and_plan_errors():
  assert parse_policies(["expert:3", "eps0.25:2"]) == [("expert", 3), ("eps0.25", 2)]
  assert parse_policies(["stale0.3:4"]) == [("stale0.3", 4)] and parse_policy("stale0.3") == ("stale", 0.3)
  for bad, message in [("greedy:2", "unknown policy"), ("eps1.5:2", "unknown policy"), ("expert", "policy:episodes"),
                       ("stale:2", "unknown policy"), ("explorer-stale0.3:2", "unknown policy")]:
    with pytest.raises(ValueError, match=message):
      parse_policies([bad])


def test_tfds_round_trips_edge_cases(tmp_path):
  from dreamjax.data.tfds_dataset import build_dataset, load_trajectories

  records = [_record(i, n) for i, n in enumerate([0, 1, 3, 2, 5])]
  f = tmp_path / "t.jsonl"
  _write(f, [r.to_json() for r in records])
  build_dataset([f], tmp_path / "tfds", eval_fraction=0.2)
  train, held = load_trajectories(tmp_path / "tfds", "train"), load_trajectories(tmp_path / "tfds", "eval")
  assert len(train) + len(held) == 5 and len(held) >= 1
  assert sorted([*train, *held], key=lambda r: r.episode_id) == records
  with pytest.raises(ValueError, match="no split 'test'"):
    load_trajectories(tmp_path / "tfds", "test")


# Collection on real TextWorld-Express.

@pytest.fixture(scope="module")
def twx_pool():
  pytest.importorskip("textworld_express")
  from dreamjax.envs.pool import EnvPool

  pool = EnvPool("textworld_express", {"step_limit": 50}, num_workers=2)
  yield pool
  pool.close()


def _config(out_dir, **kw) -> CollectConfig:
  base = CollectConfig(env_kwargs=("step_limit=50",), policies=("expert:6", "random:3", "eps0.5:3"),
                       num_workers=2, rows_per_worker=3, out_dir=str(out_dir), progress=False)
  return dataclasses.replace(base, **kw)


@pytest.fixture(scope="module")
def collected(twx_pool, tmp_path_factory):
  cfg = _config(tmp_path_factory.mktemp("collect"))
  summary = collect(cfg, batch=twx_pool)
  return cfg, summary, read_trajectories(f"{cfg.out_dir}/trajectories.jsonl")


def test_collect_expert_succeeds_random_fails(collected):
  cfg, summary, records = collected
  assert len(records) == 12 and len({r.episode_id for r in records}) == 12
  by = {p: [r for r in records if r.policy == p] for p in ("expert", "random", "eps0.5")}
  assert sum(r.success for r in by["expert"]) >= 5
  assert sum(r.success for r in by["random"]) <= 1
  assert {r.task.param["game"] for r in by["expert"]} == {"cookingworld", "twc", "coin"}
  assert all(s.source == "expert" for r in by["expert"] if r.success for s in r.steps)
  assert all(s.source == "random" for r in by["random"] for s in r.steps)
  assert all(s.action in s.admissible for r in by["random"] for s in r.steps)
  assert {s.source for r in by["eps0.5"] for s in r.steps} >= {"random", "expert"}
  for r in records:
    assert r.num_steps == len(r.steps) > 0 and r.steps[-1].done and r.success == r.steps[-1].success
    assert all(a.next_state == b.state for a, b in zip(r.steps, r.steps[1:]))
    assert r.score is not None and r.instruction
  assert summary["episodes_done"] == 12 and summary["policies"]["expert"]["episodes"] == 6
  saved = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
  assert saved["policies"] == summary["policies"]


def test_tfds_dataset_of_a_collection_round_trips_every_field(collected):
  from dreamjax.data.tfds_dataset import load_trajectories, load_transitions

  cfg, _, records = collected
  data_dir = Path(cfg.out_dir) / "tfds"
  loaded = [*load_trajectories(data_dir, "train"), *load_trajectories(data_dir, "eval")]
  assert sorted(loaded, key=lambda r: r.episode_id) == sorted(records, key=lambda r: r.episode_id)
  rows = load_transitions(data_dir, "train") + load_transitions(data_dir, "eval")
  assert len(rows) == sum(r.num_steps for r in records)


def test_collect_in_process(tmp_path):
  pytest.importorskip("textworld_express")
  cfg = _config(tmp_path, num_workers=0, rows_per_worker=2, games=("twc",), policies=("expert:2",), build_tfds=False)
  summary = collect(cfg)
  records = read_trajectories(tmp_path / "trajectories.jsonl")
  # Records come in the order episodes end; twc gold paths are unseeded in TWX (see its env module), so either may.
  assert sorted(r.episode_id for r in records) == ["expert:twc/train/0", "expert:twc/train/1"]
  assert all(r.success for r in records) and summary["policies"]["expert"]["success_rate"] == 1.0


def test_stale_actions_are_ones_the_episode_was_offered_before_and_the_env_refuses(tmp_path):
  """stale<p>: the only collector whose data holds refused actions, each one an earlier state of the episode listed."""
  pytest.importorskip("textworld_express")
  cfg = _config(tmp_path, env_kwargs=("step_limit=8",), num_workers=0, rows_per_worker=4, games=("twc",),
                policies=("stale0.5:4",), build_tfds=False)
  collect(cfg)
  records = read_trajectories(tmp_path / "trajectories.jsonl")
  assert len(records) == 4 and {s.source for r in records for s in r.steps} == {"random", "stale"}
  for r in records:
    for j, s in enumerate(r.steps):
      offered = {a for earlier in r.steps[:j] for a in earlier.admissible}
      if s.source == "stale":
        assert s.invalid and s.action not in s.admissible and s.action in offered and not s.success
      else:
        assert not s.invalid and s.action in s.admissible
  again = tmp_path / "again"
  collect(dataclasses.replace(cfg, out_dir=str(again)))  # an episode's choices depend on its seed alone
  def actions(rs):
    return sorted((r.episode_id, [s.action for s in r.steps]) for r in rs)

  assert actions(read_trajectories(again / "trajectories.jsonl")) == actions(records)


class _Interrupted(RuntimeError):
  pass


class _InterruptAfter:
  """A BatchEnv that stops the run (as a kill would) after a number of steps."""

  def __init__(self, inner, steps: int):
    self.inner, self.steps = inner, steps

  def reset_batch(self, tasks):
    return self.inner.reset_batch(tasks)

  def step_batch(self, actions):
    self.steps -= 1
    if self.steps < 0:
      raise _Interrupted()
    return self.inner.step_batch(actions)

  def expert_actions(self, rows=None):
    return self.inner.expert_actions(rows)


def test_resume_after_interruption(collected, twx_pool, tmp_path):
  cfg, _, full = collected
  resumed_cfg = dataclasses.replace(cfg, out_dir=str(tmp_path), build_tfds=False)
  with pytest.raises(_Interrupted):
    collect(resumed_cfg, batch=_InterruptAfter(twx_pool, 70))
  jsonl = tmp_path / "trajectories.jsonl"
  partial = read_trajectories(jsonl)
  assert 0 < len(partial) < 12
  with open(jsonl, "a") as f:  # killed in the middle of writing the next record
    f.write(json.dumps(full[-1].to_json())[:100])
  with pytest.warns(PartialRecordWarning):
    summary = collect(resumed_cfg, batch=twx_pool)
  assert summary["episodes_this_run"] == 12 - len(partial)
  records = read_trajectories(jsonl)
  assert sorted(r.episode_id for r in records) == sorted(r.episode_id for r in full)
  # Random episodes depend only on their seed and the (deterministic) game: identical to the uninterrupted run.
  first = {r.episode_id: r for r in full if r.policy == "random"}
  assert [r for r in records if r.policy == "random"] == [first[r.episode_id] for r in records if r.policy == "random"]
  assert plan_episodes(resumed_cfg)[0].episode_id == "expert:cookingworld/train/0"
  with pytest.raises(ValueError, match="field 'seed' was 0"):
    collect(dataclasses.replace(resumed_cfg, seed=1), batch=twx_pool)
