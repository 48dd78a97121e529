"""The ALFWorld candidate testbed's held-out evaluation: pick_and_place_simple games of ALFRED's held-out floor plans,
greedy and sampled at temperature 1, with the SFT policy's prompts and budgets (configs/train_policy_alfworld.py), for
any policy checkpoint, e.g. a `dreamjax rl --config configs/grpo_real_alfworld.py` run's final policy.

Run:  dreamjax eval --config configs/eval_alfworld.py --set checkpoint=runs/headroom/grpo_real_alfworld/final
Tiny: dreamjax eval --config configs/eval_alfworld.py:tiny --set checkpoint=...   (2 games; it measures nothing)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.eval import EvalRunConfig
from dreamjax.config import load_config
from dreamjax.loop.learner import TaskSpec

HERE = Path(__file__).parent


def config() -> EvalRunConfig:
  sft = load_config(str(HERE / "train_policy_alfworld.py"))
  return EvalRunConfig(checkpoint=f"{sft.out_dir}/checkpoint", env="alfworld", env_kwargs=sft.env_kwargs,
                       tasks=TaskSpec(games=sft.eval.games, split="eval", count=200), agent=sft.agent,
                       rollout=sft.rollout, batch=20, sampled=True, out_dir="runs/eval/alfworld")


def tiny() -> EvalRunConfig:
  cfg = config()
  return dataclasses.replace(cfg, tasks=dataclasses.replace(cfg.tasks, count=2), batch=2, sampled=False,
                             out_dir="runs/eval/alfworld_tiny")
