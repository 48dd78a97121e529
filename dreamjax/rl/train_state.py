"""The trainer's state pytree (step, parameters, optimizer state) and where each leaf lives on the mesh.

Optimizer moments are copies of the parameter tree, so they take the parameters' shardings
(`optax.tree_utils.tree_map_params` finds them inside any optax state); scalars such as Adam's count are replicated.
The train step's in/out shardings come from `train_state_shardings`, so parameters never move between steps.
`abstract` (default: the model's whole tree, `abstract_params`) names another parameter tree of the model's logical
axes: PPO's separate critic has no `lm_head` (`dreamjax.rl.critic.critic_abstract_params`) and is laid out by the same
rules as the policy.

`nonfinite_leaves` names the floating-point leaves of any pytree that hold a NaN or an infinity: checkpoints and
exported models refuse such weights (`dreamjax.loop.checkpoint`, `dreamjax.loop.model.save_model`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Int

from dreamjax.models.config import ModelConfig
from dreamjax.models.params import abstract_params, param_shardings
from dreamjax.parallel.sharding import TRAIN_RULES, Rules, tree_shardings


@flax.struct.dataclass
class TrainState:
  step: Int[Array, ""]
  params: Any
  opt_state: optax.OptState


def train_state_shardings(cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                          rules: Rules = TRAIN_RULES, abstract: Any = None) -> TrainState:
  """A TrainState of NamedShardings: parameters and their optimizer copies by the rules, everything else replicated.
  `abstract`: the parameter tree (boxed, as `abstract_params` gives it) when it is not the model's whole tree."""
  if abstract is None:
    p_shard = param_shardings(cfg, mesh, rules)
    abstract = abstract_params(cfg)
  else:
    p_shard = tree_shardings(abstract, mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_abstract = jax.eval_shape(optimizer.init, nn.unbox(abstract))
  opt_shard = optax.tree_utils.tree_map_params(
      optimizer, lambda _, s: s, opt_abstract, p_shard, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, NamedSharding),
  )
  return TrainState(step=replicated, params=p_shard, opt_state=opt_shard)


def create_train_state(cfg: ModelConfig, params, optimizer: optax.GradientTransformation,
                       mesh: jax.sharding.Mesh | None = None, rules: Rules = TRAIN_RULES,
                       abstract: Any = None) -> TrainState:
  """A fresh state at step 0; with a mesh, parameters are resharded for training and moments are created in place.
  `abstract`: as in `train_state_shardings`."""
  if mesh is None:
    # Committed to the device, as the jitted step's outputs are: uncommitted scalars (the step, Adam's count) would
    # make the step compile a second time on its own first output.
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    return jax.device_put(state, jax.local_devices()[0])
  shardings = train_state_shardings(cfg, optimizer, mesh, rules, abstract)
  params = jax.device_put(params, shardings.params)
  init = jax.jit(lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p)),
                 in_shardings=(shardings.params,), out_shardings=shardings)
  return init(params)


def _leaf_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path) or "<root>"


def _is_float(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> list[jax.Array]:
  # One program for the whole tree (one compilation per tree structure): a reduction per leaf, where it lives.
  return [jnp.all(jnp.isfinite(x)) for x in leaves]


def nonfinite_leaves(tree: Any) -> list[str]:
  """Paths ("state/params/embed/embedding") of the floating-point leaves of `tree` holding a NaN or an infinity.
  Device arrays are reduced where they live, one jitted call per set of devices (a collective with several processes:
  every process must call it); NumPy leaves and arrays local to one of several processes are checked on the host."""
  flat = [(_leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if _is_float(x)]
  groups: dict[Any, list[int]] = {}
  host = []
  for i, (_, x) in enumerate(flat):
    if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.sharding.is_fully_addressable):
      groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    else:
      host.append(i)
  finite = {i: bool(np.isfinite(np.asarray(flat[i][1])).all()) for i in host}
  for idx in groups.values():
    finite |= dict(zip(idx, jax.device_get(_all_finite([flat[i][1] for i in idx]))))
  return [name for i, (name, _) in enumerate(flat) if not finite[i]]
