"""Creating parameters: abstract shapes with logical axes, shardings, and sharded initialisation."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dreamjax.models.config import ModelConfig
from dreamjax.models.transformer import Transformer
from dreamjax.parallel.sharding import Rules, TRAIN_RULES, tree_shardings


def _init(cfg: ModelConfig, rng: jax.Array):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(rng, tokens, tokens, jnp.ones((1, 1), bool))["params"]


def abstract_params(cfg: ModelConfig):
  """The parameter tree as `nn.LogicallyPartitioned` boxes of ShapeDtypeStructs: shapes and axis names, no memory."""
  return jax.eval_shape(lambda: _init(cfg, jax.random.key(0)))


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Rules = TRAIN_RULES):
  return tree_shardings(abstract_params(cfg), mesh, rules)


def init_params(cfg: ModelConfig, rng: jax.Array, mesh: jax.sharding.Mesh | None = None, rules: Rules = TRAIN_RULES):
  """Random parameters (plain arrays), created directly in their shards when a mesh is given."""
  if mesh is None:
    return nn.unbox(jax.jit(_init, static_argnums=0)(cfg, rng))
  shardings = param_shardings(cfg, mesh, rules)
  return jax.jit(lambda r: nn.unbox(_init(cfg, r)), out_shardings=shardings)(rng)


# Leaves the model reads in float32 whatever the compute dtype (the critic's head: `Transformer`'s values einsum).
FLOAT32_LEAVES = ("value_head",)


def in_compute_dtype(params, cfg: ModelConfig, shardings=None):
  """A copy of `params` with every leaf in the compute dtype (`cfg.dtype`), laid out as `shardings` (default: as
  they are). Exact for every forward pass: the model casts each weight to the compute dtype where it reads it
  (`Transformer`), and casting twice is casting once, so the logits are bit for bit those of the full-precision
  weights. The exception is `FLOAT32_LEAVES`, which it reads in float32 and this keeps in the parameters' dtype. For
  what never trains (the frozen reference, the sampler's copy): a bfloat16 run stores and reads them at half the
  bytes. Always a new tree (the train step donates the parameters' buffers)."""
  dt = jnp.dtype(cfg.dtype)

  def cast(path, x):
    keep = jax.tree_util.keystr(path[:1], simple=True, separator="/") in FLOAT32_LEAVES
    return jnp.copy(x) if keep or x.dtype == dt else x.astype(dt)

  fn = lambda p: jax.tree_util.tree_map_with_path(cast, p)  # noqa: E731
  return jax.jit(fn, out_shardings=shardings)(params) if shardings is not None else jax.jit(fn)(params)
