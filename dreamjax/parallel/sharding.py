"""Logical axis names -> mesh axes.

Parameters and activations name their axes (`embed`, `heads`, ...); a rule table maps each name to mesh axes
(`data`, `fsdp`, `tensor`). Training and sampling use different tables: training shards weights over `fsdp`, sampling
keeps them whole on every data shard so decoding never all-gathers weights per token.
A mesh axis that does not divide a dimension (2 KV heads on a tensor axis of 4) is dropped for that dimension rather
than failing, so one table serves every model size; `tree_shardings` warns (`ShardingWarning`) with what that costs
per device, and tools/memory_plan.py prints the same lines.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_COMMON: Rules = (
    ("batch", ("data", "fsdp")),
    ("layers", None),  # stacked layers (ModelConfig.scan_layers): each device holds every layer's shard
    ("seq", None),
    ("cache_seq", None),
    ("norm", None),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
TRAIN_RULES: Rules = (("embed", "fsdp"),) + _COMMON
SAMPLE_RULES: Rules = (("embed", None),) + _COMMON


class ShardingWarning(UserWarning):
  """A mesh axis left out of a parameter's layout because it does not divide the dimension (memory it costs)."""


def _placement(names: Sequence[str | None], shape: Sequence[int], mesh: jax.sharding.Mesh, rules: Rules
               ) -> tuple[PartitionSpec, list[tuple[str, int, str]]]:
  """(spec, dropped): each mesh axis is used at most once and only where it divides the dimension; `dropped` lists
  (logical name, dimension, mesh axis) for the axes the rules asked for that did not divide."""
  table = dict(rules)
  used: set[str] = set()
  spec, dropped = [], []
  for name, dim in zip(names, shape, strict=True):
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a in mesh.shape and a not in used and mesh.shape[a] > 1)
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
      dropped.append((name, dim, axes[-1]))
      axes = axes[:-1]  # keep the leading axes that still divide
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec), dropped


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: jax.sharding.Mesh, rules: Rules) -> PartitionSpec:
  """PartitionSpec for one array; each mesh axis is used at most once and only where it divides the dimension."""
  return _placement(names, shape, mesh, rules)[0]


def _is_partitioned(x) -> bool:
  return isinstance(x, nn.Partitioned)


@dataclasses.dataclass(frozen=True)
class DroppedAxis:
  """A mesh axis some parameters could not be split over, and the bytes per device that costs against a layout
  where it divided (what a different mesh or a model whose dimensions divide would save)."""

  axis: str
  size: int
  dims: tuple[str, ...]  # "heads=28": the logical dimensions it did not divide
  leaves: int
  extra_bytes: int

  def __str__(self) -> str:
    return (f"mesh axis {self.axis}={self.size} does not divide {', '.join(self.dims)}: {self.leaves} parameter "
            f"arrays are replicated over it, {self.extra_bytes / 2**30:.2f} GiB more per device than if it divided")


def dropped_axes(boxed_tree, mesh: jax.sharding.Mesh, rules: Rules) -> list[DroppedAxis]:
  """The mesh axes some parameters of the tree could not be split over (Qwen2.5-7B's 28 heads on tensor=8)."""
  found: dict[str, tuple[set[str], int, float]] = {}
  for leaf in jax.tree.leaves(boxed_tree, is_leaf=_is_partitioned):
    if not _is_partitioned(leaf):
      continue
    shape = leaf.value.shape
    spec, dropped = _placement(leaf.names, shape, mesh, rules)
    placed = math.prod(mesh.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
    shard_bytes = math.prod(shape) * jax.numpy.dtype(leaf.value.dtype).itemsize / placed
    for name, dim, axis in dropped:
      dims, leaves, extra = found.get(axis, (set(), 0, 0.0))
      dims.add(f"{name}={dim}")
      found[axis] = (dims, leaves + 1, extra + shard_bytes * (1 - 1 / mesh.shape[axis]))
  return [DroppedAxis(axis, mesh.shape[axis], tuple(sorted(dims)), leaves, round(extra))
          for axis, (dims, leaves, extra) in sorted(found.items())]


def tree_shardings(boxed_tree, mesh: jax.sharding.Mesh, rules: Rules):
  """NamedShardings for a tree of `nn.LogicallyPartitioned` leaves (arrays or ShapeDtypeStructs), unboxed. An axis
  dropped for a dimension is a `ShardingWarning` with its memory cost (Python shows each distinct one once)."""

  def one(leaf):
    if not _is_partitioned(leaf):
      return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_spec(leaf.names, leaf.value.shape, mesh, rules))

  for dropped in dropped_axes(boxed_tree, mesh, rules):
    warnings.warn(str(dropped), ShardingWarning, stacklevel=2)
  return jax.tree.map(one, boxed_tree, is_leaf=_is_partitioned)


def named_sharding(names: Sequence[str | None], shape: Sequence[int], mesh: jax.sharding.Mesh, rules: Rules) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Activation sharding constraint under the active `nn.logical_axis_rules` and `jax.set_mesh`; else a no-op."""
  rules = nn.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))
