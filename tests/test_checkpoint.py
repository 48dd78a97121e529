"""Checkpoints (dreamjax.loop.checkpoint), the tracker (dreamjax.loop.track), and resuming a killed real-env RL run.

The resume test runs one tiny GRPO config on real TextWorld-Express three ways: uninterrupted in one folder; in a
child process SIGKILLed once its second checkpoint is committed and the next iteration's metrics row is written (so
the folder holds a row past its checkpoint); and resumed in the killed run's folder. The resumed run must end with
the uninterrupted run's arrays bit for bit (parameters, optimizer state, step, reference, key) and the same
metrics.jsonl and evals.jsonl rows, timings aside. The SIGTERM test does the same with a child sent SIGTERM (a
preemption notice), which must checkpoint the iteration it is in and exit with 75.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dreamjax.loop.checkpoint import RunCheckpointer, generator_state, restore_generator
from dreamjax.loop.plots import metric_curves as plot_metrics
from dreamjax.loop.track import TrackConfig, Tracker, progress, read_metrics, truncate_jsonl
from dreamjax.models import abstract_params, load_hf_checkpoint, tiny
from dreamjax.parallel import MeshConfig, make_mesh
from dreamjax.rl.train_state import create_train_state, train_state_shardings
from tests import rl_resume_child as child
from tests.jax_settings import jax_config, persistent_cache
from tests.warm_start import behaviour_clone

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "commit_success.txt"  # orbax's marker of a finished step (COMMIT_FILE atomicity)


def _state(mesh, seed: int = 0, num_layers: int = 1):
  """A TrainState of a tiny model (on `mesh`, or one device) with random parameters and non-zero optimizer moments
  (one Adam update, in one jit). Parameters are drawn with NumPy: compiling the model's init would dominate here."""
  cfg = tiny("qwen2", num_layers=num_layers)
  optimizer = optax.adamw(1e-3)
  rng = np.random.default_rng(seed)
  shapes = nn.unbox(abstract_params(cfg))
  params = jax.tree.map(lambda x: rng.normal(0, 0.02, x.shape).astype(x.dtype), shapes)
  state = create_train_state(cfg, params, optimizer, mesh)

  def update(state):
    grads = jax.tree.map(lambda p: jnp.cos(p * (seed + 1)), state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 3, params=optax.apply_updates(state.params, updates), opt_state=opt_state)

  shardings = train_state_shardings(cfg, optimizer, mesh) if mesh is not None else None
  return cfg, optimizer, jax.jit(update, out_shardings=shardings)(state)


