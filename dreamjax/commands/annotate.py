"""`dreamjax annotate`: per-step reasoning and task tutorials for a trajectories JSONL, into an annotations JSONL.

Two annotators (dreamjax.experience.annotate's `Annotator` protocol):
- "rules": derived from privileged env information in the records; seconds for thousands of episodes.
- "teacher": a teacher LLM behind an OpenAI-compatible endpoint (`TeacherConfig`; the key is read from the
  environment variable `teacher.api_key_env` when it is set, answers are cached on disk, see teacher.py).

The output defaults to annotations.<annotator>.jsonl beside the input. A rerun skips episodes already annotated, so an
interrupted run is resumed by running the same command. The env's step limit (which tells a step-limit ending from a
failure) is read from collect_config.json beside the input when the collector wrote one, unless `step_limit` is set.
The whole input is validated before any output is written. Bad settings or input files raise ValueError naming the
field or file (the CLI prints it and exits with code 2); a teacher that cannot annotate an episode (every retry
failed with `on_failure="raise"`, or a misconfigured URL, model or key) is reported the same way, and the
annotations written before it are kept for the rerun.

Several processes (a command started on every worker of a pod): the processes join (`initialize`), process 0 alone
annotates and writes (the output, the teacher's answer cache) and returns the summary, and the others wait for it at
a barrier and return an empty one. Annotating runs no model here (a teacher is an HTTP endpoint), so other processes
would only send every request again.

  dreamjax annotate --config configs/annotate_twx.py[:tiny] [--set annotator=teacher --set teacher.base_url=...]
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dreamjax.data.records import iter_trajectories
from dreamjax.experience.annotate import Annotator, annotate_file, rule_annotator, success_references
from dreamjax.experience.teacher import FAILURE_MODES, TeacherAnnotator, TeacherError
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.track import progress
from dreamjax.parallel import DistributedConfig, barrier, initialize, is_primary

ANNOTATORS = ("rules", "teacher")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
  """The teacher LLM's endpoint and request settings (used when `AnnotateConfig.annotator` is "teacher")."""

  base_url: str = ""  # OpenAI-compatible API root, e.g. http://localhost:8000/v1
  model: str = ""  # the model name the endpoint serves
  api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key (unset: no Authorization header)
  cache_dir: str = ""  # answer cache; empty: teacher_cache/ beside the output
  max_retries: int = 4
  timeout_s: float = 120.0
  temperature: float = 0.0
  on_failure: str = "raise"  # when every retry fails: "raise" stops, "fallback" uses the rule-based annotation
  json_mode: bool = True  # send response_format=json_object (some servers reject it)

  def __post_init__(self):
    if self.on_failure not in FAILURE_MODES:
      raise ValueError(f"TeacherConfig.on_failure must be one of {FAILURE_MODES}, got {self.on_failure!r}")
    if self.max_retries < 0:
      raise ValueError(f"TeacherConfig.max_retries must be >= 0, got {self.max_retries}")
    if self.timeout_s <= 0:
      raise ValueError(f"TeacherConfig.timeout_s must be > 0, got {self.timeout_s}")


@dataclasses.dataclass(frozen=True)
class AnnotateConfig:
  trajectories: str = "runs/collect/twx/trajectories.jsonl"  # TrajectoryRecord JSONL (dreamjax collect)
  out: str = ""  # annotations JSONL; empty: annotations.<annotator>.jsonl beside the trajectories
  annotator: str = "rules"  # "rules" | "teacher"
  step_limit: int = 0  # the env's step limit; 0: from collect_config.json beside the trajectories
  limit: int = 0  # annotate at most this many episodes in this run; 0: all
  workers: int = 1  # episodes annotated at once (threads; for a teacher behind HTTP)
  teacher: TeacherConfig = TeacherConfig()
  progress: bool = True  # a bar over the episodes annotated (shown only when stderr is a terminal)
  distributed: DistributedConfig = DistributedConfig()  # multi-process runs (default: from the environment)

  def __post_init__(self):
    # Only single-field checks here: overrides are applied one at a time, so a check across fields (a teacher needs
    # base_url and model) would refuse the intermediate configs; `run` makes those.
    if self.annotator not in ANNOTATORS:
      raise ValueError(f"AnnotateConfig.annotator must be one of {ANNOTATORS}, got {self.annotator!r}")
    for name in ("step_limit", "limit"):
      if getattr(self, name) < 0:
        raise ValueError(f"AnnotateConfig.{name} must be >= 0, got {getattr(self, name)}")
    if self.workers < 1:
      raise ValueError(f"AnnotateConfig.workers must be >= 1, got {self.workers}")


