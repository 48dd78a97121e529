"""Trajectory JSONL files as a TFDS dataset in array_record, built and read without TensorFlow.

Encodings chosen for TFDS's TensorFlow-free path (both checked in tests/test_data.py):
- tf.Example keeps floats as float32, so rewards and scores are stored as the int64 bit patterns of their float64
  values (`reward_bits`, `score_bits`); they round-trip exactly. A missing score is `has_score=False`.
- Ragged sequences inside sequences need TensorFlow to serialise, so each step's admissible actions are stored
  concatenated in the episode-level `admissible` list and split again by `steps/admissible_count`.
- The task is its canonical JSON (Task.dumps), so any env's params survive.

Splits are "train" and "eval", drawn per episode from a hash of the episode id: deterministic, and an episode keeps
its split when more data is collected and the dataset is rebuilt. Read it back with `load_trajectories(data_dir,
split)` (a lazy sequence of TrajectoryRecord over `builder.as_data_source()`) or `load_transitions`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from etils import epath
import tensorflow_datasets as tfds

from dreamjax.data.records import StepRecord, TrajectoryRecord, Transition, iter_trajectory_files, transitions
from dreamjax.envs.base import Task

NAME = "dreamjax_trajectories"


def _bits(x: float) -> int:
  return int(np.array(x, dtype=np.float64).view(np.int64))


def _float(bits: Any) -> float:
  return float(np.array(bits, dtype=np.int64).view(np.float64))


def _text(v: Any) -> str:
  return v.decode("utf-8") if isinstance(v, bytes) else str(v)


FEATURES = tfds.features.FeaturesDict({
    "episode_id": tfds.features.Text(),
    "env": tfds.features.Text(),
    "task": tfds.features.Text(),  # Task.dumps()
    "instruction": tfds.features.Text(),
    "policy": tfds.features.Text(),
    "seed": np.int64,
    "success": np.bool_,
    "num_steps": np.int64,
    "has_score": np.bool_,
    "score_bits": np.int64,  # float64 bits; 0 when has_score is False
    "admissible": tfds.features.Sequence(tfds.features.Text()),  # every step's admissible actions, concatenated
    "steps": tfds.features.Sequence({
        "state": tfds.features.Text(),
        "action": tfds.features.Text(),
        "next_state": tfds.features.Text(),
        "reward_bits": np.int64,  # float64 bits
        "done": np.bool_,
        "success": np.bool_,
        "invalid": np.bool_,
        "source": tfds.features.Text(),
        "admissible_count": np.int64,
    }),
})


def encode(r: TrajectoryRecord) -> dict[str, Any]:
  return {
      "episode_id": r.episode_id, "env": r.env, "task": r.task.dumps(), "instruction": r.instruction,
      "policy": r.policy, "seed": r.seed, "success": r.success, "num_steps": r.num_steps,
      "has_score": r.score is not None, "score_bits": 0 if r.score is None else _bits(r.score),
      "admissible": [a for s in r.steps for a in s.admissible],
      "steps": [{"state": s.state, "action": s.action, "next_state": s.next_state, "reward_bits": _bits(s.reward),
                 "done": s.done, "success": s.success, "invalid": s.invalid, "source": s.source,
                 "admissible_count": len(s.admissible)} for s in r.steps],
  }


def decode(ex: dict[str, Any]) -> TrajectoryRecord:
  st = ex["steps"]
  admissible = [_text(a) for a in ex["admissible"]]
  steps, at = [], 0
  for j in range(len(st["state"])):
    count = int(st["admissible_count"][j])
    steps.append(StepRecord(
        state=_text(st["state"][j]), action=_text(st["action"][j]), next_state=_text(st["next_state"][j]),
        reward=_float(st["reward_bits"][j]), done=bool(st["done"][j]), success=bool(st["success"][j]),
        invalid=bool(st["invalid"][j]), admissible=tuple(admissible[at:at + count]), source=_text(st["source"][j])))
    at += count
  return TrajectoryRecord(
      episode_id=_text(ex["episode_id"]), env=_text(ex["env"]), task=Task.from_json(json.loads(_text(ex["task"]))),
      instruction=_text(ex["instruction"]), policy=_text(ex["policy"]), seed=int(ex["seed"]), steps=tuple(steps),
      success=bool(ex["success"]), num_steps=int(ex["num_steps"]),
      score=_float(ex["score_bits"]) if bool(ex["has_score"]) else None)


def eval_ids(episode_ids: Iterable[str], eval_fraction: float) -> set[str]:
  """Episodes whose id hashes below eval_fraction; at least one when there are two or more and the fraction is > 0,
  so a small collection still has an eval split."""
  ids = sorted(set(episode_ids))
  u = {i: int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") / 2**64 for i in ids}
  chosen = {i for i in ids if u[i] < eval_fraction}
  if not chosen and eval_fraction > 0 and len(ids) >= 2:
    chosen = {min(ids, key=u.__getitem__)}
  return chosen


class DreamjaxTrajectories(tfds.core.GeneratorBasedBuilder):
  """Offline trajectories from JSONL files (`jsonl_files`, needed only to build; reading needs just data_dir)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "dreamjax.trajectory.v1 records; float64 as bits; admissible actions concatenated."}

  def __init__(self, *, jsonl_files: Sequence[str | Path] = (), eval_fraction: float = 0.1, **kwargs):
    self._jsonl_files = tuple(Path(p) for p in jsonl_files)
    self._eval_fraction = eval_fraction
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS's own lookup goes through `importlib_resources` for builders inside packages; that backport is not part
    # of this stack, and the answer is this file either way.
    return epath.Path(inspect.getfile(cls))

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, description=__doc__, features=FEATURES)

  def _split_generators(self, dl_manager):
    if not self._jsonl_files:
      raise ValueError(f"{NAME}: no JSONL files to build from (pass jsonl_files=...)")
    # Validates every record, and that no episode id repeats, before anything is written.
    held_out = eval_ids([r.episode_id for r in iter_trajectory_files(self._jsonl_files)], self._eval_fraction)
    splits = {"train": self._generate_examples(held_out, False)}
    if held_out:
      splits["eval"] = self._generate_examples(held_out, True)
    return splits

  def _generate_examples(self, held_out: set[str], want_eval: bool):
    for r in iter_trajectory_files(self._jsonl_files):
      if (r.episode_id in held_out) == want_eval:
        yield r.episode_id, encode(r)


