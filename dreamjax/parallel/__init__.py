"""Meshes, logical-axis sharding rules, and multi-process initialisation and host helpers."""

from dreamjax.parallel.distributed import (
    DistributedConfig,
    barrier,
    check_same,
    from_primary,
    initialize,
    is_primary,
    leaf_to_host,
    spans_every_process,
    to_devices,
    to_host,
)
from dreamjax.parallel.mesh import AXES, MeshConfig, make_mesh
from dreamjax.parallel.sharding import (
    SAMPLE_RULES,
    TRAIN_RULES,
    Rules,
    constrain,
    logical_to_spec,
    named_sharding,
    tree_shardings,
)

__all__ = [
    "AXES", "DistributedConfig", "MeshConfig", "make_mesh", "SAMPLE_RULES", "TRAIN_RULES", "Rules", "barrier",
    "check_same", "constrain", "from_primary", "initialize", "is_primary", "leaf_to_host", "logical_to_spec", "named_sharding", "spans_every_process", "to_devices",
    "to_host", "tree_shardings",
]
