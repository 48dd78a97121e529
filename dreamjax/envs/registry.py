"""Env construction by name, so configs and pool workers (separate processes) can build adapters from plain data.

Adapters are imported lazily: importing dreamjax never starts a JVM or a browser or needs an optional package.
"""

from __future__ import annotations

import importlib
from typing import Any

from dreamjax.envs.base import Env

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
