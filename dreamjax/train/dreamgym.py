"""The DreamGym loop: PPO or GRPO against the experience model, with a curriculum and replay write-back.

PAPER.md "Experience model", "Curriculum" and "RL". Every iteration:
1. tasks: the curriculum draws B tasks from the task pool (seed tasks from the offline data plus M_task's variants,
   at most lambda of them generated; `dreamjax.curriculum.state.select`), or, with the curriculum off, the next B seed
   tasks of a seeded shuffle (as the real-env loop draws);
2. rollouts: G episodes per task against `SyntheticEnv`: policy and M_exp alternate turn by turn, each M_exp step
   retrieving its top-k neighbours for every row from the replay buffer;
3. advantages and update: `RealEnvRL.iteration`, the real-env loop's own code (reference and critic scoring, GRPO or
   GAE, clipped update), so DreamGym and its real-env baselines differ only in the env and the task draw;
4. write-back: the episodes' parsed steps go to the durable replay buffer (source "synthetic", the iteration as
   policy version) and into the retrieval index, so later M_exp steps can be grounded on them;
5. curriculum: every episode's return updates its task's reward variance (the GRPO group; for PPO, k-means clusters
   of the pool's instructions); every `generate_every` iterations M_task (M_exp's weights under the task-generation
   prompt) writes variants of the highest-variance seed tasks, which are validated and enter the pool;
6. every `rl.eval_every` iterations (and before the first and after the last), greedy success on held-out tasks of
   the REAL env (`rl.env`, `rl.eval_tasks`), with its Wilson interval.
Training consumes no real transitions; `synthetic_transitions` counts M_exp steps (answers that parsed and were sent
to it). Evaluation episodes on the real env are reported apart, as in the real-env loop.

Ablations (PAPER.md): `replay=False` shows M_exp no retrieved transitions and writes nothing back ("w/o replay");
`curriculum.enabled=False` draws seed tasks uniformly and generates none ("w/o curriculum"); "w/o reasoning" is an
M_exp trained with `format.reasoning=false` (`dreamjax train-exp --set format.reasoning=false`), and `reasoning`
states which one the run expects: a mismatch with the checkpoint's exp_model.json is an error, so an ablation table
cannot silently mix them up.

Checkpoints and resume: as the real-env loop (`rl.checkpoint_every`, `rl.keep_checkpoints`, `rl.track`), with the
curriculum state and task pool, the M_task counters and the replay buffer's positions added; a resumed run rewinds the
buffer to its checkpoint, rebuilds the retrieval index in the chunks it was built in, and draws what the
uninterrupted run would have drawn. Rerun the same command to resume.

Several processes (multi-host), as the real-env loop (rl_real's docstring): `run` first calls
`dreamjax.parallel.initialize(rl.distributed)`, and every process then runs this same host program on the same seeds:
the curriculum draw, the rollouts against its own SyntheticEnv (policy and M_exp sampling are SPMD programs over the
whole mesh, their row-sharded outputs gathered whole with `to_host`), the update, M_task's generation. The replay
buffer has one writer, process 0: it seeds it and appends each iteration's write-back; after a barrier the other
processes refresh a read-only view of the same folder, and every process adds the new transitions to its own
retrieval index from the buffer, so all indexes hold the same transitions and return the same neighbours.
`check_same` compares, once per iteration, the drawn task slots, a digest of every M_exp step's retrieved
transitions and prompt (`SyntheticEnv.digest`) and the buffer's length (besides the learner's rollout check), and at
start the replay marks. Process 0 alone writes the run folder's files (config, metrics, evals, summary, plots,
task_pool.json, final/ after a gather of the parameters); orbax checkpoints are saved by every process (the curriculum
state, process-local on each, is written from process 0's copy). `out_dir` must be a filesystem every process sees.
Each mesh (the policy's and M_exp's) must hold devices of every process: with several processes use the colocated
placement over all devices.

Seed tasks are the offline data's tasks (their first recorded state starts the synthetic episode); none may be a
held-out evaluation task. Outputs in `out_dir`: those of the real-env loop (config.json, metrics.jsonl, evals.jsonl,
summary.json, learning_curve.svg, final/) plus replay/ (the buffer with the offline seed and the written-back
episodes) and task_pool.json (the final curriculum).

Run: `dreamjax dreamgym --config configs/dreamgym_twx.py[:tiny] [--set key=value ...]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.curriculum import clusters
from dreamjax.curriculum import state as cstate
from dreamjax.curriculum.pool import TaskPool
from dreamjax.curriculum.task_gen import GenerationConfig, SeedExample, generate_variants
from dreamjax.data.records import TrajectoryRecord
from dreamjax.envs.base import Task
from dreamjax.experience.format import ExpFormatConfig
from dreamjax.experience.sft_data import annotations_for
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from
from dreamjax.parallel import (
    SAMPLE_RULES,
    MeshConfig,
    barrier,
    check_same,
    initialize,
    is_primary,
    make_mesh,
    spans_every_process,
    to_host,
)
from dreamjax.replay.buffer import ReplayBuffer
from dreamjax.replay.transition import from_trajectories
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.sampling import Sampler
from dreamjax.train.evaluate import plot_learning_curve, unparsed_rows
from dreamjax.train.exp_sft import META_FILE, load_records, make_retriever
from dreamjax.train.rl_real import (
    CURVES,
    RealEnvRL,
    RLConfig,
    _eval_row,
    draw_tasks,
    episode_returns,
    load_policy,
    make_batch_env,
    open_checkpoints,
    phase_key,
)
from dreamjax.track import Tracker, echo, progress, truncate_jsonl
from dreamjax.train.run import load_model, save_model, to_json

PHASE_SYNTHETIC, PHASE_CURRICULUM, PHASE_GENERATION, PHASE_CLUSTERS = 10, 11, 12, 13


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
  variants_per_seed: int = 2
  max_depth: int = 2  # variants of variants up to this depth
  max_new_tokens: int = 128  # M_task's output budget
  clusters: int = 8  # PPO: k-means groups over instructions
  generation: GenerationConfig = GenerationConfig()

  def __post_init__(self):
    cstate.generated_cap(1, self.lam)  # validates lam
    for name in ("capacity", "seeds_per_round", "variants_per_seed", "max_new_tokens", "clusters"):
      if getattr(self, name) < 1:
        raise ValueError(f"CurriculumConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.generate_every < 0 or not 0 <= self.ema < 1 or self.temperature <= 0:
      raise ValueError("CurriculumConfig: generate_every >= 0, 0 <= ema < 1 and temperature > 0 are required")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Where M_exp runs. "colocated": on the policy's own mesh (every device holds a share of both models; fastest
  when both fit, since policy and M_exp decode in turn and neither sits idle). "split": the policy, its reference and
  optimizer state on the first `rl.devices` devices and M_exp (with M_task, its weights) on the next `exp_devices`
  (0: all the rest), each with its own mesh; an 8B M_exp's weights and KV cache then never compete with the policy's
  optimizer state for memory. Nothing crosses between the two meshes but text, so no array is resharded between them."""

  mode: str = "colocated"  # colocated | split
  exp_devices: int = 0
  exp_mesh: MeshConfig = MeshConfig()  # M_exp's mesh over its devices (split only)

  def __post_init__(self):
    if self.mode not in ("colocated", "split") or self.exp_devices < 0:
      raise ValueError(f"PlacementConfig: mode must be colocated or split and exp_devices >= 0, got {self}")


