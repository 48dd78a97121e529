"""The run folder lock (`dreamjax.loop.lock`): one writer per folder across processes, taken over from a dead holder.

Holders are real child processes (a few lines of Python that take the lock and sleep), killed with SIGKILL to leave a
stale lock behind. The commands are run through the CLI against a folder another process holds: they must refuse at
once, with the holder's pid in the message, before writing anything there. Two JAX processes joined by
`jax.distributed` check that only process 0 locks and that both refuse together.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dreamjax.cli import main as cli_main
from dreamjax.loop.learner import RLConfig
from dreamjax.loop.lock import LOCK_FILE, RunFolderLocked, _check_holder, lock_run_folder
from dreamjax.loop.run import Run

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()

# A child that takes the lock of argv[2] and holds it until killed ("hold"; "family" also starts a subprocess and
# forks, as env workers and simulators are started, and prints their pids), or tries once and reports ("try").
CHILD = """
import os, subprocess, sys, time
from dreamjax.loop.lock import RunFolderLocked, lock_run_folder
try:
  lock = lock_run_folder(sys.argv[2])
except RunFolderLocked as e:
  print("refused:", e, flush=True)
  sys.exit(3)
print("locked", flush=True)
if sys.argv[1] == "family":
  started = subprocess.Popen(["sleep", "60"], close_fds=False)
  forked = os.fork()
  if forked == 0:
    time.sleep(60)
    os._exit(0)
  print(started.pid, forked, flush=True)
if sys.argv[1] != "try":
  time.sleep(120)
"""

# One of two JAX processes (1 CPU device each): lock a free folder twice (re-entered), release, then a held one.
DIST_CHILD = """
import json, os, sys
import jax
from dreamjax.loop.lock import RunFolderLocked, lock_run_folder
from dreamjax.parallel import DistributedConfig, initialize
initialize(DistributedConfig())
free, held, report = sys.argv[1:4]
a = lock_run_folder(free)
b = lock_run_folder(free)
holder = open(os.path.join(free, ".lock")).read() if jax.process_index() == 0 else None
b.release()
a.release()
try:
  lock_run_folder(held)
  refused = None
except RunFolderLocked as e:
  refused = str(e)
with open(report, "w") as f:
  json.dump({"index": jax.process_index(), "count": jax.process_count(), "holder": holder, "refused": refused}, f)
"""


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_"))}
  return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **extra}


def _child(mode: str, folder: Path) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", CHILD, mode, str(folder)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=_env(), cwd=str(ROOT))


@pytest.fixture
def hold():
  """hold(folder): a live child process holding the folder's lock; killed at the end of the test."""
  procs = []

  def start(folder: Path, mode: str = "hold") -> subprocess.Popen:
    proc = _child(mode, folder)
    procs.append(proc)
    line = proc.stdout.readline()
    assert line == "locked\n", line + proc.stdout.read()
    return proc

  yield start
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
    proc.stdout.close()


def _try_in_child(folder: Path) -> tuple[int, str]:
  proc = _child("try", folder)
  out, _ = proc.communicate(timeout=60)
  return proc.returncode, out


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()  # reaped: no process (not even a zombie) has this pid now
  return proc.pid


def test_a_second_process_is_refused_with_the_folder_and_the_holder(tmp_path, hold):
  folder = tmp_path / "run"
  holder = hold(folder)
  with pytest.raises(RunFolderLocked) as e:
    lock_run_folder(folder)
  message = str(e.value)
  assert f"run folder {folder} is in use by pid {holder.pid} on host {HOST}, started 20" in message
  assert "\n" not in message and "use another out_dir" in message
  code, out = _try_in_child(folder)  # another process alike
  assert code == 3 and f"pid {holder.pid}" in out


def _holding(pids: list[int], path: Path) -> list[int]:
  """Those of `pids` with a descriptor open on `path`."""
  def holds(pid: int) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
      try:
        if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
          return True
      except OSError:  # closed while we looked
        pass
    return False
  return [pid for pid in pids if holds(pid)]


def test_a_killed_holder_leaves_a_lock_that_is_taken_over(tmp_path, hold, capfd):
  """Even while a process it started and one it forked live on (they do not keep its descriptor)."""
  folder = tmp_path / "run"
  holder = hold(folder, "family")
  descendants = [int(pid) for pid in holder.stdout.readline().split()]
  try:
    # The forked child drops its copy in an at-fork hook, which runs when the child is first scheduled: on a loaded
    # machine that can come after its parent printed the pids, so wait for it (a copy kept for good fails here).
    deadline = time.monotonic() + 30
    while _holding(descendants, (folder / LOCK_FILE).resolve()) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _holding(descendants, (folder / LOCK_FILE).resolve()) == []
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert all(Path(f"/proc/{pid}").exists() for pid in descendants)
    with lock_run_folder(folder):
      assert f"taking over the lock left by pid {holder.pid} on host {HOST}" in capfd.readouterr().err
      assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
      assert _try_in_child(folder)[0] == 3
  finally:
    for pid in descendants:
      os.kill(pid, signal.SIGKILL)
  assert (folder / LOCK_FILE).read_text() == ""  # a released lock names nobody
  assert _try_in_child(folder) == (0, "locked\n")


