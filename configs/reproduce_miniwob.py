"""The paper's main comparison on MiniWoB++ (BrowserGym on Debian's Chromium, dreamjax/envs/miniwob.py): data, M_exp,
SFT, DPO, real-env PPO/GRPO, DreamGym, DreamGym-S2R and the component ablations, each RL method over three seeds, one
table. MiniWoB stands in for the paper's WebShop here: the same kind of page state (a list of `[id] type: text`
elements) and click/type actions, runnable offline.

The stages are those of configs/reproduce_twx.py (same models, optimisers and RL settings), pointed at MiniWoB by
`dreamjax.commands.reproduce.on_env`: the ten tasks with scripted experts (configs/collect_miniwob.py), 15-step episodes (the
paper's web step limit), train pages from seeds 0.., held-out pages from seeds 1,000,000.. (never trained on).

Run:   dreamjax reproduce --config configs/reproduce_miniwob.py          (accelerator; set the model checkpoints)
Tiny:  dreamjax reproduce --config configs/reproduce_miniwob.py:tiny     (CPU; click-button and click-link, tiny models)
Rerunning a command resumes it: finished stages are reused. Results: <out_dir>/results.md, results.json, results.svg, data_efficiency.svg.
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.reproduce import Budgets, ReproduceConfig, for_slow_env, on_env
from dreamjax.config import load_config
from dreamjax.loop.learner import TaskSpec
from dreamjax.rollout.agent import AgentFormat

HERE = Path(__file__).parent


def config() -> ReproduceConfig:
  twx = load_config(str(HERE / "reproduce_twx.py"))
  collect = load_config(str(HERE / "collect_miniwob.py"))
  cfg = on_env(dataclasses.replace(twx, out_dir="runs/reproduce/miniwob"), env="miniwob", env_kwargs=collect.env_kwargs,
               agent=AgentFormat(think=False, history_turns=4, history_token_budget=512, max_admissible=50),
               rollout=dict(max_turns=15, max_action_tokens=32, max_episode_tokens=480, prompt_buckets=(1024, 2048)),
               train=TaskSpec(games=collect.games, split="train", count=300),
               held_out=TaskSpec(games=collect.games, split="eval", count=20))
  return dataclasses.replace(cfg, collect=collect)


def tiny() -> ReproduceConfig:
  """Two one-click tasks, the tiny models and RL budgets of configs/reproduce_twx.py:tiny with smaller groups (a
  MiniWoB step drives a real browser: about 0.1-0.3 s)."""
  twx = load_config(f"{HERE / 'reproduce_twx.py'}:tiny")
  games = ("click-button", "click-link")
  cfg = on_env(dataclasses.replace(twx, out_dir="runs/reproduce/miniwob_tiny"),
               env="miniwob", env_kwargs=("max_steps=5",),
               agent=AgentFormat(think=False, history_turns=2, history_token_budget=128, max_admissible=30),
               rollout=dict(max_turns=5, max_action_tokens=16, max_episode_tokens=64, prompt_buckets=(384, 768)),
               train=TaskSpec(games=games, split="train", count=200),
               held_out=TaskSpec(games=games, split="eval", count=20))
  cfg = for_slow_env(cfg, iterations=6, group_size=4, check_tasks=5, micro_batches=4)  # a step drives a browser
  return dataclasses.replace(
      cfg,
      collect=dataclasses.replace(cfg.collect, policies=("expert:100", "random:40", "eps0.3:60"), rows_per_worker=4),
      exp=dataclasses.replace(cfg.exp, max_len=1024),
      # The paper's ratios (SFT 1 : DPO 2 : real-env RL 4, S2R 1/16 of it) at what 6 iterations of 8 episodes of at
      # most 5 steps can spend.
      budgets=Budgets(sft=60, dpo=120, real_rl=240, s2r=15))
