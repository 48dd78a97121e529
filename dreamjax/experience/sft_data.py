"""SFT examples for the experience model (Eq. 5) from offline trajectories: split, annotate, retrieve, render, fit.

Pipeline (host-side, deterministic):
1. **Split by task** (`split_by_task`): whole tasks go to the held-out side, so held-out transitions come from tasks
   the model never saw (every episode of a task, whatever its policy, lands on one side). The order is a hash of
   (seed, task id), so adding episodes or tasks never moves an existing task across the split.
2. **Annotate** (`annotations_for`): the reasoning R*_t of each step and the episode's tutorial, from given annotation
   files or, by default, the rule-based annotator run on the fly (references for failed runs' tutorials come from
   the successful runs among the records).
3. **Retrieve**: the retriever holds the TRAINING transitions only; each example's top-k neighbours are queried with
   its own (state, action) and never come from its own episode, so no example shows its own answer. Other episodes
   of the same task may be retrieved (`exclude="episode"`, the default): at RL time the buffer holds the training
   tasks' offline transitions, as the paper's does. `exclude="task"` keeps only other tasks' transitions, so training
   sees neighbours the way unseen tasks (held-out ones, M_task's variations) do. Held-out examples retrieve from
   training transitions; their tasks are never in the retriever.
4. **Render and fit** (`ExampleBuilder`): `transition_example` gives (ids, kinds, loss mask); an example longer than
   `max_len` tokens is shortened by dropping history pairs (oldest first), then retrieved examples (last first), and
   dropped only if still too long. Each step is counted in `SftData.stats`.
   With the format's actions block, each example shows its state's recorded admissible actions and is trained to
   write the next state's (`action_lists`: the next step's recorded list, none after the episode's end). The last
   step of an episode cut without ending has no recorded next list: it is left out (`dropped_unknown_actions`) rather
   than taught an empty list.

Each `ExpExample` also carries `regions`, a per-token code splitting the target into Eq. 5's two terms: the reasoning
block (term 1), and the next-state block, the actions block and the outcome flags with the end-of-turn token (term 2;
the actions block has its own code so its NLL is reported apart). Regions are found
by token prefixes of the target's parts; with BPE a token may straddle the boundary between two parts, and it is then
counted in the later part (nothing is scored twice or dropped). The fidelity module reads the next-state block's
log-probability from them (the eps_P estimate).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
from jaxtyping import Int

from dreamjax.data.records import TrajectoryRecord, Transition, transitions
from dreamjax.experience import rename
from dreamjax.experience.annotate import Annotation, check_annotation, rule_annotator, success_references
from dreamjax.experience.format import (
    ExpFormatConfig,
    action_lists,
    build_prompt,
    render_user,
    system_prompt,
    transition_example,
    transition_target,
)
from dreamjax.replay.retriever import Retriever
from dreamjax.text import Tokenizer

EXCLUDE = ("task", "episode")  # what a training example's retrieved neighbours must not share with it
# Region codes of `ExpExample.regions`.
PROMPT, REASONING, NEXT_STATE, OUTCOME, ACTIONS = 0, 1, 2, 3, 4
REGION_NAMES = {REASONING: "reasoning", NEXT_STATE: "next_state", ACTIONS: "actions", OUTCOME: "outcome"}


@dataclasses.dataclass(frozen=True, eq=False)
class ExpExample:
  transition: Transition  # its `history` is the full one; `shown_history` says how much of it the prompt shows
  retrieved: tuple[Transition, ...]  # as shown (after any trimming)
  reasoning: str
  tutorial: str
  ids: Int[np.ndarray, " T"]  # prompt then target, int32
  loss_mask: Int[np.ndarray, " T"]  # 1 on the target tokens and the end-of-turn token
  regions: Int[np.ndarray, " T"]  # PROMPT / REASONING / NEXT_STATE / OUTCOME per token
  prompt_len: int  # ids[:prompt_len] is the sampling prompt (generation header included)
  shown_history: int  # (state, action) pairs of the history shown in the prompt
  admissible: tuple[str, ...] = ()  # the actions admissible in the state, as the prompt shows them
  next_admissible: tuple[str, ...] = ()  # those admissible in the next state: the target's actions block

  @property
  def prompt(self) -> Int[np.ndarray, " P"]:
    return self.ids[: self.prompt_len]

  @property
  def target_ids(self) -> Int[np.ndarray, " N"]:
    return self.ids[self.prompt_len:][self.loss_mask[self.prompt_len:] == 1]


@dataclasses.dataclass(frozen=True)
class SftData:
  train: list[ExpExample]
  held_out: list[ExpExample]
  train_records: list[TrajectoryRecord]
  held_out_records: list[TrajectoryRecord]
  annotations: dict[str, Annotation]  # by episode id, for both sides
  stats: dict[str, int]


def _task_key(seed: int, task_id: str) -> bytes:
  return hashlib.sha256(f"{seed}:{task_id}".encode()).digest()


def split_by_task(records: Sequence[TrajectoryRecord], held_out_fraction: float,
                  seed: int = 0) -> tuple[list[TrajectoryRecord], list[TrajectoryRecord]]:
  """(train, held-out) records, whole tasks on one side: round(fraction x tasks) tasks are held out (at least one
  when the fraction is positive and there are two tasks or more; never all of them). Record order is kept."""
  if not 0.0 <= held_out_fraction < 1.0:
    raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
  tasks = sorted({r.task.task_id for r in records}, key=lambda t: _task_key(seed, t))
  n = round(held_out_fraction * len(tasks))
  if held_out_fraction > 0 and len(tasks) >= 2:
    n = min(max(n, 1), len(tasks) - 1)
  held = set(tasks[:n])
  return [r for r in records if r.task.task_id not in held], [r for r in records if r.task.task_id in held]


def annotations_for(records: Sequence[TrajectoryRecord], given: Mapping[str, Annotation] | None = None,
                    step_limit: int | None = None) -> dict[str, Annotation]:
  """Every record's annotation: from `given` (checked against its record; one missing is an error), or, when
  `given` is None, from the rule-based annotator of the records' env."""
  if given is not None:
    out = {}
    for r in records:
      if r.episode_id not in given:
        raise ValueError(f"annotations: episode {r.episode_id!r} has no annotation (annotate it, or pass no "
                         "annotation files to use the rule-based annotator)")
      check_annotation(given[r.episode_id], r, f"annotation of {r.episode_id!r}")
      out[r.episode_id] = given[r.episode_id]
    return out
  envs = sorted({r.env for r in records})
  annotators = {env: rule_annotator(env, step_limit, success_references(r for r in records if r.env == env))
                for env in envs}
  return {r.episode_id: annotators[r.env].annotate(r) for r in records}


