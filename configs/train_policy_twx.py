"""Policy SFT (behaviour cloning) on TextWorld-Express expert trajectories: the SFT baseline and the RL warm start.

Data:  dreamjax collect --config configs/collect_twx.py                      (runs/collect/twx, three games)
Run:   dreamjax train-policy --config configs/train_policy_twx.py
Real:  dreamjax train-policy --config configs/train_policy_twx.py --set model.checkpoint=/path/to/Qwen2.5-7B-Instruct \
         --set optim.lr=1e-5 --set optim.warmup_steps=20 --set micro_batches=4
Tiny (CPU; 17 minutes on a shared, heavily loaded 2-core machine): two-room coin games, a 2-layer model trained
from scratch (measured: held-out success 0.66 [0.52, 0.78] and 0.74 [0.60, 0.84] over 50 dev tasks on two
collections, its failures inadmissible move directions); collect its data first (a
4-step limit: the expert needs 2 or 3, and most random runs fail, which gives the DPO run its rejected side):
       dreamjax collect --config configs/collect_twx.py --set games=coin \
         --set "game_params=numLocations=2, includeDoors=0" --set env_kwargs=step_limit=4 \
         --set policies=expert:96,random:64,eps0.5:32 --set num_workers=0 --set rows_per_worker=8 \
         --set out_dir=runs/collect/coin_tiny
       dreamjax train-policy --config configs/train_policy_twx.py:tiny
The output folder's `checkpoint/` is the warm start for `dreamjax rl` (model.checkpoint) and for DPO
(configs/dpo_twx.py); `summary.json` holds the held-out success with its 95% interval.
"""

from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.loop.evaluate import EvalConfig
from dreamjax.loop.model import ModelSource
from dreamjax.loop.policy_data import RowConfig
from dreamjax.models import tiny as tiny_model
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig

COIN_TINY = "numLocations=2, includeDoors=0"


def config() -> PolicySftConfig:
  steps = 3000
  return PolicySftConfig(
      data=("runs/collect/twx/trajectories.jsonl",),
      env="textworld_express",
      env_kwargs=("step_limit=50", "invalid_action=continue"),
      agent=AgentFormat(think=False, history_turns=4, history_token_budget=512, max_admissible=50),
      rows=RowConfig(experts=("expert",), successful_only=True, think="auto"),
      rollout=RolloutConfig(max_turns=50, max_action_tokens=32, max_episode_tokens=1600, prompt_buckets=(1024, 2048)),
      # Without a checkpoint: a small Qwen2-shaped model trained from scratch (lr for that; a real checkpoint wants
      # about 1e-5).
      model=ModelSource(tiny=tiny_model("qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768,
                                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                        max_position_embeddings=4096)),
      optim=OptimConfig(lr=1e-3, warmup_steps=100, schedule="cosine", total_steps=steps, end_lr_factor=0.1,
                        weight_decay=0.01),
      batch_size=32,
      max_steps=steps,
      eval=EvalConfig(games=("cookingworld", "twc", "coin"), split="dev", num_tasks=50, train_tasks=0,
                      every_steps=1000, num_envs=16),
      out_dir="runs/policy_sft/twx",
      seed=0,
  )


def tiny() -> PolicySftConfig:
  steps = 300
  return PolicySftConfig(
      data=("runs/collect/coin_tiny/trajectories.jsonl",),
      env="textworld_express",
      env_kwargs=("step_limit=20",),
      agent=AgentFormat(think=False, history_turns=3, history_token_budget=256),
      rows=RowConfig(),
      rollout=RolloutConfig(max_turns=10, max_action_tokens=16, max_episode_tokens=160, prompt_buckets=(512,)),
      model=ModelSource(tiny=tiny_model("qwen2", vocab_size=768, hidden_size=128, intermediate_size=384, num_layers=2,
                                        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)),
      optim=OptimConfig(lr=3e-3, warmup_steps=20, schedule="cosine", total_steps=steps, end_lr_factor=0.05),
      batch_size=16,
      max_steps=steps,
      eval=EvalConfig(games=("coin",), split="dev", num_tasks=50, game_params=COIN_TINY, train_tasks=20,
                      every_steps=100, num_envs=10),
      devices=1,
      log_every=20,
      out_dir="runs/policy_sft/coin_tiny",
      seed=0,
  )
