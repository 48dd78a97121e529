"""The host-side task pool: which `Task` sits in which curriculum slot, serialisable for checkpoints."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dreamjax.curriculum.state import CurriculumState, add, init, remove
from dreamjax.envs.base import Task

FORMAT = "dreamjax.curriculum.TaskPool/1"


class TaskPool:
  """Host-side owner of the curriculum: which `Task` sits in which slot, plus the `CurriculumState` over the slots.

  Seed tasks are never evicted. Generated tasks fill free slots; when none is left the least useful generated tasks
  make room: lowest variance (never-tried ones count `prior_variance`, by default infinite, so fresh variants survive
  until tried), then the longest unseen, then the lowest slot. `variant_counters[seed_id]` counts the variants ever
  offered per seed; pass it to `task_gen.generate_variants` so generated ids are never reused, even after an eviction.
  """

  def __init__(self, capacity: int):
    self.state = init(capacity)
    self.tasks: list[Task | None] = [None] * capacity
    self.variant_counters: dict[str, int] = {}
    self._slot: dict[str, int] = {}

  @property
  def capacity(self) -> int:
    return len(self.tasks)

  def __len__(self) -> int:
    return len(self._slot)

  def slot_of(self, task_id: str) -> int:
    return self._slot.get(task_id, -1)

  def tasks_at(self, slots: Sequence[int] | np.ndarray) -> list[Task | None]:
    return [self.tasks[int(s)] if 0 <= int(s) < self.capacity else None for s in np.asarray(slots).reshape(-1)]

  def _free(self) -> list[int]:
    return [i for i, t in enumerate(self.tasks) if t is None]

  def _place(self, tasks: Sequence[Task], slots: Sequence[int], generated: bool, parents: Sequence[int],
             depths: Sequence[int]) -> None:
    for t, s in zip(tasks, slots):
      self.tasks[s] = t
      self._slot[t.task_id] = s
    n = np.asarray
    self.state = add(self.state, n(slots, np.int32), is_generated=n([generated] * len(slots)),
                     parent=n(parents, np.int32), depth=n(depths, np.int32))

  def add_seeds(self, tasks: Sequence[Task]) -> np.ndarray:
    """Adds seed tasks into free slots; raises when an id is already in the pool or the free slots do not suffice."""
    ids = [t.task_id for t in tasks]
    dup = next((i for i in ids if i in self._slot or ids.count(i) > 1), None)
    if dup is not None:
      raise ValueError(f"TaskPool.add_seeds: task id {dup!r} is already in the pool or given twice")
    free = self._free()
    if len(tasks) > len(free):
      raise ValueError(f"TaskPool.add_seeds: {len(tasks)} tasks for {len(free)} free slots of {self.capacity}")
    slots = free[:len(tasks)]
    self._place(tasks, slots, False, [-1] * len(tasks), [0] * len(tasks))
    return np.asarray(slots, np.int32)

  def add_generated(self, tasks: Sequence[Task], prior_variance: float = float("inf")) -> np.ndarray:
    """Adds M_task's variants (params carry "generated_from" and "generation"); evicts as needed. Returns their slots,
    -1 for a task that found no room (only seed tasks and this call's own parents left) or whose id is taken."""
    lacking = next((t.task_id for t in tasks if "generated_from" not in t.param), None)
    if lacking is not None:
      raise ValueError(f"TaskPool.add_generated: task {lacking!r} has no 'generated_from' param (see task_gen.py)")
    parents = [self.slot_of(str(t.param["generated_from"])) for t in tasks]
    protected = set(parents)
    out = []
    for t, parent in zip(tasks, parents):
      # Every offered variant advances its seed's counter, placed or not: ids only grow, so none is ever reused.
      seed_id = str(t.param["generated_from"])
      self.variant_counters[seed_id] = self.variant_counters.get(seed_id, 0) + 1
      if t.task_id in self._slot:
        out.append(-1)
        continue
      free = self._free()
      if not free:
        victim = self._least_useful(protected, prior_variance)
        if victim < 0:
          out.append(-1)
          continue
        self.evict([victim])
        free = [victim]
      depth = int(t.param.get("generation", 1))
      self._place([t], free[:1], True, [parent], [depth])
      protected.add(free[0])
      out.append(free[0])
    return np.asarray(out, np.int32)

  def _least_useful(self, protected: set[int], prior_variance: float) -> int:
    s = jax.device_get(self.state)
    tried = s.times_sampled > 0
    utility = np.where(tried, s.reward_var, prior_variance)
    ok = s.valid & s.is_generated & ~np.isin(np.arange(self.capacity), list(protected))
    if not ok.any():
      return -1
    order = np.lexsort((np.arange(self.capacity), s.last_seen, utility, ~ok))
    return int(order[0])

  def evict(self, slots: Sequence[int]) -> None:
    """Frees the given slots (seed tasks included, when the caller asks)."""
    for s in slots:
      task = self.tasks[int(s)]
      if task is not None:
        del self._slot[task.task_id]
        self.tasks[int(s)] = None
    self.state = remove(self.state, np.asarray(slots, np.int32))

  def to_json(self) -> dict[str, Any]:
    arrays = jax.device_get(self.state)
    return {
        "format": FORMAT, "capacity": self.capacity,
        "tasks": [None if t is None else t.to_json() for t in self.tasks],
        "state": {f.name: np.asarray(getattr(arrays, f.name)).tolist() for f in dataclasses.fields(arrays)},
        "variant_counters": dict(sorted(self.variant_counters.items())),
    }

  @classmethod
  def from_json(cls, d: Mapping[str, Any], source: str = "task pool") -> TaskPool:
    if not isinstance(d, Mapping):
      raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
      raise ValueError(f"{source}: field 'format': expected {FORMAT!r}, got {d.get('format')!r}")
    capacity = d.get("capacity")
    if not isinstance(capacity, int) or capacity < 1:
      raise ValueError(f"{source}: field 'capacity': expected a positive integer, got {capacity!r}")
    pool = cls(capacity)
    tasks = d.get("tasks")
    if not isinstance(tasks, list) or len(tasks) != pool.capacity:
      raise ValueError(f"{source}: field 'tasks': expected a list of {pool.capacity} entries")
    stored = d.get("state")
    if not isinstance(stored, Mapping):
      raise ValueError(f"{source}: field 'state': expected an object of per-slot arrays")
    fields = {}
    for f in dataclasses.fields(CurriculumState):
      ref = getattr(pool.state, f.name)
      try:
        value = np.asarray(stored[f.name], dtype=ref.dtype)
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}: field 'state.{f.name}': missing or not a {ref.dtype} array ({e})") from e
      if value.shape != ref.shape:
        raise ValueError(f"{source}: field 'state.{f.name}': expected shape {ref.shape}, got {value.shape}")
      fields[f.name] = jnp.asarray(value)
    pool.state = CurriculumState(**fields)
    valid = np.asarray(pool.state.valid)
    for i, t in enumerate(tasks):
      if (t is not None) != bool(valid[i]):
        raise ValueError(f"{source}: field 'tasks[{i}]': {'a task' if t else 'no task'} in a slot marked "
                         f"{'valid' if valid[i] else 'free'}")
      if t is not None:
        task = Task.from_json(t, source=f"{source}: tasks[{i}]")
        if task.task_id in pool._slot:
          raise ValueError(f"{source}: field 'tasks[{i}]': task id {task.task_id!r} occurs twice")
        pool.tasks[i], pool._slot[task.task_id] = task, i
    pool.variant_counters = {str(k): int(v) for k, v in d.get("variant_counters", {}).items()}
    return pool

  def save(self, path: str | pathlib.Path) -> None:
    path = pathlib.Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(self.to_json()))
    tmp.replace(path)  # atomic: a crash mid-write leaves the previous file intact

  @classmethod
  def load(cls, path: str | pathlib.Path) -> TaskPool:
    try:
      d = json.loads(pathlib.Path(path).read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON: {e}") from e
    return cls.from_json(d, source=str(path))