def _count(stats: dict[str, int] | None, key: str) -> None:
  if stats is not None:
    stats[key] = stats.get(key, 0) + 1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def target_parts(fmt: ExpFormatConfig, target: str) -> tuple[str, str, str]:
  """(reasoning block, reasoning + next-state block, reasoning + next-state + actions blocks) prefixes of a rendered
  target; the last equals the second without the actions block."""
  cut = target.index("</next_state>") + len("</next_state>\n")
  think = target[: target.index("</think>") + len("</think>\n")] if fmt.reasoning else ""
  actions = target[: target.index("</actions>") + len("</actions>\n")] if fmt.actions else target[:cut]
  return think, target[:cut], actions


class ExampleBuilder:
  """Renders and fits examples to `max_len` tokens (see the module docstring)."""

  def __init__(self, tokenizer: Tokenizer, fmt: ExpFormatConfig, max_len: int):
    if max_len < 16:
      raise ValueError(f"max_len must be >= 16, got {max_len}")
    self.tokenizer, self.fmt, self.max_len = tokenizer, fmt, max_len

  def _regions(self, ids: np.ndarray, loss_mask: np.ndarray, prompt_len: int, target: str) -> np.ndarray:
    regions = np.where(loss_mask == 1, OUTCOME, PROMPT).astype(np.int32)  # frame tokens after end-of-turn stay 0
    body = list(ids[prompt_len:])
    think, upto_state, upto_actions = target_parts(self.fmt, target)
    n_think = _common_prefix(self.tokenizer.encode(think), body) if think else 0
    n_state = _common_prefix(self.tokenizer.encode(upto_state), body)
    n_actions = _common_prefix(self.tokenizer.encode(upto_actions), body) if self.fmt.actions else n_state
    regions[prompt_len:prompt_len + n_actions] = ACTIONS
    regions[prompt_len:prompt_len + n_state] = NEXT_STATE
    regions[prompt_len:prompt_len + n_think] = REASONING
    return regions

  def fit(self, t: Transition, retrieved: Sequence[Transition], reasoning: str = "", tutorial: str = "",
          stats: dict[str, int] | None = None, admissible: Sequence[str] = (),
          next_admissible: Sequence[str] | None = None) -> ExpExample | None:
    """The example of transition `t` with `retrieved` neighbours and the admissible actions of its state and of its
    next state (`action_lists`), shortened to fit; None when it cannot fit."""
    fmt = self.fmt
    history = list(t.history)[-fmt.max_history:] if fmt.history and fmt.max_history else []
    shown = list(retrieved)[: fmt.k] if fmt.retrieval else []
    target = transition_target(fmt, t, reasoning, next_admissible, admissible)
    admissible = tuple(admissible) if fmt.actions else ()
    next_admissible = tuple(next_admissible or ()) if fmt.actions else ()
    cut_history = cut_retrieval = False
    while True:
      ex = transition_example(self.tokenizer, fmt, dataclasses.replace(t, history=tuple(history)), shown, reasoning,
                              tutorial, admissible, next_admissible)
      if len(ex.ids) <= self.max_len:
        break
      if history:
        history, cut_history = history[1:], True
      elif shown:
        shown, cut_retrieval = shown[:-1], True
      else:
        _count(stats, "dropped_too_long")
        return None
    if cut_history:
      _count(stats, "trimmed_history")
    if cut_retrieval:
      _count(stats, "trimmed_retrieval")
    prompt_len = int(np.argmax(ex.loss_mask))
    return ExpExample(t, tuple(shown), reasoning, tutorial, ex.ids, ex.loss_mask,
                      self._regions(ex.ids, ex.loss_mask, prompt_len, target), prompt_len, len(history), admissible,
                      next_admissible)

  def prompt(self, instruction: str, history: Sequence[tuple[str, str]], retrieved: Sequence[Transition],
             state: str, action: str, step: int, reserve: int, tutorial: str = "",
             admissible: Sequence[str] = ()) -> np.ndarray:
    """A sampling prompt (open-loop prediction), fitted like an example whose target takes `reserve` tokens."""
    fmt = self.fmt
    history = list(history)[-fmt.max_history:] if fmt.history and fmt.max_history else []
    shown = list(retrieved)[: fmt.k] if fmt.retrieval else []
    while True:
      ids = build_prompt(self.tokenizer, fmt, instruction, history, shown, state, action, tutorial, step,
                         admissible).prompt()
      if len(ids) + reserve <= self.max_len or not (history or shown):
        return ids
      if history:
        history = history[1:]
      else:
        shown = shown[:-1]


