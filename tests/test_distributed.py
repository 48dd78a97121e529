"""Multi-process runs: `dreamjax.parallel.distributed` settings, and training commands over two JAX processes.

The two-process runs start two local processes (tests/distributed_child.py), 4 fake CPU devices each, joined by
`jax.distributed` (gloo collectives) into one 8-device mesh (data=2 x fsdp=4, so batch rows and weights are split across
the processes). They run, one after the other in the same processes: a few M_exp SFT steps (`train-exp`), three policy
SFT steps (`train-policy`), two GRPO iterations on real TextWorld-Express from a behaviour-cloned warm start (`rl`), and
two DreamGym GRPO iterations inside an experience model with the curriculum, M_task and replay write-back (`dreamgym`).
Before them a third child runs the same four configs alone on 8 fake devices, after training the M_exp both DreamGym
runs use (120 steps, which take 2.5x as long across the processes as alone). It runs first rather than beside the
cluster: beside a third busy process on 2 cores, one process compiled slowly enough to miss Gloo's 30 s meeting (the
known limit in dreamjax/parallel/distributed.py's docstring; experiments/RESULTS.md, thirty-second stop). Every child
keeps a persistent compilation cache, which only saves compile time (the dreamgym policy's programs are the rl run's).
Checked: both processes finish and agree (summaries, checkpoint metadata, checkpoint arrays); process 1 writes nothing
in the run folders (the replay buffer included: it only reads it) but its own orbax array-metadata files; and the
distributed runs equal the single-process ones: rollouts, rewards, M_exp's answers, the replay buffer, the task pool and
evaluations exactly, update metrics and final parameters to float32 rounding (not bit for bit: the cross-process
all-reduces sum in another order than the in-process ones).

A lighter pair of children checks the host-side helpers across processes without a model: placing and gathering
sharded rows, `check_same` catching data that differs, and a checkpoint of a sharded array and a process-local key.

The settings tests build `plan`s from explicit environments, so nothing is initialised in this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from dreamjax.config import apply_overrides
from dreamjax.loop.learner import RLConfig
from dreamjax.loop.track import read_metrics
from dreamjax.parallel import DistributedConfig, barrier, initialize, is_primary, make_mesh, to_devices, to_host
from dreamjax.parallel.distributed import Plan, plan
from dreamjax.parallel.sharding import TRAIN_RULES, named_sharding

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # the whole two-process run; on timeout or failure both children are killed
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "1"}


# ---------------------------------------------------------------------------------------------------------------------
# Settings: where each field comes from, when `auto` initialises, and the errors.

def test_single_process_environments_stay_single_process():
  assert plan(DistributedConfig(), {}, tpu_vm=False) is None
  assert plan(DistributedConfig(num_processes=1), {}, tpu_vm=False) is None
  assert plan(DistributedConfig(), {"JAX_NUM_PROCESSES": "1"}, tpu_vm=False) is None
  assert plan(DistributedConfig(), {**SLURM, "SLURM_NTASKS": "1"}, tpu_vm=False) is None
  assert plan(DistributedConfig(), {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "1"}, tpu_vm=False) is None
  assert plan(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "host-a"}, tpu_vm=True) is None
  # A SLURM allocation without a step (a bare sbatch script) is not a cluster JAX can bootstrap from.
  assert plan(DistributedConfig(), {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, tpu_vm=False) is None
  # `off` ignores everything.
  assert plan(DistributedConfig(enabled="off", coordinator_address="h:1", num_processes=2, process_id=0), SLURM,
              tpu_vm=True) is None


def test_explicit_fields_win_over_the_environment_field_by_field():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3",
         "JAX_LOCAL_DEVICE_IDS": "0,1"}
  assert plan(DistributedConfig(), env, tpu_vm=False) == Plan("10.0.0.1:1234", 4, 3, (0, 1), "env")
  assert plan(DistributedConfig(process_id=2, local_device_ids=(5,)), env, tpu_vm=False) == \
      Plan("10.0.0.1:1234", 4, 2, (5,), "config+env")
  cfg = DistributedConfig(coordinator_address="h:9", num_processes=2, process_id=1)
  assert plan(cfg, {}, tpu_vm=False) == Plan("h:9", 2, 1, None, "config")
  assert plan(dataclasses.replace(cfg, num_processes=1, process_id=0), {}, tpu_vm=False) is None  # auto: one process
  assert plan(dataclasses.replace(cfg, num_processes=1, process_id=0, enabled="on"), {}, tpu_vm=False) == \
      Plan("h:9", 1, 0, None, "config")


def test_clusters_jax_bootstraps_are_left_to_it():
  assert plan(DistributedConfig(), SLURM, tpu_vm=False) == Plan(None, None, None, None, "slurm")
  # An explicit local_device_ids overrides JAX's one-process-per-device default under SLURM.
  assert plan(DistributedConfig(local_device_ids=(0, 1, 2, 3)), SLURM, tpu_vm=False) == \
      Plan(None, None, None, (0, 1, 2, 3), "config+slurm")
  ompi = {"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.2:4000", "OMPI_COMM_WORLD_SIZE": "2"}
  assert plan(DistributedConfig(), ompi, tpu_vm=False) == Plan(None, None, None, None, "ompi")
  # A Cloud TPU VM: the host count comes from the metadata server unless GKE lists the hosts.
  assert plan(DistributedConfig(), {}, tpu_vm=True) == Plan(None, None, None, None, "tpu")
  assert plan(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "a,b"}, tpu_vm=True) == Plan(None, None, None, None, "tpu")
  assert plan(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "2"}, tpu_vm=True) == \
      Plan(None, None, None, None, "tpu")
  # `on` asks JAX even when `auto` would not.
  assert plan(DistributedConfig(enabled="on"), {**SLURM, "SLURM_NTASKS": "1"}, tpu_vm=False) == \
      Plan(None, None, None, None, "slurm")


@pytest.mark.parametrize("cfg, env, match", [
    (DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2), {}, r"process_id .* is 2, not below"),
    (DistributedConfig(), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"},
     r"process_id \(or JAX_PROCESS_ID\) is 5"),
    (DistributedConfig(num_processes=2, process_id=0), {}, r"coordinator_address \(or JAX_COORDINATOR_ADDRESS\) is not"),
    (DistributedConfig(coordinator_address="h:1", num_processes=2), {}, r"process_id \(or JAX_PROCESS_ID\) is not"),
    (DistributedConfig(coordinator_address="h:1"), {}, r"coordinator_address .* is set but .*num_processes"),
    (DistributedConfig(), {"JAX_PROCESS_ID": "1"}, r"process_id .* is set but .*num_processes"),
    (DistributedConfig(), {"JAX_NUM_PROCESSES": "two"}, r"JAX_NUM_PROCESSES='two' is not an integer"),
    (DistributedConfig(), {"JAX_NUM_PROCESSES": "0"}, r"JAX_NUM_PROCESSES='0' must be >= 1"),
    (DistributedConfig(), {"JAX_LOCAL_DEVICE_IDS": "0,x"}, r"JAX_LOCAL_DEVICE_IDS='0,x' is not a comma-separated"),
    (DistributedConfig(), {**SLURM, "SLURM_NTASKS": "many"}, r"SLURM_NTASKS='many' is not an integer"),
    (DistributedConfig(enabled="on"), {}, r"enabled is 'on' but nothing describes the processes"),
    (DistributedConfig(enabled="on", num_processes=1, process_id=0), {}, r"coordinator_address .* is needed"),
])
def test_inconsistent_settings_name_the_field(cfg, env, match):
  with pytest.raises(ValueError, match=match):
    plan(cfg, env, tpu_vm=False)


@pytest.mark.parametrize("kw, match", [
    (dict(enabled="yes"), "enabled must be one of"), (dict(num_processes=-1), "num_processes must be >= 0"),
    (dict(process_id=-2), "process_id must be >= 0"), (dict(local_device_ids=(0, -1)), "local_device_ids must be >= 0"),
    (dict(initialization_timeout=0), "initialization_timeout must be >= 1"),
])
def test_config_validation(kw, match):
  with pytest.raises(ValueError, match=f"DistributedConfig.{match}"):
    DistributedConfig(**kw)


def test_rl_config_carries_the_section_and_the_cli_can_set_it():
  cfg = apply_overrides(RLConfig(), ["distributed.local_device_ids=0,1,2,3", "distributed.enabled=off"])
  assert cfg.distributed == DistributedConfig(local_device_ids=(0, 1, 2, 3), enabled="off")
  with pytest.raises(ValueError, match="enabled must be one of"):
    apply_overrides(cfg, ["distributed.enabled=maybe"])


def test_initialize_is_a_no_op_alone_and_too_late_is_a_clear_error(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "OMPI_MCA_orte_hnp_uri",
              *SLURM):
    monkeypatch.delenv(var, raising=False)
  jax.devices()  # the backend is up, as in any test process
  initialize(DistributedConfig())
  assert not jax.distributed.is_initialized() and jax.process_count() == 1 and is_primary()
  barrier("alone")  # a no-op with one process
  # jax.distributed.initialize checks for a running backend before it connects anywhere.
  with pytest.raises(RuntimeError, match=r"dreamjax.parallel.initialize .*must be called before any JAX calls"):
    initialize(DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0))
  assert not jax.distributed.is_initialized()


def test_host_transfers_with_one_process_are_plain_transfers():
  mesh = make_mesh()
  rows = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
  sharding = named_sharding(("batch", None), rows.shape, mesh, TRAIN_RULES)
  placed = to_devices({"rows": rows}, {"rows": sharding})["rows"]
  assert placed.sharding == sharding and len(placed.addressable_shards) == 8
  back = to_host({"rows": placed, "key": jax.random.key(3), "n": 4})
  np.testing.assert_array_equal(back["rows"], rows)
  np.testing.assert_array_equal(back["key"], jax.random.key_data(jax.random.key(3)))
  assert back["n"] == 4 and isinstance(back["rows"], np.ndarray)


# ---------------------------------------------------------------------------------------------------------------------
# Two processes, one run.

@pytest.fixture(scope="module")
def twx():
  pytest.importorskip("textworld_express")
  from dreamjax.envs.base import SerialBatchEnv
  from dreamjax.envs.textworld_express import TextWorldExpressEnv
  from tests.distributed_child import ROWS

  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=10) for _ in range(ROWS)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def warm_start(twx, tmp_path_factory) -> Path:
  from dreamjax.data.collect import CollectConfig, collect
  from dreamjax.data.records import read_trajectories
  from tests.distributed_child import FMT, ROLLOUT, ROWS, TWO_ROOMS
  from tests.warm_start import behaviour_clone

  root = tmp_path_factory.mktemp("warm")
  cfg = CollectConfig(games=("coin",), split="train", game_params=TWO_ROOMS, policies=("expert:12",), num_workers=0,
                      rows_per_worker=ROWS, env_kwargs=("step_limit=10",), out_dir=str(root / "data"),
                      build_tfds=False, progress=False)
  collect(cfg, batch=twx)
  folder, _ = behaviour_clone(read_trajectories(root / "data" / "trajectories.jsonl"), FMT, ROLLOUT, root)
  return folder


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(cache: Path, port: int = 0, process_id: int = 0) -> dict[str, str]:
  """A child's environment: 4 fake devices and the cluster's settings, or (port 0) 8 devices alone."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_"))}
  # PJRT_NPROC avoids the fake-device rendezvous deadlock on small machines.
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={4 if port else 8}", PJRT_NPROC="32",
             JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  if port:
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(process_id))
  # Compile time only: a command reuses the programs an earlier one compiled (the rl and dreamgym policies have the
  # same shapes); in the cluster process 0 writes the cache and process 1 reads it too.
  env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
  return env


