"""One process of the two-process runs of tests/test_distributed.py.

Each process is started with 4 fake CPU devices; every command joins them (through `DistributedConfig`'s environment
variables, as a launcher would set them) into one 8-device mesh. Both run the same program on the same seeds and
data, four commands in a row (one start-up and one `jax.distributed` cluster for all of them):
1. `dreamjax train-exp` (`exp_config`): a few M_exp SFT steps on the warm start's offline data, into OUT_ROOT/exp;
1b. `dreamjax train-policy` (`policy_config`): three SFT steps of the warm start on that data, into OUT_ROOT/policy;
2. `dreamjax rl` (`dist_config`): two GRPO iterations on real TextWorld-Express, into OUT_ROOT/run;
3. `dreamjax dreamgym` (`dreamgym_config`): two GRPO iterations inside EXP_MODEL, with the curriculum, M_task and
   replay write-back, evaluated on real TextWorld-Express, into OUT_ROOT/dreamgym.
EXP_MODEL is an M_exp trained long enough that some of its answers parse (`exp_model_config`), by the single-process
reference: trained in the cluster, its 120 steps took 2.5x as long as alone (every step's weights and gradients cross
the two processes), for nothing the few steps of 1. do not already check. The cluster waits for it before 3.
Every process reports, as JSON in REPORT: its process index and count, the devices it saw, each command's summary,
for rl and dreamgym the final checkpoint's metadata and a checksum of its arrays (restored and gathered, so each
process checks what the cluster holds), and every file or folder under OUT_ROOT that it created, wrote, renamed or
removed (from Python's audit hooks, which see every `open`, `os.mkdir`, `os.rename`, `os.replace`, `os.remove` and
`shutil.rmtree` of the process, whichever library makes them; orbax's array shards are written by TensorStore's C++
code, which the hooks do not see).

The config functions are the test's only configs: the distributed runs and the single-process references use them.

`reference` runs the same four commands in one process on 8 devices: the test's single-process references.

`helpers` checks the host-side helpers of `dreamjax.parallel` across the two processes, without a model, and that a
mesh leaving a process out is refused with a clear error.

Usage (with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set):
  python tests/distributed_child.py WARM_START_FOLDER OFFLINE_DATA OUT_ROOT EXP_MODEL REPORT
  python tests/distributed_child.py helpers REPORT
Usage (alone, with 8 fake devices; it trains EXP_MODEL into OUT_ROOT/exp_model first):
  python tests/distributed_child.py reference WARM_START_FOLDER OFFLINE_DATA OUT_ROOT REPORT
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

from dreamjax.commands.dreamgym import DreamGymConfig
from dreamjax.commands.train_exp import ExpSftConfig
from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.config import load_config
from dreamjax.curriculum.source import CurriculumConfig
from dreamjax.loop.evaluate import EvalConfig
from dreamjax.loop.learner import RLConfig, TaskSpec
from dreamjax.loop.model import ModelSource
from dreamjax.loop.track import TrackConfig
from dreamjax.parallel import MeshConfig
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]

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


def exp_config(data: str | Path, out: str | Path, steps: int = 8) -> ExpSftConfig:
  """M_exp SFT (configs/train_exp_twx.py:tiny) over all 8 devices; no held-out side, so no decoding."""
  cfg = load_config(str(ROOT / "configs" / "train_exp_twx.py") + ":tiny",
                    [f"trajectories={data}", f"out_dir={out}", f"steps={steps}",
                     f"optim.warmup_steps={min(10, steps // 4)}", f"optim.total_steps={steps}", "eval_every=0",
                     "held_out_fraction=0", "max_len=512", f"log_every={steps // 2}",
                     "model.tiny.max_position_embeddings=640"])  # DreamGym's 480-token prompts + 128-token answers
  return dataclasses.replace(cfg, mesh=MeshConfig(data=2, fsdp=4), track=TrackConfig(progress=False))


def exp_model_config(data: str | Path, out: str | Path) -> ExpSftConfig:
  """The DreamGym runs' M_exp: enough steps that some of its answers parse (an answer that never parses ends its
  episode as an env failure, and a run whose every episode failed would not update)."""
  return exp_config(data, out, steps=120)


def dreamgym_config(warm_start: str | Path, data: str | Path, exp_model: str | Path, out: str | Path
                    ) -> DreamGymConfig:
  """The rl run's policy side inside M_exp: seed tasks and replay seed from the offline data, M_task on."""
  # Two held-out tasks in one batch of two rows: the real env starts two JVMs, not one per rollout row.
  rl = dataclasses.replace(dist_config(warm_start, out), eval_tasks=TaskSpec(("coin",), "dev", 0, 2, TWO_ROOMS),
                           eval_batch=2)
  return DreamGymConfig(rl=rl, exp_model=str(exp_model), offline_data=(str(data),), reasoning=False,
                        exp_max_new_tokens=128, exp_prompt_buckets=(480,),  # 128: a whole answer with its list
                        curriculum=CurriculumConfig(capacity=64, generate_every=2, seeds_per_round=2,
                                                    variants_per_seed=2, max_new_tokens=24, lam=0.5,
                                                    min_variance=-1.0),
                        out_dir=str(out))


def policy_config(warm_start: str | Path, data: str | Path, out: str | Path) -> PolicySftConfig:
  """A few behaviour-cloning steps of the warm start on its own offline data, rows over all 8 devices; no
  evaluation (the rl run evaluates in the real env)."""
  return PolicySftConfig(data=(str(data),), env_kwargs=("step_limit=10",), agent=FMT, rollout=ROLLOUT,
                         model=ModelSource(checkpoint=str(warm_start)), optim=OptimConfig(lr=1e-3), batch_size=8,
                         max_steps=3, log_every=1, eval=EvalConfig(num_tasks=0), mesh=MeshConfig(data=2, fsdp=4),
                         out_dir=str(out), track=TrackConfig(progress=False))


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


