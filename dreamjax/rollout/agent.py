"""The agent's side of the conversation: the per-turn prompt and the `<think>...</think><action>...</action>` answer.

Every turn the policy gets a fresh two-message prompt (docs/paper_map.md, "Agent prompt"), not a growing chat: a system message
(role and answer format), then one user message with the task, the number of steps taken, the recent history, the
current state and the admissible actions. A fresh prompt keeps its length bounded however long the episode runs, and
matches what verl-agent (whose defaults the paper follows) shows its agents. The user message is one segment of kind
OBSERVATION: it changes every turn, and no loss ever selects it.

Prompt rendering, in order:
- history: the last `history_turns` (state, action) pairs, each on one line with the state's lines joined by "; ";
  then the oldest pairs are dropped until the history block, tokenised alone, fits `history_token_budget` tokens.
  Steps are numbered from 1, so the model sees which steps were dropped. With `history_fields` set, a history state
  keeps only its "Field: value" lines of those fields (TWX's "Location", say): a step then costs about ten tokens
  instead of about ninety, so a small prompt holds the whole episode (which rooms the agent has been in) instead of
  its last two steps. The current state is always shown whole.
- admissible actions: all of them when there are at most `max_admissible`, else a deterministic pseudo-random subset
  (ranked by a hash of step, state and action, shown in the env's order). A hash rather than the first k keeps the
  subset from always missing the same actions (TWX sorts its actions alphabetically) while a rerun sees the same
  prompt. `max_admissible = 0` hides the list.
- `repeat_task` shows the task line a second time just before the admissible actions, so that matching the task's
  object against the actions is a short-range lookup. On ALFWorld it did not help a tiny policy choose `take` where
  the expert took the task's object (experiments/RESULTS.md, thirty-third stop on issue 18); it stays as a layout to
  compare against.

Answers are parsed by `parse_answer`, which is total: malformed output is an outcome (an error string), never an
exception. The first complete `<action>...</action>` block is the answer, as in verl-agent's projection; text after
it is ignored (the sampler stops at end-of-turn, so that is only reached by answers that kept going), and a think
block is optional (a policy fine-tuned on bare actions answers without one). Structure that makes the action
ambiguous is an error: no `<action>`, a stray `</action>` before it, an unclosed block, an empty action, an action
inside an unclosed `<think>`, or think/action tags nested inside the action.
`format_answer` writes the exact answer text, so SFT targets built from expert actions parse back to the same action.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

from dreamjax.envs.base import state_line
from dreamjax.text import Kind, SegmentBuilder, Tokenizer

ACTION_OPEN, ACTION_CLOSE = "<action>", "</action>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TAGS = (ACTION_OPEN, ACTION_CLOSE, THINK_OPEN, THINK_CLOSE)

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent acting in a text environment. Each turn you are given your task, how many steps you have "
    "taken, your recent history, the current state and the actions you can take. Choose the next action."
)
# What the history shows for a turn whose answer did not parse: the agent should see that the turn was wasted.
INVALID_ANSWER = "(no valid action)"


@dataclasses.dataclass(frozen=True)
class AgentFormat:
  """How the policy's prompt is laid out and what answer it is asked for. Frozen and hashable."""

  system_prompt: str = DEFAULT_SYSTEM_PROMPT  # the role; the answer-format sentence is appended according to `think`
  history_turns: int = 4  # at most this many recent (state, action) pairs
  history_token_budget: int = 512  # the rendered history block is cut, oldest first, to fit this many tokens
  max_admissible: int = 50  # admissible actions shown at most (0: none)
  think: bool = True  # ask for a <think> block before the action
  history_fields: tuple[str, ...] = ()  # history states keep only these "Field: value" lines (empty: whole states)
  repeat_task: bool = False  # the task line again just before the admissible actions (see the module docstring)

  def __post_init__(self):
    for name in ("history_turns", "history_token_budget", "max_admissible"):
      if getattr(self, name) < 0:
        raise ValueError(f"AgentFormat.{name} must be >= 0, got {getattr(self, name)}")
    if isinstance(self.history_fields, str) or not all(isinstance(f, str) and f.strip() for f in self.history_fields):
      raise ValueError(f"AgentFormat.history_fields must be a tuple of field names, got {self.history_fields!r}")

  def system_text(self) -> str:
    if self.think:
      answer = ("Answer as <think>your brief reasoning</think><action>your next action</action>, with exactly one "
                "action, written as one of the admissible actions when they are listed.")
    else:
      answer = ("Answer as <action>your next action</action>, with exactly one action, written as one of the "
                "admissible actions when they are listed.")
    return f"{self.system_prompt.strip()}\n{answer}"


