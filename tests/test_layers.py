"""The package layering (docs/architecture.md): every import inside dreamjax runs from a higher layer to a lower one,
so no package-level cycle can form, and no command imports another command (`reproduce` runs them all)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dreamjax"

# Lowest first. A package may import packages of strictly lower layers only.
LAYERS = (
    ("parallel", "text", "config", "storage"),
    ("models", "envs"),
    ("sampling", "data"),
    ("rollout",),
    ("rl", "replay"),
    ("experience",),
    ("curriculum",),
    ("loop", "plan"),
    ("commands",),
    ("cli",),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _imports(path: pathlib.Path) -> list[str]:
  """Every dreamjax module `path` imports, at any depth (function-level imports count too)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dreamjax"):
      out += [node.module] if node.module != "dreamjax" else [f"dreamjax.{a.name}" for a in node.names]
      if node.module in ("dreamjax.commands",):
        out += [f"dreamjax.commands.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      out += [a.name for a in node.names if a.name.startswith("dreamjax.")]
  return out


def _package(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT)
  return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _modules():
  return [p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT]


def test_every_package_has_a_layer():
  packages = {_package(p) for p in _modules()}
  assert packages <= set(LAYER), f"add {sorted(packages - set(LAYER))} to LAYERS"


def test_imports_run_downward():
  wrong = []
  for path in _modules():
    src = _package(path)
    for module in _imports(path):
      dst = module.split(".")[1]
      if dst != src and LAYER[dst] >= LAYER[src]:
        wrong.append(f"{path.relative_to(ROOT.parent)} imports {module} ({src} is layer {LAYER[src]}, {dst} "
                     f"layer {LAYER[dst]})")
  assert not wrong, "\n".join(wrong)


def test_commands_do_not_import_each_other():
  wrong = []
  for path in (ROOT / "commands").glob("*.py"):
    if path.stem in ("reproduce", "__init__"):
      continue
    wrong += [f"{path.name} imports {m}" for m in _imports(path) if m.startswith("dreamjax.commands")]
  assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_violation(tmp_path):
  """The checks above can fail: an upward import written to a scratch module is found."""
  scratch = tmp_path / "models_scratch.py"
  scratch.write_text("from dreamjax.loop.run import Run\nimport dreamjax.commands.rl\n")
  assert _imports(scratch) == ["dreamjax.loop.run", "dreamjax.commands.rl"]
  assert LAYER["loop"] > LAYER["models"] and LAYER["commands"] > LAYER["models"]
