"""`dreamjax tables` merges reproduce results into the paper's Table 1 and Table 2 layouts: methods in the paper's
order, one column per environment and backbone grouped by environment, the real-data column, "-" for a missing row,
and one-line errors for a missing file or field and for two runs claiming the same column."""

import json

import pytest

from dreamjax.cli import main
from dreamjax.commands.tables import TablesConfig, run


def result_row(method, rate, cap=None, kind="online"):
  return {"method": method, "success_rate": rate, "ci_low": rate - 0.1, "ci_high": rate + 0.1,
          "budget": {"kind": kind, "cap": cap, "spent": cap or 0}}


def write(folder, env, backbone, rows):
  folder.mkdir(parents=True)
  (folder / "results.json").write_text(json.dumps({"env": env, "backbone": backbone, "rows": rows}))
  return str(folder)


@pytest.fixture
def runs(tmp_path):
  twx_a = write(tmp_path / "twx_a", "textworld_express", "llama3b", [
      result_row("SFT", 0.3, 200, "offline"), result_row("GRPO (real env)", 0.5, 800),
      result_row("DreamGym GRPO", 0.45, 0), result_row("DreamGym GRPO w/o replay", 0.4, 0)])
  alf = write(tmp_path / "alf", "alfworld", "llama3b", [
      result_row("SFT", 0.6, 240, "offline"), result_row("DreamGym GRPO", 0.65, 0),
      result_row("DreamGym GRPO w/o task generation", 0.62, 0)])
  twx_b = write(tmp_path / "twx_b", "textworld_express", "qwen7b", [
      result_row("GRPO (real env)", 0.55, 800), result_row("SFT", 0.35, 200, "offline")])
  return [twx_a, alf, twx_b]


def test_table_layouts(runs, tmp_path):
  out = tmp_path / "tables"
  result = run(TablesConfig(results=tuple(runs), out_dir=str(out)))
  t1 = (out / "table1.md").read_text().splitlines()
  assert t1[2] == ("| method | real transitions | textworld_express / llama3b | textworld_express / qwen7b | "
                   "alfworld / llama3b |")
  assert t1[4] == "| SFT | 200 offline / 240 offline | 30.0 [20.0, 40.0] | 35.0 [25.0, 45.0] | 60.0 [50.0, 70.0] |"
  assert t1[5] == "| GRPO (real env) | 800 online | 50.0 [40.0, 60.0] | 55.0 [45.0, 65.0] | - |"
  assert t1[6] == "| DreamGym GRPO | 0 online | 45.0 [35.0, 55.0] | - | 65.0 [55.0, 75.0] |"
  assert len(t1) == 7  # methods no run has (DPO, S2R, PPO) are left out; ablations are Table 2's
  t2 = (out / "table2.md").read_text().splitlines()
  assert [line.split(" | ")[0] for line in t2[4:]] == ["| DreamGym GRPO", "| DreamGym GRPO w/o replay",
                                                       "| DreamGym GRPO w/o task generation"]
  assert t2[5].endswith("| 40.0 [30.0, 50.0] | - | - |")
  saved = json.loads((out / "tables.json").read_text())
  assert saved["table1"] == result["table1"] and saved["table2"]["columns"][2] == "alfworld / llama3b"


def test_bad_inputs_are_one_line_errors(runs, tmp_path, capsys):
  with pytest.raises(ValueError, match=r"twx_a/results.json and .*twx_a/results.json are both textworld_express / "
                                       r"llama3b"):
    run(TablesConfig(results=(runs[0], runs[0] + "/results.json")))
  old = tmp_path / "old"
  old.mkdir()
  (old / "results.json").write_text(json.dumps({"rows": []}))
  with pytest.raises(ValueError, match=r"old/results.json has no 'env' \(written by an older reproduce"):
    run(TablesConfig(results=(str(old),)))
  assert main(["tables", "--config", "configs/tables.py", "--set", f"results={tmp_path}/missing"]) == 2
  assert capsys.readouterr().err.strip() == (f"dreamjax tables: TablesConfig.results: {tmp_path}/missing does not "
                                             f"exist (run `dreamjax reproduce` first)")