def _assert_equal_trees(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
  for x, y in zip(la, lb):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_train_state_round_trip_keeps_shardings_and_keys(tmp_path):
  mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
  cfg, optimizer, state = _state(mesh)
  key = jax.random.fold_in(jax.random.key(7), 3)
  saved = {"state": state, "root": key, "keys": jax.random.split(jax.random.key(1), 3), "count": np.arange(5)}
  with RunCheckpointer(tmp_path / "ck") as ck:
    ck.save(10, saved, {"iteration": 10, "pool": {"tasks": ["a", "b"]}})
  # Restore onto a fresh state of the same layout (other values), in a new checkpointer as a resumed run would.
  _, _, other = _state(mesh, seed=1)
  like = {"state": other, "root": jax.random.key(0), "keys": jax.random.split(jax.random.key(2), 3),
          "count": np.zeros(5, np.int64)}
  with RunCheckpointer(tmp_path / "ck") as ck:
    arrays, meta = ck.restore(None, like)
  assert meta == {"iteration": 10, "pool": {"tasks": ["a", "b"]}}
  _assert_equal_trees(arrays, saved)
  for got, want in zip(jax.tree.leaves(arrays["state"]), jax.tree.leaves(other)):
    assert got.sharding == want.sharding
  assert arrays["state"].params["embed"].sharding.spec == other.params["embed"].sharding.spec != ()
  assert isinstance(arrays["count"], np.ndarray)
  # The typed keys come back as keys of the same implementation and draw the same numbers.
  assert jax.random.key_impl(arrays["root"]) == jax.random.key_impl(key)
  assert np.array_equal(jax.random.uniform(arrays["root"], (4,)), jax.random.uniform(key, (4,)))
  assert np.array_equal(jax.random.uniform(arrays["keys"][2]), jax.random.uniform(saved["keys"][2]))
  # Onto abstract leaves of another mesh: resharded on load.
  mesh2 = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  shardings = train_state_shardings(cfg, optimizer, mesh2)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  with RunCheckpointer(tmp_path / "ck") as ck:
    restored, _ = ck.restore(10, {**like, "state": abstract})
  _assert_equal_trees(restored["state"], state)
  for got, want in zip(jax.tree.leaves(restored["state"]), jax.tree.leaves(shardings)):
    assert got.sharding == want


def test_keep_last_n_and_uncommitted_steps(tmp_path):
  folder = tmp_path / "ck"
  like = {"x": jnp.zeros(3), "k": jax.random.key(0)}
  ck = RunCheckpointer(folder, keep=2)
  assert ck.latest_step() is None
  for step in (1, 2, 3, 4):
    ck.save(step, {"x": jnp.full(3, step, jnp.float32), "k": jax.random.key(step)}, {"step": step})
  assert ck.steps() == [3, 4] and sorted(p.name for p in folder.iterdir()) == ["3", "4"]
  with pytest.raises(ValueError, match="already committed"):
    ck.save(4, like, {})
  with pytest.raises(ValueError, match="meta is not JSON"):
    ck.save(5, like, {"bad": object()})
  with pytest.raises(ValueError, match="leaf 'n/1' is not an array; put Python values in meta"):
    ck.save(5, {"n": [jnp.zeros(1), 3]}, {})
  ck.close()
  # A save killed before its commit marker: a complete-looking step 5 without the marker, and a step 6 cut short.
  shutil.copytree(folder / "4", folder / "5")
  (folder / "5" / COMMIT).unlink()
  (folder / "6" / "arrays").mkdir(parents=True)
  ck = RunCheckpointer(folder, keep=2)
  assert ck.latest_step() == 4, sorted(p.name for p in folder.iterdir())
  arrays, meta = ck.restore(None, like)
  assert meta == {"step": 4} and np.array_equal(arrays["x"], np.full(3, 4.0))
  with pytest.raises(FileNotFoundError, match="step 5 is not a committed checkpoint"):
    ck.restore(5, like)
  # The next save of that step goes through, the oldest is dropped, and the torn step is gone (orbax removes
  # uncommitted step folders in the background when a manager opens the folder; a save waits for that).
  ck.save(5, {"x": jnp.full(3, 5.0), "k": jax.random.key(5)}, {"step": 5})
  assert ck.steps() == [4, 5] and ck.restore(5, like)[1] == {"step": 5}
  assert sorted(p.name for p in folder.iterdir()) == ["4", "5"]
  ck.close()


def test_a_checkpointer_closed_without_a_save_exits_without_a_traceback(tmp_path):
  """orbax removes unfinished steps in a thread started when the folder opens; a command that closed its folder
  without saving (a config error, say) once let that thread run into the interpreter's shutdown, which printed a
  RuntimeError traceback under the command's own one-line error."""
  code = (f"from dreamjax.loop.checkpoint import RunCheckpointer\n"
          f"RunCheckpointer({str(tmp_path / 'ck')!r}).close()\nprint('closed')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=Path(__file__).parent.parent)
  assert out.returncode == 0 and out.stdout.strip() == "closed", out.stderr[-2000:]
  assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_arrays_may_be_donated_as_soon_as_save_returns(tmp_path):
  """The train step donates the state right after a checkpoint starts; the checkpoint keeps the values it was given."""
  x = {"w": jnp.arange(1 << 20, dtype=jnp.float32)}
  overwrite = jax.jit(lambda t: {"w": t["w"] * 0 - 1}, donate_argnums=0)
  with RunCheckpointer(tmp_path / "ck") as ck:
    ck.save(1, x)
    # JAX donates x unless the save still holds it (then it copies, and warns): either way the save must be intact.
    # Whether it was donated depends on timing (7 of 12 tries were not, under load), so the test does not ask.
    y = overwrite(x)
    restored, _ = ck.restore(1, y)
  assert np.array_equal(restored["w"], np.arange(1 << 20, dtype=np.float32)) and float(y["w"][0]) == -1


def test_mismatch_names_the_folder_and_the_paths(tmp_path):
  _, _, state = _state(None)
  with RunCheckpointer(tmp_path / "ck") as ck:
    ck.save(1, {"state": state, "root": jax.random.key(0)}, {})
    folder = str(ck.folder)
    _, _, deeper = _state(None, num_layers=2)  # one more layer: its leaves are missing from the checkpoint
    with pytest.raises(ValueError, match=f"step 1 in {folder} does not match.*layers_1.*missing from the checkpoint"):
      ck.restore(1, {"state": deeper, "root": jax.random.key(0)})
    wrong = state.replace(step=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"step: checkpoint has shape \(\) int32, target \(2,\) int32"):
      ck.restore(1, {"state": wrong, "root": jax.random.key(0)})
    with pytest.raises(ValueError, match="extra: missing.*root: an array in the target, a PRNG key in the checkpoint"):
      ck.restore(1, {"state": state, "root": jnp.zeros(2, jnp.uint32), "extra": jnp.zeros(1)})
    with pytest.raises(ValueError, match="PRNG key implementation rbg in the target, threefry2x32 saved"):
      ck.restore(1, {"state": state, "root": jax.random.key(0, impl="rbg")})
    with pytest.raises(FileNotFoundError, match="step 2 is not a committed checkpoint"):
      ck.restore(2, {"state": state, "root": jax.random.key(0)})


def test_numpy_generator_state_survives_json():
  rng = np.random.default_rng(123)
  rng.random(7)
  state = json.loads(json.dumps(generator_state(rng)))
  assert np.array_equal(restore_generator(state).random(5), rng.random(5))


def test_tracker_jsonl_summary_plot_and_resume_truncation(tmp_path):
  cfg = {"lr": 0.1, "nested": {"a": [1, 2]}}
  with Tracker(tmp_path, cfg) as tr:
    run_id = tr.run_id
    rows = [tr.log(s, {"loss": np.float32(1.0 / s), "acc": s / 10, "vec": np.arange(2)}, phase="train")
            for s in (1, 2, 3)]
    tr.log(3, {"eval": {"success": 0.5}}, jsonl=False)  # W&B only
    tr.summary({"final": {"loss": 0.25}, "n": 3})
    tr.plot_metrics(("loss", "acc", "absent"), title="curves")
  assert len(run_id) == 8 and run_id.isalnum() and run_id == run_id.lower()
  assert json.loads((tmp_path / "config.json").read_text()) == cfg
  got = read_metrics(tmp_path / "metrics.jsonl")
  assert got == rows and [r["step"] for r in got] == [1, 2, 3] and got[1]["loss"] == np.float32(0.5).item()
  assert got[0]["vec"] == [0, 1] and got[0]["phase"] == "train" and "time_s" in got[0]
  assert json.loads((tmp_path / "summary.json").read_text()) == {"final": {"loss": 0.25}, "n": 3}
  svg = (tmp_path / "metrics.svg").read_text()
  assert "<svg" in svg and ">loss<" in svg and ">acc<" in svg and "absent" not in svg  # the panels of keys present
  # A killed run's torn last line and rows past the checkpoint are dropped on resume; the run id is kept.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "lo')
  with Tracker(tmp_path, cfg, run_id=run_id, resume_step=2) as tr:
    assert tr.run_id == run_id
    tr.log(3, {"loss": 9.0})
  assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 0.5), (3, 9.0)]
  with Tracker(tmp_path / "other", cfg, primary=False) as tr:  # another process of a multi-process run
    assert tr.log(1, {"loss": 1.0})["loss"] == 1.0 and tr.run_id
    tr.summary({"n": 1})
  assert not (tmp_path / "other").exists()
  with Tracker(tmp_path, cfg) as tr:  # a fresh run starts an empty log
    assert tr.run_id != run_id
  assert (tmp_path / "metrics.jsonl").read_text() == ""
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
  with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON row"):
    truncate_jsonl(bad, lambda r: True)
  with pytest.raises(ValueError, match="TrackConfig.wandb must be one of"):
    TrackConfig(wandb="yes")
  assert list(progress(range(3), "quiet")) == [0, 1, 2]  # stderr is not a terminal under pytest: no bar, same items
  assert "<svg" in plot_metrics([], ("x",), tmp_path / "empty.svg").read_text()


