"""The experience model's text interface: the prompt it reads, the target it is trained to write, and the parser.

M_exp sees [task instruction, optional tutorial, k retrieved past transitions, recent history, the current state's
admissible actions, current state and action] and writes (docs/paper_map.md, "Experience model") a reasoning trace
first, then the next state, its admissible actions and the outcome:

  <think>
  why the action leads where it does
  </think>
  <next_state>
  the whole next abstract state, in the env's own format
  </next_state>
  <actions>
  the actions admissible in that state, one per line, in the env's order
  </actions>
  <invalid>false</invalid>
  <reward>0</reward>
  <done>false</done>
  <success>false</success>

The invalid flag says whether the env would reject the action (not understood, not admissible). Real envs report it
(`StepResult.invalid`) and the RL loop penalises it (verl-agent's invalid-action penalty), so M_exp must predict it
for SyntheticEnv to report it: inferring it from the feedback text would tie the loop to each env's wording.

The actions block (switch `ExpFormatConfig.actions`, on by default) lists what the env would admit in the predicted
state, so that SyntheticEnv's observations carry an admissible list every turn, as the real envs' do: the policy then
reads the same prompt layout in DreamGym as in real-env RL and evaluation. It is trained from the recorded lists: step
t's record holds the list of its own state, so the target of transition t takes step t+1's list (`action_lists`); a
step that ends the episode has an empty block (the policy never acts in a final state), and the last step of an
episode cut without ending (a collection cap) has no known list and makes no target. The prompt shows the current
state's list (the recorded one, or the one M_exp predicted on the step before), since no abstract state renders
everything its list is made of (TextWorld-Express lists distractor objects' actions, for one). Which envs use it and
why: see dreamjax/experience/synthetic_env.py.

State changes (switch `ExpFormatConfig.state_changes`, off by default): in a text env whose states are
"Field: value" lines (TextWorld-Express, ALFWorld), an action changes one or two fields and the rest of the state is
copied. A small model's exact match is lost on that copy (a long "You see" list rewritten with one token wrong), so
with the switch on the next_state block holds only the changes:

  <next_state>
  Inventory: flour
  Feedback: You take the flour.
  </next_state>

Each line either sets a field ("Field: value": replaced in place, or appended after the last line when the current
state lacks it) or removes one ("-Field"); "(no change)" alone says the state is unchanged. `state_change_text` writes
them (removals first, then the set lines in the next state's order) and `apply_state_changes` reads them back; the
parser applies them to the current state, so `ExpPrediction.next_state` is always the whole state and everything
downstream (SyntheticEnv, fidelity metrics) is unchanged. A target whose changes do not rebuild the next state exactly
(duplicate fields, a line that is not "Field: value", fields reordered) is an error naming the transition: that env
needs the whole-state format.

List edits (switch `ExpFormatConfig.list_edits`, with state changes): a changed field whose value is a comma list
("You see", "Inventory") still repeats the list's unchanged items, and a small model copies them as badly. With the
switch on, such a field is written as item edits where they rebuild it exactly and name no more items than its
line does (counted, not measured in characters, so that one action always gets the same edit):

  <next_state>
  You see ~= shelf (flour)
  Inventory -= flour
  Feedback: You put the flour in the shelf.
  </next_state>

"Field -= item" removes the item, "Field += item" appends one, "Field ~= item" replaces the one item of the same name
(the text before " (", so "shelf (empty)" becomes "shelf (flour)"). Commas inside parentheses do not split items.
The parser reads edits with or without the switch; the switch only decides what the target writes.

Action edits (switch `ExpFormatConfig.action_edits`, with the actions block): a step changes a few admissible
actions, and a small model rewriting the whole list copies the unchanged ones as badly as it copied states (the
actions block matched exactly on 0.17 of twc's held-out transitions, experiments/RESULTS.md, eleventh stop). In
SyntheticEnv the error compounds: the next prompt shows the wrong list, and M_exp copies its wrong item. With the
switch on the block says how the current list (the one the prompt shows) changes:

  <actions>
  - take flour
  + put flour in shelf
  </actions>

"- action" removes an action the current list holds, "+ action" adds one it lacks, before the first listed action
that sorts after it (so a sorted list, as TextWorld-Express lists, stays sorted); "(no change)" alone keeps the list.
The target writes edits only where they rebuild the next list exactly, order included, and are shorter than it;
otherwise the whole list, as without the switch (so a final state's empty block, and an env whose lists are in no
sorted order, are written whole). `parse_output` applies them given the current list (`admissible`), and only with
the switch on, since a whole list may hold an action that starts with "- ".

Instructions (switch `ExpFormatConfig.instructions`, on by default): the system message explains the job and the
answer format, which a pretrained LLM needs to be told. A model trained from scratch learns the format from its
targets alone and gains nothing from reading the same ~520 tokens at the head of every example, which on twc are half
of each example's length and so half of each training step's work (experiments/RESULTS.md, thirteenth stop). With the
switch off the system message is its first sentence only.

Without reasoning (the ablation switch `ExpFormatConfig.reasoning=False`) the think block is absent. The target is
appended to the prompt as the assistant turn with `Kind.ACTION`, so the SFT loss mask covers exactly the target
tokens and its end-of-turn token: both terms of Eq. 5 (reasoning, then next state and reward) under one mask.

Parsing is total: `parse_output` never raises. Anything it cannot read exactly (a missing, duplicated, nested or
unterminated tag, text outside the blocks, a reward other than 0/1, a flag other than true/false, an empty state, an
empty line among the actions) becomes the failure outcome `ExpPrediction(ok=False, done=True, success=False,
reward=0.0, invalid=False, next_state=FAILURE_STATE, admissible=(), error=...)`, which metrics count. SyntheticEnv
resamples such an answer and ends the episode as an env failure only when every attempt fails (its docstring says
why). The failure outcome's `invalid` is False: a malformed prediction is the simulator's failure, not evidence that
the agent's action was invalid.

Rewards are binary and outcome-based (1 only on the step that ends a successful episode), so the outcome is a function
of (done, success) and the three stated values must agree: reward 1 with done and success, reward 0 otherwise, and
success only with done; an invalid action changes nothing, so it cannot complete the task (invalid excludes
success); a finished episode lists no actions. A prediction that disagrees with itself (reward 1 but done false,
success without reward, actions after the end, ...) is treated as malformed, never repaired: a model confused about
the outcome must not be able to grant itself a reward it did not consistently claim. `render_target` refuses such
combinations for the same reason.

Prompts are deterministic text: the same inputs give the same tokens, and a section whose switch is off (retrieval,
history, tutorial, actions) is left out entirely rather than shown empty, so ablations differ only by those sections.
An empty admissible list is left out too (an env that lists none).
States shown in the prompt are clipped to `max_state_chars`; targets are never clipped (the model must learn to
write whole states).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
from jaxtyping import Int

from dreamjax.data.records import TrajectoryRecord, Transition
from dreamjax.envs.base import outcome_problem
from dreamjax.text import Kind, SegmentBuilder, Tokenizer, policy_mask

TAGS = ("think", "next_state", "actions", "invalid", "reward", "done", "success")
FAILURE_STATE = "The simulation failed: the experience model's prediction could not be read. The episode is over."
_MARKERS = tuple(m for tag in TAGS for m in (f"<{tag}>", f"</{tag}>"))
JOB = "You simulate an interactive environment for an agent."


@dataclasses.dataclass(frozen=True)
class ExpFormatConfig:
  reasoning: bool = True  # think block before the prediction (paper ablation: "without reasoning")
  history: bool = True  # recent (state, action) pairs of this episode (quality study: "without history")
  retrieval: bool = True  # top-k retrieved transitions from the replay buffer (ablation: "without replay")
  tutorial: bool = False  # the annotator's task tutorial (overall plan, success and failure modes) in the prompt
  # the admissible actions: the current state's in the prompt, the next state's as a target block (module docstring)
  actions: bool = True
  # the next state written as its changed lines only ("Field: value" set, "-Field" removed), applied to the current
  # state by the parser (module docstring, "State changes"); for envs whose states are unique "Field: value" lines
  state_changes: bool = False
  # with state_changes: a changed comma-list field written as item edits ("Field -= item", "Field += item",
  # "Field ~= item") where they rebuild it and name no more items than it (module docstring, "List edits")
  list_edits: bool = False
  # with actions: the next state's admissible actions written as edits of the current list ("- action", "+ action",
  # "(no change)") where they rebuild it and are shorter (module docstring, "Action edits")
  action_edits: bool = False
  # the system message explains the job and the answer format; off, it only names the job (module docstring,
  # "Instructions")
  instructions: bool = True
  max_history: int = 4  # most recent (state, action) pairs shown
  k: int = 3  # retrieved transitions shown (the first k given)
  max_state_chars: int = 2000  # each state shown in the prompt (current, history, retrieved) is clipped to this
  max_action_chars: int = 300
  max_tutorial_chars: int = 2000

  def __post_init__(self):
    for name in ("max_history", "k"):
      if getattr(self, name) < 0:
        raise ValueError(f"ExpFormatConfig.{name} must be >= 0, got {getattr(self, name)}")
    if self.list_edits and not self.state_changes:
      raise ValueError("ExpFormatConfig.list_edits writes edits of the state changes: it needs state_changes=True")
    if self.action_edits and not self.actions:
      raise ValueError("ExpFormatConfig.action_edits writes edits of the actions block: it needs actions=True")
    for name in ("max_state_chars", "max_action_chars", "max_tutorial_chars"):
      if getattr(self, name) < 16:
        raise ValueError(f"ExpFormatConfig.{name} must be >= 16, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ExpPrediction:
  next_state: str
  reward: float
  done: bool
  success: bool
  reasoning: str  # "" when absent or unreadable
  ok: bool  # False: the output was malformed and the fields hold the failure outcome
  error: str  # what was wrong ("" when ok)
  invalid: bool = False  # the predicted env's verdict on the action; False in the failure outcome (module docstring)
  admissible: tuple[str, ...] = ()  # the actions admissible in next_state, in order; () without the actions block

  @classmethod
  def failure(cls, error: str, reasoning: str = "") -> ExpPrediction:
    return cls(FAILURE_STATE, 0.0, True, False, reasoning, False, error, False, ())


def expected_tags(cfg: ExpFormatConfig) -> tuple[str, ...]:
  """The blocks of `cfg`'s target, in order."""
  return tuple(t for t in TAGS if (t != "think" or cfg.reasoning) and (t != "actions" or cfg.actions))


