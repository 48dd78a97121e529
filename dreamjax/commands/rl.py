"""`dreamjax rl`: PPO or GRPO against a real environment (the paper's real-env baselines and the S2R stage), with
held-out evaluation; the shared loop (`dreamjax.loop.run`) on a `PolicyLearner`, tasks drawn uniformly from the
training pool (a fixed shuffle per pass, so the draw depends only on the seed and the iteration).

Real transitions: one per answer that parsed and was sent to the env; unparseable answers cost no env step. Only
training rollouts count; evaluation episodes are reported separately. `max_real_transitions` is S2R's budget.

Several processes (multi-host: TPU pods, multi-GPU hosts): `run` first calls `dreamjax.loop.config.start_run(cfg)`
(`dreamjax.parallel.initialize`, then the compilation cache), so the mesh spans every process's devices; every
process then runs the same host program on the same seeds and tasks, each stepping its own copy of the envs (text
envs are cheap next to the model, and duplicated stepping keeps every process's prompts identical without
host-to-host messages); process 0 alone writes the run folder.

Preemption: on SIGTERM the run checkpoints the iteration it is in once it ends and exits with status 75
(`dreamjax.loop.preemption`); the same command resumes it, as after a kill (`dreamjax.loop.run`).

  dreamjax rl --config configs/grpo_real_twx.py:tiny                                   # killed? rerun it to resume
  dreamjax rl --config configs/grpo_real_twx.py:tiny --set track.wandb=offline --set checkpoint_every=5
"""

from __future__ import annotations

from typing import Any

from dreamjax.curriculum.source import UniformTasks
from dreamjax.envs.base import BatchEnv
from dreamjax.envs.registry import make_batch_env
from dreamjax.loop.config import run_mesh, start_run
from dreamjax.loop.learner import PolicyLearner, RLConfig, load_policy
from dreamjax.loop.run import Run, resuming, run_iterations


def run(cfg: RLConfig, env: BatchEnv | None = None) -> dict[str, Any]:
  """Trains (resuming from the latest checkpoint in `out_dir` when there is one), evaluates, writes the run folder;
  returns the summary. `env` may be any BatchEnv taking `cfg.rows` rows (it is not closed here); by default one is
  made from the config."""
  start_run(cfg)  # before anything touches devices: joins the processes, points the compilation cache
  return resuming(lambda: _run(cfg, env))


def _run(cfg: RLConfig, env: BatchEnv | None) -> dict[str, Any]:
  cfg.model.check("RLConfig.model.checkpoint")  # a bad path: one line now, not a traceback once the JVMs started
  mesh = run_mesh(cfg)
  train_pool, eval_pool = cfg.train_tasks.tasks(cfg.env), cfg.eval_tasks.tasks(cfg.env)
  shared = {t.task_id for t in train_pool} & {t.task_id for t in eval_pool}
  if shared:
    raise ValueError(f"RLConfig: train_tasks and eval_tasks share {len(shared)} tasks (e.g. {sorted(shared)[0]!r}); "
                     f"evaluation must be on held-out tasks")
  with Run(cfg, cfg, cfg.out_dir) as run:
    owned = env is None
    env = make_batch_env(cfg.env, cfg.env_kwargs, cfg.rows, cfg.num_workers) if owned else env
    try:
      folder, model_cfg, params, tok = load_policy(cfg, run.out, run.resume is not None, env, train_pool, mesh)
      learner = PolicyLearner(cfg, model_cfg, params, tok, mesh)
      return run_iterations(run, learner, UniformTasks(train_pool, cfg.tasks_per_iteration, cfg.seed), env,
                            eval_env=env, eval_tasks=eval_pool, model_folder=folder)
    finally:
      if owned:
        env.close()