def make_meshes(rl: RLConfig, placement: PlacementConfig) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
  """(the policy's mesh, M_exp's mesh): the same mesh when colocated, disjoint device sets when split."""
  devices = jax.devices()
  if placement.mode == "colocated":
    mesh = spans_every_process(make_mesh(rl.mesh, devices[:rl.devices] if rl.devices else None),
                               f"DreamGymConfig: the policy's mesh (rl.devices={rl.devices})")
    return mesh, mesh
  if not rl.devices or rl.devices >= len(devices):
    raise ValueError(f"PlacementConfig.mode=split: rl.devices must leave devices for M_exp (rl.devices="
                     f"{rl.devices}, {len(devices)} devices)")
  rest = devices[rl.devices:]
  if placement.exp_devices > len(rest):
    raise ValueError(f"PlacementConfig.exp_devices={placement.exp_devices}: only {len(rest)} devices are left after "
                     f"the policy's {rl.devices}")
  # Split placement cuts jax.devices() in two, so with several processes one side lacks some process's devices.
  return (spans_every_process(make_mesh(rl.mesh, devices[:rl.devices]),
                              f"DreamGymConfig: the policy's mesh (rl.devices={rl.devices}, placement split)"),
          spans_every_process(make_mesh(placement.exp_mesh, rest[:placement.exp_devices] if placement.exp_devices
                                        else rest), "DreamGymConfig: M_exp's mesh (placement split)"))


