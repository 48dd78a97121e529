"""`dreamjax eval`: a policy checkpoint's held-out success on a real environment, as every table compares them.

Any policy folder (SFT, DPO, real-env RL, DreamGym, S2R: all are HF folders) is loaded and run through
`dreamjax.loop.evaluate.evaluate`, greedily (one episode per task) and, with `sampled`, once more at temperature 1
(the stochastic policy RL optimises). The tasks are a `TaskSpec` of the env's held-out fold, so the methods of a table
are compared on exactly the same games. Writes `eval.json` (rates, 95% Wilson intervals, failure statistics,
per-task outcomes) to `out_dir` and returns it, and the episodes themselves (instruction, states, actions, rewards) as
`episodes.jsonl` and `sampled_episodes.jsonl`, in the format `dreamjax collect` writes, to see what the policy did.

Run: `dreamjax eval --config <a config defining an EvalRunConfig> --set checkpoint=runs/dreamgym/grpo_twx/final`
(`dreamjax reproduce` runs it on every final policy with its `eval` section).

Several processes (multi-host): `start_run(cfg)` first joins them; every process then runs the same program (the
model sharded over every process's devices, the sampler's rows too, so each process takes part in every step, and
each steps its own copy of the envs, as `dreamjax rl`'s evaluations do) and returns the result; process 0 alone
writes eval.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from dreamjax.envs.registry import make_batch_env
from dreamjax.loop.config import RunConfig, run_mesh, start_run
from dreamjax.loop.evaluate import evaluate, greedy_rollout
from dreamjax.loop.learner import TaskSpec
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.model import load_model
from dreamjax.loop.track import to_json
from dreamjax.parallel import is_primary
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine


@dataclasses.dataclass(frozen=True)
class EvalRunConfig(RunConfig):
  checkpoint: str = ""  # an HF policy folder
  env: str = "textworld_express"
  env_kwargs: tuple[str, ...] = ("step_limit=20",)
  num_workers: int = 0
  tasks: TaskSpec = TaskSpec(split="dev", count=100)
  agent: AgentFormat = AgentFormat(think=False)
  rollout: RolloutConfig = RolloutConfig(max_turns=15, max_action_tokens=32, max_episode_tokens=512,
                                         prompt_buckets=(512, 768))
  batch: int = 16  # episodes run together
  sampled: bool = False  # also one episode per task at temperature 1
  out_dir: str = "runs/eval"


def run(cfg: EvalRunConfig) -> dict[str, Any]:
  if not cfg.checkpoint or not (Path(cfg.checkpoint) / "config.json").is_file():
    raise ValueError(f"EvalRunConfig.checkpoint: {cfg.checkpoint!r} is not an HF checkpoint folder")
  if cfg.batch < 1:
    raise ValueError(f"EvalRunConfig.batch must be >= 1, got {cfg.batch}")
  start_run(cfg)  # before anything touches devices: joins the processes, points the compilation cache
  with lock_run_folder(cfg.out_dir):  # one evaluation per folder, refused before the model loads
    return _evaluate(cfg)


def _evaluate(cfg: EvalRunConfig) -> dict[str, Any]:
  mesh = run_mesh(cfg)
  model_cfg, params, tok = load_model(cfg.checkpoint, mesh=mesh)
  tasks = cfg.tasks.tasks(cfg.env)
  greedy = RolloutEngine(model_cfg, tok, cfg.agent, greedy_rollout(cfg.rollout), mesh=mesh)
  env = make_batch_env(cfg.env, cfg.env_kwargs, cfg.batch, cfg.num_workers)
  key = jax.random.key(cfg.seed)
  try:
    result = evaluate(greedy, params, env, tasks, key, batch_size=cfg.batch, keep_records=True, progress=True)
    episodes = {"episodes.jsonl": result.pop("records")}
    if cfg.sampled:
      sampled = RolloutEngine(model_cfg, tok, cfg.agent, dataclasses.replace(cfg.rollout, group_size=1), mesh=mesh)
      result["sampled"] = evaluate(sampled, params, env, tasks, jax.random.fold_in(key, 1), batch_size=cfg.batch,
                                   keep_records=True, progress=True)
      episodes["sampled_episodes.jsonl"] = result["sampled"].pop("records")
  finally:
    env.close()
  result |= {"checkpoint": cfg.checkpoint, "config": to_json(cfg)}
  if is_primary():  # the one writer of the run folder
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in episodes.items():  # what the policy did, in the collection format (dreamjax.data.records)
      (out / name).write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
  print(f"{cfg.checkpoint}: greedy success {result['success_rate']:.3f} [{result['ci_low']:.3f}, "
        f"{result['ci_high']:.3f}] over {result['episodes']} tasks" +
        (f", sampled {result['sampled']['success_rate']:.3f}" if cfg.sampled else ""), flush=True)
  return result
