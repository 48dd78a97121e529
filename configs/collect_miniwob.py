"""Offline MiniWoB++ trajectories (BrowserGym on Debian's Chromium) over the tasks with scripted experts.

Run:   dreamjax collect --config configs/collect_miniwob.py
Tiny (CPU, a few minutes): 8 episodes (expert and random) of click-button and enter-text:
       dreamjax collect --config configs/collect_miniwob.py:tiny
Resume: rerun the same command; episodes already in out_dir/trajectories.jsonl are skipped.
"""

import dataclasses

from dreamjax.data.collect import CollectConfig


def config() -> CollectConfig:
  return CollectConfig(
      env="miniwob",
      env_kwargs=("max_steps=15",),
      games=("click-button", "click-link", "click-dialog", "click-checkboxes", "click-tab", "choose-list",
             "enter-text", "focus-text", "login-user", "enter-password"),
      split="train",
      policies=("expert:1000", "random:500", "eps0.3:500"),
      num_workers=2,
      rows_per_worker=1,
      out_dir="runs/collect/miniwob",
      seed=0,
  )


def tiny() -> CollectConfig:
  return dataclasses.replace(config(), games=("click-button", "enter-text"), policies=("expert:4", "random:4"),
                             out_dir="runs/collect/miniwob_tiny")