@dataclasses.dataclass(frozen=True)
class DreamGymConfig:
  # The policy side, exactly as the real-env loop takes it: warm start, algorithm, optimiser, rollout budgets, and the
  # REAL env with its held-out tasks for evaluation (`rl.train_tasks` is unused: seed tasks come from offline_data).
  rl: RLConfig = RLConfig()
  exp_model: str = ""  # M_exp: a checkpoint folder written by `dreamjax train-exp` (holds exp_model.json)
  offline_data: tuple[str, ...] = ()  # TrajectoryRecord JSONL files: the replay seed and the seed tasks
  seed_tasks: int = 0  # use the first this many offline tasks (in file order); 0: all
  reasoning: bool = True  # the M_exp format this run expects (False: the "w/o reasoning" ablation's M_exp)
  replay: bool = True  # False: the "w/o replay" ablation (no retrieval, no write-back)
  curriculum: CurriculumConfig = CurriculumConfig()
  exp_temperature: float = 1.0
  exp_max_new_tokens: int = 0  # 0: the decode budget recorded in exp_model.json
  exp_prompt_buckets: tuple[int, ...] = ()  # M_exp prompt widths; empty: powers of two up to its max_len
  # M_exp's (and M_task's) weights and compute: frozen, so unlike the trained policy it may hold bfloat16 weights.
  exp_dtype: str = "float32"
  placement: PlacementConfig = PlacementConfig()
  out_dir: str = "runs/dreamgym"

  def __post_init__(self):
    if self.seed_tasks < 0 or self.exp_max_new_tokens < 0 or self.exp_temperature <= 0:
      raise ValueError("DreamGymConfig: seed_tasks >= 0, exp_max_new_tokens >= 0 and exp_temperature > 0 required")
    if self.exp_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"DreamGymConfig.exp_dtype must be 'float32' or 'bfloat16', got {self.exp_dtype!r}")


def load_exp_model(cfg: DreamGymConfig, mesh) -> tuple[Any, Any, Any, dict[str, Any], ExpFormatConfig]:
  """(model config, params laid out for sampling, tokenizer, exp_model.json, the format the run uses)."""
  folder = Path(cfg.exp_model)
  meta_path = folder / META_FILE
  if not cfg.exp_model or not meta_path.is_file():
    raise ValueError(f"DreamGymConfig.exp_model: {folder} has no {META_FILE}; give a checkpoint folder written by "
                     f"`dreamjax train-exp`")
  meta = json.loads(meta_path.read_text())
  fmt = ExpFormatConfig(**meta["format"])
  if fmt.reasoning != cfg.reasoning:
    raise ValueError(f"DreamGymConfig.reasoning is {cfg.reasoning} but {meta_path} records format.reasoning="
                     f"{fmt.reasoning}; train the M_exp this run expects (dreamjax train-exp --set format.reasoning="
                     f"{str(cfg.reasoning).lower()}) or set reasoning={str(fmt.reasoning).lower()}")
  if not cfg.replay:
    fmt = dataclasses.replace(fmt, retrieval=False)
  model_cfg, params, tok = load_model(folder, mesh=mesh, rules=SAMPLE_RULES,
                                      overrides={"dtype": cfg.exp_dtype, "param_dtype": cfg.exp_dtype})
  return model_cfg, params, tok, meta, fmt