def collected_step_limit(trajectories: str | Path) -> int | None:
  """The step limit in the collector's collect_config.json beside `trajectories` (env_kwargs "step_limit=N" or
  "max_steps=N"), None when there is none."""
  path = Path(trajectories).parent / "collect_config.json"
  if not path.is_file():
    return None
  try:
    config = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
  for item in config.get("env_kwargs", []) if isinstance(config, dict) else []:
    key, _, value = str(item).partition("=")
    if key.strip() in ("step_limit", "max_steps") and value.strip().isdigit():
      return int(value)
  return None


def output_path(cfg: AnnotateConfig) -> Path:
  return Path(cfg.out) if cfg.out else Path(cfg.trajectories).parent / f"annotations.{cfg.annotator}.jsonl"


def _teacher(cfg: AnnotateConfig, out: Path, step_limit: int | None, fallback: Annotator) -> Annotator:
  t = cfg.teacher
  missing = [f"teacher.{name}" for name in ("base_url", "model") if not getattr(t, name)]
  if missing:
    raise ValueError(f"AnnotateConfig: annotator 'teacher' needs {' and '.join(missing)} (e.g. --set "
                     f"teacher.base_url=http://localhost:8000/v1 --set teacher.model=<served model>)")
  return TeacherAnnotator(t.base_url, t.model, api_key_env=t.api_key_env, max_retries=t.max_retries,
                          timeout_s=t.timeout_s, cache_dir=Path(t.cache_dir) if t.cache_dir else out.parent /
                          "teacher_cache", temperature=t.temperature, on_failure=t.on_failure,
                          json_mode=t.json_mode, step_limit=step_limit,
                          fallback=fallback if t.on_failure == "fallback" else None)


def run(cfg: AnnotateConfig) -> dict[str, Any]:
  """Annotates the episodes of `cfg.trajectories` that the output lacks; prints and returns the summary (counts,
  seconds, the output path, the step limit used and, for a teacher, its request/cache/retry/fallback counts); {} on
  processes other than process 0 (module docstring)."""
  src = Path(cfg.trajectories)
  if not src.is_file():
    raise ValueError(f"AnnotateConfig.trajectories: {src} does not exist (collect trajectories with `dreamjax "
                     f"collect` first)")
  out = output_path(cfg)
  initialize(cfg.distributed)  # before the lock, which process 0 alone takes once the processes have joined
  with lock_run_folder(out.parent):  # one writer per folder (the collector's, by default): none appends under another
    summary = _annotate(cfg, src, out) if is_primary() else {}
    barrier("annotate", host_work=True)  # the others read nothing before the annotations are whole
  return summary


def _annotate(cfg: AnnotateConfig, src: Path, out: Path) -> dict[str, Any]:
  step_limit = cfg.step_limit or collected_step_limit(src)
  records = list(iter_trajectories(src))  # validates the whole file before any output is written
  envs = sorted({r.env for r in records})
  if len(envs) > 1:
    raise ValueError(f"AnnotateConfig.trajectories: {src} mixes envs {envs}; annotate one env per file")
  env = envs[0] if envs else "textworld_express"
  rules = rule_annotator(env, step_limit, success_references(records))
  annotator = rules if cfg.annotator == "rules" else _teacher(cfg, out, step_limit, rules)
  total = min(cfg.limit, len(records)) if cfg.limit else None  # without a limit, episodes already done are unknown
  with progress(total=total, desc="annotate", unit="episode", enabled=cfg.progress) as bar:
    try:
      summary = annotate_file(src, out, annotator, limit=cfg.limit or None, workers=cfg.workers,
                              log=lambda _: bar.update())
    except TeacherError as e:  # a failed teacher is a setting to fix; what it annotated stays in `out`
      raise ValueError(f"{e} (the annotations written so far stay in {out}; rerun to resume)") from e
  summary["step_limit"] = step_limit
  stats = getattr(annotator, "stats", None)
  if stats is not None:
    summary.update(requests=stats.requests, cache_hits=stats.cache_hits, retries=stats.retries,
                   fallbacks=stats.fallbacks, errors=stats.errors[:10])
  print(json.dumps(summary, indent=1), flush=True)
  return summary
