"""Configs: loading a config file, typed overrides, and errors that name the field."""

import pytest

from dreamjax.commands.sample import SampleConfig
from dreamjax.config import apply_overrides, load_config


def test_overrides_are_parsed_by_field_type():
  cfg = apply_overrides(SampleConfig(), ["batch=3", "top_p=0.5", "model.tie_word_embeddings=true",
                                         "model.eos_token_id=7", "mesh.tensor=2"])
  assert (cfg.batch, cfg.top_p, cfg.model.tie_word_embeddings, cfg.model.eos_token_id, cfg.mesh.tensor) == (
      3, 0.5, True, 7, 2)
  assert apply_overrides(cfg, ["model.eos_token_id=none"]).model.eos_token_id is None
  assert apply_overrides(cfg, ["batch=4", "batch=5"]).batch == 5  # the last wins


def test_tuple_overrides_take_plain_lists_and_json_lists():
  """`--set 'trajectories=["a.jsonl", "b.jsonl"]'` once kept the quotes in each path ("... does not exist")."""
  from dreamjax.loop.learner import TaskSpec
  for raw in ("a,b", "(a, b)", '["a", "b"]', "['a','b']"):
    assert apply_overrides(TaskSpec(), [f"games={raw}"]).games == ("a", "b")


def test_fields_that_must_agree_change_together():
  """Each section is rebuilt once with all its changes: RLConfig refuses a rollout temperature its objective does not
  share, and one override at a time could never change both."""
  cfg = load_config("configs/grpo_real_twx.py:tiny", ["rollout.temperature=0.7", "objective.temperature=0.7"])
  assert (cfg.rollout.temperature, cfg.objective.temperature) == (0.7, 0.7)
  with pytest.raises(ValueError, match="must be > 0 and equal to objective.temperature"):
    load_config("configs/grpo_real_twx.py:tiny", ["rollout.temperature=0.7"])


@pytest.mark.parametrize("item, message", [
    ("bach=3", "unknown field 'bach'"),
    ("batch=three", "field 'batch' expects int"),
    ("model.tie_word_embeddings=maybe", "expects bool"),
    ("batch", "not of the form key=value"),
    ("batch.x=1", "not inside a config section"),
    ("model=1", "set its fields"),
    ("modl.eos_token_id=1", "unknown field 'modl.eos_token_id'"),
    ("model=1,model.eos_token_id=1", "set both 'model.eos_token_id' and a section above it"),
    ("model.eos_token_id=1,model=1", "set both 'model' and fields inside it"),
])
def test_bad_overrides_name_the_field(item, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(SampleConfig(), item.split(","))


def test_load_config_file_and_errors(tmp_path):
  assert load_config("configs/sample.py", ["batch=2"]).batch == 2
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_config(tmp_path / "missing.py")
  (tmp_path / "empty.py").write_text("x = 1\n")
  with pytest.raises(ValueError, match="defines no config"):
    load_config(tmp_path / "empty.py")


def test_variant_functions(tmp_path):
  f = tmp_path / "c.py"
  f.write_text("import dataclasses\n\n@dataclasses.dataclass(frozen=True)\nclass C:\n  n: int = 1\n\n"
               "def config():\n  return C()\n\ndef tiny():\n  return C(n=2)\n")
  assert load_config(str(f)).n == 1
  assert load_config(f"{f}:tiny", ["n=5"]).n == 5
  assert load_config(f"{f}:tiny").n == 2
  with pytest.raises(ValueError, match=r"defines no huge\(\) function \(variants here: config, tiny\)"):
    load_config(f"{f}:huge")


def test_a_mistyped_field_in_a_config_file_is_one_line_naming_file_line_and_field(tmp_path):
  f = tmp_path / "rl_typo.py"
  f.write_text("import dataclasses\n\nfrom dreamjax.loop.learner import RLConfig\nfrom dreamjax.rl.optim import "
               "OptimConfig\n\n\ndef config():\n  return RLConfig(iteratons=3)\n\n\ndef tiny():\n"
               "  return dataclasses.replace(RLConfig(), optim=OptimConfig(lerning_rate=1e-3))\n\n\n"
               "def bad_value():\n  return RLConfig(algorithm='a2c')\n")
  with pytest.raises(ValueError) as e:
    load_config(f)
  assert str(e.value).startswith(f"{f}:8: config(): RLConfig has no field 'iteratons' (did you mean 'iterations'?); "
                                 "its fields: ")
  assert "\n" not in str(e.value) and "max_nonfinite_updates" in str(e.value)
  # A section's class is found through the file's imports; no near name, but the valid ones.
  with pytest.raises(ValueError, match=rf"^{f}:12: tiny\(\): OptimConfig has no field 'lerning_rate'; its fields: "
                                       r"b1, b2, clip_norm, .*, lr, "):
    load_config(f"{f}:tiny")
  with pytest.raises(ValueError, match=rf"^{f}:16: bad_value\(\): RLConfig.algorithm must be one of"):
    load_config(f"{f}:bad_value")


def test_the_cli_prints_config_errors_as_one_line(tmp_path, capsys):
  from dreamjax.cli import main

  f = tmp_path / "sample_typo.py"
  f.write_text("from dreamjax.commands.sample import SampleConfig\n\n\ndef config():\n  return SampleConfig(bach=2)\n")
  assert main(["sample", "--config", str(f)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(f"dreamjax sample: {f}:5: config(): SampleConfig has no field 'bach' "
                                                 "(did you mean 'batch'?)")
