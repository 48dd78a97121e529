"""Offline trajectories -> the policy's per-turn token rows: behaviour-cloning rows (SFT) and preference pairs (DPO).

A row is exactly what the rollout engine records for one turn (`dreamjax.rollout.engine`): the turn's prompt from
`build_turn_prompt` (system message, then the user message with task, step count, recent history, current state and
admissible actions, then the generation header), followed by the answer's ids and the end-of-turn token. The loss
mask is 1 on the answer and end-of-turn only (`Kind.ACTION`), as on sampled tokens at RL time. Nothing after
end-of-turn is kept (the engine stops there too), and a prompt longer than the rollout's largest bucket drops history
oldest first, as `RolloutEngine.turn_prompt` does. So a policy warm-started here sees at RL time exactly the token
layout it was trained on.

History. Turn t shows the (state, action) pairs of turns 0..t-1 as recorded. For env-rejected actions that is what
the engine shows too (the parsed action); offline records have no unparseable answers.

Which turns are demonstrations (`RowConfig`): episodes of the `experts` policies (default the env's expert), only
successful ones by default, and within them only steps the expert chose (`step_sources`): a random or fallback step
of an epsilon-noisy episode, or an action the env rejected, is never cloned, though it still appears in the history
of the turns after it.

Think text. The answer is `format_answer(action, think)`. `think="none"` gives bare `<action>...</action>` answers;
`"template"` a fixed one-sentence rationale naming the action; `"auto"` (default) follows `AgentFormat.think`. The
template carries no information the action does not: it only teaches the `<think>` layout the system prompt asks
for. Real rationales need a teacher (the experience model's annotators reason about consequences with hindsight,
which the policy cannot see), so the TWX configs train bare actions with `AgentFormat(think=False)`.

DPO pairs (`PairConfig`): within each task, successful episodes of `chosen_policies` against failed episodes of
`rejected_policies`. Chosen episodes are ordered shortest first (then by id), rejected ones by a hash of (seed,
episode id); pair i takes chosen i mod C and rejected i mod R, for i < min(cap, max(C, R)), so every episode is used
before any repeats and reruns pair identically. A pair is two lists of rows (every turn of each episode, optionally
only the first `max_turns`) for `dreamjax.rl.batch.dpo_batch`. Leading turns whose rows are identical on both sides
(an epsilon-noisy run that followed the expert before deviating) add the same log-prob to both sides and cancel in
the DPO margin, so they are dropped (`drop_common_prefix`; at least one row per side is kept).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
from jaxtyping import Int

from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.rollout.agent import INVALID_ANSWER, AgentFormat, fit_turn_prompt, format_answer, user_text
from dreamjax.rollout.engine import RolloutConfig, allowed_tokens, answer_ids, pack_choices
from dreamjax.text import Kind, SegmentBuilder, Tokenizer

THINK_MODES = ("auto", "none", "template")
ANY = "*"  # in a policy list: every policy


@dataclasses.dataclass(frozen=True)
class RowConfig:
  """Which recorded turns become behaviour-cloning rows, and how their answers are written."""

  experts: tuple[str, ...] = ("expert",)  # record policies whose episodes are demonstrations ("*": all)
  successful_only: bool = True
  step_sources: tuple[str, ...] = ("expert", "policy")  # step sources that are cloned (not random/fallback)
  skip_invalid: bool = True  # never clone an action the env rejected
  think: str = "auto"  # auto | none | template (see the module docstring)
  # Also train on the prompt's tokens (every one after the first), as a language model: a prompt repeats the goal in
  # each state and the history's actions type its values, so predicting them is practice in copying from the context.
  prompt_loss: bool = False
  # Score each answer token among the tokens restricted decoding allows there (RolloutConfig.constrain_actions), as
  # the RL update does, not over the whole vocabulary: a token the admissible actions force costs nothing, and the
  # loss is the demonstration's choices alone. A turn whose action is not among its admissible ones is left out.
  restricted_loss: bool = False

  def __post_init__(self):
    if self.think not in THINK_MODES:
      raise ValueError(f"RowConfig.think must be one of {THINK_MODES}, got {self.think!r}")
    if not self.experts:
      raise ValueError("RowConfig.experts is empty: no episode could be a demonstration")


@dataclasses.dataclass(frozen=True)
class PairConfig:
  """How DPO preference pairs are drawn from offline episodes of the same task."""

  chosen_policies: tuple[str, ...] = ("expert",)  # successful episodes of these are chosen ("*": all)
  rejected_policies: tuple[str, ...] = (ANY,)  # failed episodes of these are rejected
  max_pairs_per_task: int = 2
  max_turns: int = 0  # per episode; 0 keeps every turn, else the first max_turns
  drop_common_prefix: bool = True
  seed: int = 0

  def __post_init__(self):
    if self.max_pairs_per_task < 1 or self.max_turns < 0:
      raise ValueError(f"PairConfig: max_pairs_per_task ({self.max_pairs_per_task}) must be >= 1 and max_turns "
                       f"({self.max_turns}) >= 0")


@dataclasses.dataclass(frozen=True, eq=False)
class TurnRow:
  """One turn as the update sees it: prompt ids then answer ids and end-of-turn, with its 0/1 loss mask."""

  ids: Int[np.ndarray, " T"]  # int32
  # int32, 1 exactly on the answer and end-of-turn (with RowConfig.prompt_loss: on every token but the first)
  loss_mask: Int[np.ndarray, " T"]
  prompt_len: int  # ids[:prompt_len] is what the sampler is given
  episode_id: str
  turn: int
  # RowConfig.restricted_loss: per answer token, the tokens restricted decoding allows there (-1 padded); None: the
  # whole vocabulary
  allowed: Int[np.ndarray, "N A"] | None = None

  @property
  def answer_ids(self) -> Int[np.ndarray, " N"]:
    return self.ids[self.prompt_len:]


@dataclasses.dataclass(frozen=True, eq=False)
class PreferencePair:
  task_id: str
  chosen_id: str  # episode ids
  rejected_id: str
  chosen: tuple[TurnRow, ...]
  rejected: tuple[TurnRow, ...]

  def as_rows(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[tuple[np.ndarray, np.ndarray]]]:
    """(chosen rows, rejected rows) as (ids, loss mask) for `dpo_batch`."""
    return [(r.ids, r.loss_mask) for r in self.chosen], [(r.ids, r.loss_mask) for r in self.rejected]


def _matches(policy: str, names: Sequence[str]) -> bool:
  return ANY in names or policy in names


def think_text(mode: str, fmt: AgentFormat, action: str) -> str:
  """The think block's content for a demonstration of `action` ("" for none)."""
  if mode not in THINK_MODES:
    raise ValueError(f"think mode must be one of {THINK_MODES}, got {mode!r}")
  if mode == "none" or (mode == "auto" and not fmt.think):
    return ""
  return f"The next step toward the task is to {action.strip()}."


