"""Preemption (dreamjax.loop.preemption) and resuming policy SFT, DPO and M_exp SFT (dreamjax.loop.run.RunFolder).

The unit tests check the SIGTERM flag, JAX's sync point with several processes, a step loop's checkpoint point and the
CLI's exit status. The resume test runs each command's tiny config (tests/preemption_child.py) three ways: whole, in
this process; in a child process (the `dreamjax` CLI, train steps slowed) sent SIGTERM once its checkpoint 2 is
committed, which must checkpoint the step it is at and exit with 75; in a second child resuming from there, SIGKILLed
once its next checkpoint is committed and a metrics row past it is written (policy SFT and M_exp SFT); and resumed
again here. The result must
equal the whole run's: the last checkpoint's arrays and the final HF parameters bit for bit, the metrics rows and
evaluations (timings aside), and the run keeps the run id (the W&B run) of its first start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dreamjax.cli import main as cli_main
from dreamjax.commands import dpo, train_exp, train_policy
from dreamjax.config import load_config
from dreamjax.loop.checkpoint import RunCheckpointer
from dreamjax.loop.preemption import PREEMPTED_EXIT, Preempted, Preemption
from dreamjax.loop.run import RunFolder
from dreamjax.loop.track import read_metrics
from dreamjax.models import load_hf_checkpoint
from tests import preemption_child as child
from tests.jax_settings import jax_config, persistent_cache

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "commit_success.txt"  # orbax's marker of a finished step
CONFIG = ROOT / "tests" / "preemption_child.py"


def test_sigterm_only_sets_a_flag_and_the_previous_handler_comes_back():
  before = signal.getsignal(signal.SIGTERM)
  with Preemption() as preemption:
    assert not preemption.should_stop(1)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread before the next bytecode
    assert preemption.should_stop(2) and preemption.should_stop(3)
  assert signal.getsignal(signal.SIGTERM) == before


def test_several_processes_stop_at_jax_s_sync_point(monkeypatch):
  """With the distributed runtime up, JAX's preemption service owns SIGTERM and names the step every process stops
  at: no Python handler is set, and `should_stop` is the sync point."""
  from jax.experimental import multihost_utils

  asked = []
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda step: asked.append(step) or step == 3)
  before = signal.getsignal(signal.SIGTERM)
  with Preemption() as preemption:
    assert signal.getsignal(signal.SIGTERM) == before
    assert [preemption.should_stop(s) for s in (1, 2, 3)] == [False, False, True] and asked == [1, 2, 3]


def test_a_step_loop_checkpoints_and_stops_on_sigterm_but_finishes_its_last_step(tmp_path):
  saved = []
  with RunFolder(None, tmp_path / "run", keep=2) as run:

    def save(step: int) -> None:
      saved.append(step)
      run.ckpt.save(step, {"x": np.arange(3)}, {"step": step})

    run.after_step(1, 5, 2, save, "a loop")
    run.after_step(2, 5, 2, save, "a loop")  # periodic
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted, match="a loop preempted after step 3: its checkpoint is committed in") as e:
      run.after_step(3, 5, 2, save, "a loop")
    assert e.value.step == 3 and run.ckpt.steps() == [2, 3]  # committed before the raise
    run.after_step(5, 5, 2, save, "a loop")  # the last step: the loop saves it itself, after its final evaluation
  assert saved == [2, 3]
  with RunFolder(None, tmp_path / "run", keep=2) as run:
    assert run.resume == 3 and run.meta == {"step": 3}


def test_a_resumed_run_counts_the_seconds_of_the_processes_before_it(tmp_path):
  """A run's "seconds" (the tables' training cost) once counted only the last process of a resumed run. Each
  checkpoint now records the run's elapsed seconds, and a resumed run adds its own to them; the gap between the
  processes is not counted."""
  from dreamjax.loop.track import TrackConfig

  start = time.perf_counter()
  with RunFolder(None, tmp_path / "run", keep=2) as run, run.tracker(TrackConfig(progress=False)) as tracker:
    time.sleep(0.3)
    run.save(1, {"x": np.arange(3)}, {"step": 1}, tracker)
  first = time.perf_counter() - start
  time.sleep(0.5)  # between the processes
  start = time.perf_counter()
  with RunFolder(None, tmp_path / "run", keep=2) as run:
    before, now = run.meta["seconds"], run.elapsed()
    assert run.resume == 1 and 0.3 <= before <= first
    assert before <= now <= before + time.perf_counter() - start  # the gap is not counted


def test_the_cli_exits_75_when_a_run_is_preempted(monkeypatch, capsys):
  import dreamjax.commands.rl as rl

  def preempted(cfg):
    raise Preempted("GRPO on textworld_express in runs/x", 3, "runs/x/checkpoints")

  monkeypatch.setattr(rl, "run", preempted)
  assert cli_main(["rl", "--config", str(ROOT / "configs" / "grpo_real_twx.py:tiny")]) == PREEMPTED_EXIT == 75
  err = capsys.readouterr().err
  assert err.startswith("dreamjax rl: GRPO on textworld_express in runs/x preempted after step 3") and "rerun" in err


# --- resume after SIGTERM and SIGKILL -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
  """A persistent compilation cache shared with the child processes: every run compiles the same programs."""
  settings = persistent_cache(str(tmp_path_factory.mktemp("xla_cache")))
  with jax_config(**settings):
    yield {n.upper(): str(v) for n, v in settings.items()}


@pytest.fixture(scope="module")
def twx():
  pytest.importorskip("textworld_express")
  from dreamjax.envs.base import SerialBatchEnv
  from dreamjax.envs.textworld_express import TextWorldExpressEnv

  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=4) for _ in range(child.EVAL.num_envs)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def data(twx, tmp_path_factory) -> Path:
  """Coin episodes of the expert and of a random policy on the same tasks (DPO pairs them)."""
  from dreamjax.data.collect import CollectConfig, collect

  out = tmp_path_factory.mktemp("data")
  collect(CollectConfig(env_kwargs=("step_limit=4",), games=("coin",), game_params=child.COIN,
                        policies=("expert:8", "random:8"), num_workers=0, rows_per_worker=child.EVAL.num_envs,
                        out_dir=str(out), build_tfds=False, progress=False), batch=twx)
  return out / "trajectories.jsonl"


COMMANDS = {"policy_sft": "train-policy", "dpo": "dpo", "exp_sft": "train-exp"}


class Runs:
  """Each variant's settings and its whole run (DPO starts from the whole policy SFT run's checkpoint)."""

  def __init__(self, data: Path, twx, root: Path):
    self.data, self.twx, self.root, self.whole = data, twx, root, {}

  def settings(self, variant: str) -> list[str]:
    if variant == "exp_sft":
      return [f"trajectories={self.data}"]
    sets = [f"data={self.data}"]
    return sets + [f"checkpoint={self.run('policy_sft')[1]['checkpoint']}"] if variant == "dpo" else sets

  def run(self, variant: str, out: Path | None = None) -> tuple[Path, dict]:
    """(folder, summary) of the variant's run in `out` (None: its whole run, made once)."""
    if out is None and variant in self.whole:
      return self.whole[variant]
    folder = out or self.root / f"whole_{variant}"
    cfg = load_config(f"{CONFIG}:{variant}", self.settings(variant) + [f"out_dir={folder}"])
    summary = train_exp.run(cfg) if variant == "exp_sft" else (train_policy if variant == "policy_sft" else
                                                               dpo).run(cfg, env=self.twx)
    if out is None:
      self.whole[variant] = (folder, summary)
    return folder, summary