def _run_children(root: Path, args: list[list[str]], reference: list[str] | None = None,
                  script: str = "distributed_child.py", timeout_s: float | None = None) -> list[dict]:
  """Runs tests/`script` once per argument list (process i gets args[i]) joined into one cluster, and, with
  `reference`, once more alone on 8 devices; returns their JSON reports (child i writes root/report{i}.json, its last
  argument; the reference's comes last). Past `timeout_s` (default TIMEOUT_S), or as soon as any fails, the children
  still running are killed, and the output of each failed or killed child is printed."""
  timeout_s = timeout_s or TIMEOUT_S
  port = _free_port()
  runs = [(extra, _child_env(root / "jax_cache", port, i)) for i, extra in enumerate(args)]
  if reference is not None:
    runs.append((reference, _child_env(root / "jax_cache_alone")))
  procs, logs = [], []
  start = time.monotonic()
  try:
    for i, (extra, env) in enumerate(runs):
      logs.append(open(root / f"child{i}.log", "w"))
      procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / script), *extra,
                                     str(root / f"report{i}.json")], stdout=logs[i], stderr=subprocess.STDOUT,
                                    env=env, cwd=str(ROOT)))
    # Until all exit; one failing ends the wait at once (the other would block in a collective until JAX's heartbeat
    # timeout), and so does the deadline.
    while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
      if time.monotonic() - start > timeout_s:
        raise TimeoutError(f"the children ran past {timeout_s} s")
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in logs:
      f.close()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    for i in failed:
      print(f"--- child {i} (exit {procs[i].returncode}) ---\n" + (root / f"child{i}.log").read_text()[-6000:])
  assert not failed, f"children {failed} failed (output above)"
  return [json.loads((root / f"report{i}.json").read_text()) for i in range(len(runs))]