class SFTExample(NamedTuple):
  ids: Int[np.ndarray, " T"]  # prompt then target, int32
  kinds: Int[np.ndarray, " T"]  # dreamjax.text.Kind codes
  loss_mask: Int[np.ndarray, " T"]  # 1 on the target tokens and the end-of-turn token closing them


# --- the prompt ------------------------------------------------------------------------------------------------------


def system_prompt(cfg: ExpFormatConfig) -> str:
  if not cfg.instructions:
    return JOB
  think = ("<think>\nhow the action changes the state: whether it is valid here, what it affects, and whether the task "
           "is now complete or failed\n</think>\n") if cfg.reasoning else ""
  first = "First reason step by step, then predict" if cfg.reasoning else "Predict"
  listed = ", the actions admissible in it" if cfg.actions else ""
  # Without the switch the text is what earlier M_exp checkpoints were trained on.
  listing = (": (no change) when they are the current ones, or one line per change, \"- action\" for an action "
             "removed and \"+ action\" for one added, or the whole list, one per line, in the environment's order"
             ) if cfg.action_edits else ", one per line, in the environment's order"
  actions = (f"<actions>\nthe actions admissible in the next state{listing} (none when the episode ends)"
             "\n</actions>\n") if cfg.actions else ""
  edits = (", or \"Field -= item\", \"Field += item\" or \"Field ~= item\" for one item of a comma list removed, "
           "appended, or put in place of the item of the same name") if cfg.list_edits else ""
  state = ("the next state's lines that differ from the current state's, one per line: \"Field: value\" for a field "
           f"set or added, \"-Field\" for a field removed{edits}, or (no change)") if cfg.state_changes \
      else "the whole next state"
  return (
      f"{JOB} You are given the agent's task, examples of similar "
      f"past transitions, the recent history of the episode, the current state{listed} and the agent's action. "
      f"{first} the environment's response: the next state, written in exactly the same format as the states you "
      f"are shown{listed}, whether the environment rejects the action as invalid, and the outcome.\n"
      "Answer in exactly this format:\n"
      f"{think}<next_state>\n{state}\n</next_state>\n{actions}<invalid>true or false</invalid>\n"
      "<reward>0 or 1</reward>\n"
      "<done>true or false</done>\n<success>true or false</success>\n"
      "The reward is 1 only when the action completes the task, and then done and success are true. An invalid or "
      "useless action changes nothing but the feedback. When the episode ends without completing the task, done is "
      "true, success false and the reward 0."
  )


