"""Experiment configs: a Python file in configs/ defines `config()` returning a frozen dataclass tree;
`--set a.b=value` overrides are parsed by the type of the field they replace, with errors that name the field.

A config function that fails while building its tree (a mistyped field such as `RLConfig(lerning_rate=...)`, a value a
section's `__post_init__` refuses) is reported as one ValueError naming the file, the line and, for a mistyped
field, the class, the nearest valid field names and the valid ones; errors of other kinds (a bad import, a syntax
error) keep their traceback, which is the useful report for code.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import traceback
import types
import typing
from pathlib import Path
from typing import Any


def load_config(path: str | Path, overrides: list[str] = ()) -> Any:
  """`configs/x.py` calls its `config()`; `configs/x.py:tiny` calls its `tiny()` (a config's small CPU variant)."""
  path, _, variant = str(path).partition(":")
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"config file {path} does not exist")
  spec = importlib.util.spec_from_file_location(f"dreamjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  name = variant or "config"
  if not callable(getattr(module, name, None)):
    known = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and
                   getattr(v, "__module__", None) == module.__name__ and not isinstance(v, type))
    raise ValueError(f"{path}: defines no {name}() function (variants here: {', '.join(known) or 'none'})")
  try:
    cfg = getattr(module, name)()
  except (TypeError, ValueError) as e:
    raise ValueError(_build_error(e, path, name, module)) from None
  return apply_overrides(cfg, overrides, source=f"{path}:{name}" if variant else str(path))


_UNKNOWN = re.compile(r"^(?P<cls>[\w.]+?)(?:\.__init__)?\(\) got an unexpected keyword argument '(?P<field>\w+)'")


def _build_error(e: Exception, path: Path, function: str, module: types.ModuleType) -> str:
  """One line for an error raised while `function()` of the config file built its tree."""
  frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
  where = f"{path}:{frames[-1].lineno}" if frames else str(path)
  match = _UNKNOWN.match(str(e))
  if not match:
    return f"{where}: {function}(): {e}"
  cls_name, field = match["cls"].rsplit(".", 1)[-1], match["field"]
  cls = _find_dataclass(module, cls_name)
  if cls is None:  # not a config section (a function, or a class the file cannot reach): name the argument
    return f"{where}: {function}(): {cls_name}() takes no argument {field!r}"
  fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)
  near = difflib.get_close_matches(field, fields, n=3)
  hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
  return f"{where}: {function}(): {cls_name} has no field {field!r}{hint}; its fields: {', '.join(fields)}"


def _find_dataclass(module: types.ModuleType, name: str) -> type | None:
  """The dataclass called `name` that the config module can reach: its own names, then the sections (field types) of
  those classes, so `RLConfig(optim=OptimConfig(...))` finds OptimConfig whichever way the file imported it."""
  seen: set[type] = set()
  todo = [v for v in vars(module).values() if isinstance(v, type) and dataclasses.is_dataclass(v)]
  while todo:
    cls = todo.pop(0)
    if cls in seen:
      continue
    seen.add(cls)
    if cls.__name__ == name:
      return cls
    try:
      hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: this class's sections are not searched
      continue
    for hint in hints.values():
      todo += [h for h in (hint, *typing.get_args(hint)) if isinstance(h, type) and dataclasses.is_dataclass(h)]
  return None


def apply_overrides(cfg: Any, items: list[str], source: str = "config") -> Any:
  """`cfg` with every `key=value` of `items` (the last wins for a key given twice). Each section is rebuilt once with
  all of its changes, so a section's `__post_init__` checks them together: fields that must agree, such as RLConfig's
  rollout.temperature and objective.temperature, can be changed together from the command line."""
  tree: dict[str, Any] = {}
  for item in items:
    if "=" not in item:
      raise ValueError(f"override {item!r} is not of the form key=value")
    key, raw = (s.strip() for s in item.split("=", 1))
    *parents, leaf = key.split(".")
    node = tree
    for name in parents:
      node = node.setdefault(name, {})
      if not isinstance(node, dict):
        raise ValueError(f"{source}: overrides set both {key!r} and a section above it")
    if isinstance(node.get(leaf), dict):
      raise ValueError(f"{source}: overrides set both {key!r} and fields inside it")
    node[leaf] = (raw, key)
  return _apply(cfg, tree, source)


def _apply(node: Any, tree: dict[str, Any], source: str) -> Any:
  changes = {}
  for name, change in tree.items():
    key = _first_key(change)
    if not dataclasses.is_dataclass(node):
      raise ValueError(f"{source}: cannot override {key!r}: {name} is not inside a config section")
    fields = {f.name for f in dataclasses.fields(node)}
    if name not in fields:
      raise ValueError(f"{source}: unknown field {key!r} (known here: {', '.join(sorted(fields))})")
    if isinstance(change, dict):
      changes[name] = _apply(getattr(node, name), change, source)
      continue
    raw = change[0]
    hint = typing.get_type_hints(type(node))[name]
    try:
      changes[name] = _parse(raw, hint)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{source}: field {key!r} expects {_name(hint)}, got {raw!r} ({e})") from None
  return dataclasses.replace(node, **changes)


def _first_key(change: tuple[str, str] | dict[str, Any]) -> str:
  """The full key of an override (the first one inside a section's changes), for error messages."""
  while isinstance(change, dict):
    change = next(iter(change.values()))
  return change[1]


def _name(hint) -> str:
  return getattr(hint, "__name__", str(hint))


def _unquote(s: str) -> str:
  return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


def _parse(raw: str, hint) -> Any:
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(hint)
    if raw.lower() == "none" and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _parse(raw, option)
      except (ValueError, TypeError) as e:
        errors.append(str(e))
    raise ValueError("; ".join(errors))
  if origin is tuple:
    # "a,b", "(a, b)" and a JSON list '["a", "b"]' all give ("a", "b"): quotes around an element are not part of it.
    items = [_unquote(s.strip()) for s in raw.strip().strip("()[]").split(",") if s.strip()]
    args = typing.get_args(hint)
    element = args[0] if args else str
    return tuple(_parse(s, element) for s in items)
  if hint is bool:
    if raw.lower() in ("1", "true", "yes"):
      return True
    if raw.lower() in ("0", "false", "no"):
      return False
    raise ValueError("not a boolean")
  if hint in (int, float, str):
    return hint(raw)
  if dataclasses.is_dataclass(hint):
    raise TypeError("a whole section cannot be set at once; set its fields")
  raise TypeError(f"unsupported field type {hint}")
