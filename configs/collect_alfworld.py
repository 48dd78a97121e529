"""Offline ALFWorld trajectories on locally generated games: 2,000 episodes over the 6 task types.

Run:   dreamjax collect --config configs/collect_alfworld.py
Tiny (CPU, a few minutes): 12 episodes (expert and random) over the 6 task types:
       dreamjax collect --config configs/collect_alfworld.py:tiny
Resume: rerun the same command; episodes already in out_dir/trajectories.jsonl are skipped.
Games are generated on first use and cached under $ALFWORLD_DATA (default .cache/alfworld).
"""

import dataclasses

from dreamjax.data.collect import CollectConfig


def config() -> CollectConfig:
  return CollectConfig(
      env="alfworld",
      env_kwargs=("step_limit=50", "invalid_action=continue"),  # 50 steps, as verl-agent and the paper use
      games=("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
             "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"),
      split="train",
      policies=("expert:1200", "random:400", "eps0.3:400"),
      num_workers=2,
      rows_per_worker=1,
      out_dir="runs/collect/alfworld",
      seed=0,
  )


def tiny() -> CollectConfig:
  return dataclasses.replace(config(), policies=("expert:6", "random:6"), out_dir="runs/collect/alfworld_tiny")


def headroom() -> CollectConfig:
  """The ALFWorld candidate testbed's offline data: pick_and_place_simple games of the train floor plans, a 20-step
  limit, and ALFWorld's hand-coded expert alone (`expert=handcoded`: the planner fallback reads the game's PDDL facts,
  which tell it where the object is, while the hand-coded expert searches the receptacles its object class can be in
  and acts on what it sees). 600 expert, 200 eps0.3 and 100 random episodes (configs/train_policy_alfworld.py's data)."""
  return dataclasses.replace(
      config(), games=("pick_and_place_simple",), env_kwargs=("step_limit=20", "invalid_action=continue",
                                                              "expert=handcoded"),
      policies=("expert:600", "eps0.3:200", "random:100"), build_tfds=False, out_dir="runs/headroom/alfworld_pp_train20")