def clip(text: str, n: int) -> str:
  """`text` cut to at most n characters, marked with "..." where cut."""
  return text if len(text) <= n else text[: n - 3] + "..."


def _flag(value: bool) -> str:
  return "true" if value else "false"


def _reward_text(reward: float) -> str:
  if reward not in (0.0, 1.0):
    raise ValueError(f"reward {reward!r} is not binary: this project's rewards are 0 or 1")
  return "1" if reward == 1.0 else "0"


def render_example(cfg: ExpFormatConfig, t: Transition) -> str:
  """One retrieved transition, compactly: (state, action -> next state, reward, done, success)."""
  return (f"State:\n{clip(t.state, cfg.max_state_chars)}\nAction: {clip(t.action, cfg.max_action_chars)}\n"
          f"Next state:\n{clip(t.next_state, cfg.max_state_chars)}\n"
          f"Invalid: {_flag(t.invalid)}, reward: {float(t.reward):g}, done: {_flag(t.done)}, "
          f"success: {_flag(t.success)}")


def render_user(cfg: ExpFormatConfig, instruction: str, history: Sequence[tuple[str, str]],
                retrieved: Sequence[Transition], state: str, action: str, tutorial: str = "",
                step: int | None = None, admissible: Sequence[str] = ()) -> str:
  """The user message. `history` is the episode's (state, action) pairs before this step, oldest first (pass them
  all: the last `max_history` are shown); `step` is the current step's index, by default len(history); `admissible`
  the actions admissible in `state` (shown before it, clipped like a state, when the format's actions switch is
  on)."""
  step = len(history) if step is None else step
  parts = [f"# Task\n{instruction.strip() or '(no instruction)'}"]
  if cfg.tutorial and tutorial.strip():
    parts.append(f"# Tutorial\n{clip(tutorial.strip(), cfg.max_tutorial_chars)}")
  if cfg.retrieval and cfg.k and retrieved:
    shown = list(retrieved)[: cfg.k]
    parts.append("# Similar past transitions\n" + "\n\n".join(
        f"## Example {i + 1}\n{render_example(cfg, t)}" for i, t in enumerate(shown)))
  if cfg.history and cfg.max_history and history:
    kept = list(history)[-cfg.max_history :]
    first = step - len(kept)
    omitted = f" ({first} earlier steps not shown)" if first > 0 else ""
    parts.append(f"# History, oldest first{omitted}\n" + "\n\n".join(
        f"## Step {first + i + 1}\nState:\n{clip(s, cfg.max_state_chars)}\nAction: {clip(a, cfg.max_action_chars)}"
        for i, (s, a) in enumerate(kept)))
  if cfg.actions and admissible:
    # Before the state rather than after it: the state, the action and the target's next state then sit as close as
    # without the list, which a small model's copying depends on (configs/train_exp_twx.py:tiny).
    parts.append(f"# Admissible actions in the current state\n{clip(chr(10).join(admissible), cfg.max_state_chars)}")
  parts.append(f"# Current state (step {step + 1})\n{clip(state, cfg.max_state_chars)}")
  parts.append(f"# Action\n{clip(action, cfg.max_action_chars)}")
  return "\n\n".join(parts)


