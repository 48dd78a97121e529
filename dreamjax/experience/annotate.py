"""Reasoning annotation: one reason per step and a task tutorial per episode, the R*_t of Eq. 5.

The paper's teacher sees the whole trajectory and its outcome and writes, per step, why the action leads where it does
(a "transition plan"), plus a tutorial (overall plan, success mode, failure mode). Two kinds of annotator sit behind
the `Annotator` protocol: a teacher LLM behind an OpenAI-compatible endpoint (teacher.py), and the rule-based
`RuleAnnotator` here, which derives the same content from privileged information in the record. Its reason for a step
says, each part only when the record shows it (so every sentence is true of this step):
- whether the action was admissible or invalid (the step records `admissible` and `invalid`);
- the preconditions visible in the state and what changed (per-env state readers in annotate_rules.py);
- the outcome: reward, and on the last step why the episode ended (success, step limit, invalid action, the env's
  failure condition, or a recording cut off before the end).
A reason says nothing M_exp could not know when it predicts the step: not who chose the action (in DreamGym the
policy does, whatever policy the record came from) and not how many steps the recorded episode still took (its
future). Such sentences are true of the record but cannot be inferred from the prompt, so a model trained to write
them learns to guess, and its guesses sit between the prompt and the prediction that should copy from it.
Its tutorial gives the task, the overall plan from a successful run (this one, or a reference run of the same task),
how success looks and how episodes fail.

Annotations live in their own JSONL file keyed by episode_id, beside the trajectories they describe, so one collection
can carry several annotations (rules, different teachers) and an annotation run can be resumed:
  {"format": "dreamjax.annotation.v1", "episode_id": "...", "annotator": "rules:textworld_express",
   "tutorial": "...", "reasons": ["...", ...]}
Reading is strict, like dreamjax.data.records: a bad field raises ValueError naming file:line and the field.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dreamjax.data.jsonl import JsonlWriter, read_jsonl
from dreamjax.data.records import StepRecord, TrajectoryRecord, iter_numbered_trajectories
from dreamjax.experience.annotate_rules import RULES, line_diff, quote

FORMAT = "dreamjax.annotation.v1"
_KEYS = {"format", "episode_id", "annotator", "tutorial", "reasons"}


@dataclasses.dataclass(frozen=True)
class Annotation:
  episode_id: str
  tutorial: str
  reasons: tuple[str, ...]  # one per step of the episode, in order
  annotator: str = ""  # who wrote it: "rules:<env>", "teacher:<model>", ...

  def to_json(self) -> dict[str, Any]:
    return {"format": FORMAT, "episode_id": self.episode_id, "annotator": self.annotator, "tutorial": self.tutorial,
            "reasons": list(self.reasons)}

  @classmethod
  def from_json(cls, d: Any, source: str = "annotation") -> Annotation:
    if not isinstance(d, dict):
      raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    missing = sorted(_KEYS - d.keys())
    if missing:
      raise ValueError(f"{source}: field {missing[0]!r}: missing")
    unknown = sorted(d.keys() - _KEYS)
    if unknown:
      raise ValueError(f"{source}: field {unknown[0]!r}: unknown field")
    if d["format"] != FORMAT:
      raise ValueError(f"{source}: field 'format': expected {FORMAT!r}, got {d['format']!r}")
    for key in ("episode_id", "annotator", "tutorial"):
      if not isinstance(d[key], str):
        raise ValueError(f"{source}: field {key!r}: expected a string, got {type(d[key]).__name__}")
    if not isinstance(d["reasons"], list):
      raise ValueError(f"{source}: field 'reasons': expected a list of strings, got {type(d['reasons']).__name__}")
    for j, reason in enumerate(d["reasons"]):
      if not isinstance(reason, str):
        raise ValueError(f"{source}: field 'reasons[{j}]': expected a string, got {type(reason).__name__}")
    return cls(d["episode_id"], d["tutorial"], tuple(d["reasons"]), d["annotator"])


@runtime_checkable
class Annotator(Protocol):
  """Writes the reasoning of one recorded episode; `name` goes into the annotations it writes."""

  name: str

  def annotate(self, record: TrajectoryRecord) -> Annotation: ...


def rule_annotator(env_name: str, step_limit: int | None = None,
                   references: Mapping[str, TrajectoryRecord] | None = None) -> RuleAnnotator:
  """The rule-based annotator of an env ("textworld_express", "alfworld", "miniwob").

  `step_limit`: the env's step limit, when known, to tell a step-limit ending from the env's failure condition.
  `references`: successful records by task_id (see `success_references`), whose plan the tutorial of a failed run of
  the same task shows.
  """
  return RuleAnnotator(env_name, step_limit, references)


def check_annotation(annotation: Annotation, record: TrajectoryRecord, source: str = "annotation") -> None:
  """Raises ValueError when `annotation` cannot describe `record` (another episode, another number of steps)."""
  if annotation.episode_id != record.episode_id:
    raise ValueError(f"{source}: field 'episode_id': {annotation.episode_id!r} annotates another episode than "
                     f"{record.episode_id!r}")
  if len(annotation.reasons) != record.num_steps:
    raise ValueError(f"{source}: field 'reasons': {len(annotation.reasons)} reasons for episode "
                     f"{record.episode_id!r} of {record.num_steps} steps")


def read_annotations(path: str | Path) -> dict[str, Annotation]:
  """Annotations of a JSONL file by episode_id; a repeated episode_id is an error (an unterminated last line, cut off
  by a kill, is skipped with a warning)."""
  out: dict[str, Annotation] = {}
  lines: dict[str, int] = {}
  for number, value in read_jsonl(path):
    a = Annotation.from_json(value, source=f"{path}:{number}")
    if a.episode_id in out:
      raise ValueError(f"{path}:{number}: field 'episode_id': {a.episode_id!r} is annotated twice (first at line "
                       f"{lines[a.episode_id]})")
    out[a.episode_id], lines[a.episode_id] = a, number
  return out


def write_annotations(path: str | Path, annotations: Iterable[Annotation]) -> None:
  """Appends annotations to `path` (created if needed), one flushed line each."""
  with JsonlWriter(path) as w:
    for a in annotations:
      w.write(a.to_json())


def annotate_file(trajectories: str | Path, out: str | Path, annotator: Annotator, limit: int | None = None,
                  workers: int = 1, log: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Annotates the episodes of a trajectories JSONL that `out` lacks, appending each as it is written.

  Resumable: a rerun reads `out`, checks each existing annotation against its episode, and does only the rest.
  `limit` caps the episodes annotated in this run. `workers` > 1 annotates that many episodes at once in threads
  (for a teacher behind HTTP); annotations are still written in file order. Returns counts and timing.
  """
  out = Path(out)
  done = read_annotations(out) if out.is_file() else {}
  new = skipped = steps = 0
  t0 = time.perf_counter()

  def todo() -> Iterator[tuple[str, TrajectoryRecord]]:
    nonlocal skipped
    budget = limit
    for number, record in iter_numbered_trajectories(trajectories):
      if record.episode_id in done:
        check_annotation(done[record.episode_id], record, f"{out} (episode {record.episode_id!r})")
        skipped += 1
        continue
      if budget is not None and budget <= 0:
        return
      budget = None if budget is None else budget - 1
      yield f"{trajectories}:{number}", record

  def run(item: tuple[str, TrajectoryRecord]) -> tuple[str, TrajectoryRecord, Annotation]:
    return item[0], item[1], annotator.annotate(item[1])

  with JsonlWriter(out) as writer, ThreadPoolExecutor(max(1, workers)) as pool:
    items = todo()
    while chunk := list(itertools.islice(items, max(1, workers) * 4)):
      for where, record, annotation in (pool.map(run, chunk) if workers > 1 else map(run, chunk)):
        check_annotation(annotation, record, f"{annotator.name} on {where}")
        writer.write(dataclasses.replace(annotation, annotator=annotation.annotator or annotator.name).to_json())
        done[record.episode_id] = annotation
        new += 1
        steps += record.num_steps
        if log is not None:
          log(f"annotated {record.episode_id} ({record.num_steps} steps)")
  seconds = time.perf_counter() - t0
  return {"annotated": new, "already_done": skipped, "steps": steps, "seconds": round(seconds, 3),
          "out": str(out), "annotator": annotator.name}