def test_helpers_across_two_processes(tmp_path):
  reports = _run_children(tmp_path, [["helpers"]] * 2)
  rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  for i, r in enumerate(reports):
    assert r["process_index"] == i and r["primary"] == (i == 0)
    assert not r["addressable"] and r["local_shards"] == 4  # each process holds its half of the rows
    np.testing.assert_array_equal(r["gathered"], 2 * rows)  # gathered whole on every process
    assert r["total"] == rows.sum()
    assert "the process index differs between process 0 and processes [1]" in r["mismatch"]
    # The checkpoint round trip: the sharded rows back on their layout, the process-local root key back on this
    # process's device with process 0's value, NumPy leaves and metadata as saved.
    np.testing.assert_array_equal(r["restored"]["rows"], 2 * rows)
    assert r["restored"]["root"] == np.asarray(jax.random.key_data(jax.random.key(7))).tolist()
    assert r["restored"]["count"] == [0, 1, 2] and r["meta"] == {"note": "two processes"}
    assert r["rows_sharding"] and r["root_local"]
    split, sft = r["refused"]
    assert "policy's mesh (rl.devices=4, placement split): the mesh's 4 devices include none of processes [1]" in split
    assert "mesh, devices: the mesh's 2 devices include none of processes [1]" in sft


def _data(warm_start: Path) -> Path:
  return warm_start.parent / "data" / "trajectories.jsonl"  # the offline data the warm start was cloned from