def build_prompt(tokenizer: Tokenizer, cfg: ExpFormatConfig, instruction: str, history: Sequence[tuple[str, str]],
                 retrieved: Sequence[Transition], state: str, action: str, tutorial: str = "",
                 step: int | None = None, admissible: Sequence[str] = ()) -> SegmentBuilder:
  """The prompt as token segments: a system message (the job and the output format), then one user message.

  `builder.prompt()` gives the ids to sample from; `builder.append(Kind.ACTION, target)` the SFT example.
  """
  user = render_user(cfg, instruction, history, retrieved, state, action, tutorial, step, admissible)
  return SegmentBuilder(tokenizer).append(Kind.SYSTEM, system_prompt(cfg)).append(Kind.TASK, user)


# --- state changes ---------------------------------------------------------------------------------------------------

NO_CHANGE = "(no change)"


def _field(line: str) -> str | None:
  """The field name of a "Field: value" line, else None."""
  key, sep, _ = line.partition(": ")
  return key if sep and key and not key.startswith("-") else None


_EDIT = re.compile(r"([^:\n]+?) ([-+~])= (.+)")  # "Field op= item"; a "Field: value" line has a colon before any op


def list_items(value: str) -> list[str]:
  """A comma-list value's items, split at ", " outside parentheses ("table (cup, fork), chair": two items)."""
  items, depth, start = [], 0, 0
  for i, ch in enumerate(value):
    depth += (ch == "(") - (ch == ")")
    if depth == 0 and value.startswith(", ", i):
      items.append(value[start:i])
      start = i + 2
  return items + [value[start:]] if value else items


