"""Device mesh from config: axes `data` (replicas), `fsdp` (sharded weights and batch), `tensor` (model parallel)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Axis sizes; one of them may be -1, meaning all remaining devices."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
  devices = list(devices if devices is not None else jax.devices())
  sizes = [cfg.data, cfg.fsdp, cfg.tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"MeshConfig: at most one axis may be -1, got {cfg}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"MeshConfig {cfg}: {len(devices)} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"MeshConfig {cfg} needs {math.prod(sizes)} devices, {len(devices)} are available")
  # Auto axes: sharding is propagated by the compiler from the parameter and input shardings we give it.
  return jax.sharding.Mesh(
      np.asarray(devices).reshape(sizes), AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES)
  )