@pytest.fixture(scope="module")
def runs(warm_start, tmp_path_factory):
  """(the two children's reports, the distributed runs' root, the single-process runs' root)."""
  root = tmp_path_factory.mktemp("distributed")
  out, single = root / "dist", root / "single"
  data = [str(warm_start), str(_data(warm_start))]
  exp_model = single / "exp_model" / "checkpoint"  # the reference trains it first
  # The reference runs first, alone, so the cluster's processes meet within Gloo's 30 s (module docstring).
  (root / "alone").mkdir()
  _run_children(root / "alone", [], ["reference", *data, str(single)])
  reports = _run_children(root, [[*data, str(out), str(exp_model)]] * 2)
  return reports, out, single


def _untimed(value):
  """A row without timings (keys ending in "_s" or "seconds"), also inside nested dicts and lists."""
  if isinstance(value, dict):
    return {k: _untimed(v) for k, v in value.items() if not k.endswith(("_s", "seconds"))}
  return [_untimed(v) for v in value] if isinstance(value, list) else value


def test_both_processes_finish_and_agree(runs):
  reports, _, _ = runs
  assert [r["process_index"] for r in reports] == [0, 1] and [r["primary"] for r in reports] == [True, False]
  assert all(r["process_count"] == 2 and r["devices"] == 8 and r["local_devices"] == 4 for r in reports)
  a, b = reports
  for command in ("train_exp", "train_policy", "rl", "dreamgym"):  # evaluations, transitions, the tracker's run id
    assert _untimed(a[command]["summary"]) == _untimed(b[command]["summary"]), command
  for command in ("rl", "dreamgym"):
    assert a[command]["meta"] == b[command]["meta"] and a[command]["meta"]["iteration"] == 2, command
    assert a[command]["checksums"] == b[command]["checksums"] and len(a[command]["checksums"]) > 10, command
  # The resume state every process restores: replay marks, task pool and curriculum arrays.
  assert len(a["dreamgym"]["meta"]["replay_marks"]) == 3 and a["dreamgym"]["meta"]["task_pool"]
  assert any("curriculum" in path for path in a["dreamgym"]["checksums"])


