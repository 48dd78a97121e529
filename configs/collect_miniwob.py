"""Offline MiniWoB++ trajectories (BrowserGym on Debian's Chromium) over the tasks with scripted experts.

Run:   dreamjax collect --config configs/collect_miniwob.py
Tiny (CPU, a few minutes): 8 episodes (expert and random) of click-button and enter-text:
       dreamjax collect --config configs/collect_miniwob.py:tiny
Headroom (the eight tasks where random play rarely wins; configs/train_policy_miniwob.py's data, about 12 minutes):
       dreamjax collect --config configs/collect_miniwob.py:headroom
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


def headroom() -> CollectConfig:
  """The five typing tasks (random text never matches) and the three click tasks where a random click won 0.10-0.20
  of 20 held-out pages (experiments/RESULTS.md, "A second family: MiniWoB headroom"); 200 expert, 20 eps0.3 and 10
  random episodes of each, 8-step limit (the experts need 1-3). With 40 expert episodes a task, SFT memorised the
  names it had seen and typed them on new pages (0.263 held-out); 200 give 0.375 (RESULTS, twenty-fourth stop).
  About 12 minutes on 2 cores (2.6 episodes/s)."""
  return dataclasses.replace(
      config(), games=("enter-text", "enter-text-2", "enter-password", "login-user", "enter-date", "click-option",
                       "click-button-sequence", "click-link"),
      env_kwargs=("max_steps=8",), policies=("expert:1600", "eps0.3:160", "random:80"), build_tfds=False,
      out_dir="runs/headroom/miniwob_train8")