def build_dataset(jsonl_files: Sequence[str | Path], data_dir: str | Path, eval_fraction: float = 0.1,
                  quiet: bool = True) -> DreamjaxTrajectories:
  """(Re)builds the dataset under data_dir from the JSONL files; a previous build of the same version is replaced."""
  builder = DreamjaxTrajectories(jsonl_files=jsonl_files, eval_fraction=eval_fraction, data_dir=str(data_dir),
                                 file_format="array_record")
  if Path(builder.data_dir).exists():  # derived data: rebuilding from the JSONL is always safe
    shutil.rmtree(builder.data_dir)
  shown = tfds.core.utils.tqdm_utils._active  # restore the caller's choice of progress bars afterwards
  try:
    if quiet:
      tfds.disable_progress_bar()
    builder.download_and_prepare(file_format="array_record")
  finally:
    tfds.core.utils.tqdm_utils.display_progress_bar(shown)
  return builder


class _Records(Sequence):
  """Records decoded on access from an array_record data source (random access, nothing loaded up front)."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    if i < 0:
      i += len(self)
    if not 0 <= i < len(self):
      raise IndexError(i)
    return decode(self._source[i])


def load_trajectories(data_dir: str | Path, split: str = "train") -> Sequence[TrajectoryRecord]:
  builder = DreamjaxTrajectories(data_dir=str(data_dir))
  if not builder.is_prepared():
    raise FileNotFoundError(f"{data_dir}: no {NAME} dataset (version {builder.VERSION}) built there")
  if split not in builder.info.splits:
    raise ValueError(f"{data_dir}: {NAME} has no split {split!r} (has {', '.join(builder.info.splits)})")
  return _Records(builder.as_data_source(split=split))


def load_transitions(data_dir: str | Path, split: str = "train", max_history: int | None = None) -> list[Transition]:
  return list(transitions(load_trajectories(data_dir, split), max_history=max_history))
