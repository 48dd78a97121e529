"""Meshes and logical-axis sharding rules."""

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
    "AXES", "MeshConfig", "make_mesh", "SAMPLE_RULES", "TRAIN_RULES", "Rules", "constrain", "logical_to_spec",
    "named_sharding", "tree_shardings",
]
