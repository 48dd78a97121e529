"""DreamGym on TextWorld-Express: GRPO inside the experience model, held-out evaluation on the real games.

Needs three earlier runs (their outputs are the paths below): offline data (configs/collect_twx.py), the experience
model trained on it (configs/train_exp_twx.py) and the policy SFT warm start (configs/train_policy_twx.py).

Run:   dreamjax dreamgym --config configs/dreamgym_twx.py
Ablations (docs/paper_map.md): an M_exp trained with --set format.retrieval=false, given as --set exp_model=...
       --set replay=false | --set curriculum.generate_every=0 | --set curriculum.enabled=false | an M_exp trained
       with --set format.reasoning=false, given as --set exp_model=... --set reasoning=false
PPO:   --set rl.algorithm=ppo --set rl.advantage=gae_turn (a separate critic, rl.critic.*; reproduce's PPO rows take
       verl-agent's settings from dreamjax/loop/learner.py's as_ppo)
Tiny (CPU): collect the small coin dataset and train the tiny M_exp as configs/train_exp_twx.py's docstring says, the
       tiny policy warm start as configs/train_policy_twx.py's says, then
       dreamjax dreamgym --config configs/dreamgym_twx.py:tiny
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.dreamgym import DreamGymConfig
from dreamjax.config import load_config
from dreamjax.curriculum.source import CurriculumConfig
from dreamjax.loop.learner import TaskSpec

_GRPO = str(Path(__file__).with_name("grpo_real_twx.py"))  # the real-env GRPO config: same policy side
COIN_TINY = "numLocations=2, includeDoors=0, numDistractorItems=0"  # the tiny M_exp's games


def config() -> DreamGymConfig:
  rl = load_config(_GRPO)
  return DreamGymConfig(
      rl=rl,
      exp_model="runs/exp_sft/twx/checkpoint",
      offline_data=("runs/collect/twx/trajectories.jsonl",),
      # M_task proposes 4 variants per seed and its selection prompt keeps the feasible, harder one (the paper's
      # task-generation appendix).
      curriculum=CurriculumConfig(capacity=2048, lam=0.2, generate_every=5, seeds_per_round=8, proposals_per_seed=4,
                                  variants_per_seed=1),
      exp_kv_reuse=True,  # M_exp's retries and steps prefill only what its cache lacks (exact)
      out_dir="runs/dreamgym/grpo_twx",
  )


def tiny() -> DreamGymConfig:
  """Coin games as the tiny M_exp knows them, the tiny warm start, one CPU device; a few minutes."""
  rl = load_config(f"{_GRPO}:tiny")
  eval_tasks = TaskSpec(games=("coin",), split="dev", start=0, count=50, game_params=COIN_TINY)
  return DreamGymConfig(
      rl=dataclasses.replace(rl, eval_tasks=eval_tasks, iterations=10, eval_every=5),
      exp_model="runs/exp_sft/twx_tiny/checkpoint",
      offline_data=("runs/collect/twx_coin_tiny/trajectories.jsonl",),
      reasoning=False,  # the tiny M_exp is trained without reasoning (see configs/train_exp_twx.py:tiny)
      curriculum=CurriculumConfig(capacity=256, lam=0.25, generate_every=2, seeds_per_round=2, variants_per_seed=2,
                                  max_new_tokens=64),
      exp_kv_reuse=True,
      out_dir="runs/dreamgym/grpo_coin_tiny",
  )
