"""Policy SFT on the ALFWorld candidate testbed: pick_and_place_simple games, a 20-step limit, answers restricted to
the admissible commands, demonstrations from ALFWorld's hand-coded expert (configs/collect_alfworld.py:headroom).

Why restricted answers: free answers of the tiny policy were 98% inadmissible on ALFWorld (experiments/RESULTS.md,
issue 6), which measures its spelling of object ids, not its choices; twc's testbed restricts them for the same reason.
Held-out = games of ALFRED's held-out floor plans (split "eval"), rooms no training game uses.

Data: dreamjax collect --config configs/collect_alfworld.py:headroom
Run:  dreamjax train-policy --config configs/train_policy_alfworld.py
Tiny: dreamjax train-policy --config configs/train_policy_alfworld.py:tiny   (a few steps on the tiny collection)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.config import load_config
from dreamjax.loop.evaluate import EvalConfig
from dreamjax.loop.model import ModelSource
from dreamjax.loop.policy_data import RowConfig
from dreamjax.models import tiny as tiny_model
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig

HERE = Path(__file__).parent
EXPERTS = ("expert",)


def config() -> PolicySftConfig:
  # The first recipe in the SFT band: 3 copies of each demonstration with the goal's object replaced, the prompt in
  # the loss and tied embeddings, 3,000 steps: 0.200 [0.150, 0.261] on the 200 held-out games (experiments/RESULTS.md,
  # thirty-seventh stop), and 0.220 [0.168, 0.282] in length-grouped batches (thirty-eighth stop). The policy has to
  # match the goal's object word against the objects in view before it takes one; the copies vary that word, and
  # tied embeddings give a one-layer path from a token seen to the same token answered. At 800 steps without them it
  # won 1 of 50 (thirty-second stop).
  steps = 3000
  data = load_config(f"{HERE / 'collect_alfworld.py'}:headroom")
  return PolicySftConfig(
      data=(f"{data.out_dir}/trajectories.jsonl",),
      env="alfworld",
      env_kwargs=("step_limit=20", "invalid_action=continue"),
      # The whole episode's places in the history, one short line a step ("Location: shelf 1 | action: go to shelf 2"),
      # so the policy can tell which receptacles it has searched; two full states fill about 256 tokens. Both scored 0
      # of 50 held-out games at 200 steps (experiments/RESULTS.md, thirty-first stop).
      agent=AgentFormat(think=False, history_turns=20, history_token_budget=384, history_fields=("Location",),
                        max_admissible=50),
      # The hand-coded expert's own steps only: where it gives up, random play stands in ("fallback").
      rows=RowConfig(experts=EXPERTS, step_sources=EXPERTS, successful_only=True, prompt_loss=True),
      value_copies=3,
      # 480 answer tokens an episode: 20 turns of up to 24 (at 192 the last turns' answers were cut off). The 1152
      # bucket: training game 312's first prompt is 1051 tokens (50 admissible commands), which stopped a GRPO run.
      rollout=RolloutConfig(max_turns=20, max_action_tokens=24, max_episode_tokens=480,
                            prompt_buckets=(768, 1024, 1152), constrain_actions=True),
      model=ModelSource(tiny=tiny_model("qwen2", vocab_size=768, hidden_size=128, intermediate_size=384, num_layers=2,
                                        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1280,
                                        tie_word_embeddings=True)),
      optim=OptimConfig(lr=3e-3, warmup_steps=20, schedule="cosine", total_steps=steps, end_lr_factor=0.05),
      batch_size=16,
      # Rows run from 313 tokens to 1,077, median 456 (the long ones list up to 50 admissible commands): padded to the
      # longest, 45% of a batch's tokens were real; in batches of like lengths, 85%.
      group_rows=256,
      epochs=1000,  # max_steps ends it
      max_steps=steps,
      log_every=25,
      eval=EvalConfig(games=data.games, split="eval", num_tasks=50, train_tasks=0, num_envs=10, every_steps=1000),
      out_dir="runs/headroom/alfworld_sft",
  )


def tiny() -> PolicySftConfig:
  cfg = config()
  return dataclasses.replace(
      cfg, data=("runs/collect/alfworld_tiny/trajectories.jsonl",), max_steps=4,
      optim=dataclasses.replace(cfg.optim, warmup_steps=1, total_steps=4),
      eval=dataclasses.replace(cfg.eval, num_tasks=2, num_envs=2), out_dir="runs/headroom/alfworld_sft_tiny")
