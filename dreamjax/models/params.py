"""Creating parameters: abstract shapes with logical axes, shardings, and sharded initialisation."""

from __future__ import annotations

import functools

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


# Stacked (`ModelConfig.scan_layers`) <-> unrolled layers. The same weights either way: training and scoring may run
# the scanned stack, while decoding with KV caches and the HF files keep one entry per layer.

def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


def _stack(*xs):
  if _is_box(xs[0]):
    return xs[0].replace(value=_stack(*(x.value for x in xs)), names=("layers", *xs[0].names))
  if isinstance(xs[0], jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
  return jnp.stack(xs)


def _take(x, i: int):
  if _is_box(x):
    return x.replace(value=_take(x.value, i), names=tuple(x.names[1:]))
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return x[i]


def _stack_tree(params, num_layers: int):
  if "layers" in params or "layers_0" not in params:
    raise ValueError("stack_layers: the parameters are not unrolled (no `layers_0` entry); already stacked?")
  names = [f"layers_{i}" for i in range(num_layers)]
  rest = {k: v for k, v in params.items() if k not in names}
  return {**rest, "layers": jax.tree.map(_stack, *(params[n] for n in names), is_leaf=_is_box)}


def _unstack_tree(params, num_layers: int):
  if "layers" not in params:
    raise ValueError("unstack_layers: the parameters are not stacked (no `layers` entry); already unrolled?")
  rest = {k: v for k, v in params.items() if k != "layers"}
  return {**rest, **{f"layers_{i}": jax.tree.map(lambda x, i=i: _take(x, i), params["layers"], is_leaf=_is_box)
                     for i in range(num_layers)}}


@functools.lru_cache(maxsize=32)
def _jitted(convert, num_layers: int, leaves: tuple | None = None, treedef=None):
  # One jitted conversion per (direction, layer count, target layout): a learner unstacking every iteration compiles
  # once, and one program does every slice rather than one eager dispatch per layer and leaf.
  fn = functools.partial(convert, num_layers=num_layers)
  return jax.jit(fn) if treedef is None else jax.jit(fn, out_shardings=jax.tree.unflatten(treedef, leaves))


def _convert(convert, params, cfg: ModelConfig, shardings):
  if shardings is not None:
    leaves, treedef = jax.tree.flatten(shardings)
    return _jitted(convert, cfg.num_layers, tuple(leaves), treedef)(params)
  if all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
    return _jitted(convert, cfg.num_layers)(params)
  return convert(params, num_layers=cfg.num_layers)  # boxes or ShapeDtypeStructs: nothing to compute


def stack_layers(params, cfg: ModelConfig, shardings=None):
  """Unrolled parameters (`layers_0` ... `layers_{L-1}`) in the layout of `cfg.replace(scan_layers=True)`: one `layers`
  entry whose leaves carry a leading layer axis; the other entries pass through. Pure (fine under jit), and also takes
  boxed trees (`nn.LogicallyPartitioned` arrays or ShapeDtypeStructs, as `abstract_params`), adding the axis name
  "layers". Arrays convert in one jitted program (cached), laid out by `shardings` when given (the stacked tree's,
  e.g. `param_shardings(cfg)`), so a sharded tree converts on its devices; else where XLA puts them."""
  return _convert(_stack_tree, params, cfg, shardings)


def unstack_layers(params, cfg: ModelConfig, shardings=None):
  """The inverse of `stack_layers`: stacked parameters in the unrolled layout of `cfg.replace(scan_layers=False)`,
  which KV-cache forwards (the sampler) need; exact (slices of the same values). `shardings` as in `stack_layers`."""
  return _convert(_unstack_tree, params, cfg, shardings)


def sampling_copy(params, cfg: ModelConfig, shardings=None):
  """Training parameters as a sampler wants them: unrolled (KV-cache decoding; `unstack_layers` when `cfg.scan_layers`),
  in the compute dtype (`in_compute_dtype`: exact, half the bytes in a bfloat16 run; cast before unstacking, so no
  float32 copy is made) and laid out as `shardings` (the sampler's `param_shardings()`; None: as they are). With
  nothing to change these are `params` themselves, no copy."""
  cast = jnp.dtype(cfg.dtype) != jnp.dtype(cfg.param_dtype)
  if cfg.scan_layers:
    return unstack_layers(in_compute_dtype(params, cfg) if cast else params, cfg, shardings)
  if cast:
    return in_compute_dtype(params, cfg, shardings)
  return params if shardings is None else jax.device_put(params, shardings)
