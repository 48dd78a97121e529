"""The paper's main comparison on ALFWorld (games generated locally by dreamjax/envs/alfworld_games.py): data, M_exp, SFT,
DPO, real-env PPO/GRPO, DreamGym, DreamGym-S2R and the component ablations, each RL method over three seeds, one table.

The stages are those of configs/reproduce_twx.py (same models, optimisers and RL settings), pointed at ALFWorld by
`dreamjax.commands.reproduce.on_env`: its six task types, 50-step episodes (as verl-agent and the paper), train games from
ALFRED's training floor plans, held-out games from its held-out ones, and the paper's offline mix (expert demos plus
oracle/random runs, configs/collect_alfworld.py).

Run:   dreamjax reproduce --config configs/reproduce_alfworld.py          (accelerator; set the model checkpoints)
Tiny:  dreamjax reproduce --config configs/reproduce_alfworld.py:tiny     (CPU; pick-and-place games, tiny models)
Rerunning a command resumes it: finished stages are reused. Results: <out_dir>/results.md, results.json, results.svg, data_efficiency.svg.
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.reproduce import Budgets, ReproduceConfig, for_slow_env, on_env
from dreamjax.config import load_config
from dreamjax.loop.learner import TaskSpec
from dreamjax.rollout.agent import AgentFormat

HERE = Path(__file__).parent
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")


def config() -> ReproduceConfig:
  twx = load_config(str(HERE / "reproduce_twx.py"))
  cfg = on_env(dataclasses.replace(twx, out_dir="runs/reproduce/alfworld"), env="alfworld", env_kwargs=("step_limit=50", "invalid_action=continue"),
                agent=AgentFormat(think=False, history_turns=4, history_token_budget=768, max_admissible=60),
                rollout=dict(max_turns=50, max_action_tokens=32, max_episode_tokens=1600,
                             prompt_buckets=(1024, 2048, 4096)),
                train=TaskSpec(games=TASK_TYPES, split="train", count=500),
                # 23 per type, 138 games: about the size of ALFWorld's usual 134-game held-out set
                held_out=TaskSpec(games=TASK_TYPES, split="eval", count=23))
  return dataclasses.replace(cfg, collect=load_config(str(HERE / "collect_alfworld.py")))


def tiny() -> ReproduceConfig:
  """Pick-and-place games only (the expert needs about 7 steps), the tiny models of configs/reproduce_twx.py:tiny,
  smaller groups and fewer iterations."""
  twx = load_config(f"{HERE / 'reproduce_twx.py'}:tiny")
  games = ("pick_and_place_simple",)
  cfg = on_env(dataclasses.replace(twx, out_dir="runs/reproduce/alfworld_tiny"),
               env="alfworld", env_kwargs=("step_limit=20", "invalid_action=continue"),
               agent=AgentFormat(think=False, history_turns=2, history_token_budget=192, max_admissible=40),
               rollout=dict(max_turns=20, max_action_tokens=16, max_episode_tokens=192, prompt_buckets=(768, 1024)),
               train=TaskSpec(games=games, split="train", count=200),
               held_out=TaskSpec(games=games, split="eval", count=20))
  # An ALFWorld step costs 0.2-1 s here (0.9 steps/s while collecting on a loaded 2-core machine); turn rows of about
  # 1,000 tokens: one 128-row micro-batch took 12-14 GB and was OOM-killed.
  cfg = for_slow_env(cfg, iterations=6, group_size=4, check_tasks=5, micro_batches=4)
  return dataclasses.replace(
      cfg,
      collect=dataclasses.replace(cfg.collect, policies=("expert:80", "random:20", "eps0.3:40")),
      exp=dataclasses.replace(cfg.exp, max_len=1536),
      sft=dataclasses.replace(cfg.sft, model=dataclasses.replace(
          cfg.sft.model, tiny=cfg.sft.model.tiny.replace(max_position_embeddings=2048))),  # ALFWorld's long rooms
      # The paper's ratios (SFT 1 : DPO 2 : real-env RL 4, S2R 1/16 of it) at what 6 iterations of 8 episodes of at
      # most 20 steps can spend.
      budgets=Budgets(sft=240, dpo=480, real_rl=960, s2r=60))
