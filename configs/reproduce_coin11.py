"""The coin11 testbed: TextWorld-Express coin games on 11-room maps behind doors, chosen so that learning can show on a
2-core CPU machine (docs/testbeds.md). Every stage of the paper's comparison on three seeds, then one table.

Why these games: on the two-room games of configs/reproduce_twx.py:tiny a uniform random policy already succeeds
0.63, so no row can show learning. Here the coin sits in one of 11 rooms, most behind closed doors, and the episode
ends after 14 steps: random play succeeds 0.10 on held-out games, the exploring expert 0.72
(experiments/headroom_twx.py). The tiny policy below, shown the rooms it has been in, reaches 0.28 after SFT;
real-env GRPO does not yet improve on it (docs/testbeds.md).

Offline data comes from policies that see only what the agent sees: the exploring expert (`dreamjax.envs.twx_explorer`:
opens doors, walks to unvisited rooms, takes the coin on sight), the same with 30% random steps, and random play.
TWX's gold-path expert knows where the coin is, so its demonstrations cannot be learned from the observations; it is
not used here.

Run (CPU, hours: three seeds of every row; rerunning resumes, finished stages are reused):
       dreamjax reproduce --config configs/reproduce_coin11.py
One seed, GRPO rows only:   --set seeds=0 --set algorithms=grpo
Tiny (every stage at test size; it checks that they fit together, not what they measure):
       dreamjax reproduce --config configs/reproduce_coin11.py:tiny
Results: <out_dir>/results.md, results.json, results.svg, data_efficiency.svg.
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.reproduce import Budgets, ReproduceConfig, at_test_size, on_env
from dreamjax.config import load_config
from dreamjax.experience.format import ExpFormatConfig
from dreamjax.loop.learner import TaskSpec
from dreamjax.loop.policy_data import PairConfig, RowConfig
from dreamjax.models import tiny as tiny_model
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat

HERE = Path(__file__).parent
COIN11 = "numLocations=11, includeDoors=1, numDistractorItems=0"
STEP_LIMIT = 14
EXPLORERS = ("explorer",)  # the step source SFT clones and the policy DPO prefers


def config() -> ReproduceConfig:
  base = load_config(f"{HERE / 'reproduce_twx.py'}:tiny")
  cfg = on_env(dataclasses.replace(base, out_dir="runs/reproduce/coin11"), env="textworld_express",
               env_kwargs=(f"step_limit={STEP_LIMIT}",),
               # History lines keep only the location (about 10 tokens a step instead of 90): the whole episode fits,
               # so the policy can see which rooms it has already been in (docs/testbeds.md).
               agent=AgentFormat(think=False, history_turns=STEP_LIMIT, history_token_budget=256,
                                 history_fields=("Location",)),
               rollout=dict(max_turns=STEP_LIMIT, max_action_tokens=16, max_episode_tokens=224, prompt_buckets=(512,)),
               train=TaskSpec(games=("coin",), split="train", count=500, game_params=COIN11),
               held_out=TaskSpec(games=("coin",), split="dev", count=200, game_params=COIN11))
  sft = cfg.sft
  # One pass over each iteration's rows (verl's default), half the update time of two.
  real = dataclasses.replace(cfg.real, iterations=60, eval_every=10, eval_sampled=False, pad_to=512, epochs=1,
                             eval_tasks=dataclasses.replace(cfg.real.eval_tasks, count=50))
  return dataclasses.replace(
      cfg,
      # The noisy explorer first: SFT's budget reads the first 4000 transitions of the file, in this order, and its
      # episodes hold the explorer's recoveries from random steps (states the clean explorer never reaches).
      collect=dataclasses.replace(cfg.collect, policies=("explorer-eps0.3:200", "explorer:800", "random:200"),
                                  max_steps=STEP_LIMIT),
      # Every step the explorer chose is a good exploring step, also in episodes the step limit ended first.
      sft=dataclasses.replace(
          sft, rows=RowConfig(experts=(*EXPLORERS, "explorer-eps0.3"), step_sources=EXPLORERS, successful_only=False),
          max_steps=600,
          optim=dataclasses.replace(sft.optim, warmup_steps=20, total_steps=600),
          eval=dataclasses.replace(sft.eval, num_tasks=50, every_steps=300, train_tasks=0)),
      dpo=dataclasses.replace(cfg.dpo, pairs=PairConfig(chosen_policies=EXPLORERS,
                                                        rejected_policies=("random", "explorer-eps0.3"),
                                                        max_pairs_per_task=2)),
      exp=dataclasses.replace(
          cfg.exp, format=ExpFormatConfig(reasoning=True, k=1, max_history=2),
          model=dataclasses.replace(cfg.exp.model, tiny=tiny_model(
              "qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=32)),
          optim=OptimConfig(lr=3e-3, warmup_steps=30, schedule="cosine", total_steps=500, end_lr_factor=0.1),
          steps=500, max_len=1280),
      real=real,
      dreamgym=dataclasses.replace(cfg.dreamgym, reasoning=True,
                                   rl=dataclasses.replace(cfg.dreamgym.rl, iterations=60, eval_every=10,
                                                          eval_sampled=False, pad_to=512,
                                                          eval_tasks=real.eval_tasks)),
      ablations=("no_replay", "no_reasoning", "no_task_generation", "no_curriculum"),
      budgets=Budgets(sft=4000, dpo=8000, real_rl=16000, s2r=1000),
      eval=dataclasses.replace(cfg.eval, batch=40, sampled=False),
  )


def tiny() -> ReproduceConfig:
  """Every stage of `config()` at test size: it checks that the testbed's stages fit together, not what they
  measure."""
  return at_test_size(config(), policies=("explorer-eps0.3:8", "explorer:16", "random:8"),
                      out_dir="runs/reproduce/coin11_tiny")