def seed_records(cfg: DreamGymConfig, eval_ids: set[str]) -> tuple[list[TrajectoryRecord], list[Task]]:
  """The offline records and the seed tasks (first appearance order), checked against the held-out tasks."""
  if not cfg.offline_data:
    raise ValueError("DreamGymConfig.offline_data: give at least one TrajectoryRecord JSONL file (dreamjax collect)")
  records = load_records(cfg.offline_data)
  tasks = list({r.task.task_id: r.task for r in records if r.steps}.values())
  if cfg.seed_tasks:
    tasks = tasks[:cfg.seed_tasks]
  leaked = sorted({t.task_id for t in tasks} & eval_ids)
  if leaked:
    raise ValueError(f"DreamGymConfig.offline_data: {len(leaked)} seed tasks are held-out evaluation tasks (e.g. "
                     f"{leaked[0]!r}); collect the offline data on another split")
  if len(tasks) < cfg.rl.tasks_per_iteration:
    raise ValueError(f"DreamGymConfig: {len(tasks)} seed tasks for rl.tasks_per_iteration="
                     f"{cfg.rl.tasks_per_iteration}")
  return records, tasks


def write_back_transitions(traj: Trajectories, unparsed: np.ndarray, iteration: int) -> list:
  """The episodes' steps that reached M_exp (answers that did not parse never did) as synthetic replay transitions."""
  skip = {(int(traj.episode[m]), int(traj.turn[m])) for m in np.flatnonzero(unparsed)}
  out = []
  for e, record in enumerate(traj.records):
    steps = tuple(s for t, s in enumerate(record.steps) if (e, t) not in skip)
    if steps:
      out += from_trajectories([dataclasses.replace(record, steps=steps)], "synthetic", policy_version=iteration)
  return out


class Curriculum:
  """The task pool, its statistics and M_task; with `enabled=False`, a seeded uniform draw over the seed tasks."""

  def __init__(self, cfg: DreamGymConfig, seeds: list[Task], records: list[TrajectoryRecord], root: jax.Array,
               sampler: Sampler | None, exp_params, exp_tok, encode):
    self.cfg, self.c, self.seeds, self.root = cfg, cfg.curriculum, seeds, root
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

  def draw(self, iteration: int) -> tuple[list[Task], np.ndarray]:
    """(B tasks, their pool slots)."""
    b = self.cfg.rl.tasks_per_iteration
    if not self.c.enabled:
      tasks = draw_tasks(self.seeds, b, iteration, self.cfg.rl.seed)
      return tasks, np.asarray([self.pool.slot_of(t.task_id) for t in tasks], np.int32)
    slots = np.asarray(cstate.select(
        self.pool.state, phase_key(self.root, iteration, PHASE_CURRICULUM), num_tasks=b,
        num_generated_max=cstate.generated_cap(b, self.c.lam), temperature=self.c.temperature,
        min_variance=self.c.min_variance, explore_prob=self.c.explore_prob))
    return self.pool.tasks_at(slots), slots  # the pool holds at least B seed tasks, so no slot is -1

  def update(self, traj: Trajectories, returns: np.ndarray, slots: np.ndarray, iteration: int) -> dict[str, float]:
    """Folds the episodes' returns into the statistics, then (every generate_every iterations) generates variants."""
    episode_slots = slots[traj.task_index]
    groups = None
    if self.cfg.rl.algorithm == "ppo":  # no per-task group: clusters of instructions rank the tasks
      by_slot = clusters.pool_groups(self.pool, self.encode, phase_key(self.root, iteration, PHASE_CLUSTERS),
                                     k=self.c.clusters)
      groups = by_slot[episode_slots]
    self.pool.state = cstate.update(self.pool.state, episode_slots, returns, np.ones(len(returns), bool),
                                    ema=self.c.ema, groups=groups)
    s = jax.device_get(self.pool.state)
    gen = self.pool.state.is_generated
    out = {"pool_tasks": len(self.pool), "pool_generated": int(np.asarray(gen).sum()),
           "batch_generated_frac": float(np.asarray(s.is_generated)[slots].mean()),
           "batch_reward_var": float(np.asarray(s.reward_var)[slots].mean())}
    if self.c.enabled and self.c.generate_every and (iteration + 1) % self.c.generate_every == 0:
      out.update(self.generate(iteration))
    return out

  def generate(self, iteration: int) -> dict[str, float]:
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
                               existing=existing, counters=self.pool.variant_counters, cfg=self.c.generation)
    placed = self.pool.add_generated(list(result.tasks)) if result.tasks else np.zeros(0, np.int32)
    for k, v in result.counts.items():
      self.generation_counts[k] = self.generation_counts.get(k, 0) + v
    return {"generated": int((placed >= 0).sum()), "generation_candidates": sum(result.counts.values()),
            **{f"generation_{k}": v for k, v in result.counts.items()}}

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


