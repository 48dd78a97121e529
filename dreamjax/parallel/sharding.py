"""Logical axis names -> mesh axes.

Parameters and activations name their axes (`embed`, `heads`, ...); a rule table maps each name to mesh axes
(`data`, `fsdp`, `tensor`). Training and sampling use different tables: training shards weights over `fsdp`, sampling
keeps them whole on every data shard so decoding never all-gathers weights per token.
A mesh axis that does not divide a dimension (2 KV heads on a tensor axis of 4) is dropped for that dimension rather
than failing, so one table serves every model size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_COMMON: Rules = (
    ("batch", ("data", "fsdp")),
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


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: jax.sharding.Mesh, rules: Rules) -> PartitionSpec:
  """PartitionSpec for one array; each mesh axis is used at most once and only where it divides the dimension."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name, dim in zip(names, shape, strict=True):
    target = table.get(name) if name is not None else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    axes = tuple(a for a in axes if a in mesh.shape and a not in used and mesh.shape[a] > 1)
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
      axes = axes[:-1]  # keep the leading axes that still divide
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def _is_partitioned(x) -> bool:
  return isinstance(x, nn.Partitioned)


def tree_shardings(boxed_tree, mesh: jax.sharding.Mesh, rules: Rules):
  """NamedShardings for a tree of `nn.LogicallyPartitioned` leaves (arrays or ShapeDtypeStructs), unboxed."""

  def one(leaf):
    if not _is_partitioned(leaf):
      return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_spec(leaf.names, leaf.value.shape, mesh, rules))

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
