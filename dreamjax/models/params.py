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
