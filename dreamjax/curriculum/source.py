"""Where an RL iteration's tasks come from: `UniformTasks`, a seeded uniform draw over a fixed pool (real-env RL and
DreamGym's "w/o curriculum" ablation), and `CurriculumTasks`, DreamGym's curriculum (reward-variance selection over a
task pool that M_task's generated variants join, at most lambda of each draw).

The curriculum's statistics are taken on the paper's signal, the binary outcome reward (`outcome_rewards`: 1 for a
successful episode, else 0), not on the returns the advantages see: those subtract the invalid-action penalty, which
would give a task whose episodes all succeed (some after a wasted turn) a non-zero "reward entropy" and rank it as
feasible-yet-challenging when the policy has nothing left to learn on it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dreamjax.curriculum import clusters
from dreamjax.curriculum import state as cstate
from dreamjax.curriculum.pool import TaskPool
from dreamjax.curriculum.task_gen import GenerationConfig, SeedExample, generate_variants
from dreamjax.data.records import TrajectoryRecord
from dreamjax.envs.base import Task
from dreamjax.experience.synthetic_env import initial_states_from
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.rl.keys import PHASE_CLUSTERS, PHASE_CURRICULUM, PHASE_GENERATION, PHASE_TASKS, phase_key
from dreamjax.sampling import Sampler


def outcome_rewards(traj: Trajectories) -> np.ndarray:
  """float32 [N]: each episode's binary outcome reward, 1.0 when it succeeded and 0.0 otherwise, whatever invalid-action
  penalties its turns took (the signal `CurriculumTasks.update` takes; see the module docstring)."""
  return np.asarray(traj.success, bool).astype(np.float32)


def draw_tasks(pool: list[Task], n: int, iteration: int, seed: int) -> list[Task]:
  """Tasks n*i .. n*i + n - 1 of an endless sequence of seeded shuffles of the pool (one shuffle per pass), so the
  draw depends only on the seed and the iteration and every task comes up once per pass."""
  out = []
  for i in range(n * iteration, n * (iteration + 1)):
    order = np.random.default_rng((seed, PHASE_TASKS, i // len(pool))).permutation(len(pool))
    out.append(pool[order[i % len(pool)]])
  return out


@dataclasses.dataclass(frozen=True)
class UniformTasks:
  pool: list[Task]
  tasks_per_iteration: int
  seed: int

  def draw(self, iteration: int) -> list[Task]:
    return draw_tasks(self.pool, self.tasks_per_iteration, iteration, self.seed)


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  enabled: bool = True  # False: the "w/o curriculum" ablation (uniform seed tasks, no generation)
  capacity: int = 512  # task pool slots (seed tasks + generated ones)
  lam: float = 0.2  # at most this fraction of an iteration's tasks are generated ones
  ema: float = 0.5  # decay of the per-task reward mean/variance statistics
  temperature: float = 0.05  # softmax temperature over reward variance
  min_variance: float = 0.0  # tasks at or below it are drawn only by exploration or to fill the batch
  explore_prob: float = 0.1
  generate_every: int = 1  # iterations between M_task rounds; 0: never generate
  seeds_per_round: int = 4  # high-variance tasks M_task writes variants of per round
  # M_task proposes this many candidates per seed; the rule filters drop the infeasible ones and a selection prompt
  # keeps `variants_per_seed` of the rest (the paper's appendix keeps the one that is feasible and harder: 1).
  proposals_per_seed: int = 4
  variants_per_seed: int = 1
  max_depth: int = 2  # variants of variants up to this depth
  max_new_tokens: int = 256  # M_task's output budget: room for `proposals_per_seed` instructions of ~40 tokens
  clusters: int = 8  # PPO: k-means groups over instructions
  generation: GenerationConfig = GenerationConfig()

  def __post_init__(self):
    cstate.generated_cap(1, self.lam)  # validates lam
    for name in ("capacity", "seeds_per_round", "proposals_per_seed", "variants_per_seed", "max_new_tokens",
                 "clusters"):
      if getattr(self, name) < 1:
        raise ValueError(f"CurriculumConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.variants_per_seed > self.proposals_per_seed:
      raise ValueError(f"CurriculumConfig.variants_per_seed ({self.variants_per_seed}) must not exceed "
                       f"proposals_per_seed ({self.proposals_per_seed}): the selection keeps some of the proposals")
    if self.generate_every < 0 or not 0 <= self.ema < 1 or self.temperature <= 0:
      raise ValueError("CurriculumConfig: generate_every >= 0, 0 <= ema < 1 and temperature > 0 are required")


class CurriculumTasks:
  """DreamGym's task source: the task pool, its statistics and M_task. `draw` picks an iteration's tasks; `update`
  folds the rollout's outcome rewards into the statistics and, every `generate_every` iterations, has M_task propose
  variants of the highest-variance seeds and select among them. With `enabled=False` it draws the seed tasks
  uniformly (`UniformTasks`) and generates nothing. `algorithm` "ppo" ranks tasks by k-means clusters of
  instructions (no per-task group)."""

  def __init__(self, c: CurriculumConfig, seeds: list[Task], records: list[TrajectoryRecord], *, tasks_per_iteration: int,
               algorithm: str, seed: int, root: jax.Array, sampler: Sampler | None, exp_params, exp_tok, encode):
    self.c, self.seeds, self.root, self.b, self.algorithm = c, seeds, root, tasks_per_iteration, algorithm
    self.uniform = UniformTasks(seeds, tasks_per_iteration, seed)
    self.pool = TaskPool(max(self.c.capacity, len(seeds)))
    self.pool.add_seeds(seeds)
    self.sampler, self.exp_params, self.exp_tok, self.encode = sampler, exp_params, exp_tok, encode
    # Grounding for M_task's prompts: each seed's recorded first state and a successful action sequence.
    first = initial_states_from(records)
    wins = {}
    for r in records:
      if r.success and r.task.task_id not in wins:
        wins[r.task.task_id] = tuple(s.action for s in r.steps)
    self.examples = {t.task_id: SeedExample(t, first[t.task_id].state if t.task_id in first else "",
                                            wins.get(t.task_id, ())) for t in seeds}
    self.generation_counts: dict[str, int] = {}

  def draw(self, iteration: int) -> list[Task]:
    """The iteration's B tasks."""
    if not self.c.enabled:
      return self.uniform.draw(iteration)
    slots = np.asarray(cstate.select(
        self.pool.state, phase_key(self.root, iteration, PHASE_CURRICULUM), num_tasks=self.b,
        num_generated_max=cstate.generated_cap(self.b, self.c.lam), temperature=self.c.temperature,
        min_variance=self.c.min_variance, explore_prob=self.c.explore_prob))
    return self.pool.tasks_at(slots)  # the pool holds at least B seed tasks, so no slot is -1

  def slots(self, tasks: list[Task]) -> np.ndarray:
    """int32 [len(tasks)]: the pool slots of tasks (drawn ones, or each episode's)."""
    return np.asarray([self.pool.slot_of(t.task_id) for t in tasks], np.int32)

  def update(self, episode_slots: np.ndarray, returns: np.ndarray, iteration: int,
             valid: np.ndarray | None = None) -> dict[str, Any]:
    """Folds the episodes' rewards (episode e ran the task in pool slot `episode_slots[e]`; pass `outcome_rewards`,
    the binary outcomes) into the statistics, then (every generate_every iterations) generates variants. Each drawn
    task ran G episodes, so means over episodes are means over the draw. Episodes with `valid` False (the env failed
    on them) are left out of the statistics."""
    groups = None
    if self.algorithm == "ppo":  # no per-task group: clusters of instructions rank the tasks
      by_slot = clusters.pool_groups(self.pool, self.encode, phase_key(self.root, iteration, PHASE_CLUSTERS),
                                     k=self.c.clusters)
      groups = by_slot[episode_slots]
    valid = np.ones(len(returns), bool) if valid is None else np.asarray(valid, bool)
    self.pool.state = cstate.update(self.pool.state, episode_slots, returns, valid,
                                    ema=self.c.ema, groups=groups)
    s = jax.device_get(self.pool.state)
    gen = self.pool.state.is_generated
    out = {"pool_tasks": len(self.pool), "pool_generated": int(np.asarray(gen).sum()),
           "batch_generated_frac": float(np.asarray(s.is_generated)[episode_slots].mean()),
           "batch_reward_var": float(np.asarray(s.reward_var)[episode_slots].mean())}
    if self.c.enabled and self.c.generate_every and (iteration + 1) % self.c.generate_every == 0:
      out.update(self.generate(iteration))
    return out

  def generate(self, iteration: int) -> dict[str, Any]:
    """One M_task round. Its metrics: the candidates' counts (generation_<reason>), the selection's prompts and
    fallbacks, and `generation_log`, the per-seed records of task_gen.log_record (proposed, selected, rejected with
    the reason), which go to metrics.jsonl with the iteration's row."""
    seeds = np.asarray(cstate.seeds_for_generation(self.pool.state, k=self.c.seeds_per_round,
                                                   min_variance=self.c.min_variance, max_depth=self.c.max_depth,
                                                   max_children=self.c.variants_per_seed * 4))
    chosen = [t for t in self.pool.tasks_at(seeds[seeds >= 0]) if t is not None]
    if not chosen:
      return {"generated": 0}
    examples = [self.examples.get(t.task_id) or SeedExample(t, *self._lineage(t)) for t in chosen]
    existing = [t.instruction for t in self.pool.tasks if t is not None]
    result = generate_variants(self.sampler, self.exp_params, self.exp_tok, examples,
                               phase_key(self.root, iteration, PHASE_GENERATION), self.c.variants_per_seed,
                               proposals=self.c.proposals_per_seed, existing=existing,
                               counters=self.pool.variant_counters, cfg=self.c.generation)
    placed = self.pool.add_generated(list(result.tasks)) if result.tasks else np.zeros(0, np.int32)
    for k, v in result.counts.items():
      self.generation_counts[k] = self.generation_counts.get(k, 0) + v
    return {"generated": int((placed >= 0).sum()), "generation_candidates": sum(result.counts.values()),
            **{f"generation_{k}": v for k, v in result.counts.items()},
            "generation_selection_prompts": result.selection["prompts"],
            "generation_selection_fallbacks": result.selection["fallbacks"], "generation_log": list(result.log)}

  def _lineage(self, task: Task) -> tuple[str, tuple[str, ...]]:
    """A generated task's grounding: its root seed's example state (actions are the seed's, so none are shown)."""
    root = task
    while "generated_from" in root.param:
      parent = self.pool.tasks_at([self.pool.slot_of(str(root.param["generated_from"]))])[0]
      if parent is None:
        break
      root = parent
    ex = self.examples.get(root.task_id)
    return (ex.initial_state if ex else ""), ()
