"""`dreamjax sample` end to end at a tiny size: tokenizer training, checkpoint export and reload, sampling."""

import json

from dreamjax.cli import main


def test_sample_runs_and_writes_its_report(tmp_path):
  args = ["sample", "--config", "configs/sample.py", "--set", f"out_dir={tmp_path}", "--set", "batch=2",
          "--set", "max_new_tokens=8", "--set", "model.num_layers=1"]
  assert main(args) == 0
  report = json.loads((tmp_path / "sample.json").read_text())
  assert report["batch"] == 2 and report["tokens_per_s"] > 0 and report["compilations"] == 1
  assert len(report["samples"]) == 2
  assert (tmp_path / "tiny-checkpoint" / "model.safetensors").is_file()
  assert main(args) == 0  # reuses the checkpoint it built


def test_cli_reports_bad_overrides(capsys):
  assert main(["sample", "--config", "configs/sample.py", "--set", "batch=x"]) == 2
  assert "field 'batch' expects int" in capsys.readouterr().err