# --- rule-based annotators -------------------------------------------------------------------------------------------


def ending(record: TrajectoryRecord, step_limit: int | None) -> str:
  """Why the episode ended: success, step_limit, invalid_action, failure, ended (cause unknown without the step
  limit), cut_off (the record stops before the env ended it) or empty."""
  if not record.steps:
    return "empty"
  last = record.steps[-1]
  if last.success:
    return "success"
  if not last.done:
    return "cut_off"
  if step_limit is None:
    return "ended"
  if record.num_steps >= step_limit:
    return "step_limit"
  return "invalid_action" if last.invalid else "failure"


def _outcome(record: TrajectoryRecord, j: int, step: StepRecord, end: str, step_limit: int | None) -> str:
  r = f"reward {step.reward:g}"
  if j < record.num_steps - 1 or end == "cut_off":
    if step.done:
      return f"The episode ends here: {r}."
    return f"The task is not complete yet: {r}, and the episode goes on" + (
        " (the recording stops here)." if end == "cut_off" and j == record.num_steps - 1 else ".")
  return {
      "success": f"This completes the task: {r}, and the episode ends in success.",
      "step_limit": f"This is step {step_limit}, the step limit, so the episode ends without success: {r}.",
      "invalid_action": f"The invalid action ends the episode as a failure: {r}.",
      "failure": f"This triggers the environment's failure condition: the episode ends without success, {r}.",
  }.get(end, f"The episode ends here without success after {record.num_steps} steps"
             + (", on an invalid action" if step.invalid else "") + f": {r}.")


