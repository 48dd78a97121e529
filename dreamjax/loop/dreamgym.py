"""What DreamGym adds to the shared RL loop (`dreamjax.loop.run`): M_exp behind the env protocol
(`synthetic_env`), where the policy and M_exp run (`PlacementConfig`, `make_meshes`), the seed tasks from offline
data, and `DreamGymHook`, the after-iteration work: replay write-back (the episodes' parsed steps join the durable
buffer and the retrieval index, so later M_exp steps can be grounded on them), the curriculum's update and M_task's
generation, M_exp's statistics, and its failures (exp_failures.jsonl).

Several processes: the replay buffer has one writer, process 0; after a barrier the others refresh a read-only view,
and every process adds the new transitions to its own retrieval index from the buffer, so all indexes hold the same
transitions and return the same neighbours. `check_same` compares, once per iteration, the drawn task slots, a
digest of every M_exp step's retrieved transitions and prompt (`SyntheticEnv.digest`) and the buffer's length. Each
mesh must hold devices of every process: with several processes use the colocated placement over all devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.curriculum.pool import TaskPool
from dreamjax.curriculum.source import CurriculumTasks, outcome_rewards
from dreamjax.data.records import TrajectoryRecord, read_trajectory_files
from dreamjax.envs.base import Task
from dreamjax.experience.synthetic_env import SyntheticEnv
from dreamjax.loop.evaluate import unparsed_rows
from dreamjax.loop.learner import RLConfig
from dreamjax.loop.run import Hook
from dreamjax.loop.track import json_dumps, truncate_jsonl
from dreamjax.parallel import MeshConfig, barrier, check_same, is_primary, make_mesh, spans_every_process
from dreamjax.replay.buffer import ReplayBuffer
from dreamjax.replay.write_back import write_back_transitions
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.text import Tokenizer


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Where M_exp runs. "colocated": on the policy's own mesh (every device holds a share of both models; fastest
  when both fit, since policy and M_exp decode in turn and neither sits idle). "split": the policy, its reference and
  optimizer state on the first `rl.devices` devices and M_exp (with M_task, its weights) on the next `exp_devices`
  (0: all the rest), each with its own mesh; an 8B M_exp's weights and KV cache then never compete with the policy's
  optimizer state for memory. Nothing crosses between the two meshes but text, so no array is resharded between them."""

  mode: str = "colocated"  # colocated | split
  exp_devices: int = 0
  exp_mesh: MeshConfig = MeshConfig()  # M_exp's mesh over its devices (split only)

  def __post_init__(self):
    if self.mode not in ("colocated", "split") or self.exp_devices < 0:
      raise ValueError(f"PlacementConfig: mode must be colocated or split and exp_devices >= 0, got {self}")


def make_meshes(rl: RLConfig, placement: PlacementConfig) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
  """(the policy's mesh, M_exp's mesh): the same mesh when colocated, disjoint device sets when split."""
  devices = jax.devices()
  if placement.mode == "colocated":
    mesh = spans_every_process(make_mesh(rl.mesh, devices[:rl.devices] if rl.devices else None),
                               f"DreamGymConfig: the policy's mesh (rl.devices={rl.devices})")
    return mesh, mesh
  if not rl.devices or rl.devices >= len(devices):
    raise ValueError(f"PlacementConfig.mode=split: rl.devices must leave devices for M_exp (rl.devices="
                     f"{rl.devices}, {len(devices)} devices)")
  rest = devices[rl.devices:]
  if placement.exp_devices > len(rest):
    raise ValueError(f"PlacementConfig.exp_devices={placement.exp_devices}: only {len(rest)} devices are left after "
                     f"the policy's {rl.devices}")
  # Split placement cuts jax.devices() in two, so with several processes one side lacks some process's devices.
  return (spans_every_process(make_mesh(rl.mesh, devices[:rl.devices]),
                              f"DreamGymConfig: the policy's mesh (rl.devices={rl.devices}, placement split)"),
          spans_every_process(make_mesh(placement.exp_mesh, rest[:placement.exp_devices] if placement.exp_devices
                                        else rest), "DreamGymConfig: M_exp's mesh (placement split)"))