def answer_text(step: StepRecord, think: str) -> str | None:
  """What the policy answered on this step: the formatted action, or (for a recorded unparseable policy answer, whose
  action field holds the raw text) that text itself; None for an empty action."""
  if not step.action.strip():
    return None
  try:
    return format_answer(step.action, think)
  except ValueError:
    return step.action


def answer_row(builder: SegmentBuilder, answer: str) -> tuple[np.ndarray, np.ndarray, int]:
  """(ids, loss mask, prompt length): `builder.prompt()` then the answer's ids through end-of-turn."""
  prompt = builder.prompt()
  full = builder.append(Kind.ACTION, answer)
  ids, kinds = full.arrays()
  if not np.array_equal(ids[:len(prompt)], prompt):  # holds by ChatFormat's check; a custom template could break it
    raise ValueError("answer_row: the assistant header differs from the generation prompt, so SFT rows would not "
                     "match rollout rows")
  action = np.flatnonzero(kinds == Kind.ACTION)
  end = int(action[-1]) + 1  # end-of-turn closes the policy's tokens; the template's tail after it is not sampled
  return ids[:end], (kinds[:end] == Kind.ACTION).astype(np.int32), len(prompt)


def episode_rows(record: TrajectoryRecord, tokenizer: Tokenizer, fmt: AgentFormat, rollout: RolloutConfig,
                 think: str, turns: Iterable[int], stats: collections.Counter) -> list[TurnRow]:
  """Rows of the given turns of one episode; turns that cannot be rows are counted in `stats` and left out."""
  rows = []
  for t in turns:
    step = record.steps[t]
    answer = answer_text(step, think_text(think, fmt, step.action))
    if answer is None:
      stats["skipped_empty_action"] += 1
      continue
    history = [(s.state, s.action) for s in record.steps[:t]]
    builder, shown = fit_turn_prompt(tokenizer, fmt, record.instruction, t, history, step.state, step.admissible,
                                     rollout.prompt_buckets[-1])
    if builder is None:
      stats["skipped_prompt_too_long"] += 1
      continue
    ids, mask, prompt_len = answer_row(builder, answer)
    if len(ids) - prompt_len > rollout.max_action_tokens:  # the sampler could never finish this answer
      stats["skipped_answer_too_long"] += 1
      continue
    stats["history_trimmed"] += shown < min(len(history), fmt.history_turns)  # the bucket cut pairs it would show
    rows.append(TurnRow(ids, mask, prompt_len, record.episode_id, t))
  return rows