def _run_summary(record: TrajectoryRecord, end: str, step_limit: int | None) -> str:
  invalid = sum(s.invalid for s in record.steps)
  extra = f", {invalid} of them invalid" if invalid else ""
  return {
      "success": f"this run succeeded in {record.num_steps} steps{extra}.",
      "step_limit": f"this run failed: it reached the step limit of {step_limit} steps{extra}.",
      "invalid_action": f"this run failed: an invalid action ended it after {record.num_steps} steps{extra}.",
      "failure": f"this run failed: the environment's failure condition ended it after {record.num_steps} steps"
                 f"{extra}.",
      "cut_off": f"this run was recorded for {record.num_steps} steps{extra} without ending.",
      "empty": "this run has no steps.",
  }.get(end, f"this run ended without success after {record.num_steps} steps{extra}.")


class RuleAnnotator:
  """Annotates one env's records. `step_limit` (the env's, when known) tells a step-limit ending from a failure;
  `references` maps task_id to a successful record of that task, whose plan the tutorial of a failed run shows."""

  def __init__(self, env: str, step_limit: int | None = None,
               references: Mapping[str, TrajectoryRecord] | None = None):
    if env not in RULES:
      raise ValueError(f"no rule-based annotator for env {env!r}; known: {', '.join(sorted(RULES))}")
    self.env, self.step_limit, self.references = env, step_limit, dict(references or {})
    self.rules = RULES[env]()
    self.name = f"rules:{env}"

  def reason(self, record: TrajectoryRecord, j: int, end: str) -> str:
    s = record.steps[j]
    # What the state shows comes before the verdict, so that the verdict follows from the state. In DreamGym the
    # admissible list M_exp is shown is its own, and a verdict read off that list cannot catch an entry it invented.
    parts = self.rules.preconditions(s.state, s.action)
    if s.invalid:
      parts += self.rules.refusal(s.state, s.action)
      listed = " (it is not among the admissible actions)" if s.admissible and not self.rules.admissible(
          s.action, s.admissible) else ""
      parts.append(f"The action {quote(s.action, 120)} is invalid here{listed}, so the environment does not carry it "
                   "out.")
    elif s.admissible and self.rules.admissible(s.action, s.admissible):
      parts.append(f"The action {quote(s.action, 120)} is one of the {len(s.admissible)} admissible actions.")
    else:
      parts.append(f"The environment accepts the action {quote(s.action, 120)}.")
    if s.state == s.next_state:
      parts.append("Nothing changes: the next state is the same as this one.")
    parts += self.rules.effects(s.state, s.next_state) or line_diff(s.state, s.next_state)
    parts.append(_outcome(record, j, s, end, self.step_limit))
    return " ".join(parts)

  def tutorial(self, record: TrajectoryRecord, end: str) -> str:
    lines = [f"Task: {' '.join(record.instruction.split()) or '(no instruction)'}"]
    ref = record if record.success else self.references.get(record.task.task_id)
    if ref is not None and ref.success and ref.steps:
      plan = [s.action for s in ref.steps if not s.invalid and s.state != s.next_state]
      where = "this run" if ref is record else f"a successful run of this task, {ref.episode_id}"
      shown = "; ".join(plan[:40]) + ("; ..." if len(plan) > 40 else "")
      lines.append(f"Plan (from {where}; {len(plan)} steps that change the state): {shown}.")
      last = ref.steps[-1]
      said = self.rules.headline(last.next_state)
      lines.append(f"Success mode: the task is complete, with reward 1 and the episode over, when the action "
                   f"{quote(last.action, 120)} succeeds" + (f" ({quote(said, 160)})." if said else "."))
    else:
      lines.append("Plan: no successful run of this task is recorded; work towards the task above.")
      lines.append("Success mode: the episode ends with reward 1 on the step that completes the task.")
    summary = _run_summary(record, end, self.step_limit)
    lines.append(f"Failure mode: {self.rules.failure_modes} In the record, {summary}")
    return "\n".join(lines)

  def annotate(self, record: TrajectoryRecord) -> Annotation:
    if record.env != self.env:
      raise ValueError(f"{self.name}: episode {record.episode_id!r} is from env {record.env!r}")
    end = ending(record, self.step_limit)
    reasons = tuple(self.reason(record, j, end) for j in range(record.num_steps))
    return Annotation(record.episode_id, self.tutorial(record, end), reasons, self.name)


def success_references(records: Iterable[TrajectoryRecord]) -> dict[str, TrajectoryRecord]:
  """The shortest successful record of each task (expert runs first on ties), for tutorials of failed runs."""
  best: dict[str, TrajectoryRecord] = {}
  for r in records:
    if not r.success:
      continue
    key = (r.num_steps, r.policy != "expert", r.episode_id)
    old = best.get(r.task.task_id)
    if old is None or key < (old.num_steps, old.policy != "expert", old.episode_id):
      best[r.task.task_id] = r
  return best