def _files(folder: Path) -> list[str]:
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "checkpoints" not in p.parts)


def test_only_process_0_writes_the_run_folders(runs):
  (a, b), out, single = runs
  # Process 1 writes only its own orbax array metadata (array shards are written by TensorStore, unseen here) of
  # every run's checkpoints (RL's every iteration, M_exp SFT's and policy SFT's after their last step); it reads the
  # replay buffer process 0 writes.
  assert {path for _, path in b["writes"]} == {f"{run}/checkpoints/{step}/arrays/array_metadatas/process_1"
                                                 for run, step in (("run", 2), ("dreamgym", 2), ("exp", 8),
                                                                   ("policy", 3))}
  written = {path for event, path in a["writes"] if event == "open"}
  for run in ("run", "dreamgym"):
    assert {f"{run}/{f}" for f in ("config.json", "metrics.jsonl", "evals.jsonl", "summary.json", "final/config.json",
                                   "checkpoints/2/meta/metadata", "checkpoints/2/commit_success.txt")} <= written
  assert {"dreamgym/task_pool.json.tmp", "dreamgym/replay/MANIFEST.json.tmp", "exp/checkpoint/exp_model.json",
          "exp/init/config.json", "exp/summary.json"} <= written
  # One writer: one row per iteration (two appending processes would double them), the same files as a lone run.
  for run in ("run", "dreamgym"):
    assert [r["step"] for r in read_metrics(out / run / "metrics.jsonl")] == [1, 2]
    assert [r["iteration"] for r in read_metrics(out / run / "evals.jsonl")] == [0, 2]
    assert _files(out / run) == _files(single / run)
  assert _files(out / "exp") == _files(single / "exp")
  assert [r["step"] for r in read_metrics(out / "policy" / "metrics.jsonl")] == [1, 2, 3]
  assert _files(out / "policy") == _files(single / "policy")


# Metrics computed from the update's arithmetic (float32 sums whose order differs across processes); everything else
# comes from rollouts, rewards and counts and must be exactly equal.
UPDATE_METRICS = {"loss", "loss_first", "loss_last", "pg_loss", "kl", "kl_first", "entropy", "grad_norm",
                  "grad_norm_max", "approx_kl", "ratio_mean", "ratio_max", "ratio_min", "clip_frac", "learning_rate"}