def _item_name(item: str) -> str:
  return item.split(" (", 1)[0]


def _edit_items(items: list[str], op: str, item: str) -> str:
  """Applies one item edit to `items` in place; "" or what is wrong."""
  if op == "+":
    items.append(item)
  elif op == "-":
    if item not in items:
      return f"removes the item {clip(item, 40)!r}, which the field does not hold"
    items.remove(item)
  else:
    same = [j for j, x in enumerate(items) if _item_name(x) == _item_name(item)]
    if len(same) != 1:
      return f"replaces the item named {clip(_item_name(item), 40)!r}, which the field holds {len(same)} times"
    items[same[0]] = item
  return ""


def apply_state_changes(state: str, changes: str) -> tuple[str, str]:
  """(the state after `changes`, "") or ("", what is wrong). Never raises (the parser's contract)."""
  if changes.strip() == NO_CHANGE:
    return state, ""
  lines = state.splitlines()
  for change in changes.split("\n"):
    edit = _EDIT.fullmatch(change)
    if edit:
      name, op, item = edit.groups()
      at = [i for i, line in enumerate(lines) if _field(line) == name]
      if len(at) != 1:
        return "", f"the change {clip(change, 60)!r} edits a field the current state does not hold once"
      items = list_items(lines[at[0]].partition(": ")[2])
      problem = _edit_items(items, op, item)
      if problem:
        return "", f"the change {clip(change, 60)!r} {problem}"
      lines[at[0]] = f"{name}: {', '.join(items)}"
      continue
    if change.startswith("-"):
      names = [i for i, line in enumerate(lines) if _field(line) == change[1:]]
      if len(names) != 1:
        return "", f"the change {clip(change, 60)!r} removes a field the current state does not hold once"
      del lines[names[0]]
      continue
    name = _field(change)
    if name is None:
      return "", f"the change {clip(change, 60)!r} is neither \"Field: value\" nor \"-Field\""
    at = [i for i, line in enumerate(lines) if _field(line) == name]
    if len(at) > 1:
      return "", f"the change {clip(change, 60)!r} sets a field the current state holds {len(at)} times"
    if at:
      lines[at[0]] = change
    else:
      lines.append(change)
  return ("\n".join(lines), "") if lines else ("", "the changes remove every line of the state")


def _list_edits(old_line: str, new_line: str) -> list[str]:
  """A changed field's line as item edits where they rebuild it and name no more items than it, else the line.

  Counting items rather than characters keeps one action's edit the same whatever else the list holds: putting one of
  two items down is "Inventory -= <that item>", not "Inventory: <the other item>" when that happens to be shorter."""
  name = _field(new_line)
  old, new = list_items(old_line.partition(": ")[2]), list_items(new_line.partition(": ")[2])
  removed, added = list((Counter(old) - Counter(new)).elements()), list((Counter(new) - Counter(old)).elements())
  replaced, appended = [], []
  for item in added:
    same = [r for r in removed if _item_name(r) == _item_name(item)]
    if same:
      removed.remove(same[0])
      replaced.append(item)
    else:
      appended.append(item)
  edits = ([f"{name} ~= {i}" for i in replaced] + [f"{name} -= {i}" for i in removed]
           + [f"{name} += {i}" for i in appended])
  rebuilt, problem = apply_state_changes(old_line, "\n".join(edits))
  return edits if edits and not problem and rebuilt == new_line and len(edits) <= len(new) else [new_line]


def state_change_text(state: str, next_state: str, list_edits: bool = False) -> str:
  """The changes that turn `state` into `next_state` (the module docstring's format; with `list_edits`, changed
  comma lists as item edits, "List edits"). Raises ValueError when no such text rebuilds `next_state` exactly."""
  before = {_field(line): line for line in state.splitlines()}
  after = [(_field(line), line) for line in next_state.splitlines()]
  kept = {name for name, _ in after}
  changed = [_list_edits(before[name], line) if list_edits and name is not None and name in before else [line]
             for name, line in after if before.get(name) != line]
  text = "\n".join([f"-{name}" for name in before if name not in kept] + [c for lines in changed for c in lines]) \
      or NO_CHANGE
  rebuilt, problem = apply_state_changes(state, text)
  if problem or rebuilt != next_state:
    raise ValueError("the next state is not the current one with some \"Field: value\" lines set or removed "
                     f"({problem or 'fields reordered, repeated or not of that form'}); this env needs "
                     "ExpFormatConfig(state_changes=False)")
  return text