def open_replay(folder: Path, records: list[TrajectoryRecord], marks: list[int] | None, retrieve: bool
                ) -> tuple[ReplayBuffer, list[int]]:
  """The run's replay buffer and its marks (`marks` None: a fresh run, whose first mark is the end of the offline
  seed, or 0 when M_exp retrieves nothing). Process 0 is the one writer: it seeds the buffer and rewinds it to the
  last mark (dropping what iterations after the checkpoint wrote); the other processes open it read-only once that is
  committed, so every process reads the same transitions."""
  buffer = None
  if is_primary():
    buffer = ReplayBuffer(folder)
    if marks is None:
      marks = [buffer.seed(records, tag="offline").stop if retrieve else 0]
    buffer.truncate(marks[-1])
  barrier("dreamgym.replay_open")
  if buffer is None:
    buffer = ReplayBuffer(folder, read_only=True)
    if marks is None:
      seed = buffer.stats().seeds.get("offline")
      marks = [seed.stop if retrieve and seed is not None else 0]
  check_same("the replay buffer's marks and length", np.asarray([*marks, len(buffer)], np.int64))
  return buffer, marks


def rebuild_retriever(retriever, buffer: ReplayBuffer, marks: list[int]) -> None:
  """Adds the buffer's transitions to a fresh retriever in the chunks they were first added in (the offline seed,
  then one write-back per iteration), so a resumed run's index answers exactly as the uninterrupted run's did."""
  start = 0
  for end in marks:
    if end > start:
      retriever.add(list(buffer.iter_from(start, end)))
    start = end


