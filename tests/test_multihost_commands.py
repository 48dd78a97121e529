"""The commands that are not training loops (`sample`, `reproduce` with its `collect` and `eval` stages, `annotate`)
over two JAX processes: two local processes with 4 fake CPU devices each, joined by `jax.distributed`, run
tests/commands_child.py while a third runs the same alone on 8 devices. Checked: both processes finish and return the
same results; process 1 writes nothing under the run folders; the files equal the single-process run's (the collected
episodes once each, byte for byte; the annotations; the evaluation; reproduce's table); and each process's return
value equals the single-process one but for timings. Reproduce's SFT stage is a stand-in (training over several
processes is tests/test_distributed.py's subject), so of reproduce this covers joining before its lock, its guarded
writes and the barrier after each stage, with real collect and eval stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dreamjax.data.records import read_trajectories
from tests.test_distributed import _run_children

pytest.importorskip("textworld_express")

TIMEOUT_S = 900  # the three children together (~100 s alone on 2 cores); on timeout or failure all are killed


def _run(root: Path) -> tuple[list[dict], dict]:
  """(the two cluster processes' reports, the single-process report); prints the output of any child that failed."""
  reports = _run_children(root, [[str(root / "dist")]] * 2, [str(root / "single")], script="commands_child.py",
                          timeout_s=TIMEOUT_S)
  return reports[:2], reports[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("commands")
  cluster, single = _run(root)
  return cluster, single, root / "dist", root / "single"


def _files(folder: Path) -> list[str]:
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _same(value, dist: Path, single: Path):
  """`value` with the run root's path made the single run's and without timings (keys ending in "_s" or naming
  seconds), nested dicts and lists included."""
  if isinstance(value, dict):
    return {k: _same(v, dist, single) for k, v in value.items() if not (k.endswith("_s") or "seconds" in k)}
  if isinstance(value, list):
    return [_same(v, dist, single) for v in value]
  return value.replace(str(dist), str(single)) if isinstance(value, str) else value


def test_both_processes_finish_and_agree(runs):
  (a, b), single, dist, alone = runs
  assert [(r["process_index"], r["process_count"], r["devices"]) for r in (a, b)] == [(0, 2, 8), (1, 2, 8)]
  for command in ("sample", "reproduce"):  # every process runs the same program and returns the same result
    assert _same(a[command], dist, alone) == _same(b[command], dist, alone) == _same(single[command], dist, alone)
  assert len(a["sample"]["samples"]) == 8
  assert a["reproduce"]["rows"][0]["method"] == "SFT" and a["reproduce"]["offline_transitions"] > 0
  # Annotate runs on process 0 alone; the others return an empty summary.
  assert _same(a["annotate"], dist, alone) == _same(single["annotate"], dist, alone) and b["annotate"] == {}
  assert a["annotate"]["annotated"] == 4


def test_only_process_0_writes_the_run_folders(runs):
  (a, b), _, dist, single = runs
  # Not even a lock file: every command (and reproduce before its stages) joins the processes before it locks.
  assert b["writes"] == []
  written = {path for event, path in a["writes"] if event == "open"}
  assert {"sample/sample.json", "sample/tiny-checkpoint/config.json", "reproduce/config.json",
          "reproduce/results.json", "reproduce/data/trajectories.jsonl", "reproduce/data/summary.json",
          "reproduce/sft/eval/eval.json", "reproduce/sft/eval/episodes.jsonl",
          "annotate/annotations.rules.jsonl"} <= written
  assert _files(dist) == _files(single)


def test_outputs_equal_the_single_process_run(runs):
  _, _, dist, single = runs
  # Collect: each episode once, in the same order, byte for byte (random episodes depend only on their seeds).
  data = "reproduce/data/trajectories.jsonl"
  assert len({r.episode_id for r in read_trajectories(dist / data)}) == 4
  for path in (data, "reproduce/data/collect_config.json", "annotate/annotations.rules.jsonl", "reproduce/results.md"):
    assert (dist / path).read_bytes() == (single / path).read_bytes(), path
  for path in ("reproduce/sft/eval/eval.json", "reproduce/results.json", "reproduce/data/summary.json",
               "sample/sample.json"):
    assert _same(json.loads((dist / path).read_text()), dist, single) == \
        _same(json.loads((single / path).read_text()), dist, single), path
  # The evaluation's episodes: one per scored task, in its order, each as its outcome says, the same actions.
  episodes = {run: read_trajectories(run / "reproduce/sft/eval/episodes.jsonl") for run in (dist, single)}
  outcomes = json.loads((dist / "reproduce/sft/eval/eval.json").read_text())["outcomes"]
  assert [(r.task.task_id, r.success, r.num_steps) for r in episodes[dist]] == [tuple(o) for o in outcomes]
  assert [[s.action for s in r.steps] for r in episodes[dist]] == [[s.action for s in r.steps] for r in episodes[single]]
