"""Offline TextWorld-Express trajectories: 5,000 episodes over cookingworld, twc and coin (expert, random, eps0.3).

Run:   dreamjax collect --config configs/collect_twx.py
Tiny (CPU, about a minute): 300 episodes of two-room coin games without doors or distractors, the data of the tiny
experience model (configs/train_exp_twx.py:tiny) and of configs/annotate_twx.py:tiny:
       dreamjax collect --config configs/collect_twx.py:tiny
Resume: rerun the same command; episodes already in out_dir/trajectories.jsonl are skipped.
"""

import dataclasses

from dreamjax.data.collect import CollectConfig


def config() -> CollectConfig:
  return CollectConfig(
      env="textworld_express",
      # cookingworld's gold paths run to 114 steps (median 41); at 50, a quarter of its expert episodes are cut off.
      env_kwargs=("step_limit=100", "invalid_action=continue"),
      games=("cookingworld", "twc", "coin"),
      split="train",
      policies=("expert:2000", "random:1000", "eps0.3:2000"),
      num_workers=2,
      rows_per_worker=1,  # several JVMs per process step slower than one (experiments/bench/envs.py)
      out_dir="runs/collect/twx",
      seed=0,
  )


def tiny() -> CollectConfig:
  return dataclasses.replace(
      config(),
      env_kwargs=("step_limit=8",),  # the expert needs 2 or 3 steps in these games
      games=("coin",),
      game_params="numLocations=2, includeDoors=0, numDistractorItems=0",
      policies=("expert:150", "random:50", "eps0.5:100"),
      num_workers=0,  # envs in this process, 8 episodes stepped together
      rows_per_worker=8,
      build_tfds=False,
      out_dir="runs/collect/twx_coin_tiny",
  )