def seed_records(offline_data: Sequence[str], seed_tasks: int, tasks_per_iteration: int, eval_ids: set[str]
                 ) -> tuple[list[TrajectoryRecord], list[Task]]:
  """The offline records and the first `seed_tasks` (0: all) of their tasks in first-appearance order, checked
  against the held-out tasks."""
  records = read_trajectory_files(offline_data, "DreamGymConfig.offline_data")
  tasks = list({r.task.task_id: r.task for r in records if r.steps}.values())
  if seed_tasks:
    tasks = tasks[:seed_tasks]
  leaked = sorted({t.task_id for t in tasks} & eval_ids)
  if leaked:
    raise ValueError(f"DreamGymConfig.offline_data: {len(leaked)} seed tasks are held-out evaluation tasks (e.g. "
                     f"{leaked[0]!r}); collect the offline data on another split")
  if len(tasks) < tasks_per_iteration:
    raise ValueError(f"DreamGymConfig: {len(tasks)} seed tasks for rl.tasks_per_iteration={tasks_per_iteration}")
  return records, tasks


class DreamGymHook(Hook):
  """After each iteration: write the episodes back to the replay buffer and index (with `write_back`), update the
  curriculum (and let M_task generate); its checkpoint share is the curriculum's state, the task pool, M_task's
  counters and the buffer's marks. Each M_exp failure (SyntheticEnv.failures) is a row of `failures_path`
  (exp_failures.jsonl in the run folder, tagged with its iteration): on resume, the rows of iterations after the
  checkpoint are dropped, since those iterations run again."""

  def __init__(self, synthetic: SyntheticEnv, curriculum: CurriculumTasks, buffer: ReplayBuffer, marks: list[int],
               retriever, tokenizer: Tokenizer, write_back: bool, failures_path: Path, resume: int | None):
    self.synthetic, self.curriculum, self.buffer, self.marks = synthetic, curriculum, buffer, marks
    self.retriever, self.tokenizer, self.write_back = retriever, tokenizer, write_back
    self.failures_path = failures_path if is_primary() else None  # the one writer of the run folder
    if self.failures_path is not None:
      truncate_jsonl(failures_path, lambda row: resume is not None and row["iteration"] <= resume)

  def before_iteration(self, iteration: int) -> None:
    self.synthetic.start_iteration(iteration)

  def after_iteration(self, iteration: int, traj: Trajectories, metrics: dict[str, Any]) -> dict[str, Any]:
    if self.write_back:
      if is_primary():  # the one writer; the others read what it committed
        self.buffer.append(write_back_transitions(traj, unparsed_rows(traj, self.tokenizer), iteration))
      barrier("dreamgym.write_back")
      self.buffer.refresh()  # a no-op for the writer
    self.marks.append(len(self.buffer))
    if self.retriever is not None:  # from the buffer on every process, so every index holds the same transitions
      self.retriever.add(list(self.buffer.iter_from(self.marks[-2], self.marks[-1])))
    slots = self.curriculum.slots([r.task for r in traj.records])
    # Every process must have drawn the same tasks and grounded M_exp on the same neighbours.
    check_same(f"the curriculum draw, M_exp's retrievals and the replay buffer of iteration {iteration + 1}",
               slots, self.synthetic.digest(), np.asarray([len(self.buffer)], np.int64))
    out = self.curriculum.update(slots, outcome_rewards(traj), iteration, ~traj.env_error)
    if self.failures_path is not None:
      with open(self.failures_path, "a", encoding="utf-8") as f:
        f.writelines(json_dumps({"iteration": iteration + 1, **row}) + "\n" for row in self.synthetic.failures)
    s = self.synthetic.stats
    # exp_failures: M_exp steps unreadable after their retries (or whose prompt overflowed), which end their episode
    # as env failures: counted in env_errors too, and left out of the update and of write-back.
    return out | {"replay_size": len(self.buffer), "exp_parse_failures": s["parse_failures"],
                  "exp_retries": s["exp_retries"], "exp_failures": s["exp_failures"],
                  "exp_overflows": s["overflows"], "exp_truncations": s["truncations"],
                  "exp_generated_tokens": s["mean_generated_tokens"], "exp_accepted_per_step": s["accepted_per_step"],
                  "exp_tokens_per_forward": s["tokens_per_forward"]}

  def checkpoint_arrays(self) -> dict[str, Any]:
    return {"curriculum": self.curriculum.pool.state}

  def checkpoint_meta(self) -> dict[str, Any]:
    return {"replay_marks": self.marks, "task_pool": self.curriculum.pool.to_json(),
            "generation": self.curriculum.generation_counts}

  def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    self.curriculum.pool = TaskPool.from_json(meta["task_pool"], source="checkpoint: task_pool")
    self.curriculum.pool.state = arrays["curriculum"]
    self.curriculum.generation_counts = dict(meta["generation"])

  def finish(self, out: Path) -> dict[str, Any]:
    if is_primary():
      self.curriculum.pool.save(out / "task_pool.json")
    return {"generation": self.curriculum.generation_counts, "replay_size": len(self.buffer)}
