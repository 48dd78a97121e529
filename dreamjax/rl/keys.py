"""PRNG keys per (iteration, phase): every random draw of a training loop comes from the run's root key folded with
the iteration and the phase that draws, so a rerun or a resumed run draws exactly what an uninterrupted one did.

The phases of every loop share this one table so that no two of them ever fold the same numbers into one root key.
"""

from __future__ import annotations

import jax

# The policy learner (any env); PHASE_CRITIC: PPO's separate critic's update steps.
PHASE_ROLLOUT, PHASE_UPDATE, PHASE_SHUFFLE, PHASE_EVAL, PHASE_TASKS, PHASE_CRITIC = range(6)
# DreamGym: M_exp's sampling, the curriculum draw, M_task's generation, PPO's task clusters.
PHASE_SYNTHETIC, PHASE_CURRICULUM, PHASE_GENERATION, PHASE_CLUSTERS = range(10, 14)


def phase_key(root: jax.Array, iteration: int, phase: int) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(root, iteration), phase)
