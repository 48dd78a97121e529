"""The DreamGym loop: PPO or GRPO against the experience model, with a curriculum and replay write-back.

The paper's method (docs/paper_map.md) on the shared loop (`dreamjax.loop.run`). Every iteration:
1. tasks: the curriculum draws B tasks from the task pool (seed tasks from the offline data plus M_task's variants,
   at most lambda of them generated; `dreamjax.curriculum.state.select`), or, with the curriculum off, the next B seed
   tasks of a seeded shuffle (as the real-env loop draws);
2. rollouts: G episodes per task against `SyntheticEnv`: policy and M_exp alternate turn by turn, each M_exp step
   retrieving its top-k neighbours for every row from the replay buffer;
3. advantages and update: `PolicyLearner.iteration`, the real-env loop's own code (reference and critic scoring, GRPO
   or GAE, clipped update), so DreamGym and its real-env baselines differ only in the env and the task draw;
4. write-back: the episodes' parsed steps go to the durable replay buffer (source "synthetic", the iteration as
   policy version) and into the retrieval index, so later M_exp steps can be grounded on them;
5. curriculum: every episode's return updates its task's reward variance (the GRPO group; for PPO, k-means clusters
   of the pool's instructions); every `generate_every` iterations M_task (M_exp's weights under the task-generation
   prompt) writes variants of the highest-variance seed tasks, which are validated and enter the pool;
6. every `rl.eval_every` iterations (and before the first and after the last), greedy success on held-out tasks of
   the REAL env (`rl.env`, `rl.eval_tasks`), with its Wilson interval.
Training consumes no real transitions; `synthetic_transitions` counts M_exp steps (answers that parsed and were sent
to it). Evaluation episodes on the real env are reported apart, as in the real-env loop.

Ablations: `replay=False` ("w/o replay") runs an M_exp trained without retrieved transitions (`dreamjax train-exp
--set format.retrieval=false`; a mismatch with its exp_model.json is an error) and writes nothing back;
`curriculum.enabled=False` draws seed tasks uniformly and generates none ("w/o curriculum"); "w/o reasoning" is an
M_exp trained with `format.reasoning=false` (`dreamjax train-exp --set format.reasoning=false`), and `reasoning`
states which one the run expects: a mismatch with the checkpoint's exp_model.json is an error, so an ablation table
cannot silently mix them up.

Checkpoints and resume: as the real-env loop (`rl.checkpoint_every`, `rl.keep_checkpoints`, `rl.track`), with the
curriculum state and task pool, the M_task counters and the replay buffer's marks added (`DreamGymHook`); a resumed
run rewinds the buffer to its checkpoint, rebuilds the retrieval index in the chunks it was built in
(`dreamjax.replay.write_back`), and draws what the uninterrupted run would have drawn. Rerun the same command to
resume. On SIGTERM (a preemption notice) the run checkpoints the iteration it is in once it ends and exits with
status 75 (`dreamjax.loop.preemption`).

Several processes (multi-host): see `dreamjax.loop.dreamgym` (one replay writer, identical indexes, digests
compared every iteration) and `dreamjax.loop.run`.

Seed tasks are the offline data's tasks (their first recorded state starts the synthetic episode); none may be a
held-out evaluation task. Outputs in `out_dir`: those of the real-env loop (config.json, metrics.jsonl, evals.jsonl,
summary.json, learning_curve.svg, final/) plus replay/ (the buffer with the offline seed and the written-back
episodes), task_pool.json (the final curriculum) and exp_failures.jsonl (each M_exp step that failed after its
retries: the iteration, task, step, state, action, M_exp's last answer and its error).

Run: `dreamjax dreamgym --config configs/dreamgym_twx.py[:tiny] [--set key=value ...]`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from dreamjax.curriculum.source import CurriculumConfig, CurriculumTasks
from dreamjax.envs.registry import make_batch_env
from dreamjax.experience.exp_model import exp_retriever, load_exp_model
from dreamjax.experience.sft_data import annotations_for
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from
from dreamjax.loop.config import start_run
from dreamjax.loop.dreamgym import DreamGymHook, PlacementConfig, make_meshes, seed_records
from dreamjax.loop.learner import PolicyLearner, RLConfig, load_policy
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.run import Run, resuming, run_iterations
from dreamjax.parallel import is_primary
from dreamjax.replay.write_back import open_replay, rebuild_retriever
from dreamjax.rl.keys import PHASE_SYNTHETIC, phase_key
from dreamjax.sampling import Sampler, SpeculativeConfig


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
  exp_temperature: float = 1.0  # 0: greedy M_exp answers
  exp_max_new_tokens: int = 0  # 0: the decode budget recorded in exp_model.json
  exp_prompt_buckets: tuple[int, ...] = ()  # M_exp prompt widths; empty: powers of two up to its max_len
  # Resamples of an M_exp answer that did not parse; a row still unreadable after them ends as an env failure,
  # left out of the update and of write-back (dreamjax/experience/synthetic_env.py).
  exp_retries: int = 2
  # The temperature of those resamples; None: exp_temperature (so greedy M_exp, exp_temperature 0, never retries).
  exp_retry_temperature: float | None = None
  # M_exp's copy-speculative decoding (draft_tokens 0: off; the policy's is rl.rollout.speculative). On by default:
  # a next state mostly copies the prompt (experiments/bench/synthetic_env.py, trained tiny M_exp on 2 CPU cores:
  # K=4 1.39x the transitions/s of plain decoding, 3.0 tokens per forward, the same greedy answers).
  exp_speculative: SpeculativeConfig = SpeculativeConfig(draft_tokens=4)
  # M_exp keeps each row's KV cache between steps and prefills only what it lacks (SyntheticEnv's kv_reuse; the
  # policy's is rl.rollout.kv_reuse).
  exp_kv_reuse: bool = False
  # M_exp's (and M_task's) weights and compute: frozen, so unlike the trained policy it may hold bfloat16 weights.
  exp_dtype: str = "float32"
  placement: PlacementConfig = PlacementConfig()
  out_dir: str = "runs/dreamgym"

  def __post_init__(self):
    if min(self.seed_tasks, self.exp_max_new_tokens, self.exp_temperature, self.exp_retries,
           self.exp_retry_temperature or 0) < 0:
      raise ValueError("DreamGymConfig: seed_tasks, exp_max_new_tokens, exp_temperature, exp_retries and "
                       "exp_retry_temperature must be >= 0")
    if self.exp_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"DreamGymConfig.exp_dtype must be 'float32' or 'bfloat16', got {self.exp_dtype!r}")


def run(cfg: DreamGymConfig) -> dict[str, Any]:
  """The `dreamjax dreamgym` command: trains in the experience model (resuming from the latest checkpoint in
  `out_dir` when there is one), evaluates on the real env, writes the run folder; returns the summary."""
  start_run(cfg.rl)  # before anything touches devices: joins the processes, points the compilation cache
  with lock_run_folder(cfg.out_dir):  # a second run on the folder is refused before M_exp loads; `Run` re-enters it
    return resuming(lambda: _run(cfg))


def _run(cfg: DreamGymConfig) -> dict[str, Any]:
  rl = dataclasses.replace(cfg.rl, out_dir=cfg.out_dir)
  rl.model.check("DreamGymConfig.rl.model.checkpoint")  # before M_exp loads and the real env starts
  mesh, exp_mesh = make_meshes(rl, cfg.placement)
  eval_pool = rl.eval_tasks.tasks(rl.env)
  records, seeds = seed_records(cfg.offline_data, cfg.seed_tasks, rl.tasks_per_iteration, {t.task_id for t in eval_pool})
  exp_cfg, exp_params, exp_tok, meta, fmt = load_exp_model(cfg.exp_model, reasoning=cfg.reasoning, replay=cfg.replay,
                                                          dtype=cfg.exp_dtype, mesh=exp_mesh)
  root = jax.random.key(rl.seed)
  with Run(rl, cfg, cfg.out_dir) as run:
    if is_primary():  # the one writer of the run folder
      Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    retrieve = bool(fmt.retrieval and fmt.k)
    buffer, marks = open_replay(run.out / "replay", records, run.meta.get("replay_marks"), retrieve)
    retriever = exp_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
    if retrieve:
      rebuild_retriever(retriever, buffer, marks)
    notes = annotations_for(records) if fmt.tutorial else {}
    tutorials = {r.task.task_id: notes[r.episode_id].tutorial for r in reversed(records)} if fmt.tutorial else {}
    max_new = cfg.exp_max_new_tokens or meta["max_new_tokens"]
    # Prompt widths: powers of two up to what M_exp was trained on, leaving room for its answer in the position table.
    top = min(meta["max_len"], exp_cfg.max_position_embeddings - max_new)
    buckets = cfg.exp_prompt_buckets or tuple(b for b in (256, 512, 1024, 2048, 4096, 8192) if b < top) + (top,)
    synthetic = SyntheticEnv(exp_cfg, exp_params, exp_tok, fmt, retriever if retrieve else None,
                             initial_states=initial_states_from(records), max_new_tokens=max_new,
                             temperature=cfg.exp_temperature, prompt_buckets=buckets,
                             key=phase_key(root, 0, PHASE_SYNTHETIC), mesh=exp_mesh, tutorials=tutorials,
                             max_steps=rl.rollout.max_turns, exp_retries=cfg.exp_retries,
                             retry_temperature=cfg.exp_retry_temperature,
                             speculative=cfg.exp_speculative, kv_reuse=cfg.exp_kv_reuse)
    task_sampler = Sampler(exp_cfg, cfg.curriculum.max_new_tokens, pad_id=exp_tok.pad_id, mesh=exp_mesh) \
        if cfg.curriculum.enabled and cfg.curriculum.generate_every else None
    curriculum = CurriculumTasks(cfg.curriculum, seeds, records, tasks_per_iteration=rl.tasks_per_iteration,
                                 algorithm=rl.algorithm, seed=rl.seed, root=root, sampler=task_sampler,
                                 exp_params=exp_params, exp_tok=exp_tok, encode=retriever.encoder.encode)
    real = make_batch_env(rl.env, rl.env_kwargs, rl.rows, rl.num_workers)
    try:
      folder, model_cfg, params, tok = load_policy(rl, run.out, run.resume is not None, real, seeds, mesh)
      hook = DreamGymHook(synthetic, curriculum, buffer, marks, retriever if retrieve else None, tok,
                          write_back=cfg.replay, failures_path=run.out / "exp_failures.jsonl", resume=run.resume)
      return run_iterations(run, PolicyLearner(rl, model_cfg, params, tok, mesh), curriculum, synthetic,
                            eval_env=real, eval_tasks=eval_pool, model_folder=folder, hooks=[hook])
    finally:
      real.close()
      buffer.close()
