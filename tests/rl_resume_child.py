"""The run the resume test kills: a tiny GRPO run on real TextWorld-Express, checkpointed every iteration.

`resume_config` is the one config of tests/test_checkpoint.py's resume tests, so the uninterrupted run, this child
(killed by the test once its second checkpoint is committed, or sent SIGTERM once its first is) and the resumed run
are the same run. Preempted, it exits with the CLI's status, 75. The child builds
its own envs from the config, as `dreamjax rl` does.

Usage: python tests/rl_resume_child.py WARM_START_FOLDER OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from dreamjax.commands.rl import run
from dreamjax.loop.learner import RLConfig, TaskSpec
from dreamjax.loop.model import ModelSource
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig

TWO_ROOMS = "numLocations=2, includeDoors=0"
FMT = AgentFormat(think=False, history_turns=2, history_token_budget=200)
ROLLOUT = RolloutConfig(group_size=2, max_turns=3, max_action_tokens=12, max_episode_tokens=36, prompt_buckets=(384,),
                        temperature=1.0)
ROWS = 2 * ROLLOUT.group_size  # B * G


def resume_config(warm_start: str | Path, out: str | Path) -> RLConfig:
  return RLConfig(model=ModelSource(checkpoint=str(warm_start)), algorithm="grpo",
                  objective=PolicyGradientConfig(kl_coef=0.05), env_kwargs=("step_limit=10",),
                  train_tasks=TaskSpec(("coin",), "train", 20, 6, TWO_ROOMS),
                  eval_tasks=TaskSpec(("coin",), "dev", 0, 2, TWO_ROOMS), agent=FMT, rollout=ROLLOUT,
                  tasks_per_iteration=2, optim=OptimConfig(lr=1e-3), rows_per_step=16, pad_to=400, score_batch=8,
                  iterations=4, eval_every=2, checkpoint_every=1, keep_checkpoints=2, out_dir=str(out), seed=5,
                  devices=1)


if __name__ == "__main__":
  from dreamjax.loop.preemption import PREEMPTED_EXIT, Preempted

  try:
    run(resume_config(sys.argv[1], sys.argv[2]))
  except Preempted as e:  # as the `dreamjax` CLI reports it
    print(e, file=sys.stderr)
    sys.exit(PREEMPTED_EXIT)
