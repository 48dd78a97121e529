"""Policy SFT on MiniWoB++ (BrowserGym on Debian's Chromium): the headroom probe for a second testbed family.

The eight tasks of configs/collect_miniwob.py:headroom are those of the twenty with scripted experts where a uniform
random policy over the admissible actions rarely wins (20 held-out pages each at a 15-step limit: 0 on the five typing tasks, 0.10-0.20 on the three click tasks;
experiments/RESULTS.md, "A second family: MiniWoB headroom"). The model is configs/reproduce_miniwob.py:tiny's
(a 2-layer Qwen2 trained from scratch on the env's text), with room for MiniWoB's longer pages.

Data:  dreamjax collect --config configs/collect_miniwob.py:headroom
Run:   dreamjax train-policy --config configs/train_policy_miniwob.py
Tiny (two tasks, 20 steps; it measures nothing):
       dreamjax collect --config configs/collect_miniwob.py:tiny
       dreamjax train-policy --config configs/train_policy_miniwob.py:tiny
Measured (experiments/RESULTS.md, twenty-fourth to twenty-sixth stops), held-out success over 20 pages of each
task (seeds from 1,000,000), against 0.056 for random play: 0.506 [0.430, 0.583] greedy and 0.456 sampled after
3,600 steps (about 33 minutes on 2 cores; enter-text 18 and enter-text-2 15 of 20, passwords never); 0.375 at 1,200
steps, where the policy typed names it had memorised. Three value copies of each quoting episode
(`value_copies=3`) scored the same at 3,600 steps (0.494), so they are off. `summary.json` holds it per task, and the
fit on 5 training pages.

A policy that copies (twenty-eighth and twenty-ninth stops): `dreamjax train-policy --config
configs/train_policy_miniwob.py:copying` adds 5 copies of each episode whose goal quotes a value or states a date,
with made-up values, and puts the prompt's tokens in the loss, so the prompt's repeated goal teaches the copy: 0.713
[0.638, 0.777] greedy and 0.637 sampled, enter-password, login-user and enter-date 20 of 20 each (passwords had never
been typed right before), click-option 0, click-link 5 and enter-text-2 9; 27 minutes alone. Without the dates'
copies it scored 0.600, typing enter-date's years wrong (1 of 20). Stopped at 1,200 steps (before the dates' copies)
it scored 0.281 greedy and 0.181 sampled, inside the issue's SFT band, and real-env GRPO from it gained +0.019 at
best (configs/grpo_real_miniwob.py).
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


def config() -> PolicySftConfig:
  steps = 3600  # 17 passes over the rows; 1,200 steps (0.375) left the policy typing names it had memorised
  data = load_config(f"{HERE / 'collect_miniwob.py'}:headroom")
  return PolicySftConfig(
      data=(f"{data.out_dir}/trajectories.jsonl",),
      env="miniwob",
      env_kwargs=("max_steps=8",),  # the experts need 1-3 steps on these tasks
      agent=AgentFormat(think=False, history_turns=2, history_token_budget=128, max_admissible=50),
      rows=RowConfig(experts=("expert",), successful_only=True),
      rollout=RolloutConfig(max_turns=8, max_action_tokens=32, max_episode_tokens=160, prompt_buckets=(768, 1024)),
      # Tied input and output embeddings, as Qwen2's small checkpoints have: 0.375 held-out against 0.319 untied (one
      # seed each, overlapping intervals; the gain was enter-date and enter-text).
      model=ModelSource(tiny=tiny_model("qwen2", vocab_size=768, hidden_size=128, intermediate_size=384, num_layers=2,
                                        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1280,
                                        tie_word_embeddings=True)),
      optim=OptimConfig(lr=3e-3, warmup_steps=10, schedule="cosine", total_steps=steps, end_lr_factor=0.05),
      batch_size=16,
      epochs=1000,  # max_steps ends it
      max_steps=steps,
      log_every=25,
      eval=EvalConfig(games=data.games, split="eval", num_tasks=20, train_tasks=5, num_envs=8),
      out_dir="runs/headroom/miniwob_sft",
  )


def tiny() -> PolicySftConfig:
  cfg = config()
  return dataclasses.replace(
      cfg, data=("runs/collect/miniwob_tiny/trajectories.jsonl",), max_steps=20,
      optim=dataclasses.replace(cfg.optim, total_steps=20),
      eval=dataclasses.replace(cfg.eval, games=("click-button", "enter-text"), num_tasks=2, train_tasks=0, num_envs=2),
      out_dir="runs/headroom/miniwob_sft_tiny")


def copying() -> PolicySftConfig:
  cfg = config()
  return dataclasses.replace(cfg, value_copies=5, value_copies_made_up=True,
                             rows=dataclasses.replace(cfg.rows, prompt_loss=True),
                             out_dir="runs/headroom/miniwob_sft_copying")
