"""tools/bank_run.py on a run folder laid out as `dreamjax reproduce` lays one out: what a bank keeps and leaves out,
a restore that gives the kept files back byte for byte, and the refusals that keep a bad bank from touching a run.
(The slow end-to-end test in tests/test_reproduce.py restores a real bank and reruns the table from it.)"""

import json
import lzma
import os
from pathlib import Path

import pytest

from tools.bank_run import COMPRESS_ABOVE, BankError, main, plan, restore, save


def _write(path: Path, data: bytes | str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data if isinstance(data, bytes) else data.encode())


def _model(folder: Path) -> None:
  _write(folder / "config.json", "{}")
  _write(folder / "tokenizer_config.json", "{}")
  _write(folder / "model.safetensors", os.urandom(1000))


def _stage(run: Path, name: str, finished: bool, steps: tuple[int, ...] = (), committed: tuple[int, ...] = ()) -> Path:
  folder = run / name
  _write(folder / "config.json", "{}")
  _write(folder / "metrics.jsonl", '{"step": 1}\n')
  _write(folder / ".lock", "pid")
  _write(folder / "compile_cache" / "jit_step-cache", os.urandom(100))
  _model(folder / ("init" if name == "exp_model" else "init_model"))  # train-exp names its initial model init/
  for step in steps:
    _write(folder / "checkpoints" / str(step) / "state" / "data", os.urandom(200))
    if step in committed:
      _write(folder / "checkpoints" / str(step) / "commit_success.txt", "ok")
  if finished:
    _model(folder / "model")
    if name == "exp_model":  # M_exp's retrieval embeds with its initial model's backbone (train-exp's exp_model.json)
      _write(folder / "model" / "exp_model.json", json.dumps({"encoder_folder": str(folder / "init")}))
    _write(folder / "summary.json", json.dumps({"checkpoint": str(folder / "model"), "seconds": 12.5}))
    _write(folder / "eval" / "eval.json", json.dumps({"success_rate": 0.5}))
  return folder


@pytest.fixture
def run(tmp_path) -> Path:
  run = tmp_path / "runs" / "table"
  _write(run / "config.json", "{}")
  _write(run / "data" / "summary.json", "{}")
  # Text that compresses, over the threshold: the collected trajectories.
  _write(run / "data" / "trajectories.jsonl", '{"obs": "You see a coin."}\n' * (COMPRESS_ABOVE // 20))
  _stage(run, "sft", True, steps=(100,), committed=(100,))
  _stage(run, "dpo", True, steps=(50,), committed=(50,))
  _stage(run, "exp_model", True)
  _stage(run, "dreamgym_grpo/seed0", True)
  _stage(run, "dreamgym_grpo_no_replay/seed0", True)
  _stage(run, "real_grpo/seed0", False, steps=(5, 10, 15), committed=(5, 10))
  _write(run / "wandb" / "run-1" / "files.log", "x")
  return run


def _files(folder: Path) -> set[str]:
  return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_bank_keeps_results_and_the_models_later_stages_start_from(run, tmp_path):
  kept = {p.relative_to(run).as_posix() for p in plan(run, unfinished=False)}
  for name in ("sft", "exp_model", "dreamgym_grpo/seed0"):  # later stages start from these models
    assert f"{name}/model/model.safetensors" in kept, name
  for name in ("dpo", "dreamgym_grpo_no_replay/seed0"):  # rows whose evaluation is all that is left
    assert f"{name}/model/model.safetensors" not in kept and f"{name}/eval/eval.json" in kept, name
  for name in ("sft", "dpo"):  # a finished stage's resumable state and initial model are not needed again
    assert not any(k.startswith((f"{name}/checkpoints/", f"{name}/init_model/")) for k in kept), name
  # ...but for M_exp's, which embeds the replay retrieval every DreamGym row runs with.
  assert {"exp_model/init/model.safetensors", "exp_model/init/tokenizer_config.json"} <= kept
  assert not any("compile_cache" in k or k.endswith(".lock") or k.startswith("wandb/") for k in kept)
  assert not any(k.startswith("real_grpo/") for k in kept)  # unfinished: it starts again, its logs with it
  assert {"config.json", "data/summary.json", "data/trajectories.jsonl", "sft/summary.json", "sft/metrics.jsonl"} <= kept

  with_unfinished = {p.relative_to(run).as_posix() for p in plan(run, unfinished=True)}
  extra = with_unfinished - kept
  assert "real_grpo/seed0/checkpoints/10/commit_success.txt" in extra  # the newest committed step
  assert not any(k.startswith(("real_grpo/seed0/checkpoints/5/", "real_grpo/seed0/checkpoints/15/")) for k in extra)
  assert {"real_grpo/seed0/init_model/model.safetensors", "real_grpo/seed0/metrics.jsonl"} <= extra


def test_restore_gives_the_banked_files_back_byte_for_byte(run, tmp_path):
  bank = tmp_path / "bank"
  out = save(run, bank, unfinished=True)
  assert out["files"] == len(plan(run, unfinished=True))
  assert (bank / "data" / "trajectories.jsonl.xz").is_file() and not (bank / "data" / "trajectories.jsonl").exists()
  assert out["banked_bytes"] < out["bytes"]
  fresh = tmp_path / "elsewhere"
  assert restore(bank, fresh) == {"files": out["files"], "written": out["files"]}
  for rel in _files(fresh):
    assert (fresh / rel).read_bytes() == (run / rel).read_bytes(), rel
  assert _files(fresh) == {p.relative_to(run).as_posix() for p in plan(run, unfinished=True)}
  # Restoring again over the same files writes nothing; saving again replaces the bank whole.
  assert restore(bank, fresh)["written"] == 0
  save(run, bank)
  assert not (bank / "real_grpo").exists()


def test_a_bad_bank_or_a_differing_run_file_is_refused_before_anything_is_written(run, tmp_path, capsys):
  bank = tmp_path / "bank"
  assert main(["save", str(run), str(bank)]) == 0
  assert json.loads(capsys.readouterr().out)["files"] > 0
  target = tmp_path / "target"
  _write(target / "sft" / "summary.json", "another run's summary")
  assert main(["restore", str(bank), str(target)]) == 2
  assert f"{target / 'sft' / 'summary.json'} exists and differs" in capsys.readouterr().err
  assert _files(target) == {"sft/summary.json"}  # nothing else was written

  (target / "sft" / "summary.json").unlink()
  (bank / "sft" / "metrics.jsonl").write_text("edited\n")
  with pytest.raises(BankError, match=r"sft/metrics\.jsonl does not match its sha256"):
    restore(bank, target)
  (bank / "data" / "trajectories.jsonl.xz").write_bytes(lzma.compress(b"x")[:-4])
  with pytest.raises(BankError, match="does not decompress|does not match"):
    restore(bank, target)
  assert _files(target) == set()
  with pytest.raises(BankError, match="MANIFEST.json is missing"):
    restore(tmp_path, target)
  with pytest.raises(BankError, match="does not exist"):
    save(tmp_path / "missing", bank)