def retrieve(retriever: Retriever | None, fmt: ExpFormatConfig, states: Sequence[str], actions: Sequence[str],
             exclude_episodes: Sequence[str | None] | None = None,
             exclude_tasks: Sequence[str | None] | None = None) -> list[list[Transition]]:
  """Each row's top-k stored transitions (none when retrieval is off in `fmt`), never from the row's excluded episode
  or task. Task exclusion asks the index for k more than the largest excluded task holds, then filters."""
  if retriever is None or not fmt.retrieval or fmt.k == 0 or not len(retriever):
    return [[] for _ in states]
  if exclude_tasks is None:
    return retriever.query(list(states), list(actions), fmt.k, exclude_episodes)
  per_task = collections.Counter(retriever[i].task.task_id for i in range(len(retriever)))
  extra = max((per_task[t] for t in exclude_tasks if t is not None), default=0)
  rows = retriever.query(list(states), list(actions), fmt.k + extra, exclude_episodes)
  return [[d for d in row if d.task.task_id != task][: fmt.k] for row, task in zip(rows, exclude_tasks)]


def corpus(records: Sequence[TrajectoryRecord], annotations: Mapping[str, Annotation],
           fmt: ExpFormatConfig) -> list[str]:
  """The text M_exp reads and writes on these records (system prompt, user messages with a retrieved example, and
  targets), for training a tiny run's tokenizer."""
  texts = [system_prompt(fmt)]
  for t, (shown, following) in zip(transitions(records), action_lists(records)):
    a = annotations[t.episode_id]
    texts.append(render_user(fmt, t.instruction, t.history, [t], t.state, t.action, a.tutorial, t.step, shown))
    texts.append(transition_target(fmt, t, a.reasons[t.step], () if following is None else following, shown))
  return texts