@dataclasses.dataclass(frozen=True)
class ParsedAnswer:
  action: str | None  # the action text, stripped; None when the answer did not parse
  think: str  # the think block's content, stripped ("" when absent)
  error: str  # why the answer did not parse; "" exactly when `action` is not None


def _compact(text: str, fields: tuple[str, ...]) -> str:
  lines = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
  if fields:
    lines = [line for line in lines if (field := state_line(line)) and field[0] in fields]
  return "; ".join(lines)


def render_history(fmt: AgentFormat, history: Sequence[tuple[str, str]], step: int) -> str:
  """The history block: one line per (state, action) pair, numbered so the last pair is step `step`."""
  first = step - len(history) + 1
  return "\n".join(f"Step {first + i} state: {_compact(s, fmt.history_fields)} | action: {a}"
                   for i, (s, a) in enumerate(history))


def fit_history(tokenizer: Tokenizer, fmt: AgentFormat, history: Sequence[tuple[str, str]],
                step: int) -> tuple[tuple[str, str], ...]:
  """The most recent pairs of `history` that `fmt` keeps: at most `history_turns`, within `history_token_budget`."""
  kept = tuple(history[max(0, len(history) - fmt.history_turns):]) if fmt.history_turns else ()
  # Usually one encode: the budget is set so the recent turns fit, and dropping is the exception.
  while kept and len(tokenizer.encode(render_history(fmt, kept, step))) > fmt.history_token_budget:
    kept = kept[1:]
  return kept


def choose_admissible(fmt: AgentFormat, step: int, state: str, admissible: Sequence[str]) -> tuple[str, ...]:
  """The admissible actions shown: all when few enough, else a hashed subset of `max_admissible` in the env's order."""
  if len(admissible) <= fmt.max_admissible:
    return tuple(admissible)
  prefix = f"{step}\0{state}\0".encode()
  rank = sorted(range(len(admissible)),
                key=lambda i: hashlib.blake2b(prefix + admissible[i].encode(), digest_size=8).digest())
  return tuple(admissible[i] for i in sorted(rank[:fmt.max_admissible]))


@functools.lru_cache(maxsize=64)
def _system_segment(tokenizer: Tokenizer, fmt: AgentFormat) -> SegmentBuilder:
  # The same for every turn of every episode; tokenised once per (tokenizer, format).
  return SegmentBuilder(tokenizer).append(Kind.SYSTEM, fmt.system_text())


def user_text(fmt: AgentFormat, instruction: str, step: int, history: Sequence[tuple[str, str]], state: str,
              admissible: Sequence[str]) -> str:
  """The user message for already-fitted `history` (see `fit_history`)."""
  lines = [f"Task: {' '.join(instruction.split())}", f"Steps taken: {step}"]
  if history:
    lines += ["History (oldest first):", render_history(fmt, history, step)]
  else:
    lines.append("History: none")
  lines += ["Current state:", state.strip()]
  if fmt.repeat_task:
    lines.append(lines[0])
  shown = choose_admissible(fmt, step, state, admissible) if fmt.max_admissible else ()
  if shown:
    count = f" ({len(shown)} of {len(admissible)} shown)" if len(shown) < len(admissible) else ""
    lines.append(f"Admissible actions{count}: {' | '.join(shown)}")
  return "\n".join(lines)


