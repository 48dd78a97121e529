"""Offline TextWorld-Express trajectories: 5,000 episodes over cookingworld, twc and coin (expert, random, eps0.3).

Run:   dreamjax collect --config configs/collect_twx.py
Tiny (CPU, about a minute):
       dreamjax collect --config configs/collect_twx.py --set policies=expert:6,random:3,eps0.3:3 \
         --set num_workers=2 --set out_dir=runs/collect/twx_tiny
Resume: rerun the same command; episodes already in out_dir/trajectories.jsonl are skipped.
"""

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
