"""Every config in configs/: it loads (config() and its tiny CPU variant), it builds the config class of the command
its docstring runs it with, and every `dreamjax <cmd> --config configs/...` line in the docstrings names a file,
variant and command that fit together. Bad overrides through `dreamjax.cli.main` exit with code 2 and name the field."""

import ast
import dataclasses
import importlib
import re
import typing
from pathlib import Path

import pytest

from dreamjax.cli import COMMANDS, main
from dreamjax.config import load_config

CONFIGS = Path(__file__).parent.parent / "configs"
# configs/scale/ holds the real-size variants (dreamjax/plan/memory.py plans them); names are relative to configs/.
FILES = sorted(CONFIGS.glob("*.py")) + sorted(CONFIGS.glob("scale/*.py"))
NO_TINY = {"demo.py"}  # its config() is the tiny run already
RUN_LINE = re.compile(r"dreamjax ([a-z-]+) --config configs/((?:\w+/)?\w+\.py)(?::(\w+))?")


def _name(path: Path) -> str:
  return path.relative_to(CONFIGS).as_posix()


def _docstring(path: Path) -> str:
  doc = ast.get_docstring(ast.parse(path.read_text()))
  assert doc, f"{path.name} has no module docstring"
  return doc


def _functions(path: Path) -> set[str]:
  return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def _command(path: Path) -> str:
  """The command the file's own docstring runs it with."""
  commands = {cmd for cmd, name, _ in RUN_LINE.findall(_docstring(path)) if name == _name(path)}
  assert len(commands) == 1, f"{_name(path)}: its docstring should run it with one command, found {commands or 'none'}"
  return commands.pop()


def _config_class(command: str) -> type:
  module, function = COMMANDS[command][1].split(":")
  runner = getattr(importlib.import_module(module), function)
  return next(iter(typing.get_type_hints(runner).values()))  # as dreamjax.cli does


def test_configs_found():
  assert {p.name for p in FILES} >= {"annotate_twx.py", "collect_twx.py", "sample.py", "demo.py"}


@pytest.mark.parametrize("path", FILES, ids=_name)
def test_config_and_tiny_build_their_commands_config(path):
  command = _command(path)
  assert command in COMMANDS, f"{path.name}: `dreamjax {command}` is not a command"
  expected = _config_class(command)
  assert isinstance(expected, type) and dataclasses.is_dataclass(expected)
  cfg = load_config(path)
  assert type(cfg) is expected
  if _name(path) in NO_TINY:
    assert "tiny" not in _functions(path)
    return
  tiny = load_config(f"{path}:tiny")
  assert type(tiny) is expected and tiny != cfg
  assert f"dreamjax {command} --config configs/{_name(path)}:tiny" in _docstring(path)
  # A tiny run writes elsewhere than the full one, so trying it never mixes into (or resumes) a full run's folder.
  for field in ("out_dir", "trajectories"):
    if hasattr(cfg, field):
      assert getattr(tiny, field) != getattr(cfg, field), f"{path.name}: tiny() shares {field}"


def test_run_lines_in_docstrings_fit_the_files_they_name():
  own = {_name(p): _command(p) for p in FILES}
  lines = [(_name(p), m) for p in FILES for m in RUN_LINE.findall(_docstring(p))]
  assert len(lines) >= 2 * len(FILES) - len(NO_TINY)
  for where, (command, name, variant) in lines:
    assert name in own, f"{where}: names configs/{name}, which does not exist"
    assert command == own[name], f"{where}: runs configs/{name} with `dreamjax {command}`, not `dreamjax {own[name]}`"
    assert variant in ("", *_functions(CONFIGS / name)), f"{where}: configs/{name} defines no {variant}()"


def _fails(capsys, *argv: str) -> str:
  assert main(list(argv)) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  return captured.err


def test_bad_overrides_exit_2_naming_the_field(capsys):
  sample, annotate = str(CONFIGS / "sample.py"), str(CONFIGS / "annotate_twx.py")
  assert "unknown field 'bach' (known here: batch, checkpoint," in _fails(capsys, "sample", "--config", sample,
                                                                          "--set", "bach=3")
  err = _fails(capsys, "sample", "--config", f"{sample}:tiny", "--set", "batch=three")
  assert f"dreamjax sample: {sample}:tiny: field 'batch' expects int, got 'three'" in err
  assert "unknown field 'teacher.url'" in _fails(capsys, "annotate", "--config", annotate, "--set", "teacher.url=x")
  assert "field 'teacher.json_mode' expects bool, got 'maybe'" in _fails(capsys, "annotate", "--config", annotate,
                                                                        "--set", "teacher.json_mode=maybe")
  assert "field 'limit' expects int" in _fails(capsys, "annotate", "--config", annotate, "--set", "limit=2.5")
  # A value of the right type that the config refuses; a whole section; a config for another command.
  assert "AnnotateConfig.annotator must be one of" in _fails(capsys, "annotate", "--config", annotate,
                                                              "--set", "annotator=gpt")
  assert "a whole section cannot be set at once" in _fails(capsys, "annotate", "--config", annotate,
                                                            "--set", "teacher=x")
  assert "gives a SampleConfig; this command runs a AnnotateConfig" in _fails(capsys, "annotate", "--config", sample)
  assert "defines no huge() function (variants here: config, tiny)" in _fails(capsys, "sample", "--config",
                                                                               f"{sample}:huge")


@pytest.mark.parametrize("name", ["train_exp_twx.py", "train_policy_twx.py", "dpo_twx.py", "grpo_real_twx.py"])
def test_training_configs_take_tracking_overrides(name, capsys):
  path = CONFIGS / name
  cfg = load_config(f"{path}:tiny", ["track.wandb=offline", "track.progress=false", "track.tags=a,b"])
  assert (cfg.track.wandb, cfg.track.progress, cfg.track.tags) == ("offline", False, ("a", "b"))
  err = _fails(capsys, _command(path), "--config", f"{path}:tiny", "--set", "track.wandb=cloud")
  assert "TrackConfig.wandb must be one of ('off', 'online', 'offline'), got 'cloud'" in err