def _same_metrics(dist: Path, single: Path, rows: int) -> dict:
  """Asserts the two runs logged equal metrics (update arithmetic to float32 rounding); returns the last row."""
  dist_rows, single_rows = read_metrics(dist / "metrics.jsonl"), read_metrics(single / "metrics.jsonl")
  assert len(dist_rows) == len(single_rows) == rows
  for d, s in zip(dist_rows, single_rows):
    d, s = _untimed(d), _untimed(s)
    assert d.keys() == s.keys()
    assert {k: v for k, v in d.items() if k not in UPDATE_METRICS} == \
        {k: v for k, v in s.items() if k not in UPDATE_METRICS}
    for k in UPDATE_METRICS & d.keys():
      np.testing.assert_allclose(d[k], s[k], rtol=1e-5, atol=1e-6, err_msg=k)
  return d


def _same_params(dist: Path, single: Path, start: Path, outliers: float = 0.0, lr: float = 0.0) -> None:
  """The two runs' final HF checkpoints agree to float32 rounding, and both moved away from `start`.

  `outliers`: the fraction of elements allowed beyond rounding, each still within lr / 10. Adam divides every gradient
  element by its running RMS, so an element whose gradient is near zero (comparable to the rounding of the
  all-reduces, whose order differs across processes) can take a visibly different fraction of a step; over a few
  steps of a whole model a handful of such elements is expected."""
  a, b, first = (load_file(d / "model.safetensors") for d in (dist, single, start))
  assert a.keys() == b.keys() == first.keys()
  assert max(float(np.abs(b[k] - first[k]).max()) for k in first) > 1e-4  # the run trained
  beyond = total = 0
  for name in b:
    if outliers:
      np.testing.assert_allclose(a[name], b[name], rtol=0, atol=lr / 10, err_msg=name)
      beyond += int((np.abs(a[name] - b[name]) > 2e-6 + 1e-5 * np.abs(b[name])).sum())
      total += b[name].size
    else:
      np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=2e-6, err_msg=name)
  assert beyond <= outliers * total, f"{beyond} of {total} elements differ beyond float32 rounding"


def _same_evals(report: dict, dist: Path, single: Path) -> None:
  assert [_untimed(r) for r in read_metrics(dist / "evals.jsonl")] == [_untimed(r) for r in read_metrics(
      single / "evals.jsonl")]
  summary = json.loads((single / "summary.json").read_text())
  assert _untimed(report["summary"])["evals"] == _untimed(summary["evals"])


def test_equals_the_single_process_run(runs, warm_start):
  (a, _), out, single = runs
  d = _same_metrics(out / "run", single / "run", 2)
  assert d["rows_updated"] > 0 and d["real_transitions"] > 0 and d["loss_first"] != d["loss_last"]
  _same_evals(a["rl"], out / "run", single / "run")
  _same_params(out / "run" / "final", single / "run" / "final", warm_start)


