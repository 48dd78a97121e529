"""The launch scripts in tpu/ and their guide: every script parses (bash -n, and shellcheck where it is installed), is
strict, answers --help, refuses missing settings by name, and under DRY_RUN=1 prints exactly the gcloud / ssh /
srun commands it would run; the variables the GPU launchers set are the ones dreamjax.parallel.distributed reads.
Every command in the guide's code blocks runs (dry) as written, and every config it or the scripts name loads."""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
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
                                       "gpu_setup.sh", "gpu_ssh_run.sh", "gpu_slurm.sbatch"}


@pytest.mark.parametrize("path", [*SCRIPTS, TPU / "lib.sh"], ids=lambda p: p.name)
def test_scripts_parse_and_are_strict(path):
  assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
  if path.name != "lib.sh":  # lib.sh is sourced by the others
    assert "\nset -euo pipefail\n" in path.read_text()
    assert os.access(path, os.X_OK), f"{path.name} is not executable"


def test_shellcheck():
  if shutil.which("shellcheck") is None:
    pytest.skip("shellcheck is not installed")
  result = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS), str(TPU / "lib.sh")], capture_output=True,
                          text=True, cwd=ROOT)
  assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_help_lists_the_settings(path):
  result = _run(path.name, "--help", dry=False)
  assert result.returncode == 0 and result.stdout.startswith(("Creates", "Deletes", "Puts", "Runs"))
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
  assert _commands(_run("tpu_create.sh", env=queued).stdout) == [
      ["gcloud", "compute", "tpus", "queued-resources", "create", "t1", "--node-id=t1", "--zone=us-central2-b",
       "--accelerator-type=v5p-32", "--runtime-version=v2-alpha-tpuv5", "--project=p", "--spot"]]
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


def test_tpu_run_and_ssh_reach_every_worker():
  env = dict(TPU_NAME="t1", ZONE="z", PROJECT="p")
  ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t1", "--zone=z", "--worker=all", "--project=p"]
  (cmd,) = _commands(_run("tpu_run.sh", "dreamgym", "configs/scale/dreamgym_llama3b_tpu.py", "--set",
                          "rl.iterations=2", "--set", "out_dir=runs/a b", env=env).stdout)
  assert cmd[:-1] == ssh
  assert cmd[-1] == ("--command=set -o pipefail && cd ~/dreamjax && mkdir -p logs && .venv/bin/dreamjax dreamgym "
                     "--config configs/scale/dreamgym_llama3b_tpu.py --set rl.iterations=2 --set out_dir=runs/a\\ b "
                     "2>&1 | tee logs/dreamgym-$(hostname).log")
  (cmd,) = _commands(_run("tpu_run.sh", "rl", "configs/grpo_real_twx.py:tiny", env=dict(env, DETACH="1")).stdout)
  assert cmd[-1].endswith("nohup .venv/bin/dreamjax rl --config configs/grpo_real_twx.py:tiny > "
                          "logs/rl-$(hostname).log 2>&1 < /dev/null &")
  (cmd,) = _commands(_run("tpu_ssh.sh", "ls runs", env=dict(env, WORKER="0")).stdout)
  assert cmd == ssh[:7] + ["--worker=0", "--project=p", "--command=mkdir -p ~/dreamjax && cd ~/dreamjax && ls runs"]


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
    if words[0] == "dreamjax":
      assert words[1] in COMMANDS, line
      load_config(ROOT / words[words.index("--config") + 1])
      ran.add("dreamjax")
    elif words[0].startswith("tpu/"):
      result = _run(words[0].removeprefix("tpu/"), *words[1:], env={**env, **prefix})
      assert result.returncode == 0, f"{line}\n{result.stderr}"
      assert _commands(result.stdout), line
      if words[0] in ("tpu/tpu_run.sh", "tpu/gpu_ssh_run.sh", "tpu/gpu_slurm.sbatch"):
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
                 "tpu/gpu_setup.sh", "tpu/gpu_slurm.sbatch", "tpu/gpu_ssh_run.sh", "memory_plan"}
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
