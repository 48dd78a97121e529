"""The twc testbed's held-out evaluation on its own: configs/reproduce_twc.py's common final evaluation (200 unseen
train-fold games, tasks 600-799, answers restricted to the admissible actions, greedy and sampled at temperature 1),
for any policy checkpoint, e.g. a `dreamjax rl --config configs/grpo_real_twc.py` run's final policy.

Run:  dreamjax eval --config configs/eval_twc.py --set checkpoint=runs/grpo_real_twc/final --set out_dir=runs/eval/twc
Tiny: dreamjax eval --config configs/eval_twc.py:tiny --set checkpoint=...   (4 games; it measures nothing)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.eval import EvalRunConfig
from dreamjax.config import load_config

HERE = Path(__file__).parent


def config() -> EvalRunConfig:
  return dataclasses.replace(load_config(f"{HERE / 'reproduce_twc.py'}").eval, out_dir="runs/eval/twc")


def tiny() -> EvalRunConfig:
  cfg = config()
  return dataclasses.replace(cfg, tasks=dataclasses.replace(cfg.tasks, count=4), batch=4, out_dir="runs/eval/twc_tiny")
