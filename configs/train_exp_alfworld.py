"""M_exp on the ALFWorld testbed (configs/reproduce_alfworld_pp.py): twc's model and format (configs/train_exp_twc.py)
on the testbed's collection of pick_and_place_simple games (20 steps, configs/collect_alfworld.py:headroom).

Why twc's format carries over: an ALFWorld state here is the same "Field: value" lines (Location, You see,
Inventory, Feedback), a step changes a few of them, and the admissible list gains or loses the commands of what is in
view, so changed lines, item edits and action edits keep the target to what the step changed. What does not carry
over: what a receptacle holds is in no earlier state until the agent goes there or opens it, so a `go to` or `open`
target can name objects the prompt does not show: 32% of the collection's transitions (half its `go to` and `open`
steps; `dreamjax.envs.alfworld.reveals`, two history steps shown). M_exp can only write what the training rooms made
likely there, so its fidelity summary scores the transitions the prompt determines apart ("determined").

Sizes, measured on the collection with twc's format and a 1,024-token vocabulary trained on it (9,895 training and
1,021 held-out examples, 900 episodes split by task): targets median 201 tokens, 90th percentile 284, longest 590
(a `go to` that lists a full countertop twice); prompts without the retrieved neighbour median 372, longest 1,498.
max_len 2,048 trims 4 examples' history; batches grouped by length keep most steps far below it.

Run:  dreamjax train-exp --config configs/train_exp_alfworld.py
Tiny: dreamjax train-exp --config configs/train_exp_alfworld.py:tiny   (the same format at test size)
"""

import dataclasses
from pathlib import Path

from dreamjax.commands.train_exp import ExpSftConfig
from dreamjax.config import load_config

HERE = Path(__file__).parent


def config() -> ExpSftConfig:
  twc = load_config(str(HERE / "train_exp_twc.py"))
  collection = load_config(f"{HERE / 'collect_alfworld.py'}:headroom")
  return dataclasses.replace(twc, trajectories=(f"{collection.out_dir}/trajectories.jsonl",), max_len=2048,
                             out_dir="runs/exp_sft/alfworld_pp")


def tiny() -> ExpSftConfig:
  cfg = config()
  return dataclasses.replace(cfg, steps=4, eval_every=0, eval_examples=4,
                             optim=dataclasses.replace(cfg.optim, warmup_steps=1, total_steps=4),
                             trajectories=("runs/reproduce/alfworld_pp_tiny/data/trajectories.jsonl",),
                             out_dir="runs/exp_sft/alfworld_pp_tiny")
