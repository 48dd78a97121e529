"""The run block every training and evaluation command's config starts from, defined once (DreamGym takes it through its
`rl` section; collect, annotate and reproduce write plain folders): where the run writes, its seed, its devices and
mesh, multi-process start-up and tracking. A command's config inherits it (`class RLConfig(RunConfig)`), so
`--set out_dir=...`, `--set seed=1` and `--set mesh.fsdp=4` mean the same thing for every command."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from dreamjax.loop.track import TrackConfig
from dreamjax.parallel import DistributedConfig, MeshConfig, make_mesh, spans_every_process


@dataclasses.dataclass(frozen=True)
class RunConfig:
  out_dir: str = "runs/run"
  seed: int = 0
  # The devices the mesh spans: the first `devices` of jax.devices(); 0: all of them when an axis of `mesh` is -1,
  # else the first prod(mesh sizes).
  mesh: MeshConfig = MeshConfig()
  devices: int = 0
  track: TrackConfig = TrackConfig()
  distributed: DistributedConfig = DistributedConfig()  # multi-process runs (default: from the environment)


def run_mesh(cfg: RunConfig) -> jax.sharding.Mesh:
  """The run's mesh over its devices; with several processes it must hold devices of every one of them."""
  if cfg.devices < 0:
    raise ValueError(f"{type(cfg).__name__}.devices must be >= 0, got {cfg.devices}")
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  devices = jax.devices()
  if cfg.devices:
    devices = devices[:cfg.devices]
  elif -1 not in sizes:
    devices = devices[:math.prod(sizes)]
  return spans_every_process(make_mesh(cfg.mesh, devices), f"{type(cfg).__name__}.mesh, devices")


def check_settings(cfg: Any, positive: Sequence[str] = (), non_negative: Sequence[str] = ()) -> None:
  """Refuses settings that cannot run, naming the field."""
  name = type(cfg).__name__
  for field in positive:
    if getattr(cfg, field) < 1:
      raise ValueError(f"{name}.{field} must be >= 1, got {getattr(cfg, field)}")
  for field in non_negative:
    if getattr(cfg, field) < 0:
      raise ValueError(f"{name}.{field} must be >= 0, got {getattr(cfg, field)}")
