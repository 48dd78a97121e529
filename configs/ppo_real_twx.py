"""PPO against real TextWorld-Express games from the policy SFT warm start (the paper's "PPO, real env" baseline).

PPO as the paper ran it: the paper reports no PPO hyperparameters and follows verl-agent, whose PPO examples
(examples/ppo_trainer/run_alfworld.sh, run_webshop.sh) run verl's defaults (verl/trainer/config/ppo_trainer.yaml).
`dreamjax.loop.learner.as_ppo` sets them on the GRPO config's env, tasks, agent format, budgets and policy optimizer
(so the two rows differ only by the algorithm), each value with its source:
- a separate critic initialised from the same SFT checkpoint: AdamW lr 1e-5 (critic.optim.lr), weight decay 0.01,
  no warmup, gradient clipping 1.0, clipped value loss with cliprange_value 0.5; the critic's epochs and step size are
  the policy's (critic.ppo_epochs / ppo_mini_batch_size);
- GAE over turns with gamma = 1.0 and lambda = 1.0 (verl's algorithm.gamma / algorithm.lam, kept by the examples),
  advantages whitened over the batch (verl's GAE does);
- clipped surrogate with clip 0.2 both ways (actor.clip_ratio), token-mean aggregation, low-variance KL 0.01 to the
  warm start (the examples' actor.use_kl_loss=True, kl_loss_coef=0.01), no entropy bonus;
- one epoch per iteration (actor.ppo_epochs 1).
Held-out success (with a 95% interval) every 10 iterations.

SFT:   dreamjax train-policy --config configs/train_policy_twx.py            (runs/policy_sft/twx/checkpoint)
Run:   dreamjax rl --config configs/ppo_real_twx.py
The earlier variant (value head on the policy): --set objective.vf_coef=0.5 --set critic.mode=shared_head
Tiny (CPU, about 10 minutes): the tiny SFT warm start (see configs/train_policy_twx.py), then
       dreamjax rl --config configs/ppo_real_twx.py:tiny
"""

import importlib.util
from pathlib import Path

from dreamjax.loop.learner import RLConfig, as_ppo
from dreamjax.rl.critic import CriticConfig
from dreamjax.rl.optim import OptimConfig

# The GRPO config's env, tasks, agent format and budgets, loaded by path (configs/ is not a package).
_spec = importlib.util.spec_from_file_location("grpo_real_twx", Path(__file__).with_name("grpo_real_twx.py"))
grpo_real_twx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grpo_real_twx)


def config() -> RLConfig:
  # gamma and lambda stated here too (as_ppo sets the same): verl's GAE defaults, which verl-agent's PPO examples keep.
  return as_ppo(grpo_real_twx.config(), gamma=1.0, lam=1.0, out_dir="runs/rl_real/ppo_twx")


def tiny() -> RLConfig:
  """The tiny GRPO config's settings (policy lr 1e-3, two epochs of one step) with PPO; the critic at 3e-3, the
  value head's effective rate in the earlier shared-head tiny runs (1e-5 barely moves a tiny model in 30
  iterations). Not tuned."""
  base = grpo_real_twx.tiny()
  critic = CriticConfig(optim=OptimConfig(lr=3e-3, clip_norm=1.0, weight_decay=0.01), value_clip=0.5)
  return as_ppo(base, epochs=base.epochs, critic=critic, out_dir="runs/rl_real/ppo_coin_tiny")
