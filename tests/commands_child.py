"""One process of the two-process runs of tests/test_multihost_commands.py: the commands that are not training loops,
each joined into one cluster by `DistributedConfig`'s environment variables (as a launcher would set them).

In a row, in the same processes, under OUT_ROOT:
1. `dreamjax sample` (`sample_config`): a tiny model built by process 0 into sample/tiny-checkpoint, 8 rows sampled;
2. `dreamjax reproduce` (`reproduce_config`) into reproduce/: its real `collect` stage (random episodes on two-room
   TextWorld-Express coin games, which depend only on their seeds), the SFT stage replaced by `fake_sft` (training is
   tests/test_distributed.py's subject; this stage hands on sample's tiny model as "the SFT policy"), and the real
   `eval` stage on that policy; then its table;
3. `dreamjax annotate` (`annotate_config`): rule-based annotations of reproduce's collected episodes into annotate/.
Every process reports, as JSON in REPORT: its process index and count, each command's return value, and every file or
folder under OUT_ROOT that it created, wrote, renamed or removed (tests/distributed_child.py's audit hooks).

Started alone (without those variables) on 8 devices, it runs the same in one process: the test's single-process
reference.

Usage: python tests/commands_child.py OUT_ROOT REPORT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dreamjax.commands.annotate import AnnotateConfig
from dreamjax.commands.eval import EvalRunConfig
from dreamjax.commands.reproduce import ReproduceConfig
from dreamjax.commands.sample import SampleConfig
from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.data.collect import CollectConfig
from dreamjax.loop.learner import TaskSpec
from dreamjax.models import tiny
from dreamjax.rollout.engine import RolloutConfig
from tests.distributed_child import FMT, TWO_ROOMS, _writes


def sample_config(out: Path) -> SampleConfig:
  return SampleConfig(out_dir=str(out), batch=8, max_new_tokens=8,
                      model=tiny("qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=768))


def reproduce_config(out: Path) -> ReproduceConfig:
  collect = CollectConfig(games=("coin",), game_params=TWO_ROOMS, policies=("random:4",), env_kwargs=("step_limit=6",),
                          num_workers=0, rows_per_worker=2, build_tfds=False, progress=False)
  # Two held-out tasks in one batch of two rows: two JVMs per process.
  evaluation = EvalRunConfig(env_kwargs=("step_limit=6",), tasks=TaskSpec(("coin",), "dev", 0, 2, TWO_ROOMS),
                             agent=FMT, batch=2,
                             rollout=RolloutConfig(max_turns=2, max_action_tokens=8, max_episode_tokens=24,
                                                   prompt_buckets=(640,)))
  return ReproduceConfig(collect=collect, sft=PolicySftConfig(env_kwargs=("step_limit=6",)), eval=evaluation,
                         out_dir=str(out))


def annotate_config(data: Path, out: Path) -> AnnotateConfig:
  return AnnotateConfig(trajectories=str(data), out=str(out / "annotations.rules.jsonl"), progress=False)


def fake_sft(checkpoint: Path):
  """A stand-in for `train_policy.run` with its multi-process contract (joins first, process 0 alone writes the
  summary last): `checkpoint` as the trained policy."""
  from dreamjax.loop.config import start_run
  from dreamjax.parallel import is_primary

  def run(cfg: PolicySftConfig) -> dict:
    start_run(cfg)
    summary = {"checkpoint": str(checkpoint), "seconds": 0.0}
    if is_primary():
      Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
      (Path(cfg.out_dir) / "summary.json").write_text(json.dumps(summary))
    return summary

  return run


def main(root: str, report: str) -> None:
  out = Path(root).absolute()
  writes = _writes(out)
  import jax

  from dreamjax.commands import train_policy
  from dreamjax.commands.annotate import run as annotate
  from dreamjax.commands.reproduce import run as reproduce
  from dreamjax.commands.sample import run as sample

  result = {"sample": sample(sample_config(out / "sample"))}
  train_policy.run = fake_sft(out / "sample" / "tiny-checkpoint")
  result["reproduce"] = reproduce(reproduce_config(out / "reproduce"))
  result["annotate"] = annotate(annotate_config(out / "reproduce" / "data" / "trajectories.jsonl", out / "annotate"))
  Path(report).write_text(json.dumps({
      "process_index": jax.process_index(), "process_count": jax.process_count(), "devices": len(jax.devices()),
      **result, "writes": sorted(set(writes))}, sort_keys=True, default=str))


if __name__ == "__main__":
  main(*sys.argv[1:3])