@pytest.fixture(scope="module")
def runs(data, twx, xla_cache, tmp_path_factory) -> Runs:
  return Runs(data, twx, tmp_path_factory.mktemp("runs"))


def _start(variant: str, sets: list[str], cache_env: dict[str, str]) -> subprocess.Popen:
  args = [COMMANDS[variant], "--config", f"{CONFIG}:{variant}", *[a for s in sets for a in ("--set", s)]]
  return subprocess.Popen([sys.executable, str(CONFIG), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, **cache_env, "PYTHONPATH": str(ROOT)})


def _signal_when(proc: subprocess.Popen, ready, sig: int) -> tuple[int, str]:
  """Sends `sig` to the child once `ready()`; (its exit status, its stderr)."""
  deadline = time.monotonic() + 240
  try:
    while proc.poll() is None and time.monotonic() < deadline and not ready():
      time.sleep(0.02)
    assert proc.poll() is None, f"the child ended before it was signalled:\n{proc.stderr.read()[-3000:]}"
    assert time.monotonic() < deadline, "the child did not reach its checkpoint in time"
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return rc, proc.stderr.read()


def _untimed(row):
  if isinstance(row, dict):
    return {k: _untimed(v) for k, v in row.items() if not (k.endswith("_s") or k == "seconds")}
  return [_untimed(v) for v in row] if isinstance(row, list) else row


