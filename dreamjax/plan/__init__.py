"""Run planning: what a training run needs per device, from configs alone, before any chip is paid for.

`memory` plans per-device memory of each phase of an RL or DreamGym iteration (parameters, AdamW moments, gradients,
reference, M_exp, KV caches, activations) for a model, a mesh and the loop's settings. It sits above models, parallel
and rl, whose parameter trees and sharding rules it reuses, and takes the loops' configs duck-typed (`RL_FIELDS`,
`DREAMGYM_FIELDS`) so nothing below the loops imports them.
"""

from dreamjax.plan.memory import (
    ACCELERATORS,
    DREAMGYM_FIELDS,
    DTYPE_BYTES,
    GIB,
    PUBLISHED,
    PUBLISHED_SIZES,
    RL_FIELDS,
    Line,
    MemoryPlan,
    ParamSpec,
    activation_bytes,
    forward_bytes,
    kv_cache_bytes,
    local_rows,
    mesh_sizes,
    missing_fields,
    param_bytes,
    param_count,
    param_specs,
    plan_dreamgym,
    plan_rl,
    published_config,
    same_layout,
    shard_elements,
)

__all__ = [
    "ACCELERATORS", "DREAMGYM_FIELDS", "DTYPE_BYTES", "GIB", "PUBLISHED", "PUBLISHED_SIZES", "RL_FIELDS", "Line",
    "MemoryPlan", "ParamSpec", "activation_bytes", "forward_bytes", "kv_cache_bytes", "local_rows", "mesh_sizes",
    "missing_fields", "param_bytes", "param_count", "param_specs", "plan_dreamgym", "plan_rl", "published_config",
    "same_layout", "shard_elements",
]
