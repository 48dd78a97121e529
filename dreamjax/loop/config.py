"""The run block every training and evaluation command's config starts from, defined once (DreamGym takes it through its
`rl` section; collect, annotate and reproduce write plain folders): where the run writes, its seed, its devices and
mesh, multi-process start-up and tracking. A command's config inherits it (`class RLConfig(RunConfig)`), so
`--set out_dir=...`, `--set seed=1` and `--set mesh.fsdp=4` mean the same thing for every command."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from dreamjax.loop.track import TrackConfig
from dreamjax.parallel import DistributedConfig, MeshConfig, initialize, make_mesh, spans_every_process
from dreamjax.storage import check_remote, require_local

# Overrides RunConfig.compilation_cache "auto" for every run of a process tree (tests/conftest.py sets "off").
CACHE_ENV = "DREAMJAX_COMPILATION_CACHE"
EXPORT_DTYPES = ("", "float32", "bfloat16")


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
  # JAX's persistent compilation cache, so a restarted or resumed run loads its compiled steps instead of compiling
  # every layer again: "auto" is <out_dir>/compile_cache (or $DREAMJAX_COMPILATION_CACHE when set), "off" leaves
  # JAX's own setting alone (none, unless JAX_COMPILATION_CACHE_DIR is set), any other value a folder, which runs may
  # share (JAX trusts what it finds there: share it only with yourself).
  compilation_cache: str = "auto"
  # The dtype of the trained model's HF export: "" keeps the parameters' own (exact: float32 weights stay float32);
  # "bfloat16" halves the files and the bytes each leaf's gather moves, at bfloat16 rounding of the weights.
  export_dtype: str = ""
  # Where checkpoints go: "" is <out_dir>/checkpoints. May be a URI (gs://bucket/run/checkpoints); out_dir itself must
  # stay on POSIX storage (dreamjax.storage). Rerun with the same value to resume.
  checkpoint_dir: str = ""
  # Where the trained model's HF folder goes: "" is inside out_dir (final/ for RL, checkpoint/ for SFT, DPO and M_exp
  # SFT). May be a URI; loading it back stages a local copy.
  export_dir: str = ""


def checkpoint_folder(cfg: RunConfig) -> str:
  """The folder `cfg.checkpoint_dir` names (see RunConfig)."""
  return cfg.checkpoint_dir or str(Path(cfg.out_dir) / "checkpoints")


def export_folder(cfg: RunConfig, default: str) -> str:
  """The folder `cfg.export_dir` names, `default` inside out_dir when it is empty (see RunConfig)."""
  return cfg.export_dir or str(Path(cfg.out_dir) / default)


def compilation_cache_dir(cfg: RunConfig) -> str | None:
  """The folder `cfg.compilation_cache` names (see RunConfig), None when off (JAX's own setting stands)."""
  value = cfg.compilation_cache
  if value == "auto":
    value = os.environ.get(CACHE_ENV) or str(Path(cfg.out_dir) / "compile_cache")
  return None if value == "off" else value


def export_dtype(cfg: RunConfig) -> str | None:
  """`cfg.export_dtype` as `save_model` takes it (None: the parameters' own), checked, naming the field."""
  if cfg.export_dtype not in EXPORT_DTYPES:
    raise ValueError(f"{type(cfg).__name__}.export_dtype must be one of {EXPORT_DTYPES}, got {cfg.export_dtype!r}")
  return cfg.export_dtype or None


def start_run(cfg: RunConfig) -> None:
  """What every command does before anything touches devices: joins the multi-process run (after it, jax.devices()
  spans every process) and points JAX's persistent compilation cache at the run's folder. JAX reads its cache
  setting once per process, so a change (reproduce runs its stages in one process) resets it."""
  export_dtype(cfg)  # checked now, not after training
  name = type(cfg).__name__
  require_local(cfg.out_dir, f"{name}.out_dir")
  check_remote(cfg.checkpoint_dir, f"{name}.checkpoint_dir")
  check_remote(cfg.export_dir, f"{name}.export_dir")
  initialize(cfg.distributed)
  path = compilation_cache_dir(cfg)
  if path is not None and path != jax.config.jax_compilation_cache_dir:
    compilation_cache.reset_cache()
    compilation_cache.set_cache_dir(path)


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
