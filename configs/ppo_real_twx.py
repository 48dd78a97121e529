"""PPO against real TextWorld-Express games from the policy SFT warm start (the paper's "PPO, real env" baseline).

The critic is a value head on the policy (zero-initialised on the warm start, with a larger learning rate); advantages
are GAE over turns (one value per turn: the value at the turn's last prompt token), whitened over the batch; two
epochs of clipped updates per iteration, no KL term; held-out success (with a 95% interval) every 10 iterations.

SFT:   dreamjax train-policy --config configs/train_policy_twx.py            (runs/policy_sft/twx/checkpoint)
Run:   dreamjax rl --config configs/ppo_real_twx.py
Tiny (CPU, about 10 minutes): the tiny SFT warm start (see configs/train_policy_twx.py), then
       dreamjax rl --config configs/ppo_real_twx.py:tiny
"""

import dataclasses
import importlib.util
from pathlib import Path

from dreamjax.loop.learner import RLConfig
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig

# The GRPO config's env, tasks, agent format and budgets, loaded by path (configs/ is not a package).
_spec = importlib.util.spec_from_file_location("grpo_real_twx", Path(__file__).with_name("grpo_real_twx.py"))
grpo_real_twx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grpo_real_twx)


def _ppo(base: RLConfig, lr: float, out_dir: str, value_lr_multiplier: float = 10.0) -> RLConfig:
  return dataclasses.replace(
      base,
      algorithm="ppo",
      objective=PolicyGradientConfig(clip_low=0.2, clip_high=0.2, kl_coef=0.0, vf_coef=0.5, vf_clip=0.5,
                                     temperature=base.rollout.temperature),
      advantage="gae_turn",
      gamma=0.95,  # per turn: shorter successes are worth more
      lam=0.95,
      whiten_advantages=True,
      optim=OptimConfig(lr=lr, warmup_steps=base.optim.warmup_steps, clip_norm=1.0,
                        value_head_lr_multiplier=value_lr_multiplier),
      epochs=2,
      out_dir=out_dir,
  )


def config() -> RLConfig:
  return _ppo(grpo_real_twx.config(), 1e-6, "runs/rl_real/ppo_twx")


def tiny() -> RLConfig:
  return _ppo(grpo_real_twx.tiny(), 1e-3, "runs/rl_real/ppo_coin_tiny", value_lr_multiplier=3.0)
