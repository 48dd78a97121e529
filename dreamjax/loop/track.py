"""Experiment tracking: one `Tracker` per run, writing a local JSONL log always and Weights & Biases when asked.

- Local backend (always on): `config.json` and `metrics.jsonl` in the run folder (`MetricsLog`: one JSON object per
  logged step, flushed at once so a killed run keeps what it logged), `summary.json`, and `plot_metrics`' SVG of the
  training curves (`dreamjax.loop.plots`). Nothing else is needed to read a run.
- W&B backend (`TrackConfig.wandb`): "online" needs an API key and the network; "offline" writes the run under
  `<out_dir>/wandb/offline-run-*` with no network (upload later with `wandb sync`), with wandb's cache, config and
  data folders under `<out_dir>/wandb` too unless the user set them, and its error reporting off (not even a DNS
  lookup leaves the machine; tests/test_no_network.py). Its console capture is off (the loops print their own lines)
  and it is silent.

Resuming. A run's id (W&B's, or a local one of the same form when W&B is off) is `Tracker.run_id`; loops store it
in their checkpoint's meta and pass it back on resume, so W&B continues the same run (resume="allow"). With
`resume_step`, rows of metrics.jsonl past that step (logged after the checkpoint the run resumes from) are dropped,
so the resumed run's file equals an uninterrupted run's; W&B cannot rewind an offline run, so it ignores the steps it
already has. Without `resume_step` the run is fresh and metrics.jsonl starts empty.

In a multi-process run every process runs the loop and holds a Tracker; only process 0 (`primary`) writes files and
the W&B run, the others' calls return the same rows and write nothing.

Strict JSON. JSON has no NaN or infinity; Python's json module writes them as the bare words `NaN` and `Infinity`,
which other parsers (jq, JavaScript, strict JSON readers) reject. Every file written here (metrics.jsonl, summary.json,
config.json, and the JSONL files `truncate_jsonl` rewrites on resume) goes through `json_dumps`, as should any run
file a loop writes itself (evals.jsonl rows): a non-finite float is written as `null` (pandas reads a null in a
numeric column as NaN), everything else as it is, with `allow_nan=False` so nothing non-finite slips through.
`Tracker.log` returns the row with its floats as they were (NaN stays NaN for the caller's own formatting);
`read_metrics` returns a null as None, and the plots skip it.

`progress` is tqdm, quiet when stderr is not a terminal (logs, CI, tests); `echo` prints a line without breaking a
bar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from dreamjax.loop.plots import metric_curves


def to_json(value: Any) -> Any:
  """Config trees (frozen dataclasses, tuples, enums) as plain JSON values."""
  if dataclasses.is_dataclass(value):
    return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): to_json(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [to_json(v) for v in value]
  if isinstance(value, set | frozenset):
    return sorted(to_json(v) for v in value)
  if isinstance(value, np.generic | jax.Array | np.ndarray):
    return np.asarray(value).tolist()
  return value


def finite_json(value: Any) -> Any:
  """`value` (nested dicts, lists, tuples, scalars) with each non-finite float replaced by None."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, Mapping):
    return {k: finite_json(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [finite_json(v) for v in value]
  return value


def json_dumps(value: Any, **kwargs: Any) -> str:
  """`json.dumps` for run files: strict JSON, a non-finite float written as null (module docstring)."""
  return json.dumps(finite_json(value), allow_nan=False, **kwargs)


class MetricsLog:
  """Appends one JSON object per call to `metrics.jsonl`; values are converted to Python floats/ints."""

  def __init__(self, path: Path):
    self.path = path
    self._file = open(path, "a", encoding="utf-8")
    self._start = time.time()

  def log(self, step: int, metrics: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    row = {"step": int(step), "time_s": round(time.time() - self._start, 3), **extra, **plain_values(metrics)}
    self._file.write(json_dumps(row, sort_keys=True) + "\n")
    self._file.flush()
    return row

  def close(self) -> None:
    self._file.close()


def plain_values(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Metrics (arrays, NumPy or Python scalars) as Python numbers and lists, as a JSON row holds them."""
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = v.item() if v.ndim == 0 else v.tolist()
  return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
  """The rows of a metrics.jsonl (a non-finite value reads as None)."""
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


WANDB_MODES = ("off", "online", "offline")


@dataclasses.dataclass(frozen=True)
class TrackConfig:
  wandb: str = "off"  # off | online | offline
  project: str = "dreamjax"
  entity: str = ""  # W&B team or user; empty: the default of the logged-in user
  name: str = ""  # W&B run name; empty: the run folder's name
  group: str = ""  # W&B group: the experiment the run belongs to (`reproduce` sets its folder's name); empty: none
  job_type: str = ""  # W&B job type: the stage (`reproduce` sets train-policy, rl, dreamgym, ...); empty: none
  tags: tuple[str, ...] = ()
  progress: bool = True  # tqdm bars (shown only when stderr is a terminal)

  def __post_init__(self):
    if self.wandb not in WANDB_MODES:
      raise ValueError(f"TrackConfig.wandb must be one of {WANDB_MODES}, got {self.wandb!r}")


def git_commit() -> str | None:
  """The commit of the dreamjax checkout this code runs from, with "+dirty" when it has uncommitted changes; None
  outside a git checkout (an installed wheel). W&B records it in the run's config, so a table row names its code."""
  here = Path(__file__).resolve().parent
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    if head.returncode:
      return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                           text=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def new_run_id() -> str:
  """8 lowercase letters and digits: the form of W&B's own ids, so a local id can also name a W&B run."""
  return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _broadcast_text(text: str, size: int = 256) -> str:
  """Process 0's `text` on every process (a collective)."""
  from jax.experimental import multihost_utils

  data = text.encode()
  if len(data) > size:
    raise ValueError(f"run id {text!r} is longer than {size} bytes")
  buf = np.frombuffer(data.ljust(size, b"\0"), np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").decode()


def truncate_jsonl(path: str | Path, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
  """Rewrites a JSONL file with only the rows `keep` accepts; returns them. A torn last line (a process killed
  mid-write) is dropped; a malformed line before it is an error naming the file and line. A missing file is empty."""
  path = Path(path)
  if not path.exists():
    return []
  lines = path.read_text(encoding="utf-8").splitlines()
  rows = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}:{i + 1}: not a JSON row ({e})") from None
    if keep(row):
      rows.append(row)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text("".join(json_dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")
  tmp.replace(path)  # atomic: a kill here leaves the old file or the new one, never half of one
  return rows


def _flat_scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | bool | str]:
  """Nested dicts as "a/b" keys; scalars only (W&B plots numbers; lists such as per-task outcomes stay local)."""
  out: dict[str, Any] = {}
  for k, v in values.items():
    if isinstance(v, Mapping):
      out.update(_flat_scalars(v, f"{prefix}{k}/"))
    elif isinstance(v, bool | int | float | str) or (isinstance(v, np.generic | np.ndarray) and np.ndim(v) == 0):
      out[f"{prefix}{k}"] = v.item() if isinstance(v, np.generic | np.ndarray) else v
  return out


@contextlib.contextmanager
def _wandb_offline_env(root: Path) -> Iterator[None]:
  """The environment an offline W&B run starts in, restored afterwards so the rest of the process is unaffected.

  wandb's cache/config/data folders go under the run folder (its service process keeps them), unless the user chose
  them. Error reporting is switched off (WANDB_ERROR_REPORTING=false, unless the user set it): with it on, wandb's
  telemetry recorder, made before `wandb.init` knows the run is offline, probes W&B's server (a DNS lookup of its
  host, seen under strace; tests/test_no_network.py), and wandb-core starts with its own error reporting. Both read
  the variable when they start, inside `wandb.init`."""
  names = {"WANDB_CACHE_DIR": str(root / "cache"), "WANDB_CONFIG_DIR": str(root / "config"),
           "WANDB_DATA_DIR": str(root / "data"), "WANDB_ERROR_REPORTING": "false"}
  set_here = [n for n in names if n not in os.environ]
  for n in set_here:
    os.environ[n] = names[n]
  try:
    yield
  finally:
    for n in set_here:
      os.environ.pop(n, None)


class Tracker:
  """A run's tracker: `log(step, metrics)` appends to metrics.jsonl and W&B; `summary`, `plot_metrics`, `close`."""

  def __init__(self, out_dir: str | Path, cfg_json: Mapping[str, Any], track_cfg: TrackConfig = TrackConfig(),
               run_id: str | None = None, resume_step: int | None = None, primary: bool | None = None):
    self.out = Path(out_dir)
    self.cfg = track_cfg
    # In a multi-process run every process runs the loop; one writes the files and the W&B run.
    self.primary = jax.process_index() == 0 if primary is None else primary
    self._log = self._wandb = None
    if self.primary:
      self.out.mkdir(parents=True, exist_ok=True)
      (self.out / "config.json").write_text(json_dumps(cfg_json, indent=2, sort_keys=True))
      metrics = self.out / "metrics.jsonl"
      if resume_step is None:
        metrics.write_text("")
      else:
        truncate_jsonl(metrics, lambda row: row.get("step", 0) <= resume_step)
      self._log = MetricsLog(metrics)
    if self.primary and track_cfg.wandb != "off":
      import wandb  # imported only when used: it is slow to import and starts a service process

      root = self.out / "wandb"
      root.mkdir(exist_ok=True)
      # wandb-core, a separate binary, must come up within x_service_wait (30 s by default); on a host busy with the
      # job's own compile and env workers, with a cold file cache, its first start can take longer than that.
      settings = wandb.Settings(mode=track_cfg.wandb, silent=True, console="off", x_disable_stats=True,
                                x_service_wait=180.0)
      with _wandb_offline_env(root) if track_cfg.wandb == "offline" else contextlib.nullcontext():
        self._wandb = wandb.init(project=track_cfg.project, entity=track_cfg.entity or None,
                                 name=track_cfg.name or self.out.name, group=track_cfg.group or None,
                                 job_type=track_cfg.job_type or None, tags=list(track_cfg.tags),
                                 config=dict(cfg_json, git_commit=git_commit()), dir=str(self.out), id=run_id,
                                 resume="allow", settings=settings)
    run_id = self._wandb.id if self._wandb is not None else (run_id or new_run_id())
    # Every process builds its tracker at the same point; they take process 0's id, so summaries and checkpoint
    # metadata agree whichever process reads them.
    self.run_id = _broadcast_text(run_id) if jax.process_count() > 1 else run_id

  @property
  def wandb_run(self):
    """The W&B run (None when W&B is off), for media or artifacts beyond scalars."""
    return self._wandb

  def log(self, step: int, metrics: Mapping[str, Any], *, jsonl: bool = True, **extra: Any) -> dict[str, Any]:
    """Logs `metrics` (and `extra`) at `step`; `jsonl=False` sends them to W&B only (rows kept in their own file,
    e.g. evaluations). Returns the row as written."""
    if jsonl and self._log is not None:
      row = self._log.log(step, metrics, **extra)
    else:  # the same values as a written row (every process returns what process 0 writes)
      row = {"step": int(step), **extra, **plain_values(metrics)}
    if self._wandb is not None:
      self._wandb.log(_flat_scalars({k: v for k, v in row.items() if k != "step"}), step=int(step))
    return row

  def summary(self, values: Mapping[str, Any], filename: str = "summary.json") -> Path:
    """Writes the run's summary to the run folder (whole) and to W&B's run summary (scalars)."""
    path = self.out / filename
    if self.primary:
      path.write_text(json_dumps(values, indent=1) + "\n")
    if self._wandb is not None:
      self._wandb.summary.update(_flat_scalars(values))
    return path

  def plot_metrics(self, keys: Sequence[str], filename: str = "metrics.svg", title: str = "") -> Path:
    """Training curves of `keys` from metrics.jsonl (those present), one panel each."""
    path = self.out / filename
    return metric_curves(read_metrics(self.out / "metrics.jsonl"), keys, path, title=title) if self.primary else path

  def close(self) -> None:
    if self._log is not None:
      self._log.close()
      self._log = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None

  def __enter__(self) -> Tracker:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def progress(iterable: Iterable | int | None = None, desc: str = "", *, total: int | None = None, initial: int = 0,
             unit: str = "it", enabled: bool = True) -> tqdm:
  """A tqdm bar over `iterable` (or, given an int, a bar of that total to `update` by hand); quiet when disabled or
  when stderr is not a terminal."""
  if isinstance(iterable, int):
    iterable, total = None, iterable
  quiet = not enabled or not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
  return tqdm(iterable, desc=desc, total=total, initial=initial, unit=unit, dynamic_ncols=True, disable=quiet)


def echo(message: str) -> None:
  """Prints a line to stdout around any active progress bar."""
  tqdm.write(message, file=sys.stdout)
  sys.stdout.flush()
