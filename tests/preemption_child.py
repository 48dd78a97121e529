"""The runs tests/test_preemption.py stops: tiny policy SFT, M_exp SFT and DPO configs (this file is their config
file: `tests/preemption_child.py:policy_sft`, with the data, the SFT checkpoint and out_dir given by --set), and,
run as a script, the `dreamjax` CLI on one of them with every train step slowed down, so that the test can signal
the child between two checkpoints. Each run checkpoints every 2 of its 10 steps, logs every step and evaluates
every 4, so a resumed run must neither repeat nor skip an evaluation.

Usage: python tests/preemption_child.py COMMAND --config tests/preemption_child.py:VARIANT --set ... (exits as the
CLI does: 75 when preempted).
"""

from __future__ import annotations

import sys
import time

from dreamjax.commands.dpo import DpoConfig
from dreamjax.commands.train_exp import ExpSftConfig
from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.experience.format import ExpFormatConfig
from dreamjax.loop.evaluate import EvalConfig
from dreamjax.loop.model import ModelSource
from dreamjax.loop.policy_data import PairConfig
from dreamjax.models import tiny
from dreamjax.parallel import MeshConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig

COIN = "numLocations=2, includeDoors=0"
FMT = AgentFormat(think=False, history_turns=2, history_token_budget=128)
ROLLOUT = RolloutConfig(max_turns=3, max_action_tokens=12, max_episode_tokens=48, prompt_buckets=(512,))
EVAL = EvalConfig(games=("coin",), split="dev", num_tasks=2, game_params=COIN, every_steps=4, num_envs=2)
STEPS = 10
RUN = dict(checkpoint_every=2, keep_checkpoints=2, log_every=1, devices=1, seed=3, compilation_cache="off")
SLOW_S = 0.25  # added to every train step of the child


def policy_sft() -> PolicySftConfig:
  return PolicySftConfig(data=("",), env_kwargs=("step_limit=4",), agent=FMT, rollout=ROLLOUT,
                         model=ModelSource(tiny=tiny("qwen2", vocab_size=600, num_layers=1,
                                                     max_position_embeddings=1024)),
                         optim=OptimConfig(lr=3e-3, warmup_steps=2), batch_size=8, max_steps=STEPS, eval=EVAL, **RUN)


def dpo() -> DpoConfig:
  return DpoConfig(data=("",), checkpoint="", env_kwargs=("step_limit=4",), agent=FMT, rollout=ROLLOUT,
                   pairs=PairConfig(rejected_policies=("random",), max_pairs_per_task=2), optim=OptimConfig(lr=1e-3),
                   pairs_per_step=2, max_steps=STEPS, eval=EVAL, **RUN)


def exp_sft() -> ExpSftConfig:
  return ExpSftConfig(trajectories=("",), format=ExpFormatConfig(reasoning=False, retrieval=False, max_history=1),
                      model=ModelSource(tiny=tiny("qwen2", vocab_size=600, num_layers=1, max_position_embeddings=512)),
                      optim=OptimConfig(lr=3e-3, warmup_steps=2), batch_size=4, steps=STEPS, max_len=512,
                      max_new_tokens=32, eval_every=4, eval_examples=2, eval_batch_size=4, held_out_fraction=0.2,
                      mesh=MeshConfig(data=1, fsdp=1, tensor=1), **RUN)


def _slow_steps() -> None:
  from dreamjax.rl.update import TrainStep

  call = TrainStep.__call__

  def slow(self, *args, **kwargs):
    out = call(self, *args, **kwargs)
    time.sleep(SLOW_S)
    return out

  TrainStep.__call__ = slow


if __name__ == "__main__":
  from dreamjax.cli import main

  _slow_steps()
  sys.exit(main(sys.argv[1:]))
