"""The paper's main comparison on TextWorld-Express, end to end: data, M_exp, SFT, DPO, real-env PPO/GRPO, DreamGym,
DreamGym-S2R and the component ablations, each RL method over three seeds, then one table.

Run:   dreamjax reproduce --config configs/reproduce_twx.py          (accelerator; set the model checkpoints)
Tiny:  dreamjax reproduce --config configs/reproduce_twx.py:tiny     (CPU; about an hour on 2 cores)
Demo:  configs/demo.py (`make demo`) is the tiny one cut to one seed, GRPO only, no DPO, S2R or ablations.
Rerunning a command resumes it: finished stages are reused. Results: <out_dir>/results.md, results.json, results.svg, data_efficiency.svg.
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.eval import EvalRunConfig
from dreamjax.commands.reproduce import Budgets, ReproduceConfig
from dreamjax.config import load_config
from dreamjax.data.collect import CollectConfig
from dreamjax.loop.evaluate import EvalConfig
from dreamjax.loop.learner import TaskSpec

HERE = Path(__file__).parent


def _load(name: str):
  return load_config(str(HERE / name))


def config() -> ReproduceConfig:
  real = _load("grpo_real_twx.py")
  return ReproduceConfig(
      collect=_load("collect_twx.py"),
      exp=_load("train_exp_twx.py"),
      sft=_load("train_policy_twx.py"),
      dpo=_load("dpo_twx.py"),
      real=real,
      ppo=_load("ppo_real_twx.py"),  # PPO rows: verl-agent's PPO (separate critic, its own lr), not GRPO's settings
      dreamgym=_load("dreamgym_twx.py"),
      algorithms=("grpo", "ppo"),
      budgets=Budgets(sft=20_000, dpo=40_000, real_rl=80_000, s2r=5_000),  # the paper's (Table 1)
      ablations=("no_replay", "no_reasoning", "no_task_generation", "no_curriculum"),
      eval=EvalRunConfig(env=real.env, env_kwargs=real.env_kwargs, num_workers=real.num_workers, tasks=real.eval_tasks,
                         agent=real.agent, rollout=real.rollout, batch=32, sampled=True),
      seeds=(0, 1, 2),
      out_dir="runs/reproduce/twx",
  )


# The tiny world: two-room coin games without distractors, where a 2-layer M_exp trained in minutes predicts rewards
# and episode ends well but few next states exactly (configs/train_exp_twx.py:tiny), and a tiny SFT policy succeeds
# on about half of the held-out games.
COIN = "numLocations=2, includeDoors=0, numDistractorItems=0"


def tiny() -> ReproduceConfig:
  real = load_config(f"{HERE / 'grpo_real_twx.py'}:tiny")
  eval_tasks = TaskSpec(games=("coin",), split="dev", count=50, game_params=COIN)
  real = dataclasses.replace(real, train_tasks=dataclasses.replace(real.train_tasks, game_params=COIN),
                             eval_tasks=dataclasses.replace(eval_tasks, count=20), iterations=10, eval_every=0,
                             eval_sampled=False)
  sft = load_config(f"{HERE / 'train_policy_twx.py'}:tiny")
  sft = dataclasses.replace(sft, env_kwargs=real.env_kwargs, agent=real.agent, rollout=real.rollout, max_steps=60,
                            optim=dataclasses.replace(sft.optim, warmup_steps=10, total_steps=60),
                            eval=EvalConfig(games=("coin",), split="dev", num_tasks=20, game_params=COIN, num_envs=10))
  dpo = load_config(f"{HERE / 'dpo_twx.py'}:tiny")
  dpo = dataclasses.replace(dpo, env_kwargs=real.env_kwargs, agent=real.agent, rollout=real.rollout, eval=sft.eval)
  dreamgym = load_config(f"{HERE / 'dreamgym_twx.py'}:tiny")
  dreamgym = dataclasses.replace(dreamgym, rl=dataclasses.replace(real, out_dir=dreamgym.out_dir))
  exp = load_config(f"{HERE / 'train_exp_twx.py'}:tiny")
  return ReproduceConfig(
      collect=CollectConfig(games=("coin",), game_params=COIN, env_kwargs=("step_limit=8",),
                            policies=("expert:150", "random:50", "eps0.5:100"), num_workers=0, rows_per_worker=8,
                            build_tfds=False),
      exp=dataclasses.replace(exp, eval_every=0),  # 300 steps; held-out fidelity: configs/train_exp_twx.py:tiny
      sft=sft,
      dpo=dpo,
      real=real,
      ppo=load_config(f"{HERE / 'ppo_real_twx.py'}:tiny"),
      dreamgym=dreamgym,
      algorithms=("grpo", "ppo"),
      # The paper's ratios (SFT 1 : DPO 2 : real-env RL 4 offline-to-online, S2R 1/16 of real-env RL) scaled to what ten
      # tiny iterations spend (about 850 real transitions uncapped), so the real-env cap binds in the last iteration.
      budgets=Budgets(sft=200, dpo=400, real_rl=800, s2r=50),
      ablations=("no_replay", "no_task_generation", "no_curriculum"),  # the tiny M_exp has no reasoning to ablate
      eval=EvalRunConfig(env=real.env, env_kwargs=real.env_kwargs, tasks=eval_tasks, agent=real.agent,
                         rollout=real.rollout, batch=10, sampled=True, devices=1),
      seeds=(0, 1, 2),
      out_dir="runs/reproduce/twx_tiny",
  )