# --- action edits ----------------------------------------------------------------------------------------------------

_ACTION_EDIT = re.compile(r"([-+]) (.+)")


def apply_action_edits(admissible: Sequence[str], block: str) -> tuple[tuple[str, ...], str]:
  """(the list `block` describes given the current list `admissible`, "") or ((), what is wrong); the module
  docstring's "Action edits". A block not made of edit lines is the whole list. Never raises."""
  lines = block.split("\n") if block else []
  if lines == [NO_CHANGE]:
    return tuple(admissible), ""
  edits = [_ACTION_EDIT.fullmatch(line) for line in lines]
  if not lines or not all(edits):
    return tuple(lines), ""
  out = list(admissible)
  for line, edit in zip(lines, edits):
    op, action = edit.groups()
    if op == "-":
      if action not in out:
        return (), f"the edit {clip(line, 60)!r} removes an action the current list does not hold"
      out.remove(action)
    elif action in out:
      return (), f"the edit {clip(line, 60)!r} adds an action the current list already holds"
    else:
      out.insert(next((j for j, a in enumerate(out) if a > action), len(out)), action)
  return tuple(out), ""


def action_edit_text(admissible: Sequence[str], following: Sequence[str]) -> str:
  """The actions block's body for the next list `following` after the current `admissible`: "(no change)", the edits
  (removals, then additions in list order) where they rebuild it and are shorter, else the whole list. Raises
  ValueError when no such text rebuilds `following` exactly."""
  whole = text = "\n".join(following)
  if following and tuple(following) == tuple(admissible):
    text = NO_CHANGE
  elif following:
    edits = "\n".join([f"- {a}" for a in (Counter(admissible) - Counter(following)).elements()]
                      + [f"+ {a}" for a in (Counter(following) - Counter(admissible)).elements()])
    if len(edits) < len(whole) and apply_action_edits(admissible, edits) == (tuple(following), ""):
      text = edits
  if apply_action_edits(admissible, text) != (tuple(following), ""):
    raise ValueError(f"the admissible actions {clip(whole, 60)!r} read as action edits; this env needs "
                     "ExpFormatConfig(action_edits=False)")
  return text


# --- the target ------------------------------------------------------------------------------------------------------


def _ended_with_actions(admissible: Sequence[str], done: bool) -> str:
  return f"done is true but {len(admissible)} admissible actions are listed" if done and admissible else ""


def _actions_problem(admissible: Sequence[str]) -> str:
  """"" when every action can be one line of an actions block, else what is wrong with the first that cannot."""
  for a in admissible:
    if not isinstance(a, str) or not a.strip() or "\n" in a or "\r" in a:
      return f"the admissible action {a!r} is not one non-empty line"
    bad = next((m for m in _MARKERS if m in a), None)
    if bad:
      return f"the admissible action {a!r} contains the format tag {bad!r}"
  return ""


def render_target(cfg: ExpFormatConfig, reasoning: str, next_state: str, reward: float, done: bool,
                  success: bool, invalid: bool = False, admissible: Sequence[str] = (), state: str = "",
                  current_admissible: Sequence[str] = ()) -> str:
  """The text M_exp is trained to write; `parse_output` reads it back exactly (tested). `admissible`: the actions
  admissible in `next_state` (the actions block; ignored when the format has none); `state`: the current state, which
  the format's state changes are taken against (ignored without them); `current_admissible`: the actions admissible
  in `state`, which the format's action edits are taken against (ignored without them).

  Raises ValueError for an outcome that is not a consistent binary one, for text that holds a format tag (it would
  make the target unparseable), and for admissible actions that are not single lines or follow the episode's end.
  """
  problem = outcome_problem(float(reward), bool(done), bool(success), bool(invalid))
  if problem:
    raise ValueError(f"render_target: inconsistent outcome: {problem}")
  fields = {"next_state": next_state} | ({"reasoning": reasoning} if cfg.reasoning else {})
  for name, text in fields.items():
    bad = next((m for m in _MARKERS if m in text), None)
    if bad:
      raise ValueError(f"render_target: {name} contains the format tag {bad!r}")
  if not next_state.strip():
    raise ValueError("render_target: next_state is empty")
  actions = ""
  if cfg.actions:
    problem = _ended_with_actions(tuple(admissible), bool(done)) or _actions_problem(tuple(admissible))
    if problem:
      raise ValueError(f"render_target: {problem}")
    body = action_edit_text(current_admissible, admissible) if cfg.action_edits else "\n".join(admissible)
    actions = f"<actions>\n{body}\n</actions>\n" if body else "<actions>\n</actions>\n"
  if cfg.state_changes:
    if not state.strip():
      raise ValueError("render_target: the format writes state changes, and no current state is given")
    next_state = state_change_text(state, next_state, cfg.list_edits)
  think = f"<think>\n{reasoning}\n</think>\n" if cfg.reasoning else ""
  return (f"{think}<next_state>\n{next_state}\n</next_state>\n{actions}<invalid>{_flag(invalid)}</invalid>\n"
          f"<reward>{_reward_text(float(reward))}</reward>\n"
          f"<done>{_flag(done)}</done>\n<success>{_flag(success)}</success>")