def test_a_leftover_lock_file_of_a_dead_pid_is_taken_over(tmp_path):
  folder = tmp_path / "run"
  folder.mkdir()
  (folder / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": HOST, "started": "2020-01-01 00:00:00"}))
  with lock_run_folder(folder):
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_other_folders_and_subfolders_are_free(tmp_path, hold):
  hold(tmp_path / "a")
  with lock_run_folder(tmp_path / "b"), lock_run_folder(tmp_path / "a" / "stage"):  # reproduce's stages
    pass


def test_one_process_reenters_its_lock_and_frees_it_at_the_last_release(tmp_path):
  folder = tmp_path / "run"
  outer = lock_run_folder(folder)
  with lock_run_folder(folder):  # flock on a second descriptor of the file would refuse this process itself
    pass
  assert _try_in_child(folder)[0] == 3  # still held by the outer lock
  outer.release()
  outer.release()  # releasing twice is harmless
  assert _try_in_child(folder) == (0, "locked\n")


def test_without_flock_the_named_holder_decides():
  """Where flock is refused (some NFS/FUSE mounts), the pid in the file is checked instead."""
  folder = Path("/runs/x")
  _check_holder(folder, {})  # an empty file
  _check_holder(folder, {"pid": _dead_pid(), "host": HOST})
  with pytest.raises(RunFolderLocked, match=f"pid {os.getppid()} on host {HOST}"):
    _check_holder(folder, {"pid": os.getppid(), "host": HOST})  # alive
  with pytest.raises(RunFolderLocked, match="pid 1 on host elsewhere"):
    _check_holder(folder, {"pid": 1, "host": "elsewhere"})  # cannot be checked from here


def _untouched(folder: Path) -> dict[str, str]:
  """Files a refused run must leave as they are: an earlier run's config and metrics."""
  (folder / "config.json").write_text('{"earlier": true}')
  (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
  return {p.name: p.read_text() for p in folder.iterdir()}


OUT = "out_dir={folder}"


@pytest.mark.parametrize("command, config, settings", [
    ("rl", "configs/grpo_real_twx.py:tiny", [OUT, "model.checkpoint="]),  # no warm start on disk here: a tiny model
    ("dreamgym", "configs/dreamgym_twx.py:tiny", [OUT]),
    ("train-policy", "configs/train_policy_twx.py:tiny", [OUT]),
    ("train-exp", "configs/train_exp_twx.py:tiny", [OUT]),
    ("sample", "configs/sample.py:tiny", [OUT]),
    ("collect", "configs/collect_twx.py:tiny", [OUT]),
    ("annotate", "configs/annotate_twx.py:tiny", ["trajectories={folder}/trajectories.jsonl"]),  # writes beside it
    ("reproduce", "configs/reproduce_twx.py:tiny", [OUT]),
])
def test_commands_refuse_a_folder_another_process_holds(tmp_path, hold, capsys, command, config, settings):
  folder = tmp_path / "run"
  holder = hold(folder)
  (folder / "trajectories.jsonl").write_text("")  # an earlier collection (annotate's input)
  before = _untouched(folder)
  sets = [arg for s in settings for arg in ("--set", s.format(folder=folder))]
  assert cli_main([command, "--config", config, *sets]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"dreamjax {command}: run folder {folder} is in use by pid {holder.pid} on host {HOST}"), err
  assert {p.name: p.read_text() for p in folder.iterdir()} == before  # nothing written, truncated or created


def test_the_rl_loop_locks_before_opening_its_checkpoints(tmp_path, hold):
  folder = tmp_path / "run"
  hold(folder)
  with pytest.raises(RunFolderLocked):
    Run(RLConfig(out_dir=str(folder)), None, str(folder))
  assert not (folder / "checkpoints").exists()
  free = tmp_path / "free"
  with Run(RLConfig(out_dir=str(free)), None, str(free)) as run:
    assert run.resume is None and _try_in_child(free)[0] == 3
  assert _try_in_child(free)[0] == 0  # `close` released it


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_jax_processes_lock_once_and_refuse_together(tmp_path, hold):
  holder = hold(tmp_path / "held")
  port, procs = _free_port(), []
  for i in range(2):
    env = _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen([sys.executable, "-c", DIST_CHILD, str(tmp_path / "free"), str(tmp_path / "held"),
                                   str(tmp_path / f"report{i}.json")], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env, cwd=str(ROOT)))
  try:
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], outs
  first, second = (json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(2))
  assert (first["index"], second["index"], first["count"]) == (0, 1, 2)
  assert json.loads(first["holder"])["pid"] == procs[0].pid  # process 0 alone holds the lock
  assert (tmp_path / "free" / LOCK_FILE).read_text() == ""  # and released it
  assert f"pid {holder.pid} on host {HOST}" in first["refused"]
  assert second["refused"] == first["refused"] + " (refused on process 0)"  # no process waits on a refused one
