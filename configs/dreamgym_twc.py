"""DreamGym GRPO on the twc testbed on its own: configs/reproduce_twc.py's DreamGym stage for one seed, reading the
outputs of the earlier stages from their folders instead of being rewired by `dreamjax reproduce`.

The policy side is configs/grpo_real_twc.py's (the reproduce config's `real` section: the same warm start, optimiser,
rollout budgets and held-out checks on the real games); only where the episodes come from differs. It needs:
- the collection and the SFT warm start: `dreamjax reproduce --config configs/reproduce_twc.py` writes them first
  (runs/reproduce/twc/data, runs/reproduce/twc/sft);
- M_exp: `dreamjax train-exp --config configs/train_exp_twc.py` (runs/exp_sft/twc).

Run:  dreamjax dreamgym --config configs/dreamgym_twc.py [--set rl.seed=N --set out_dir=...]
Tiny: dreamjax dreamgym --config configs/dreamgym_twc.py:tiny   (configs/reproduce_twc.py:tiny's stage; it measures
      nothing)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.dreamgym import DreamGymConfig
from dreamjax.config import load_config

HERE = Path(__file__).parent


def _stage(variant: str, run: str, exp_model: str, out_dir: str) -> DreamGymConfig:
  d = load_config(f"{HERE / 'reproduce_twc.py'}{variant}").dreamgym
  rl = dataclasses.replace(d.rl, model=dataclasses.replace(d.rl.model, checkpoint=f"{run}/sft/checkpoint"),
                           out_dir=out_dir)
  return dataclasses.replace(d, rl=rl, exp_model=exp_model, offline_data=(f"{run}/data/trajectories.jsonl",),
                             out_dir=out_dir)


def config() -> DreamGymConfig:
  return _stage("", "runs/reproduce/twc", "runs/exp_sft/twc/checkpoint", "runs/dreamgym/grpo_twc")


def tiny() -> DreamGymConfig:
  return _stage(":tiny", "runs/reproduce/twc_tiny", "runs/reproduce/twc_tiny/exp_model/checkpoint",
                "runs/dreamgym/grpo_twc_tiny")