def run(cfg: DreamGymConfig) -> dict[str, Any]:
  """The `dreamjax dreamgym` command: trains in the experience model (resuming from the latest checkpoint in
  `out_dir` when there is one), evaluates on the real env, writes the run folder; returns the summary."""
  initialize(cfg.rl.distributed)  # before anything touches devices: after it, jax.devices() spans every process
  rl = dataclasses.replace(cfg.rl, out_dir=cfg.out_dir)
  out = Path(cfg.out_dir)
  mesh, exp_mesh = make_meshes(rl, cfg.placement)
  eval_pool = rl.eval_tasks.tasks(rl.env)
  records, seeds = seed_records(cfg, {t.task_id for t in eval_pool})
  exp_cfg, exp_params, exp_tok, meta, fmt = load_exp_model(cfg, exp_mesh)
  root = jax.random.key(rl.seed)
  ckpt, resume = open_checkpoints(rl, out)
  state: dict[str, Any] = ckpt.meta(resume) if resume is not None else {}

  if is_primary():  # the one writer of the run folder
    out.mkdir(parents=True, exist_ok=True)
  # Buffer positions after the offline seed and after each iteration's write-back. Whatever lies past the last one
  # (episodes of iterations after the checkpoint, or of a run killed before its first) is written again when redone.
  retrieve = bool(fmt.retrieval and fmt.k)
  buffer, marks = open_replay(out / "replay", records, list(state["replay_marks"]) if resume is not None else None,
                              retrieve)
  retriever = None
  if retrieve:
    retriever = make_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
    rebuild_retriever(retriever, buffer, marks)
  tutorials = {}
  if fmt.tutorial:
    notes = annotations_for(records)
    tutorials = {r.task.task_id: notes[r.episode_id].tutorial for r in reversed(records)}
  max_new = cfg.exp_max_new_tokens or meta["max_new_tokens"]
  # Prompt widths: powers of two up to what M_exp was trained on, leaving room for its answer in the position table.
  top = min(meta["max_len"], exp_cfg.max_position_embeddings - max_new)
  buckets = cfg.exp_prompt_buckets or tuple(b for b in (256, 512, 1024, 2048, 4096, 8192) if b < top) + (top,)
  synthetic = SyntheticEnv(exp_cfg, exp_params, exp_tok, fmt, retriever, initial_states=initial_states_from(records),
                           max_new_tokens=max_new, temperature=cfg.exp_temperature, prompt_buckets=buckets,
                           key=phase_key(root, 0, PHASE_SYNTHETIC), mesh=exp_mesh, tutorials=tutorials,
                           max_steps=rl.rollout.max_turns)
  task_sampler = Sampler(exp_cfg, cfg.curriculum.max_new_tokens, pad_id=exp_tok.pad_id, mesh=exp_mesh) \
      if cfg.curriculum.enabled and cfg.curriculum.generate_every else None
  encode = retriever.encoder.encode if retriever is not None else make_retriever(
      meta["retrieval_encoder"], meta["encoder_folder"]).encoder.encode
  curriculum = Curriculum(cfg, seeds, records, root, task_sampler, exp_params, exp_tok, encode)

  real = make_batch_env(rl)
  evals: list[dict[str, Any]] = list(state.get("evals", []))
  train_curve = [tuple(r) for r in state.get("train_curve", [])]  # (iteration, synthetic transitions, success)
  synthetic_transitions = int(state.get("synthetic_transitions", 0))
  tracker = None
  start = time.perf_counter()
  try:
    folder, model_cfg, params, tok = load_policy(rl, out, resume is not None, real, seeds, mesh)
    learner = RealEnvRL(rl, model_cfg, params, tok, mesh)
    if resume is not None:
      arrays, _ = ckpt.restore(resume, like=learner.checkpoint_arrays() | {"curriculum": curriculum.pool.state})
      learner.load_checkpoint_arrays(arrays)
      curriculum.pool = TaskPool.from_json(state["task_pool"], source=f"{out / 'checkpoints'}: task_pool")
      curriculum.pool.state = arrays["curriculum"]
      curriculum.generation_counts = dict(state["generation"])
      echo(f"resuming {out} after iteration {resume}")
    first = resume or 0
    tracker = Tracker(out, to_json(cfg), rl.track, run_id=state.get("tracker_run_id"), resume_step=resume)
    evals_path = out / "evals.jsonl" if tracker.primary else Path(os.devnull)
    if resume is None:
      evals_path.write_text("")
    elif tracker.primary:
      truncate_jsonl(evals_path, lambda row: row["iteration"] <= resume)

    def plots() -> None:
      if tracker.primary:
        plot_learning_curve(evals, out / "learning_curve.svg", train=train_curve,
                            title=f"DreamGym {rl.algorithm.upper()} ({rl.env} eval): held-out success (95% CI)",
                            transitions="synthetic_transitions")
        tracker.plot_metrics(CURVES, title=f"DreamGym {rl.algorithm.upper()}: training")

    with open(evals_path, "a", encoding="utf-8") as eval_file, \
        progress(rl.iterations, "dreamgym", initial=first, unit="iter", enabled=rl.track.progress and
                 tracker.primary) as bar:

      def do_eval(iteration: int) -> None:
        result = learner.evaluate(real, eval_pool)
        row = _eval_row(iteration, 0, result) | {"synthetic_transitions": synthetic_transitions}
        evals.append(row)
        eval_file.write(json.dumps({**row, "outcomes": result["outcomes"]}, sort_keys=True) + "\n")
        eval_file.flush()
        tracker.log(iteration, {"eval": row}, jsonl=False)
        echo(f"eval @ iteration {iteration} ({synthetic_transitions} synthetic transitions): real-env success "
             f"{row['success_rate']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}] over {row['episodes']} tasks")

      def checkpoint(iteration: int) -> None:
        arrays = learner.checkpoint_arrays() | {"curriculum": curriculum.pool.state}
        ckpt.save(iteration, arrays, {
            "iteration": iteration, "synthetic_transitions": synthetic_transitions, "evals": evals,
            "train_curve": train_curve, "replay_marks": marks, "task_pool": curriculum.pool.to_json(),
            "generation": curriculum.generation_counts, "tracker_run_id": tracker.run_id, "config": to_json(cfg)})
        plots()

      if resume is None:
        do_eval(0)
      for it in range(first, rl.iterations):
        t0 = time.perf_counter()
        tasks, slots = curriculum.draw(it)
        synthetic.batches = it  # the env's randomness follows the iteration (a resumed run draws the same)
        synthetic.reset_stats()
        metrics, traj = learner.iteration(synthetic, tasks, it)
        learner.real_transitions = 0  # the learner counts env steps; here they were synthetic
        unparsed = unparsed_rows(traj, tok)
        synthetic_transitions += int((~unparsed).sum())
        if cfg.replay:
          if is_primary():  # the one writer; the others read what it committed
            buffer.append(write_back_transitions(traj, unparsed, it))
          barrier("dreamgym.write_back")
          buffer.refresh()  # a no-op for the writer
        marks.append(len(buffer))
        if retriever is not None:  # from the buffer on every process, so every index holds the same transitions
          retriever.add(list(buffer.iter_from(marks[-2], marks[-1])))
        # Every process must have drawn the same tasks and grounded M_exp on the same neighbours.
        check_same(f"the curriculum draw, M_exp's retrievals and the replay buffer of iteration {it + 1}",
                   slots, synthetic.digest(), np.asarray([len(buffer)], np.int64))
        returns = episode_returns(traj, rl.invalid_penalty)
        metrics.pop("real_transitions", None)
        metrics.update(curriculum.update(traj, returns, slots, it))
        s = synthetic.stats
        metrics.update(synthetic_transitions=synthetic_transitions, replay_size=len(buffer),
                       exp_parse_failures=s["parse_failures"], exp_overflows=s["overflows"],
                       exp_truncations=s["truncations"], exp_generated_tokens=s["mean_generated_tokens"],
                       dreamgym_iteration_s=time.perf_counter() - t0)
        tracker.log(it + 1, metrics)
        train_curve.append((it + 1, synthetic_transitions, metrics["rollout_success"]))
        bar.update()
        update = f"loss {metrics['loss']:.4f}" if "loss" in metrics else "no update (no group with unequal returns)"
        echo(f"iteration {it + 1}: {update}, synthetic success {metrics['rollout_success']:.3f}, generated tasks in "
             f"batch {metrics['batch_generated_frac']:.2f}, pool {metrics['pool_tasks']} "
             f"({metrics['dreamgym_iteration_s']:.1f} s)")
        if (rl.eval_every and (it + 1) % rl.eval_every == 0) or it + 1 == rl.iterations:
          do_eval(it + 1)
        if (rl.checkpoint_every and (it + 1) % rl.checkpoint_every == 0) or it + 1 == rl.iterations:
          checkpoint(it + 1)
    final_params = to_host(learner.params)  # a collective: every process gathers, one writes
    if tracker.primary:
      save_model(final_params, model_cfg, folder, out / "final")
      curriculum.pool.save(out / "task_pool.json")
    summary = {"algorithm": rl.algorithm, "iterations": rl.iterations, "real_transitions": 0,
               "synthetic_transitions": synthetic_transitions, "initial": evals[0], "final": evals[-1],
               "evals": evals, "generation": curriculum.generation_counts, "replay_size": len(buffer),
               "seconds": time.perf_counter() - start, "checkpoint": str(out / "final"), "resumed_from": resume,
               "run_id": tracker.run_id}
    tracker.summary(summary)
    plots()
  finally:
    real.close()
    buffer.close()
    ckpt.close()
    if tracker is not None:
      tracker.close()
  return summary