def _final_checkpoint(folder: Path) -> tuple[dict, dict[str, str]]:
  """(metadata, checksum per array) of a run's last checkpoint, restored onto the layout it was saved with and
  gathered whole on every process."""
  import jax
  import numpy as np

  from dreamjax.loop.checkpoint import RunCheckpointer
  from dreamjax.parallel import to_host

  ckpt = RunCheckpointer(folder / "checkpoints")
  arrays, meta = ckpt.restore()
  ckpt.close()
  leaves = jax.tree_util.tree_flatten_with_path(to_host(arrays))[0]
  return meta, {jax.tree_util.keystr(p): hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
                for p, x in leaves}


def _wait_for(exp_model: Path) -> None:
  """Until the reference has written EXP_MODEL (exp_model.json comes last); the test kills this process if the
  reference fails."""
  import time

  from dreamjax.experience.exp_model import META_FILE

  while True:
    try:
      json.loads((exp_model / META_FILE).read_text())
      return
    except (FileNotFoundError, json.JSONDecodeError):
      time.sleep(0.5)


def main(warm: str, data: str, root: str, exp_model: str, report: str) -> None:
  out = Path(root).absolute()
  writes = _writes(out)
  import jax

  from dreamjax.commands.dreamgym import run as dreamgym
  from dreamjax.commands.rl import run as rl
  from dreamjax.commands.train_exp import run as train_exp
  from dreamjax.commands.train_policy import run as train_policy
  from dreamjax.parallel import is_primary

  result = {"train_exp": {"summary": train_exp(exp_config(data, out / "exp"))},
            "train_policy": {"summary": train_policy(policy_config(warm, data, out / "policy"))},
            "rl": {"summary": rl(dist_config(warm, out / "run"))}}
  _wait_for(Path(exp_model))
  result["dreamgym"] = {"summary": dreamgym(dreamgym_config(warm, data, exp_model, out / "dreamgym"))}
  for name, folder in (("rl", "run"), ("dreamgym", "dreamgym")):
    result[name]["meta"], result[name]["checksums"] = _final_checkpoint(out / folder)
  Path(report).write_text(json.dumps({
      "process_index": jax.process_index(), "process_count": jax.process_count(), "primary": is_primary(),
      "devices": len(jax.devices()), "local_devices": len(jax.local_devices()), **result,
      "writes": sorted(set(writes))}, sort_keys=True, default=str))


def reference(warm: str, data: str, root: str, report: str) -> None:
  """First the DreamGym runs' M_exp (`exp_model_config`, into ROOT/exp_model, which the cluster waits for); then the
  single-process references of `main`'s four commands (one process, 8 devices, same configs), into
  ROOT/{exp,policy,run,dreamgym}."""
  from dreamjax.commands.dreamgym import run as dreamgym
  from dreamjax.commands.rl import run as rl
  from dreamjax.commands.train_exp import run as train_exp
  from dreamjax.commands.train_policy import run as train_policy

  out = Path(root)
  exp_model = train_exp(exp_model_config(data, out / "exp_model"))["checkpoint"]
  result = {"train_exp": train_exp(exp_config(data, out / "exp")),
            "train_policy": train_policy(policy_config(warm, data, out / "policy")),
            "rl": rl(dist_config(warm, out / "run"))}
  result["dreamgym"] = dreamgym(dreamgym_config(warm, data, exp_model, out / "dreamgym"))
  Path(report).write_text(json.dumps(result, sort_keys=True, default=str))


def helpers(report: str) -> None:
  """The host-side helpers across two real processes, without a model: placing, gathering, comparing, barriers, and
  a checkpoint of a sharded array and a process-local PRNG key saved and restored (in REPORT's folder, shared)."""
  import jax
  import numpy as np

  from dreamjax.loop.checkpoint import RunCheckpointer
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
  # Meshes over the first devices leave process 1 out: refused up front, naming the process.
  from dreamjax.loop.config import run_mesh as mesh_of
  from dreamjax.loop.dreamgym import PlacementConfig, make_meshes

  refused = []
  for make in (lambda: make_meshes(RLConfig(mesh=MeshConfig(data=1, fsdp=4), devices=4), PlacementConfig("split")),
               lambda: mesh_of(RLConfig(mesh=MeshConfig(data=1, fsdp=2), devices=2))):
    try:
      make()
      refused.append("")
    except ValueError as e:
      refused.append(str(e))
  Path(report).write_text(json.dumps({
      "refused": refused,
      "process_index": jax.process_index(), "primary": is_primary(), "addressable": placed.is_fully_addressable,
      "local_shards": len(placed.addressable_shards), "gathered": to_host({"x": doubled})["x"].tolist(),
      "total": float(jax.jit(jax.numpy.sum)(placed)), "mismatch": mismatch,
      "restored": {k: v.tolist() for k, v in to_host(restored).items()}, "meta": meta,
      "root_local": restored["root"].sharding == like["root"].sharding,
      "rows_sharding": restored["rows"].sharding == placed.sharding}))


if __name__ == "__main__":
  if sys.argv[1] == "helpers":
    helpers(sys.argv[2])
  elif sys.argv[1] == "reference":
    reference(*sys.argv[2:6])
  else:
    main(*sys.argv[1:6])
