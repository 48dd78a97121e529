"""GRPO against real TextWorld-Express games from the policy SFT warm start (the paper's "GRPO, real env" baseline).

Each iteration rolls out G = 8 episodes of each of B = 16 training tasks in the real env, normalises every
episode's outcome reward within its group, and takes clipped policy-gradient steps with a low-variance KL to the
frozen warm start (verl-agent's defaults, docs/paper_map.md, "RL"); held-out success (with a 95% interval) every 10 iterations.

SFT:   dreamjax train-policy --config configs/train_policy_twx.py            (runs/policy_sft/twx/checkpoint)
Run:   dreamjax rl --config configs/grpo_real_twx.py
Real:  the same after an SFT run from a real checkpoint; with a mesh, e.g. --set mesh.fsdp=8 --set micro_batches=4
Tiny (CPU, about 10 minutes): the tiny SFT warm start (see configs/train_policy_twx.py), then
       dreamjax rl --config configs/grpo_real_twx.py:tiny
experiments/learning_twx.py runs the tiny variants of this and configs/ppo_real_twx.py end to end and tabulates them.
"""

import dataclasses

from dreamjax.loop.learner import RLConfig, TaskSpec
from dreamjax.loop.model import ModelSource
from dreamjax.models import tiny as tiny_model
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig

COIN_TINY = "numLocations=2, includeDoors=0"


def config() -> RLConfig:
  return RLConfig(
      model=ModelSource(checkpoint="runs/policy_sft/twx/checkpoint"),
      algorithm="grpo",
      objective=PolicyGradientConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.02, kl_kind="low_var_kl",
                                     temperature=1.0),
      advantage="grpo",
      invalid_penalty=0.1,
      env="textworld_express",
      env_kwargs=("step_limit=50", "invalid_action=continue"),
      num_workers=4,
      train_tasks=TaskSpec(games=("cookingworld", "twc", "coin"), split="train", start=0, count=500),
      eval_tasks=TaskSpec(games=("cookingworld", "twc", "coin"), split="dev", start=0, count=50),
      agent=AgentFormat(think=False, history_turns=4, history_token_budget=512, max_admissible=50),  # as in SFT
      # The exact fast paths (dreamjax/rollout/engine.py): a group's first prompt prefilled once, and each row's KV
      # cache kept across turns (experiments/bench/multiturn_rollout.py: the same trajectories, 1.35x on the demo).
      rollout=RolloutConfig(group_size=8, max_turns=50, max_action_tokens=32, max_episode_tokens=1600,
                            prompt_buckets=(1024, 2048), temperature=1.0, group_prefill=True, kv_reuse=True),
      tasks_per_iteration=16,
      optim=OptimConfig(lr=1e-6, warmup_steps=5, clip_norm=1.0),
      rows_per_step=256,
      micro_batches=8,
      epochs=1,
      pad_to=256,
      score_batch=64,
      iterations=200,
      eval_every=10,
      out_dir="runs/rl_real/grpo_twx",
      seed=0,
  )


def tiny() -> RLConfig:
  """Two-room coin games and the tiny SFT warm start (runs/policy_sft/coin_tiny/checkpoint), on one CPU device."""
  return dataclasses.replace(
      config(),
      model=ModelSource(checkpoint="runs/policy_sft/coin_tiny/checkpoint",
                        tiny=tiny_model("qwen2", max_position_embeddings=1024)),
      env_kwargs=("step_limit=20",),
      num_workers=0,
      train_tasks=TaskSpec(games=("coin",), split="train", start=0, count=200, game_params=COIN_TINY),
      eval_tasks=TaskSpec(games=("coin",), split="dev", start=0, count=50, game_params=COIN_TINY),
      agent=AgentFormat(think=False, history_turns=2, history_token_budget=160),
      # The expert needs 2 or 3 steps; 4 turns leave room for one mistake.
      rollout=RolloutConfig(group_size=8, max_turns=4, max_action_tokens=16, max_episode_tokens=64,
                            prompt_buckets=(384,), temperature=1.0, group_prefill=True, kv_reuse=True),
      # Dr. GRPO: without the std division, a group that differs only by an invalid-action penalty (all 8 found the
      # coin, one wasted a turn) gets advantages of order 0.1, not of order 1 like a success against a failure.
      normalize_std=False,
      # Groups whose 8 episodes all succeed (the coin in sight) or all fail teach nothing; skipping them saves CPU.
      drop_zero_variance_groups=True,
      tasks_per_iteration=4,
      # Tuned on the tiny runs of experiments/learning_twx.py: 3e-4 with one epoch barely moved the policy in 15
      # iterations; 5e-4 with two steps per iteration and the std-normalised advantages drifted and collapsed.
      optim=OptimConfig(lr=1e-3, clip_norm=1.0),
      rows_per_step=128,  # one step per epoch (32 episodes of at most 4 turns)
      epochs=2,
      micro_batches=1,
      pad_to=400,
      score_batch=32,
      iterations=30,
      eval_every=5,
      eval_sampled=True,
      devices=1,
      out_dir="runs/rl_real/grpo_coin_tiny",
  )
