"""One process of the two-process real-env GRPO run of tests/test_distributed.py.

Each process is started with 4 fake CPU devices; `run` joins them (through `DistributedConfig`'s environment
variables, as a launcher would set them) into one 8-device mesh. Both run the same program on the same seeds and
tasks. Every process reports, as JSON in REPORT: its process index and count, the devices it saw, the summary `run`
returned, the final checkpoint's metadata and a checksum of its arrays (restored and gathered, so each process checks
what the cluster holds), and every file or folder under OUT_DIR that it created, wrote, renamed or removed (from
Python's audit hooks, which see every `open`, `os.mkdir`, `os.rename`, `os.replace`, `os.remove` and
`shutil.rmtree` of the process, whichever library makes them; orbax's array shards are written by TensorStore's C++
code, which the hooks do not see).

`dist_config` is the one config of the test: the distributed run and the single-process reference run it.

`helpers` checks the host-side helpers of `dreamjax.parallel` across the two processes, without a model.

Usage (with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set):
  python tests/distributed_child.py WARM_START_FOLDER OUT_DIR REPORT
  python tests/distributed_child.py helpers REPORT
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from dreamjax.parallel import MeshConfig
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig
from dreamjax.track import TrackConfig
from dreamjax.train.rl_real import RLConfig, TaskSpec
from dreamjax.train.run import ModelSource

TWO_ROOMS = "numLocations=2, includeDoors=0"
FMT = AgentFormat(think=False, history_turns=2, history_token_budget=200)
ROLLOUT = RolloutConfig(group_size=4, max_turns=3, max_action_tokens=12, max_episode_tokens=36, prompt_buckets=(384,),
                        temperature=1.0)
ROWS = 2 * ROLLOUT.group_size  # B * G: one row per device of the 8-device mesh


def dist_config(warm_start: str | Path, out: str | Path) -> RLConfig:
  return RLConfig(model=ModelSource(checkpoint=str(warm_start)), algorithm="grpo",
                  objective=PolicyGradientConfig(kl_coef=0.05), env_kwargs=("step_limit=10",),
                  train_tasks=TaskSpec(("coin",), "train", 20, 6, TWO_ROOMS),
                  eval_tasks=TaskSpec(("coin",), "dev", 0, 4, TWO_ROOMS), agent=FMT, rollout=ROLLOUT,
                  tasks_per_iteration=2, optim=OptimConfig(lr=1e-3), rows_per_step=16, pad_to=400, score_batch=8,
                  iterations=2, eval_every=0, out_dir=str(out), seed=3, mesh=MeshConfig(data=2, fsdp=4),
                  track=TrackConfig(progress=False))


def _writes(root: Path) -> list[tuple[str, str]]:
  """Starts recording (event, path relative to root) of every write-like filesystem call under root."""
  seen: list[tuple[str, str]] = []
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
  events = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate"}

  def hook(event: str, args: tuple) -> None:
    if event == "open":
      path, mode, flags = args
      writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (mode is None and flags & write_flags)
      if not writing:
        return
    elif event not in events:
      return
    else:
      path = args[0]
    if isinstance(path, int | bytes) or path is None:
      return
    try:
      rel = Path(os.path.abspath(path)).relative_to(root)
    except ValueError:
      return
    seen.append((event, str(rel)))

  sys.addaudithook(hook)
  return seen


def main(warm: str, out: str, report: str) -> None:
  writes = _writes(Path(out).absolute())
  import jax
  import numpy as np

  from dreamjax.parallel import is_primary, to_host
  from dreamjax.train.checkpoint import RunCheckpointer
  from dreamjax.train.rl_real import run

  summary = run(dist_config(warm, out))
  # The final checkpoint, restored onto the layout it was saved with and gathered whole on every process.
  ckpt = RunCheckpointer(Path(out) / "checkpoints")
  arrays, meta = ckpt.restore()
  ckpt.close()
  leaves = jax.tree_util.tree_flatten_with_path(to_host(arrays))[0]
  checksums = {jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
               for p, x in leaves}
  Path(report).write_text(json.dumps({
      "process_index": jax.process_index(), "process_count": jax.process_count(), "primary": is_primary(),
      "devices": len(jax.devices()), "local_devices": len(jax.local_devices()), "summary": summary, "meta": meta,
      "checksums": checksums, "writes": sorted(set(writes))}, sort_keys=True, default=str))


def helpers(report: str) -> None:
  """The host-side helpers across two real processes, without a model: placing, gathering, comparing, barriers, and
  a checkpoint of a sharded array and a process-local PRNG key saved and restored (in REPORT's folder, shared)."""
  import jax
  import numpy as np

  from dreamjax.parallel import (
      TRAIN_RULES,
      DistributedConfig,
      barrier,
      check_same,
      initialize,
      is_primary,
      make_mesh,
      named_sharding,
      to_devices,
      to_host,
  )
  from dreamjax.train.checkpoint import RunCheckpointer

  initialize(DistributedConfig())
  initialize(DistributedConfig())  # a second call in the same process is a no-op
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  placed = to_devices(rows, named_sharding(("batch", None), rows.shape, mesh, TRAIN_RULES))
  doubled = jax.jit(lambda x: 2 * x)(placed)  # stays sharded over both processes
  check_same("the rows", rows)
  try:
    check_same("the process index", np.asarray([jax.process_index()]))
    mismatch = ""
  except RuntimeError as e:
    mismatch = str(e)
  barrier("helpers")
  folder = Path(report).parent / "checkpoints"
  with RunCheckpointer(folder) as ck:
    # A process-local key; made to differ between the processes to show whose copy is written (process 0's).
    root = jax.random.key(7 + jax.process_index())
    ck.save(1, {"rows": doubled, "root": root, "count": np.arange(3)}, {"note": "two processes"})
  like = {"rows": to_devices(np.zeros_like(rows), placed.sharding), "root": jax.random.key(0),
          "count": np.zeros(3, np.int64)}
  with RunCheckpointer(folder) as ck:
    restored, meta = ck.restore(1, like)
  Path(report).write_text(json.dumps({
      "process_index": jax.process_index(), "primary": is_primary(), "addressable": placed.is_fully_addressable,
      "local_shards": len(placed.addressable_shards), "gathered": to_host({"x": doubled})["x"].tolist(),
      "total": float(jax.jit(jax.numpy.sum)(placed)), "mismatch": mismatch,
      "restored": {k: v.tolist() for k, v in to_host(restored).items()}, "meta": meta,
      "root_local": restored["root"].sharding == like["root"].sharding,
      "rows_sharding": restored["rows"].sharding == placed.sharding}))


if __name__ == "__main__":
  if sys.argv[1] == "helpers":
    helpers(sys.argv[2])
  else:
    main(*sys.argv[1:4])
