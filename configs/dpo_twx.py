"""DPO baseline on TextWorld-Express: successful vs failed episodes of the same task, from the SFT checkpoint.

Pairs come from the offline data: the expert's successful episodes (chosen) against failed random or epsilon-noisy
episodes of the same task (rejected), at most two pairs per task. The SFT checkpoint is both the starting policy and
the frozen reference.

Plain DPO pushes the rejected answers down faster than it keeps the chosen ones up, and a small policy then leaves
the answer format: on the tiny run below, lr 2e-4 for 3 epochs raised the margin to 5.7 and took held-out success
from 0.66 to 0.0 (93% of answers unparseable). So these configs add the chosen trajectories' NLL (sft_coef = 1, RPO)
and a lower rate; the tiny run then keeps its success (0.66 -> 0.66 over 50 held-out tasks, margin 0 -> 0.38), as
the paper's DPO stays near its SFT baseline, though 28% of its answers (on the failing episodes) no longer parse.
Offline random failures do not show the SFT policy's own mistakes (on coin: inadmissible move directions); pairs
from the policy's rollouts (TrajectoryRecords, policy "policy", in the data files) would.

Data:  dreamjax collect --config configs/collect_twx.py                      (runs/collect/twx)
SFT:   dreamjax train-policy --config configs/train_policy_twx.py            (runs/policy_sft/twx/checkpoint)
Run:   dreamjax dpo --config configs/dpo_twx.py
Real:  train the SFT checkpoint from a real model (see configs/train_policy_twx.py), then the same command.
Tiny (CPU, 7 minutes on a loaded 2-core machine): the tiny SFT run's data and checkpoint (see configs/train_policy_twx.py; its 4-step limit
makes most random runs fail), then
       dreamjax dpo --config configs/dpo_twx.py:tiny
"""

from dreamjax.commands.dpo import DpoConfig
from dreamjax.loop.evaluate import EvalConfig
from dreamjax.loop.policy_data import PairConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig


def config() -> DpoConfig:
  return DpoConfig(
      data=("runs/collect/twx/trajectories.jsonl",),
      checkpoint="runs/policy_sft/twx/checkpoint",
      env="textworld_express",
      env_kwargs=("step_limit=50", "invalid_action=continue"),
      agent=AgentFormat(think=False, history_turns=4, history_token_budget=512, max_admissible=50),  # as in SFT
      rollout=RolloutConfig(max_turns=50, max_action_tokens=32, max_episode_tokens=1600, prompt_buckets=(1024, 2048)),
      # Random episodes run to the step limit; their first 20 turns carry the preference signal at a fraction of the
      # cost.
      pairs=PairConfig(chosen_policies=("expert",), rejected_policies=("random", "eps0.3"), max_pairs_per_task=2,
                       max_turns=20),
      beta=0.1,
      sft_coef=1.0,  # RPO: keeps the chosen answers likely (see the module docstring)
      optim=OptimConfig(lr=5e-5, warmup_steps=20),  # a tiny from-scratch SFT model; a real one wants about 5e-7
      pairs_per_step=8,
      epochs=2,
      eval=EvalConfig(games=("cookingworld", "twc", "coin"), split="dev", num_tasks=50, every_steps=500, at_start=True,
                      num_envs=16),
      out_dir="runs/dpo/twx",
      seed=0,
  )


def tiny() -> DpoConfig:
  return DpoConfig(
      data=("runs/collect/coin_tiny/trajectories.jsonl",),
      checkpoint="runs/policy_sft/coin_tiny/checkpoint",
      env="textworld_express",
      env_kwargs=("step_limit=20",),  # evaluation as in the tiny SFT run
      agent=AgentFormat(think=False, history_turns=3, history_token_budget=256),
      rollout=RolloutConfig(max_turns=10, max_action_tokens=16, max_episode_tokens=160, prompt_buckets=(512,)),
      pairs=PairConfig(rejected_policies=("random", "eps0.5"), max_pairs_per_task=2),
      beta=0.1,
      sft_coef=1.0,
      optim=OptimConfig(lr=5e-5, warmup_steps=5),
      pairs_per_step=8,
      epochs=2,
      eval=EvalConfig(games=("coin",), split="dev", num_tasks=50, game_params="numLocations=2, includeDoors=0",
                      at_start=True, num_envs=10),
      devices=1,
      log_every=5,
      out_dir="runs/dpo/coin_tiny",
      seed=0,
  )
