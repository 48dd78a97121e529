"""The MiniWoB candidate testbed's held-out evaluation: 20 pages of each of configs/collect_miniwob.py:headroom's
eight tasks (seeds from 1,000,000), greedy and sampled at temperature 1, with the SFT policy's prompts and budgets
(configs/train_policy_miniwob.py), for any policy checkpoint, e.g. a `dreamjax rl --config
configs/grpo_real_miniwob.py` run's final policy.

Run:  dreamjax eval --config configs/eval_miniwob.py --set checkpoint=runs/headroom/grpo_real_miniwob/final
Tiny: dreamjax eval --config configs/eval_miniwob.py:tiny --set checkpoint=...   (2 pages of two tasks; it measures
      nothing)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.eval import EvalRunConfig
from dreamjax.config import load_config
from dreamjax.loop.learner import TaskSpec

HERE = Path(__file__).parent


def config() -> EvalRunConfig:
  sft = load_config(str(HERE / "train_policy_miniwob.py"))
  return EvalRunConfig(checkpoint=f"{sft.out_dir}/checkpoint", env="miniwob", env_kwargs=sft.env_kwargs,
                       tasks=TaskSpec(games=sft.eval.games, split="eval", count=sft.eval.num_tasks), agent=sft.agent,
                       rollout=sft.rollout, batch=8, sampled=True, out_dir="runs/eval/miniwob")


def tiny() -> EvalRunConfig:
  cfg = config()
  return dataclasses.replace(cfg, tasks=dataclasses.replace(cfg.tasks, games=("click-link", "enter-text"), count=2),
                             batch=4, sampled=False, out_dir="runs/eval/miniwob_tiny")