def action_lists(records: Iterable[TrajectoryRecord]) -> Iterator[tuple[tuple[str, ...], tuple[str, ...] | None]]:
  """(the actions admissible in the step's state, those admissible in its next state) of every step of `records`, in
  `transitions(records)` order. A record's step holds the list of its own state, so the next state's is the next
  step's; a step that ends the episode has none (()); the last step of an episode cut without ending has an unknown
  one (None)."""
  for r in records:
    for j, s in enumerate(r.steps):
      following = r.steps[j + 1].admissible if j + 1 < len(r.steps) else None
      yield tuple(s.admissible), (() if s.done else following)


def transition_target(cfg: ExpFormatConfig, t: Transition, reasoning: str = "",
                      next_admissible: Sequence[str] | None = None, admissible: Sequence[str] = ()) -> str:
  """The exact target text for a recorded transition, with `next_admissible` (from `action_lists`) as its actions
  block, taken against `admissible` (the list its state shows) with action edits; a record that cannot be a target is
  an error naming its episode and step. A transition that does not end the
  episode needs its next state's list when the format has the actions block: rendering an unknown list as an empty one
  would teach M_exp that the state admits nothing."""
  where = f"episode {t.episode_id!r}, step {t.step}"
  if cfg.actions and next_admissible is None and not t.done:
    raise ValueError(f"{where}: the actions admissible after it are not recorded (the episode was cut before its next "
                     f"step), and the format has the actions block")
  try:
    return render_target(cfg, reasoning, t.next_state, t.reward, t.done, t.success, t.invalid,
                         () if next_admissible is None else next_admissible, t.state, admissible)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def sft_example(tokenizer: Tokenizer, cfg: ExpFormatConfig, instruction: str, history: Sequence[tuple[str, str]],
                retrieved: Sequence[Transition], state: str, action: str, target: str, tutorial: str = "",
                step: int | None = None, admissible: Sequence[str] = ()) -> SFTExample:
  """Prompt segments plus `target` as the assistant turn: (ids, kinds, loss mask), all int32 [T]."""
  builder = build_prompt(tokenizer, cfg, instruction, history, retrieved, state, action, tutorial, step, admissible)
  ids, kinds = builder.append(Kind.ACTION, target).arrays()
  return SFTExample(ids, kinds, policy_mask(kinds))


def transition_example(tokenizer: Tokenizer, cfg: ExpFormatConfig, t: Transition, retrieved: Sequence[Transition] = (),
                       reasoning: str = "", tutorial: str = "", admissible: Sequence[str] = (),
                       next_admissible: Sequence[str] | None = None) -> SFTExample:
  """The SFT example of a transition (its history, step index, state, the actions admissible in it, action, outcome,
  and the actions admissible after it: the pair `action_lists` gives)."""
  return sft_example(tokenizer, cfg, t.instruction, t.history, retrieved, t.state, t.action,
                     transition_target(cfg, t, reasoning, next_admissible, admissible), tutorial, step=t.step,
                     admissible=admissible)


# --- the parser ------------------------------------------------------------------------------------------------------


def _strip_one_newline(text: str) -> str:
  text = text[1:] if text.startswith("\n") else text
  return text[:-1] if text.endswith("\n") else text


def _parse_flag(value: str, name: str) -> tuple[bool | None, str]:
  v = value.strip().lower()
  if v in ("true", "false"):
    return v == "true", ""
  return None, f"<{name}> is {clip(value.strip(), 40)!r}, expected true or false"