def test_dreamgym_equals_the_single_process_run(runs, warm_start):
  """Rollouts against M_exp, its answers, the curriculum, M_task's variants and the replay buffer exactly; the
  update to float32 rounding."""
  from dreamjax.curriculum.pool import TaskPool
  from dreamjax.replay.buffer import ReplayBuffer
  from tests.distributed_child import dist_config

  (a, _), out, single = runs
  out, single = out / "dreamgym", single / "dreamgym"
  d = _same_metrics(out, single, 2)
  assert d["rows_updated"] > 0 and d["synthetic_transitions"] > 0 and d["generation_candidates"] > 0
  assert a["dreamgym"]["summary"]["real_transitions"] == 0
  _same_evals(a["dreamgym"], out, single)
  with ReplayBuffer(out / "replay", read_only=True) as x, ReplayBuffer(single / "replay", read_only=True) as y:
    items = list(x.iter_from(0))
    assert items == list(y.iter_from(0))
  synthetic = [t for t in items if t.origin == "synthetic"]
  # M_exp steps unreadable after their retries are env failures, never written back (this 120-step M_exp writes few
  # readable answers: what is checked is that every process resampled and failed the same rows)
  failed = sum(m["exp_failures"] for m in read_metrics(out / "metrics.jsonl") if "exp_failures" in m)
  assert len(synthetic) == d["synthetic_transitions"] - failed and len(items) == d["replay_size"] > len(synthetic)
  assert (out / "task_pool.json").read_text() == (single / "task_pool.json").read_text()
  assert len(TaskPool.load(out / "task_pool.json")) >= len({t.task.task_id for t in items if t.origin == "offline"})
  _same_params(out / "final", single / "final", warm_start, outliers=1e-4, lr=dist_config(warm_start, out).optim.lr)


def test_train_exp_equals_the_single_process_run(runs):
  (a, _), out, single = runs
  single = single / "exp"
  untimed = lambda s: {k: v for k, v in _untimed(s).items()  # noqa: E731
                       if k not in ("train_seconds", "checkpoint", "final_train_loss")}
  summary = json.loads((single / "summary.json").read_text())
  assert untimed(a["train_exp"]["summary"]) == untimed(summary)
  np.testing.assert_allclose(a["train_exp"]["summary"]["final_train_loss"], summary["final_train_loss"], rtol=1e-5)
  dist_rows, single_rows = read_metrics(out / "exp" / "metrics.jsonl"), read_metrics(single / "metrics.jsonl")
  assert [r["step"] for r in dist_rows] == [r["step"] for r in single_rows] == [4, 8]
  for d, s in zip(dist_rows, single_rows):
    d, s = _untimed(d), _untimed(s)
    assert d.keys() == s.keys()
    for k in d:
      np.testing.assert_allclose(d[k], s[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for name in ("tokenizer.json", "config.json", "model.safetensors"):  # process 0 built the init model a lone run builds
    assert (out / "exp" / "init" / name).read_bytes() == (single / "init" / name).read_bytes(), name
  dist_meta, single_meta = (json.loads((d / "checkpoint" / "exp_model.json").read_text()) for d in (out / "exp", single))
  assert dist_meta.pop("encoder_folder") == str(out / "exp" / "init")
  assert single_meta.pop("encoder_folder") == str(single / "init") and dist_meta == single_meta
  _same_params(out / "exp" / "checkpoint", single / "checkpoint", single / "init")


def test_train_policy_equals_the_single_process_run(runs, warm_start):
  """Policy SFT with its rows split over both processes: the same losses to float32 rounding, the same rows and
  compilations, and the same final weights."""
  (a, _), out, single = runs
  summary = json.loads((single / "policy" / "summary.json").read_text())
  same = ("rows", "steps", "epochs", "row_length", "compilations", "eval")
  assert {k: a["train_policy"]["summary"][k] for k in same} == {k: summary[k] for k in same}
  assert a["train_policy"]["summary"]["steps"] == 3 and summary["compilations"] == 1
  for k in ("first_loss", "final_loss"):
    np.testing.assert_allclose(a["train_policy"]["summary"][k], summary[k], rtol=1e-5, err_msg=k)
  dist_rows, single_rows = (read_metrics(d / "policy" / "metrics.jsonl") for d in (out, single))
  for d, s in zip(dist_rows, single_rows, strict=True):
    d, s = _untimed(d), _untimed(s)
    assert d.keys() == s.keys()
    for k in d:
      np.testing.assert_allclose(d[k], s[k], rtol=1e-5, atol=1e-6, err_msg=k)
  _same_params(out / "policy" / "checkpoint", single / "policy" / "checkpoint", warm_start)