def build_turn_prompt(tokenizer: Tokenizer, fmt: AgentFormat, instruction: str, step: int,
                      history: Sequence[tuple[str, str]], state: str, admissible: Sequence[str]) -> SegmentBuilder:
  """System and user segments of one turn; `.prompt()` adds the generation prompt.

  `step` is the number of turns taken so far and `history` the (state, action) pairs of the most recent of them,
  most recent last (so at most `step` pairs); `fmt` decides how many are shown.
  """
  if step < 0 or len(history) > step:
    raise ValueError(f"build_turn_prompt: step={step} with {len(history)} history pairs; the history holds the "
                     f"pairs of steps already taken, so it has at most `step` of them")
  kept = fit_history(tokenizer, fmt, history, step)
  return _system_segment(tokenizer, fmt).append(Kind.OBSERVATION,
                                                user_text(fmt, instruction, step, kept, state, admissible))


def fit_turn_prompt(tokenizer: Tokenizer, fmt: AgentFormat, instruction: str, step: int,
                    history: Sequence[tuple[str, str]], state: str, admissible: Sequence[str],
                    max_prompt_len: int) -> tuple[SegmentBuilder | None, int]:
  """(`build_turn_prompt`, pairs of `history` kept) with the oldest history dropped until `.prompt()` fits
  `max_prompt_len`, as the rollout engine does; (None, 0) when even no history fits."""
  history = list(history)
  frame = len(tokenizer.chat_format.generation_prompt)
  while True:
    builder = build_turn_prompt(tokenizer, fmt, instruction, step, history, state, admissible)
    if len(builder) + frame <= max_prompt_len:
      return builder, len(history)
    if not history:
      return None, 0
    history.pop(0)


def parse_answer(text: str) -> ParsedAnswer:
  """The action of a policy answer; never raises. See the module docstring for the rules."""
  if not isinstance(text, str):
    return ParsedAnswer(None, "", f"answer is a {type(text).__name__}, not text")
  start = text.find(ACTION_OPEN)
  if start < 0:
    if ACTION_CLOSE in text:
      return ParsedAnswer(None, "", f"'{ACTION_CLOSE}' without '{ACTION_OPEN}'")
    return ParsedAnswer(None, "", "empty answer" if not text.strip() else f"no '{ACTION_OPEN}' tag")
  before = text[:start]
  think, error = _think(before)
  if error:
    return ParsedAnswer(None, think, error)
  if ACTION_CLOSE in before:
    return ParsedAnswer(None, think, f"'{ACTION_CLOSE}' before the first '{ACTION_OPEN}'")
  end = text.find(ACTION_CLOSE, start + len(ACTION_OPEN))
  if end < 0:
    return ParsedAnswer(None, think, f"unclosed '{ACTION_OPEN}' (no '{ACTION_CLOSE}' after it)")
  content = text[start + len(ACTION_OPEN):end]
  nested = [t for t in _TAGS if t in content]
  if nested:
    return ParsedAnswer(None, think, f"'{nested[0]}' nested inside the action")
  action = content.strip()
  if not action:
    return ParsedAnswer(None, think, "empty action")
  return ParsedAnswer(action, think, "")


def _think(before: str) -> tuple[str, str]:
  """(think content, error) of the text before the action: the first think block; an unclosed one is an error."""
  opened = before.rfind(THINK_OPEN)
  if opened >= 0 and before.find(THINK_CLOSE, opened) < 0:
    return "", f"'{ACTION_OPEN}' inside an unclosed '{THINK_OPEN}'"
  first = before.find(THINK_OPEN)
  if first < 0:
    return "", ""
  end = before.find(THINK_CLOSE, first)
  body = before[first + len(THINK_OPEN):end]
  if THINK_OPEN in body:
    return "", f"nested '{THINK_OPEN}' tags"
  return body.strip(), ""


def format_answer(action: str, think: str = "") -> str:
  """The answer text for `action` (and an optional reasoning), exactly as the policy is trained to write it.

  Raises ValueError for an action or think text that could not round-trip through `parse_answer`.
  """
  if not action.strip():
    raise ValueError("format_answer: empty action")
  bad = [t for t in _TAGS if t in action or t in think]
  if bad:
    raise ValueError(f"format_answer: the action or think text contains the tag {bad[0]!r}")
  body = f"{ACTION_OPEN}{action.strip()}{ACTION_CLOSE}"
  return f"{THINK_OPEN}{think.strip()}{THINK_CLOSE}{body}" if think.strip() else body
