"""`make demo`: DreamGym end to end at a tiny size on TextWorld-Express coin games, 10 to 20 minutes on 2 CPU cores.

Collects offline episodes from the real games, trains a tiny experience model and a tiny SFT policy on them, runs
GRPO inside the experience model (DreamGym) and, for comparison, GRPO against the real games, evaluates the three
policies on the same 50 held-out games and prints the table (also in runs/demo/results.md). Rerunning resumes.

Run:   dreamjax reproduce --config configs/demo.py
The full tiny comparison (DPO, PPO, S2R, ablations, three seeds): configs/reproduce_twx.py:tiny.
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.reproduce import ReproduceConfig
from dreamjax.config import load_config


def config() -> ReproduceConfig:
  full = load_config(f"{Path(__file__).with_name('reproduce_twx.py')}:tiny")
  return dataclasses.replace(full, dpo=None, algorithms=("grpo",), budgets=dataclasses.replace(full.budgets, s2r=0), ablations=(), seeds=(0,),
                             out_dir="runs/demo")