def _with_prompt_loss(row: TurnRow) -> TurnRow:
  mask = np.ones_like(row.loss_mask)
  mask[0] = 0  # nothing predicts the first token
  return dataclasses.replace(row, loss_mask=mask)


def _with_allowed(row: TurnRow, admissible: Sequence[str], answers: dict[str, tuple[int, ...]], tokenizer: Tokenizer,
                  width: int) -> TurnRow | None:
  """`row` with the allowed sets of its answer tokens (`TurnRow.allowed`); None when its answer is not one of the
  admissible actions (restricted decoding could never write it)."""
  for a in admissible:
    if a not in answers:
      answers[a] = answer_ids(tokenizer, a)
  sets = allowed_tokens(pack_choices({0: [answers[a] for a in admissible]}, 1, width)[0], row.answer_ids)
  if not all(token in s for token, s in zip(row.answer_ids, sets)):
    return None
  out = np.full((len(sets), max(len(s) for s in sets)), -1, np.int32)
  for j, s in enumerate(sets):
    out[j, :len(s)] = s
  return dataclasses.replace(row, allowed=out)


def sft_rows(records: Iterable[TrajectoryRecord], tokenizer: Tokenizer, fmt: AgentFormat, cfg: RowConfig,
             rollout: RolloutConfig) -> tuple[list[TurnRow], dict[str, int]]:
  """Behaviour-cloning rows of the demonstration turns in `records` (see `RowConfig`), and counts of what was kept
  and why the rest was not."""
  if tokenizer.chat_format is None:
    raise ValueError("sft_rows: the tokenizer has no chat template, so turns cannot be built")
  if cfg.restricted_loss and not rollout.constrain_actions:
    raise ValueError("RowConfig.restricted_loss scores answers among the admissible actions' tokens, so it needs "
                     "RolloutConfig.constrain_actions")
  stats: collections.Counter = collections.Counter()
  rows: list[TurnRow] = []
  answers: dict[str, tuple[int, ...]] = {}  # admissible action -> its answer ids (restricted_loss)
  for record in records:
    stats["episodes"] += 1
    if not _matches(record.policy, cfg.experts):
      stats["episodes_other_policy"] += 1
      continue
    if cfg.successful_only and not record.success:
      stats["episodes_failed"] += 1
      continue
    stats["episodes_used"] += 1
    turns = []
    for t, step in enumerate(record.steps):
      if step.source not in cfg.step_sources:
        stats["skipped_source"] += 1
      elif cfg.skip_invalid and step.invalid:
        stats["skipped_invalid"] += 1
      else:
        turns.append(t)
    for row in episode_rows(record, tokenizer, fmt, rollout, cfg.think, turns, stats):
      if cfg.restricted_loss:
        row = _with_allowed(row, record.steps[row.turn].admissible, answers, tokenizer, rollout.max_action_tokens)
        if row is None:
          stats["skipped_not_admissible"] += 1
          continue
      rows.append(_with_prompt_loss(row) if cfg.prompt_loss else row)
  stats["rows"] = len(rows)
  stats["answer_tokens"] = sum(len(r.ids) - r.prompt_len for r in rows)
  return rows, dict(sorted(stats.items()))


