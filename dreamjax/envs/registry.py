"""Env construction by name, so configs and pool workers (separate processes) can build adapters from plain data:
one env (`make_env`), a batch of them in this process or in worker processes (`make_batch_env`), an adapter's tasks
(`env_tasks`), and the "key=value" env settings configs carry (`parse_env_kwargs`).

Adapters are imported lazily: importing dreamjax never starts a JVM or a browser or needs an optional package.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from dreamjax.envs.base import BatchEnv, Env, SerialBatchEnv, Task

ADAPTERS = {
    "textworld_express": "dreamjax.envs.textworld_express:TextWorldExpressEnv",
    "alfworld": "dreamjax.envs.alfworld:AlfworldEnv",
    "miniwob": "dreamjax.envs.miniwob:MiniWobEnv",
    "webshop": "dreamjax.envs.webshop:WebShopEnv",
}


def make_env(name: str, **kwargs: Any) -> Env:
  if name not in ADAPTERS:
    raise ValueError(f"unknown env {name!r}; known: {', '.join(sorted(ADAPTERS))}")
  module, cls = ADAPTERS[name].split(":")
  return getattr(importlib.import_module(module), cls)(**kwargs)


def make_batch_env(name: str, env_kwargs: Sequence[str], rows: int, num_workers: int = 0, **pool_kw: Any) -> BatchEnv:
  """`rows` envs stepped together: in this process (`num_workers` 0; one env per row), or an EnvPool of that many
  worker processes (any number of rows; `pool_kw` are EnvPool's timeouts)."""
  kwargs = parse_env_kwargs(env_kwargs)
  if num_workers <= 0:
    return SerialBatchEnv([make_env(name, **kwargs) for _ in range(rows)], lambda: make_env(name, **kwargs))
  from dreamjax.envs.pool import EnvPool

  return EnvPool(name, kwargs, num_workers, **pool_kw)


def parse_env_kwargs(items: Sequence[str]) -> dict[str, Any]:
  """"key=value" items as keyword arguments; values parse as JSON where they can, else stay text."""
  out = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"env_kwargs: expected key=value, got {item!r}")
    try:
      out[key.strip()] = json.loads(raw)
    except json.JSONDecodeError:
      out[key.strip()] = raw
  return out


# How each adapter module's tasks() is called for (game, split, n, start, params). The default is TWX's and MiniWoB's
# signature; ALFWorld draws by split and task type (its "games"), its `start` counting seeds of that type.
_TASK_CALLS: dict[str, Callable[..., list[Task]]] = {
    "alfworld": lambda m, game, split, n, start, params: m.tasks(split, task_types=(game,), n=n, start=start),
}


def _default_task_call(m, game, split, n, start, params):
  return m.tasks(game, split, n, start=start, **({"params": params} if params else {}))


def env_tasks(env: str, game: str, split: str, n: int, start: int = 0, params: str = "") -> list[Task]:
  """n tasks of one game from the env adapter module's own tasks() function."""
  if env not in ADAPTERS:
    raise ValueError(f"unknown env {env!r}; known: {', '.join(sorted(ADAPTERS))}")
  module = importlib.import_module(ADAPTERS[env].split(":")[0])
  if not hasattr(module, "tasks"):
    raise ValueError(f"env {env!r}: its adapter {module.__name__} has no tasks() function to draw tasks from")
  return _TASK_CALLS.get(env, _default_task_call)(module, game, split, n, start, params)