def _assert_equal_trees(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


# DPO shares the step loop's checkpoint code with policy SFT: its SIGKILL leg would add a child's start-up and test
# nothing new.
@pytest.mark.parametrize("variant, kill", [("policy_sft", True), ("exp_sft", True), ("dpo", False)])
def test_sigterm_then_sigkill_resume_to_the_uninterrupted_result(runs, xla_cache, tmp_path, variant, kill):
  whole, summary_whole = runs.run(variant)
  out = tmp_path / "run"
  sets = runs.settings(variant) + [f"out_dir={out}"]
  checkpoints, metrics = out / "checkpoints", out / "metrics.jsonl"

  # SIGTERM: the child checkpoints the step it is at, waits for the commit and exits with 75.
  rc, err = _signal_when(_start(variant, sets, xla_cache), lambda: (checkpoints / "2" / COMMIT).exists(),
                         signal.SIGTERM)
  assert rc == PREEMPTED_EXIT, err[-3000:]
  stopped = int(re.search(r"preempted after step (\d+)", err)[1])
  assert 2 < stopped <= 6, err[-3000:]
  with RunCheckpointer(checkpoints) as ck:
    assert ck.latest_step() == stopped
    run_id = ck.meta()["tracker_run_id"]
  assert max(r["step"] for r in read_metrics(metrics)) == stopped and not (out / "checkpoint").exists()

  resumed = (stopped,)
  if kill:  # SIGKILL once the next periodic checkpoint is committed and a row past it written: resumed from there
    after = stopped + 2 - stopped % 2
    rc, err = _signal_when(_start(variant, sets, xla_cache), lambda: (checkpoints / str(after) / COMMIT).exists() and
                           max(r["step"] for r in read_metrics(metrics)) > after, signal.SIGKILL)
    assert rc == -signal.SIGKILL, err[-3000:]
    assert not (out / "checkpoint").exists()
    resumed = (after, after + 2)  # killed after checkpoint `after`: before, while or after the next was written

  _, summary = runs.run(variant, out)
  assert summary["resumed_from"] in resumed
  ends, run_ids = [], []
  for folder in (whole, out):
    with RunCheckpointer(folder / "checkpoints") as ck:
      assert ck.steps()[-1] == child.STEPS
      arrays, meta = ck.restore(child.STEPS)
      ends.append(arrays)
      run_ids.append(meta["tracker_run_id"])
  _assert_equal_trees(ends[0], ends[1])
  assert run_ids[1] == run_id != run_ids[0]  # the first start's run (and W&B run) throughout
  finals = [load_hf_checkpoint(folder / "checkpoint")[1] for folder in (whole, out)]
  _assert_equal_trees(finals[0], finals[1])
  rows = read_metrics(metrics)
  assert [_untimed(r) for r in rows] == [_untimed(r) for r in read_metrics(whole / "metrics.jsonl")]
  assert sorted({r["step"] for r in rows}) == list(range(1, child.STEPS + 1))
  evals = "held_out_fidelity" if variant == "exp_sft" else "eval_history"
  assert _untimed(summary[evals]) == _untimed(summary_whole[evals])
  if variant != "exp_sft":  # evaluated every 4 steps and at the end, each once
    assert [e["step"] for e in summary["eval_history"]] == [4, 8, 10]
