"""Where a run's files may live (dreamjax/storage.py, docs/storage.md): run folders must be POSIX storage, refused
with a clear error when given a URI or a folder that lacks appends, exclusive creates or directory renames;
checkpoints and exported models may live in a gs:// bucket, here the in-memory one of tests/fake_gcs.py, reached
through the real clients (orbax, TensorStore's gcs driver, etils.epath, google-cloud-storage)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.loop.checkpoint import CheckpointWarning, RunCheckpointer
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.model import ModelSource, build_tiny_checkpoint, load_model
from dreamjax.models import save_hf_checkpoint, tiny
from dreamjax.storage import STAGING_ENV, local_copy
from tests.fake_gcs import BUCKET, fake_gcs

BUCKET_URL = f"gs://{BUCKET}"
TEXTS = ["You are in the kitchen. There is a coin here.", "> take coin", "You take the coin."] * 20


@pytest.fixture
def gcs(tmp_path, monkeypatch):
  store = fake_gcs()
  store.clear()
  monkeypatch.setenv(STAGING_ENV, str(tmp_path / "staged"))
  yield store
  store.clear()


def _objects(store, prefix: str) -> list[str]:
  return [k[len(BUCKET) + 1 + len(prefix):] for k in store.keys() if k.startswith(f"{BUCKET}/{prefix}")]


# --- run folders ----------------------------------------------------------------------------------------------------


def test_a_uri_run_folder_is_refused_naming_where_checkpoints_can_go():
  with pytest.raises(ValueError, match=r"run folder 'gs://b/run' is a URI, but a run folder must be POSIX storage.*"
                                       r"checkpoint_dir and export_dir"):
    lock_run_folder("gs://b/run")
  assert not Path("gs:").exists()  # nothing was created under a mangled local name


def test_a_folder_without_directory_renames_is_refused_and_left_clean(tmp_path, monkeypatch):
  rename = Path.rename

  def no_dir_renames(self, target):  # as gcsfuse without --rename-dir-limit
    if ".posix-probe" in self.name and self.is_dir():
      raise OSError(errno.EIO, "Input/output error")
    return rename(self, target)

  monkeypatch.setattr(Path, "rename", no_dir_renames)
  with pytest.raises(ValueError, match=rf"run folder {tmp_path} is on storage without POSIX directory renames "
                                       r"\(OSError: \[Errno 5\] Input/output error\)"):
    lock_run_folder(tmp_path)
  assert [p.name for p in tmp_path.iterdir()] == [".lock"] and (tmp_path / ".lock").read_text() == ""
  monkeypatch.undo()
  lock_run_folder(tmp_path).release()  # the refusal held nothing


def test_a_folder_whose_exclusive_create_does_not_exclude_is_refused(tmp_path, monkeypatch):
  real_open = os.open

  def ignoring_excl(path, flags, *args):  # as a filesystem that drops O_EXCL (old NFS clients, some FUSE mounts)
    if ".posix-probe" in os.fspath(path):
      flags &= ~os.O_EXCL
    return real_open(path, flags, *args)

  monkeypatch.setattr(os, "open", ignoring_excl)
  with pytest.raises(ValueError, match="without POSIX exclusive create"):
    lock_run_folder(tmp_path)
  assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_settings_are_checked_at_start_naming_the_field(gcs, monkeypatch):
  from dreamjax.commands.train_policy import PolicySftConfig
  from dreamjax.loop.config import start_run

  with pytest.raises(ValueError, match=r"PolicySftConfig.out_dir 'gs://b/run' is a URI"):
    start_run(PolicySftConfig(out_dir="gs://b/run"))
  with pytest.raises(ValueError, match=r"PolicySftConfig.checkpoint_dir: 's3://b/c': only gs:// URIs or local paths"):
    start_run(PolicySftConfig(checkpoint_dir="s3://b/c"))
  import fsspec

  def no_gcsfs(protocol):
    raise ImportError("Install gcsfs to access Google Storage")

  monkeypatch.setattr(fsspec, "get_filesystem_class", no_gcsfs)
  with pytest.raises(ValueError, match=r"PolicySftConfig.export_dir: 'gs://b/m' needs gcsfs: pip install "
                                       r"'dreamjax\[gcs\]'"):
    start_run(PolicySftConfig(export_dir="gs://b/m"))


def test_reproduce_refuses_a_stage_folder_setting_its_stages_would_share():
  from dreamjax.config import load_config

  cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs/reproduce_twx.py:tiny"), [])
  with pytest.raises(ValueError, match=r"ReproduceConfig: sft.checkpoint_dir must be empty"):
    dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, checkpoint_dir=f"{BUCKET_URL}/c"))
  with pytest.raises(ValueError, match=r"ReproduceConfig: dreamgym.rl.export_dir must be empty"):
    dataclasses.replace(cfg, dreamgym=dataclasses.replace(cfg.dreamgym, rl=dataclasses.replace(cfg.dreamgym.rl,
                                                                                               export_dir="m")))


# --- checkpoints in a bucket ----------------------------------------------------------------------------------------


def _arrays(step: int):
  return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * step, "key": jax.random.key(step),
          "n": np.int64(step)}


def test_checkpoints_in_a_bucket_keep_the_last_n_resume_and_set_a_bad_step_aside(gcs):
  folder = f"{BUCKET_URL}/run/checkpoints"
  with RunCheckpointer(folder, keep=2) as ckpt:
    assert str(ckpt.folder) == folder and ckpt.latest_step() is None
    for step in (1, 2, 3):
      ckpt.save(step, _arrays(step), {"iteration": step})
  # A resumed run's checkpointer: the oldest step was deleted in the bucket, the newest restores.
  with RunCheckpointer(folder, keep=2) as ckpt:
    assert ckpt.steps() == [2, 3]
    out, meta = ckpt.restore(None, like=_arrays(0))
  assert meta == {"iteration": 3} and int(out["n"]) == 3
  np.testing.assert_array_equal(out["w"], _arrays(3)["w"])
  np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(_arrays(3)["key"]))
  names = _objects(gcs, "run/checkpoints/")
  assert not any(n.startswith("1/") for n in names) and "3/commit_success.txt" in names
  assert any(n.startswith("3/arrays/ocdbt.process_0/d/") for n in names)  # TensorStore wrote the array data there
  # A step whose JSON item is garbage is moved aside (a copy and a delete in a bucket) and the one before it used.
  gcs.put(f"{BUCKET}/run/checkpoints/3/meta/metadata", b"{not json")
  with RunCheckpointer(folder, keep=2) as ckpt:
    with pytest.warns(CheckpointWarning, match=rf"cannot read checkpoint {folder}/3 .*moved it to 3.unreadable and "
                                               r"using step 2"):
      assert ckpt.latest_step() == 2
    assert ckpt.meta() == {"iteration": 2}
  names = _objects(gcs, "run/checkpoints/")
  assert "3.unreadable/commit_success.txt" in names and not any(n.startswith("3/") for n in names)


# --- exported models in a bucket ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
  source = ModelSource(tiny=tiny("qwen2", vocab_size=300, num_layers=1, hidden_size=64, intermediate_size=128,
                                 num_heads=2, num_kv_heads=1, head_dim=32))
  folder = build_tiny_checkpoint(source, TEXTS, tmp_path_factory.mktemp("model"), seed=0)
  return folder, load_model(folder)


def test_an_export_to_a_bucket_loads_back_through_a_staged_copy(gcs, local_model, tmp_path):
  folder, (cfg, params, tok) = local_model
  # Several safetensors files and their index, written once each as objects.
  save_hf_checkpoint(params, cfg, f"{BUCKET_URL}/models/policy", tokenizer_folder=folder, max_shard_bytes=40_000)
  names = _objects(gcs, "models/policy/")
  assert "config.json" in names and "model.safetensors.index.json" in names and "tokenizer.json" in names
  assert sum(n.endswith(".safetensors") for n in names) > 1
  cfg2, params2, tok2 = load_model(f"{BUCKET_URL}/models/policy")
  staged = tmp_path / "staged" / "gs" / BUCKET / "models" / "policy"
  assert sorted(p.name for p in staged.iterdir()) == sorted(names)  # no partial files left behind
  assert cfg2 == cfg and tok2.vocab_size == tok.vocab_size
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params2, params)
  # A second load copies nothing again (same sizes); a changed object is fetched anew.
  config = staged / "config.json"
  os.utime(config, (0, 0))
  local_copy(f"{BUCKET_URL}/models/policy")
  assert config.stat().st_mtime == 0
  gcs.put(f"{BUCKET}/models/policy/config.json", json.dumps({**json.loads(config.read_text()), "pad": 1}).encode())
  local_copy(f"{BUCKET_URL}/models/policy")
  assert json.loads(config.read_text())["pad"] == 1
  with pytest.raises(FileNotFoundError, match=rf"model folder: '{BUCKET_URL}/models/none' does not exist"):
    load_model(f"{BUCKET_URL}/models/none")


# --- a training command with its checkpoints and model in a bucket --------------------------------------------------


def test_policy_sft_checkpoints_and_exports_to_a_bucket_and_resumes_from_it(gcs, coin_expert_data, tmp_path, capsys):
  from dreamjax.commands import train_policy
  from tests import preemption_child as child

  ckpt, model = f"{BUCKET_URL}/sft/checkpoints", f"{BUCKET_URL}/sft/model"
  cfg = dataclasses.replace(child.policy_sft(), data=(str(coin_expert_data),), out_dir=str(tmp_path / "sft"), max_steps=4,
                            checkpoint_dir=ckpt, export_dir=model,
                            eval=dataclasses.replace(child.EVAL, every_steps=0, num_tasks=1))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    first = train_policy.run(cfg)
  assert first["checkpoint"] == model and first["steps"] == 4
  assert not (tmp_path / "sft" / "checkpoints").exists() and not (tmp_path / "sft" / "checkpoint").exists()
  assert {"2/commit_success.txt", "4/commit_success.txt"} <= set(_objects(gcs, "sft/checkpoints/"))
  assert "model.safetensors" in _objects(gcs, "sft/model/")
  capsys.readouterr()
  again = train_policy.run(cfg)  # a finished run's rerun resumes from the bucket and only writes its outputs again
  assert f"resuming {tmp_path / 'sft'} after step 4" in capsys.readouterr().out
  assert again["eval"] == first["eval"] and again["final_loss"] == first["final_loss"]
  _, params, _ = load_model(model)
  cfg_local = dataclasses.replace(cfg, out_dir=str(tmp_path / "local"), checkpoint_dir="", export_dir="")
  local = train_policy.run(cfg_local)  # the same run on local disk exports the same weights
  _, params_local, _ = load_model(local["checkpoint"])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params_local)