def _hash(seed: int, text: str) -> bytes:
  return hashlib.blake2b(f"{seed}\0{text}".encode(), digest_size=8).digest()


def preference_episodes(records: Iterable[TrajectoryRecord],
                        cfg: PairConfig) -> list[tuple[TrajectoryRecord, TrajectoryRecord]]:
  """(chosen, rejected) episode pairs, task by task in order of task id (see the module docstring)."""
  chosen: dict[str, list[TrajectoryRecord]] = collections.defaultdict(list)
  rejected: dict[str, list[TrajectoryRecord]] = collections.defaultdict(list)
  for r in records:
    if r.success and _matches(r.policy, cfg.chosen_policies):
      chosen[r.task.task_id].append(r)
    elif not r.success and _matches(r.policy, cfg.rejected_policies):
      rejected[r.task.task_id].append(r)
  out = []
  for task_id in sorted(chosen.keys() & rejected.keys()):
    good = sorted(chosen[task_id], key=lambda r: (r.num_steps, r.episode_id))
    bad = sorted(rejected[task_id], key=lambda r: _hash(cfg.seed, r.episode_id))
    n = min(cfg.max_pairs_per_task, max(len(good), len(bad)))
    out += [(good[i % len(good)], bad[i % len(bad)]) for i in range(n)]
  return out


def _drop_common_prefix(a: list[TurnRow], b: list[TurnRow]) -> tuple[list[TurnRow], list[TurnRow], int]:
  k = 0
  while k < min(len(a), len(b)) and np.array_equal(a[k].ids, b[k].ids):
    k += 1
  k = min(k, len(a) - 1, len(b) - 1)  # keep one row per side: an identical row still cancels in the margin
  k = max(k, 0)
  return a[k:], b[k:], k


def preference_pairs(records: Iterable[TrajectoryRecord], tokenizer: Tokenizer, fmt: AgentFormat, cfg: PairConfig,
                     rollout: RolloutConfig, think: str = "auto") -> tuple[list[PreferencePair], dict[str, int]]:
  """DPO pairs as per-turn rows, and counts of what was kept."""
  if tokenizer.chat_format is None:
    raise ValueError("preference_pairs: the tokenizer has no chat template, so turns cannot be built")
  stats: collections.Counter = collections.Counter()
  cache: dict[str, list[TurnRow]] = {}  # an episode may sit in several pairs; build its rows once

  def rows_of(record: TrajectoryRecord) -> list[TurnRow]:
    if record.episode_id not in cache:
      n = record.num_steps if cfg.max_turns == 0 else min(record.num_steps, cfg.max_turns)
      stats["turns_cut"] += record.num_steps - n
      cache[record.episode_id] = episode_rows(record, tokenizer, fmt, rollout, think, range(n), stats)
    return cache[record.episode_id]

  pairs = []
  for good, bad in preference_episodes(records, cfg):
    stats["pairs_considered"] += 1
    chosen, rejected = rows_of(good), rows_of(bad)
    if not chosen or not rejected:
      stats["pairs_without_rows"] += 1
      continue
    if cfg.drop_common_prefix:
      chosen, rejected, k = _drop_common_prefix(chosen, rejected)
      stats["common_rows_dropped"] += k
    pairs.append(PreferencePair(good.task.task_id, good.episode_id, bad.episode_id, tuple(chosen), tuple(rejected)))
  stats["pairs"] = len(pairs)
  stats["tasks"] = len({p.task_id for p in pairs})
  stats["rows"] = sum(len(p.chosen) + len(p.rejected) for p in pairs)
  return pairs, dict(sorted(stats.items()))


def policy_texts(records: Iterable[TrajectoryRecord], fmt: AgentFormat, think: str = "auto") -> list[str]:
  """Text a tiny run's BPE is trained on: the system prompt, every turn's user message and answer, the markers."""
  texts = [fmt.system_text(), INVALID_ANSWER]
  for record in records:
    for t, step in enumerate(record.steps):
      history = [(s.state, s.action) for s in record.steps[max(0, t - fmt.history_turns):t]]
      texts.append(user_text(fmt, record.instruction, t, history, step.state, step.admissible))
      answer = answer_text(step, think_text(think, fmt, step.action))
      if answer is not None:
        texts.append(answer)
  return texts