def build_examples(builder: ExampleBuilder, records: Sequence[TrajectoryRecord],
                   annotations: Mapping[str, Annotation], retriever: Retriever | None,
                   stats: dict[str, int], exclude: str = "episode") -> list[ExpExample]:
  """Examples of every transition of `records`, in record order, with neighbours from `retriever` that never come from
  the transition's own episode, nor, with `exclude="task"`, from any episode of its task."""
  if exclude not in EXCLUDE:
    raise ValueError(f"retrieval exclusion must be one of {EXCLUDE}, got {exclude!r}")
  items, lists = [], []
  for t, (shown, following) in zip(transitions(records), action_lists(records)):
    if builder.fmt.actions and following is None and not t.done:
      _count(stats, "dropped_unknown_actions")  # the episode was cut here: the next state's list is not recorded
      continue
    items.append(t)
    lists.append((shown, following))
  found = retrieve(retriever, builder.fmt, [t.state for t in items], [t.action for t in items],
                   [t.episode_id for t in items], [t.task.task_id for t in items] if exclude == "task" else None)
  out = []
  for t, neighbours, (shown, following) in zip(items, found, lists):
    a = annotations[t.episode_id]
    ex = builder.fit(t, neighbours, a.reasons[t.step], a.tutorial if builder.fmt.tutorial else "", stats, shown,
                     following)
    if ex is not None:
      out.append(ex)
  stats["examples"] = stats.get("examples", 0) + len(out)
  return out


def build_sft_data(records: Sequence[TrajectoryRecord], builder: ExampleBuilder, retriever: Retriever | None, *,
                   held_out_fraction: float, seed: int = 0, annotations: Mapping[str, Annotation] | None = None,
                   exclude: str = "episode", renamed_copies: int = 0) -> SftData:
  """Split, annotate, fill `retriever` (empty) with the training transitions, and build both sides' examples; the
  training side also gets `renamed_copies` copies of its episodes with their items renamed
  (`dreamjax.experience.rename`), whose neighbours come from the same retriever (never their own episode)."""
  train_records, held_records = split_by_task(records, held_out_fraction, seed)
  if not train_records:
    raise ValueError("build_sft_data: no training records (every task is held out?)")
  notes = annotations_for(records, annotations)
  if retriever is not None and builder.fmt.retrieval and builder.fmt.k:
    retriever.add(list(transitions(train_records, max_history=0)))
  train_stats: dict[str, int] = {}
  held_stats: dict[str, int] = {}
  train = build_examples(builder, train_records, notes, retriever, train_stats, exclude)
  for copy_records, copy_notes in rename.renamed_copies(train_records, notes, renamed_copies, seed):
    train += build_examples(builder, copy_records, copy_notes, retriever, train_stats, exclude)
  held = build_examples(builder, held_records, notes, retriever, held_stats, exclude)
  stats = {f"train_{k}": v for k, v in train_stats.items()} | {f"held_out_{k}": v for k, v in held_stats.items()}
  stats |= {"train_episodes": len(train_records), "train_renamed_copies": renamed_copies,
            "held_out_episodes": len(held_records),
            "train_tasks": len({r.task.task_id for r in train_records}),
            "held_out_tasks": len({r.task.task_id for r in held_records})}
  return SftData(train, held, train_records, held_records, notes, stats)