def _wandb_records(path: Path) -> list:
  """The records of a .wandb file (a LevelDB-style log of wandb_internal_pb2.Record: 7-byte file header, 32 KiB
  blocks, each chunk a 7-byte header of CRC, length and type FULL/FIRST/MIDDLE/LAST)."""
  from wandb.proto import wandb_internal_pb2

  data, pos, block, records, parts = path.read_bytes(), 7, 32768, [], b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    if length == 0 and kind == 0:
      break
    parts += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      records.append(record)
      parts = b""
  return records


def _wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
  """step -> logged values of a finished offline run. wandb's service may still be writing the file after `finish`
  returns, so this waits (up to 60 s) for the run's exit record."""
  from google.protobuf.message import DecodeError  # wandb's dependency

  deadline = time.monotonic() + 60
  while True:
    try:  # the file may not exist yet, or end inside a record
      records = _wandb_records(next(run_dir.glob("run-*.wandb")))
    except (StopIteration, DecodeError):
      if time.monotonic() > deadline:
        raise
      records = []
    if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  out: dict[int, dict[str, float]] = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
      out.setdefault(int(items["_step"]), {}).update(
          {k: v for k, v in items.items() if not k.startswith("_") and not k.endswith("_s")})  # timings aside
  return out


def test_wandb_offline_writes_under_the_run_folder_and_resumes_the_same_run(tmp_path):
  pytest.importorskip("wandb")
  track = TrackConfig(wandb="offline", project="dreamjax-test", tags=("ci",))
  with Tracker(tmp_path, {"lr": 0.1}, track) as tr:
    run_id = tr.run_id
    tr.log(1, {"train_loss": 2.0})
    tr.log(2, {"train_loss": 1.5, "eval": {"success_rate": 0.25}})
    tr.summary({"final_success": 0.25})
  first = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
  assert len(first) == 1
  assert _wandb_history(first[0]) == {1: {"train_loss": 2.0}, 2: {"train_loss": 1.5, "eval/success_rate": 0.25}}
  with Tracker(tmp_path, {"lr": 0.1}, track, run_id=run_id, resume_step=2) as tr:
    assert tr.run_id == run_id
    tr.log(3, {"train_loss": 1.0})
  # The resumed run is the same W&B run: same id, its own offline folder. Started within the same second as the first,
  # it gets the first's name with "-1" appended, which also sorts after it.
  runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*"))
  assert len(runs) == 2 and {3: {"train_loss": 1.0}}.items() <= _wandb_history(runs[-1]).items()
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
  # Only the run folder was written to: wandb's cache (its service's logs) went there too.
  assert list((tmp_path / "wandb" / "cache").rglob("core-debug-*.log"))