def _parse_reward(value: str) -> tuple[float | None, str]:
  try:
    r = float(value.strip())
  except ValueError:
    r = math.nan
  if r in (0.0, 1.0):
    return r, ""
  return None, f"<reward> is {clip(value.strip(), 40)!r}, expected 0 or 1"


def parse_output(text: str, cfg: ExpFormatConfig, state: str = "", admissible: Sequence[str] = ()) -> ExpPrediction:
  """Reads M_exp's output (decoded without the end-of-turn token); never raises (see the module docstring). `state`:
  the current state, which the format's state changes are applied to (ignored without them); `admissible`: the
  current state's actions, which the format's action edits are applied to (ignored without them)."""
  if not isinstance(text, str):
    return ExpPrediction.failure(f"output is a {type(text).__name__}, not text")
  s = text.strip()
  expected = expected_tags(cfg)
  if not cfg.reasoning and ("<think>" in s or "</think>" in s):
    return ExpPrediction.failure("unexpected <think> block: reasoning is off in this format")
  if not cfg.actions and ("<actions>" in s or "</actions>" in s):
    return ExpPrediction.failure("unexpected <actions> block: actions are off in this format")
  blocks: dict[str, str] = {}
  pos = 0
  for tag in expected:
    while pos < len(s) and s[pos].isspace():
      pos += 1
    opening, closing = f"<{tag}>", f"</{tag}>"
    reasoning = blocks.get("think", "")
    if not s.startswith(opening, pos):
      where = s.find(opening, pos)
      if where < 0:
        return ExpPrediction.failure(f"missing <{tag}>", reasoning)
      skipped = s[pos:where]
      misplaced = next((m for m in _MARKERS if m in skipped), None)
      if misplaced:
        return ExpPrediction.failure(f"duplicated or misplaced {misplaced} before <{tag}>", reasoning)
      return ExpPrediction.failure(f"unexpected text before <{tag}>: {clip(skipped.strip(), 40)!r}", reasoning)
    start = pos + len(opening)
    end = s.find(closing, start)
    if end < 0:
      return ExpPrediction.failure(f"missing </{tag}> (output cut off?)", reasoning)
    content = s[start:end]
    inner = next((m for m in _MARKERS if m in content), None)
    if inner:
      return ExpPrediction.failure(f"<{tag}> block contains {inner} (duplicated or nested tag)", reasoning)
    blocks[tag] = _strip_one_newline(content)
    pos = end + len(closing)
  reasoning = blocks.get("think", "")
  tail = s[pos:].strip()
  if tail:
    dup = next((m for m in _MARKERS if m in tail), None)
    what = f"duplicated {dup}" if dup else f"unexpected text after </success>: {clip(tail, 40)!r}"
    return ExpPrediction.failure(what, reasoning)
  if not blocks["next_state"].strip():
    return ExpPrediction.failure("empty <next_state>", reasoning)
  next_state = blocks["next_state"]
  if cfg.state_changes:
    if not state.strip():
      return ExpPrediction.failure("no current state to apply the <next_state> changes to", reasoning)
    next_state, problem = apply_state_changes(state, next_state)
    if problem:
      return ExpPrediction.failure(f"<next_state>: {problem}", reasoning)
  listed: tuple[str, ...] = ()  # the next state's actions
  if cfg.actions:
    listed = tuple(blocks["actions"].split("\n")) if blocks["actions"] else ()
    if any(not a.strip() for a in listed):
      return ExpPrediction.failure("an empty line in <actions>", reasoning)
    if cfg.action_edits:
      listed, problem = apply_action_edits(admissible, blocks["actions"])
      if problem:
        return ExpPrediction.failure(f"<actions>: {problem}", reasoning)
    problem = _actions_problem(listed)
    if problem:
      return ExpPrediction.failure(f"<actions>: {problem}", reasoning)
  invalid, error = _parse_flag(blocks["invalid"], "invalid")
  reward, error = (None, error) if error else _parse_reward(blocks["reward"])
  done, error = (None, error) if error else _parse_flag(blocks["done"], "done")
  success, error = (None, error) if error else _parse_flag(blocks["success"], "success")
  if error:
    return ExpPrediction.failure(error, reasoning)
  problem = outcome_problem(reward, done, success, invalid) or _ended_with_actions(listed, done)
  if problem:
    return ExpPrediction.failure(f"inconsistent outcome: {problem}", reasoning)
  return ExpPrediction(next_state, reward, done, success, reasoning, True, "", invalid, listed)
