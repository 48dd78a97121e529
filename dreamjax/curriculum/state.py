"""Curriculum state: reward-variance statistics per task slot, pure updates and selection, (the host-side task pool is pool.py).

docs/paper_map.md, "Curriculum": a task tau rolled out n times has reward variance V_tau = (1/n) sum_i (r_i - mean r)^2 (p(1-p)
for binary rewards); tasks with non-zero, high variance are "feasible yet challenging" and are preferred, M_task writes
variants of them, and lambda caps the fraction of generated tasks per iteration.

Design:
- `CurriculumState` is a fixed-capacity pytree of per-slot arrays, so adding or evicting tasks, updating statistics and
  selecting never change a shape and never recompile. Slot contents (which `Task` lives where) are host data, kept by
  `TaskPool`.
- Statistics are exponential moving averages over iterations, with decay `ema` (new = ema * old + (1 - ema) * batch);
  a task's first batch initialises them, so no prior biases a measured value. Within a batch, V_tau is the population
  variance of the task's group of episodes (the GRPO group). For PPO a group is a cluster of tasks (clusters.py): pass
  `groups` and every task takes the mean and variance of its cluster's episodes.
- Selection samples without replacement from a mixture: with weight 1 - explore_prob a softmax of V_tau / temperature
  over preferred tasks (measured variance above `min_variance`), with weight explore_prob uniform over all tasks.
  Never-tried tasks get an optimistic prior: by default an infinite one, so they come first (in random order) and
  every task is tried within capacity / num_tasks iterations (generated ones as the lambda cap lets them); a finite
  `prior_variance` (e.g. PRIOR_VARIANCE) instead enters them into the softmax with that score, trading the guarantee
  for a softer warm-up.
  Sampling uses Gumbel-top-k (Plackett-Luce); the lambda cap keeps only the best-keyed `num_generated_max` generated
  tasks eligible, which is exactly sequential sampling that skips generated tasks once the cap is reached. When too
  few tasks have positive probability, the rest of the batch is filled with valid tasks in random order; -1 only when
  the pool (within the cap) holds fewer than `num_tasks` tasks.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


PRIOR_VARIANCE = 0.25  # the largest population variance of a binary reward: p(1 - p) at p = 0.5


@flax.struct.dataclass
class CurriculumState:
  valid: Bool[Array, " C"]  # the slot holds a task
  is_generated: Bool[Array, " C"]  # written by M_task (counts against lambda)
  parent: Int[Array, " C"]  # slot of the task it is a variant of; -1 for seed tasks
  depth: Int[Array, " C"]  # 0 for seed tasks, parent's depth + 1 for variants
  times_sampled: Int[Array, " C"]  # updates in which the task had at least one valid episode
  episodes: Int[Array, " C"]  # valid episodes counted over all updates
  reward_mean: Float[Array, " C"]  # EMA of the batch mean reward
  reward_var: Float[Array, " C"]  # EMA of the batch population variance V_tau
  last_seen: Int[Array, " C"]  # `iteration` of the last update that saw the task; -1 never
  iteration: Int[Array, ""]  # number of updates so far

  @property
  def capacity(self) -> int:
    return int(self.valid.shape[0])


def init(capacity: int) -> CurriculumState:
  if capacity < 1:
    raise ValueError(f"curriculum capacity must be positive, got {capacity}")
  z = jnp.zeros((capacity,), jnp.int32)
  return CurriculumState(
      valid=jnp.zeros((capacity,), bool), is_generated=jnp.zeros((capacity,), bool), parent=z - 1, depth=z,
      times_sampled=z, episodes=z, reward_mean=jnp.zeros((capacity,), jnp.float32),
      reward_var=jnp.zeros((capacity,), jnp.float32), last_seen=z - 1, iteration=jnp.zeros((), jnp.int32))


def _targets(state: CurriculumState, slots: Int[Array, " M"]) -> Int[Array, " M"]:
  # -1 (and anything out of range) is pointed past the end so scatters with mode="drop" skip it; -1 itself would wrap.
  slots = jnp.asarray(slots, jnp.int32)
  return jnp.where((slots >= 0) & (slots < state.capacity), slots, state.capacity)


def add(state: CurriculumState, slots: Int[Array, " M"], *, is_generated: Bool[Array, " M"], parent: Int[Array, " M"],
        depth: Int[Array, " M"]) -> CurriculumState:
  """Occupies `slots` (-1 entries skipped) with fresh tasks: statistics reset, never sampled."""
  i = _targets(state, slots)

  def put(x, v):
    return x.at[i].set(jnp.broadcast_to(jnp.asarray(v, x.dtype), i.shape), mode="drop")

  return state.replace(
      valid=put(state.valid, True), is_generated=put(state.is_generated, is_generated),
      parent=put(state.parent, parent), depth=put(state.depth, depth), times_sampled=put(state.times_sampled, 0),
      episodes=put(state.episodes, 0), reward_mean=put(state.reward_mean, 0.0), reward_var=put(state.reward_var, 0.0),
      last_seen=put(state.last_seen, -1))


def remove(state: CurriculumState, slots: Int[Array, " M"]) -> CurriculumState:
  """Frees `slots` (-1 entries skipped). Their variants are re-parented to the removed task's parent, so a parent
  pointer never names a slot that a later task may reuse (chains of removed ancestors need one call per level)."""
  i = _targets(state, slots)
  removed = jnp.zeros((state.capacity + 1,), bool).at[i].set(True)[:-1]
  p = jnp.clip(state.parent, 0, state.capacity - 1)
  parent = jnp.where((state.parent >= 0) & removed[p], state.parent[p], state.parent)
  freed = init(state.capacity)
  return jax.tree.map(lambda new, old: jnp.where(removed, new, old) if old.ndim else old, freed,
                      state.replace(parent=parent))


def _f32(x) -> Array:
  return jnp.asarray(x, jnp.float32)


def _i32(x) -> Array:
  return jnp.asarray(x, jnp.int32)


# The public functions below pass every argument to their jitted cores positionally, as arrays of fixed dtypes: with
# keyword defaults, jit would key its cache on which keywords a caller happened to spell out, and a NumPy scalar
# would key it differently from a Python one.


def update(state: CurriculumState, task_slots: Int[Array, " N"], rewards: Float[Array, " N"], valid: Bool[Array, " N"],
           *, ema: float | Float[Array, ""], groups: Int[Array, " N"] | None = None) -> CurriculumState:
  """Folds one batch of episode rewards into the per-task EMAs; tasks without a valid episode are unchanged.

  Episodes count when `valid`, their slot holds a task and (with `groups`) their group id lies in [0, capacity).
  `groups` (PPO): per-episode group ids, e.g. the cluster of each episode's task; every task present takes the mean
  over its episodes of their group's statistics. Without it, a task's episodes are its group (GRPO).
  `ema` is the decay: new = ema * old + (1 - ema) * batch (0: keep only the latest batch).
  """
  return _update(state, _i32(task_slots), _f32(rewards), jnp.asarray(valid, bool), _f32(ema),
                 None if groups is None else _i32(groups))


@jax.jit
def _update(state, task_slots, rewards, valid, ema, groups):
  c = state.capacity
  slots = jnp.asarray(task_slots, jnp.int32)
  r = jnp.asarray(rewards, jnp.float32)
  ok = jnp.asarray(valid, bool) & (slots >= 0) & (slots < c) & state.valid[jnp.clip(slots, 0, c - 1)]
  g = slots if groups is None else jnp.asarray(groups, jnp.int32)
  ok = ok & (g >= 0) & (g < c)
  w = ok.astype(jnp.float32)
  si, gi = jnp.where(ok, slots, c), jnp.where(ok, g, c)  # segment c collects the ignored rows

  def seg(x, ids):
    return jax.ops.segment_sum(x, ids, num_segments=c + 1)

  n_g = seg(w, gi)
  mean_g = seg(w * r, gi) / jnp.maximum(n_g, 1.0)
  # Two passes (centre, then square) as the NumPy reference: no cancellation for rewards far from 0.
  var_g = seg(w * jnp.square(r - mean_g[gi]), gi) / jnp.maximum(n_g, 1.0)
  n_t = seg(w, si)[:c]
  if groups is None:
    mean_t, var_t = mean_g[:c], var_g[:c]
  else:
    mean_t = seg(w * mean_g[gi], si)[:c] / jnp.maximum(n_t, 1.0)
    var_t = seg(w * var_g[gi], si)[:c] / jnp.maximum(n_t, 1.0)
  seen = n_t > 0
  decay = jnp.where(state.times_sampled > 0, ema, 0.0)
  return state.replace(
      times_sampled=state.times_sampled + seen,
      episodes=state.episodes + n_t.astype(jnp.int32),
      reward_mean=jnp.where(seen, decay * state.reward_mean + (1 - decay) * mean_t, state.reward_mean),
      reward_var=jnp.where(seen, decay * state.reward_var + (1 - decay) * var_t, state.reward_var),
      last_seen=jnp.where(seen, state.iteration, state.last_seen),
      iteration=state.iteration + 1)


def selection_logp(state: CurriculumState, *, temperature: float | Array = 0.05, min_variance: float | Array = 0.0,
                   explore_prob: float | Array = 0.1, prior_variance: float | Array | None = None
                   ) -> Float[Array, " C"]:
  """Log-probability of each slot being drawn first from the selection mixture (-inf: never drawn, only used to fill).

  With `prior_variance=None` never-tried tasks are outside the mixture (-inf here): `select` takes them first.
  """
  tried = state.times_sampled > 0
  if prior_variance is None:
    preferred = state.valid & tried & (state.reward_var > min_variance)
    score = state.reward_var / temperature
  else:
    preferred = state.valid & (~tried | (state.reward_var > min_variance))
    score = jnp.where(tried, state.reward_var, prior_variance) / temperature
  sampled = state.valid if prior_variance is not None else state.valid & tried
  any_pref = jnp.any(preferred)
  log_pref = jnp.where(preferred, jax.nn.log_softmax(jnp.where(preferred, score, -jnp.inf)), -jnp.inf)
  log_pref = jnp.where(any_pref, log_pref, -jnp.inf)  # log_softmax of all -inf is nan
  n = jnp.maximum(jnp.sum(sampled), 1)
  log_uniform = jnp.where(sampled, -jnp.log(n.astype(jnp.float32)), -jnp.inf)
  eps = jnp.where(any_pref, jnp.asarray(explore_prob, jnp.float32), 1.0)  # nothing preferred: uniform
  return jnp.logaddexp(jnp.log1p(-eps) + log_pref, jnp.log(eps) + log_uniform)


def select(state: CurriculumState, key: jax.Array, *, num_tasks: int, num_generated_max: int | Array,
           temperature: float | Array = 0.05, min_variance: float | Array = 0.0, explore_prob: float | Array = 0.1,
           prior_variance: float | Array | None = None) -> Int[Array, " num_tasks"]:
  """Slots of `num_tasks` distinct tasks for the next iteration (-1 where the pool has too few), best-keyed first.

  At most `num_generated_max` (`generated_cap(num_tasks, lam)`) are generated tasks. Only `num_tasks` is static
  (and whether `prior_variance` is None).
  """
  if num_tasks > state.capacity:
    raise ValueError(f"select: num_tasks={num_tasks} exceeds the pool capacity {state.capacity}")
  return _select(state, key, num_tasks, _i32(num_generated_max), _f32(temperature), _f32(min_variance),
                 _f32(explore_prob), None if prior_variance is None else _f32(prior_variance))


@functools.partial(jax.jit, static_argnums=(2,))
def _select(state, key, num_tasks, num_generated_max, temperature, min_variance, explore_prob, prior_variance):
  c = state.capacity
  logp = selection_logp(state, temperature=temperature, min_variance=min_variance, explore_prob=explore_prob,
                        prior_variance=prior_variance)
  g = jax.random.gumbel(key, (c,))
  drawable = logp > -jnp.inf
  # 3: untried under the infinite prior, 2: drawn from the mixture, 1: filler in random order, 0: never.
  untried = state.valid & (state.times_sampled == 0) & (prior_variance is None)
  tier = jnp.where(untried, 3, jnp.where(drawable, 2, jnp.where(state.valid, 1, 0)))
  score = jnp.where(drawable, logp + g, g)
  gen_tier = jnp.where(state.is_generated, tier, 0)
  gen_rank = jnp.zeros((c,), jnp.int32).at[jnp.lexsort((-score, -gen_tier))].set(jnp.arange(c, dtype=jnp.int32))
  tier = jnp.where(state.is_generated & (gen_rank >= num_generated_max), 0, tier)
  picks = jnp.lexsort((-score, -tier))[:num_tasks]
  return jnp.where(tier[picks] > 0, picks, -1).astype(jnp.int32)


def compilations() -> dict[str, int]:
  """Programs compiled so far per jitted function (tests assert that calls with new values add none)."""
  return {"update": _update._cache_size(), "select": _select._cache_size(),
          "seeds_for_generation": _seeds_for_generation._cache_size()}


def generated_cap(num_tasks: int, lam: float) -> int:
  """lambda as a task count: the largest number of generated tasks whose fraction of the batch is at most lambda."""
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f"lambda (fraction of generated tasks) must lie in [0, 1], got {lam}")
  return int(np.floor(lam * num_tasks + 1e-9))


def seeds_for_generation(state: CurriculumState, *, k: int, min_variance: float | Array = 0.0,
                         max_depth: int | Array = 2, max_children: int | Array = 2**30) -> Int[Array, " k"]:
  """The `k` tasks M_task should write variants of next (-1 where fewer qualify): tried, V_tau above `min_variance`,
  depth below `max_depth`, fewer than `max_children` live variants. Highest variance first; ties go to the task with
  fewer variants, then the lower slot, so the choice is deterministic."""
  return _seeds_for_generation(state, k, _f32(min_variance), _i32(max_depth), _i32(max_children))


@functools.partial(jax.jit, static_argnums=(1,))
def _seeds_for_generation(state, k, min_variance, max_depth, max_children):
  c = state.capacity
  children = jax.ops.segment_sum(state.valid.astype(jnp.int32), jnp.where(state.parent >= 0, state.parent, c),
                                 num_segments=c + 1)[:c]
  ok = (state.valid & (state.times_sampled > 0) & (state.reward_var > min_variance) & (state.depth < max_depth)
        & (children < max_children))
  order = jnp.lexsort((jnp.arange(c), children, -state.reward_var, ~ok))[:k]
  return jnp.where(ok[order], order, -1).astype(jnp.int32)