# After the test above: that one checks where the wandb service (started once per process) keeps its logs.
def test_wandb_runs_carry_group_job_type_and_the_code_commit(tmp_path):
  pytest.importorskip("wandb")
  from dreamjax.loop.track import git_commit

  track = TrackConfig(wandb="offline", project="dreamjax-test", name="real_grpo-seed1", group="twx_tiny",
                      job_type="rl")
  with Tracker(tmp_path, {"lr": 0.1}, track) as tr:
    run_id = tr.run_id
  run_dir = next((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
  deadline = time.monotonic() + 30
  while True:  # wandb's service may still be writing the file after `finish` returns
    runs = [r.run for r in _wandb_records(run_dir / f"run-{run_id}.wandb") if r.WhichOneof("record_type") == "run"]
    if runs or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  run = runs[0]
  assert (run.display_name, run.run_group, run.job_type) == ("real_grpo-seed1", "twx_tiny", "rl")
  config = {i.key: json.loads(i.value_json) for i in run.config.update}
  commit = git_commit()
  assert commit and len(commit.split("+")[0]) == 40  # the tests run from a git checkout
  assert config["git_commit"] == commit and config["lr"] == 0.1


# The resume test: real TextWorld-Express, a tiny behaviour-cloned warm start, three runs of one config.

@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
  """A persistent compilation cache shared with the child process: the three runs compile the same programs."""
  settings = persistent_cache(str(tmp_path_factory.mktemp("xla_cache")))
  with jax_config(**settings):
    yield {n.upper(): str(v) for n, v in settings.items()}


@pytest.fixture(scope="module")
def twx():
  pytest.importorskip("textworld_express")
  from dreamjax.envs.base import SerialBatchEnv
  from dreamjax.envs.textworld_express import TextWorldExpressEnv

  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=10) for _ in range(child.ROWS)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def warm_start(twx, tmp_path_factory):
  """An HF folder with a weak behaviour-cloned policy: it sometimes finds the coin, so GRPO groups differ."""
  from dreamjax.data.collect import CollectConfig, collect
  from dreamjax.data.records import read_trajectories

  root = tmp_path_factory.mktemp("warm")
  cfg = CollectConfig(games=("coin",), split="train", game_params=child.TWO_ROOMS, policies=("expert:8",),
                      num_workers=0, rows_per_worker=child.ROWS, env_kwargs=("step_limit=10",),
                      out_dir=str(root / "data"), build_tfds=False, progress=False)
  collect(cfg, batch=twx)
  records = read_trajectories(root / "data" / "trajectories.jsonl")
  return behaviour_clone(records, child.FMT, child.ROLLOUT, root)[0]


@pytest.fixture(scope="module")
def whole(warm_start, twx, xla_cache, tmp_path_factory):
  """The uninterrupted run of the resume config: (its folder, its summary)."""
  from dreamjax.commands.rl import run

  folder = tmp_path_factory.mktemp("whole")
  return folder, run(child.resume_config(warm_start, folder), twx)


def _untimed(row):
  return {k: _untimed(v) if isinstance(v, dict) else v for k, v in row.items() if not k.endswith("_s")}


def _kill_after_second_checkpoint(warm: Path, out: Path, cache_env: dict[str, str]) -> int:
  """Runs the config in a child process and SIGKILLs it once checkpoint 2 is committed and iteration 3's metrics row
  is written; returns how many metrics rows the folder held at the kill."""
  env = {**os.environ, **cache_env, "PYTHONPATH": str(ROOT)}
  proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "rl_resume_child.py"), str(warm), str(out)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
  metrics, deadline = out / "metrics.jsonl", time.monotonic() + 240
  try:
    while proc.poll() is None and time.monotonic() < deadline:
      if (out / "checkpoints" / "2" / COMMIT).exists() and metrics.exists() and \
          metrics.read_text().count("\n") >= 3:
        break
      time.sleep(0.02)
    assert proc.poll() is None, f"the child ended before it was killed:\n{proc.stderr.read()[-3000:]}"
    assert time.monotonic() < deadline, "the child did not reach its second checkpoint in time"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return metrics.read_text().count("\n")


