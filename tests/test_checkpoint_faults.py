"""Faults on disk end in one line naming the file or field, and a bad latest checkpoint falls back to the one before.

Checkpoints: a corrupted file in the latest step, a junk step folder with a commit marker, array data that fails to
read, no readable step at all, and the RL loop's `Run` resuming past a bad step. Paths: a missing model folder and a
model folder without its tokenizer, through the CLI, before any env starts.
"""

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.cli import main
from dreamjax.loop.checkpoint import CheckpointError, CheckpointWarning, RunCheckpointer
from dreamjax.loop.learner import RLConfig
from dreamjax.loop.model import check_model_folder
from dreamjax.loop.run import Run


def arrays(step: int) -> dict:
  """A small tree whose values say which step saved it (the random matrix does not compress, so its data is a file of
  its own rather than inlined in the index)."""
  w = np.random.default_rng(step).normal(size=(64, 64)).astype(np.float32)
  return {"w": jnp.asarray(w), "n": jnp.int32(step), "key": jax.random.key(step)}


def save_steps(folder: Path, steps=(1, 2)) -> None:
  with RunCheckpointer(folder) as ckpt:
    for s in steps:
      ckpt.save(s, arrays(s), {"iteration": s})


def flip_bytes(path: Path) -> None:
  data = bytearray(path.read_bytes())
  for i in range(len(data) // 3, min(len(data), len(data) // 3 + 8)):
    data[i] ^= 0x5A
  path.write_bytes(bytes(data))


def truncate_array_data(step_dir: Path) -> None:
  """Cuts the largest array data file short: the step's metadata still opens, its arrays do not."""
  largest = max((step_dir / "arrays").rglob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:64])


def assert_restored(got, step: int) -> None:
  out, meta = got
  assert meta == {"iteration": step} and int(out["n"]) == step
  np.testing.assert_array_equal(out["w"], arrays(step)["w"])
  np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(arrays(step)["key"]))


def test_corrupted_latest_step_falls_back_to_the_previous_one(tmp_path):
  save_steps(tmp_path)
  flip_bytes(tmp_path / "2" / "arrays" / "manifest.ocdbt")
  with RunCheckpointer(tmp_path) as ckpt:
    with pytest.warns(CheckpointWarning, match=rf"cannot read checkpoint {tmp_path}/2 \(ValueError: DATA_LOSS.*"
                                               r"moved it to 2.unreadable and using step 1"):
      assert ckpt.latest_step() == 1
    assert_restored(ckpt.restore(like=arrays(0)), 1)
    assert ckpt.steps() == [1] and (tmp_path / "2.unreadable" / "arrays" / "manifest.ocdbt").is_file()
    ckpt.save(2, arrays(2), {"iteration": 2})  # the step number is free again, and the bad one takes no keep slot
    assert ckpt.steps() == [1, 2]
    assert_restored(ckpt.restore(2, like=arrays(0)), 2)


def test_junk_step_folder_with_a_commit_marker_is_set_aside(tmp_path):
  save_steps(tmp_path)
  (tmp_path / "7").mkdir()
  (tmp_path / "7" / "commit_success.txt").write_text("junk")
  (tmp_path / "7" / "notes.txt").write_text("not a checkpoint")
  with RunCheckpointer(tmp_path) as ckpt:
    with pytest.warns(CheckpointWarning, match=rf"{tmp_path}/7 \(.*\); moved it to 7.unreadable and using step 2"):
      assert_restored(ckpt.restore(like=arrays(0)), 2)
    assert ckpt.steps() == [1, 2]


def test_array_data_that_fails_to_read(tmp_path):
  save_steps(tmp_path)
  truncate_array_data(tmp_path / "2")
  with RunCheckpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 2  # its metadata opens
    with pytest.raises(CheckpointError) as e:  # a named step: one line, and what to do
      ckpt.restore(2, like=arrays(0))
    message = str(e.value)
    assert "\n" not in message and len(message) < 600
    assert message.startswith(f"RunCheckpointer: cannot read checkpoint {tmp_path}/2 (ValueError: ")
    assert message.endswith("; move that folder away to resume from step 1")
    with pytest.warns(CheckpointWarning, match="moved it to 2.unreadable and using step 1"):
      assert_restored(ckpt.restore(like=arrays(0)), 1)  # the latest: goes back a step
    # A target that does not match is the caller's mistake, never a reason to go back.
    with pytest.raises(ValueError, match="does not match the restore target: w: checkpoint has shape"):
      ckpt.restore(like={**arrays(0), "w": jnp.zeros((3,))})
    assert ckpt.steps() == [1]


def test_no_readable_step_is_one_error_and_moves_nothing(tmp_path):
  save_steps(tmp_path, steps=(1,))
  flip_bytes(tmp_path / "1" / "arrays" / "manifest.ocdbt")
  with RunCheckpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match=rf"no committed checkpoint in {tmp_path} can be read \(step 1: "
                                              r"ValueError: DATA_LOSS.*\); move the folder away to start afresh"):
      ckpt.latest_step()
  assert (tmp_path / "1").is_dir() and not (tmp_path / "1.unreadable").exists()


def test_the_rl_loop_resumes_from_the_last_readable_step(tmp_path):
  save_steps(tmp_path / "run" / "checkpoints", steps=(1, 2, 3))
  flip_bytes(tmp_path / "run" / "checkpoints" / "3" / "meta" / "metadata")
  cfg = RLConfig(out_dir=str(tmp_path / "run"), iterations=5)
  with pytest.warns(CheckpointWarning, match="checkpoints/3 .*using step 2"):
    run = Run(cfg, cfg, cfg.out_dir)
  with run:
    assert run.resume == 2 and run.meta == {"iteration": 2}


def test_missing_model_folder_or_tokenizer_is_one_line_before_any_env(tmp_path, capsys):
  code = main(["rl", "--config", "configs/grpo_real_twx.py:tiny", "--set", f"out_dir={tmp_path / 'run'}",
               "--set", f"model.checkpoint={tmp_path / 'nope'}"])
  err = capsys.readouterr().err
  assert code == 2 and err == (f"dreamjax rl: RLConfig.model.checkpoint: '{tmp_path / 'nope'}' does not exist or is "
                               "not a folder\n")
  assert not (tmp_path / "run").exists()  # refused before the run folder (and the task enumeration's JVM)

  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  (model / "model.safetensors").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json, tokenizer_config.json \(a model folder"):
    check_model_folder(model)
  config = tmp_path / "eval_cfg.py"
  config.write_text("from dreamjax.commands.eval import EvalRunConfig\n\n\ndef config():\n"
                    f"  return EvalRunConfig(checkpoint={str(model)!r}, out_dir={str(tmp_path / 'eval')!r})\n")
  code = main(["eval", "--config", str(config)])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1
  assert err.startswith(f"dreamjax eval: model folder: '{model}' has no tokenizer.json, tokenizer_config.json")


def test_no_warning_when_every_step_reads(tmp_path):
  save_steps(tmp_path)
  with RunCheckpointer(tmp_path) as ckpt, warnings.catch_warnings():
    warnings.simplefilter("error", CheckpointWarning)
    assert ckpt.latest_step() == 2
    assert_restored(ckpt.restore(like=arrays(0)), 2)