def test_a_killed_run_resumes_to_the_uninterrupted_result(warm_start, twx, xla_cache, whole, tmp_path):
  from dreamjax.commands.rl import run

  (whole, summary_whole), killed = whole, tmp_path / "killed"
  rows_at_kill = _kill_after_second_checkpoint(warm_start, killed, xla_cache)
  assert rows_at_kill >= 3 and not (killed / "final").exists()
  with RunCheckpointer(killed / "checkpoints") as ck:
    resumed_from = ck.latest_step()
    assert resumed_from in (2, 3)  # killed after checkpoint 2: before, while or after checkpoint 3 was written
    run_id = ck.meta()["tracker_run_id"]
  summary = run(child.resume_config(warm_start, killed), twx)
  assert summary["resumed_from"] == resumed_from and summary["run_id"] == run_id != summary_whole["run_id"]

  # Every array of the last checkpoint (parameters, optimizer state, step, reference, root key), and the exported
  # policy, bit for bit.
  ends = []
  for folder in (whole, killed):
    with RunCheckpointer(folder / "checkpoints") as ck:
      assert ck.steps() == [3, 4]  # keep_checkpoints=2
      arrays, meta = ck.restore(4)
      ends.append(arrays)
      assert meta["iteration"] == 4 and meta["real_transitions"] == summary_whole["real_transitions"]
  assert sorted(ends[0]) == ["ref_params", "root", "state"] and int(ends[0]["state"]["step"]) >= 4
  _assert_equal_trees(ends[0], ends[1])
  finals = [load_hf_checkpoint(folder / "final")[1] for folder in (whole, killed)]
  _assert_equal_trees(finals[0], finals[1])
  _, warm = load_hf_checkpoint(warm_start)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves(finals[0])))

  for name in ("metrics.jsonl", "evals.jsonl"):
    a, b = read_metrics(whole / name), read_metrics(killed / name)
    assert [_untimed(r) for r in a] == [_untimed(r) for r in b], name
  rows = read_metrics(killed / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  # The run did real work: env steps, and groups with unequal returns (non-zero advantages) in some update.
  assert rows[-1]["real_transitions"] > 0 and min(r["zero_variance_group_frac"] for r in rows) < 1
  assert [r["iteration"] for r in read_metrics(killed / "evals.jsonl")] == [0, 2, 4]
  assert [_untimed(e) for e in summary["evals"]] == [_untimed(e) for e in summary_whole["evals"]]
  assert (killed / "learning_curve.svg").is_file() and (killed / "metrics.svg").is_file()
  # Rerunning a finished run changes nothing: it resumes after the last iteration and only rewrites its outputs.
  files = {name: (killed / name).read_text() for name in ("metrics.jsonl", "evals.jsonl")}
  again = run(child.resume_config(warm_start, killed), twx)
  assert again["resumed_from"] == 4 and again["evals"] == summary["evals"] and again["run_id"] == run_id
  assert files == {name: (killed / name).read_text() for name in files}


def test_a_sigterm_checkpoints_the_iteration_and_exits_75_then_resumes_to_the_uninterrupted_result(
    warm_start, twx, xla_cache, whole, tmp_path):
  """SIGTERM once checkpoint 1 is committed: the child ends the iteration it is in, checkpoints it (a step that
  `checkpoint_every` would save anyway here) and exits with 75 without its final policy; rerun, it ends as the
  uninterrupted run did."""
  from dreamjax.commands.rl import run
  from dreamjax.loop.preemption import PREEMPTED_EXIT

  (whole, summary_whole), out = whole, tmp_path / "run"
  env = {**os.environ, **xla_cache, "PYTHONPATH": str(ROOT)}
  proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "rl_resume_child.py"), str(warm_start), str(out)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
  deadline = time.monotonic() + 240
  try:
    while proc.poll() is None and time.monotonic() < deadline and not (out / "checkpoints" / "1" / COMMIT).exists():
      time.sleep(0.02)
    assert proc.poll() is None, f"the child ended before it was signalled:\n{proc.stderr.read()[-3000:]}"
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=240)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  err = proc.stderr.read()
  assert rc == PREEMPTED_EXIT, err[-3000:]
  stopped = int(err.split("preempted after step ")[1].split(":")[0])
  assert stopped in (2, 3) and not (out / "final").exists()
  with RunCheckpointer(out / "checkpoints") as ck:
    assert ck.latest_step() == stopped
  assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, stopped + 1))
  summary = run(child.resume_config(warm_start, out), twx)
  assert summary["resumed_from"] == stopped and summary["run_id"] != summary_whole["run_id"]
  assert [_untimed(e) for e in summary["evals"]] == [_untimed(e) for e in summary_whole["evals"]]
  with RunCheckpointer(whole / "checkpoints") as a, RunCheckpointer(out / "checkpoints") as b:
    _assert_equal_trees(a.restore(4)[0], b.restore(4)[0])
  for name in ("metrics.jsonl", "evals.jsonl"):
    assert [_untimed(r) for r in read_metrics(whole / name)] == [_untimed(r) for r in read_metrics(out / name)], name


def test_a_resume_step_whose_array_data_is_corrupt_falls_back_to_the_step_before(warm_start, twx, whole, tmp_path):
  """Step 4's metadata opens, so the run is built from it; its array data fails only when read. The command starts
  again from step 3, with a warning, and ends where the uninterrupted run did, bit for bit."""
  from dreamjax.commands.rl import run

  (folder, summary_whole), copy = whole, tmp_path / "run"
  shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("final"))
  largest = max((copy / "checkpoints" / "4" / "arrays").rglob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:64])
  with pytest.warns(UserWarning, match=r"checkpoints/4 \(.*\); moved it to 4.unreadable and using step 3"):
    summary = run(child.resume_config(warm_start, copy), twx)
  assert summary["resumed_from"] == 3 and (copy / "checkpoints" / "4.unreadable").is_dir()
  with RunCheckpointer(folder / "checkpoints") as a, RunCheckpointer(copy / "checkpoints") as b:
    assert b.steps() == [3, 4]
    _assert_equal_trees(a.restore(4)[0], b.restore(4)[0])
  assert [_untimed(r) for r in read_metrics(copy / "metrics.jsonl")] == \
      [_untimed(r) for r in read_metrics(folder / "metrics.jsonl")]
  assert [_untimed(e) for e in summary["evals"]] == [_untimed(e) for e in summary_whole["evals"]]


def test_a_real_transition_budget_is_spent_exactly(warm_start, twx, whole, tmp_path):
  """The uncapped run spends 13 real transitions in 4 iterations; capped at 7, the iteration that would pass 7 steps
  only what is left, its cut episodes are left out, and the run stops there with exactly 7 spent."""
  import dataclasses

  from dreamjax.commands.rl import run

  (folder, summary_whole), out = whole, tmp_path / "capped"
  assert summary_whole["real_transitions"] == 13
  summary = run(dataclasses.replace(child.resume_config(warm_start, out), max_real_transitions=7), twx)
  rows, full = read_metrics(out / "metrics.jsonl"), read_metrics(folder / "metrics.jsonl")
  assert summary["real_transitions"] == 7 == rows[-1]["real_transitions"] and summary["iterations"] == len(rows) < 4
  assert rows[-1]["budget_cut_episodes"] > 0 and all(r["budget_cut_episodes"] == 0 for r in rows[:-1])
  # Up to the cut the run is the uncapped one.
  assert [_untimed(r) for r in rows[:-1]] == [{k: v for k, v in _untimed(r).items() if k in rows[0]}
                                               for r in full[:len(rows) - 1]]
  assert summary["final"]["iteration"] == len(rows)
