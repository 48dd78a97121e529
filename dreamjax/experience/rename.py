"""Renamed copies of training episodes: the same transitions with every item called by a made-up name.

Why: a small M_exp trained from scratch learns the names of the items it saw often, not how to copy a name from its
prompt. On twc's held-out tasks it wrote "take black belt" as "black bed sheet" and "take dirty glass" as "dirty
fork": one-step exact match fell from 0.95 on puts of items seen 50 times or more in training to 0.59 on those seen
1 to 9 times and 0 on unseen ones (experiments/RESULTS.md, twenty-first stop). A renamed copy states the same game
in words the model cannot have memorised, so only copying from the prompt predicts them.

What is renamed: the items an episode's commands carry, the X of "take X", "take X from Y" and "put X in/on Y" in any
admissible list or action of the episode. The receptacles (the Y of those commands and the objects of "open"/"close")
keep their names, and a name is only replaced where it stands as whole words, never inside a longer name (the item
"wastepaper" in the receptacle "wastepaper basket"). A new name has the old one's number of words: its last word is
drawn from the last words of the training records' item names and the others from their other words, so every word
is one the tokenizer was trained on, and it is never the name of a real item or receptacle. Every text of the
episode is rewritten with one mapping: states, actions, admissible lists (sorted again where the record's were
sorted), the reasoning and the tutorial.

The copy keeps its episode id and task, so retrieval still excludes its own episode (the original with the real
names is never its neighbour) and its examples are built like any other. Rewards stay: where the real game rewards
putting an item in its usual place, the renamed item's place is whatever the original's was, which M_exp cannot know
from the name, just as for a held-out task's unseen item. Built for text-game commands (TextWorld-Express); records
whose commands carry no items have nothing to rename.

Measured on twc (one copy, the twentieth stop's 6,000-step run otherwise): fewer answers fail to parse (0.083
against 0.109) and the held-out NLL falls, but exact match fell from 0.854 to 0.838. In twc the reward of a put
follows from the item's real name, so on renamed items the model learned to hedge it (reward recall 0.806 against
0.985 on real names), and it calls more valid actions refused. configs/train_exp_twc.py keeps the copies off.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from dreamjax.data.records import TrajectoryRecord
from dreamjax.experience.annotate import Annotation

_TAKE = re.compile(r"^take (.+?)(?: from (.+))?$")
_PUT = re.compile(r"^put (.+?) (?:in/on|in|on) (.+)$")
_RECEPTACLE = re.compile(r"^(?:open|close) (.+)$")
_TRIES = 100  # draws per new name before giving up (a word pool this small cannot name the episode's items apart)


def _commands(record: TrajectoryRecord) -> Iterable[str]:
  for s in record.steps:
    yield s.action
    yield from s.admissible


def episode_names(record: TrajectoryRecord) -> tuple[set[str], set[str]]:
  """(items, receptacles) the episode's commands name."""
  items, receptacles = set(), set()
  for c in _commands(record):
    if m := _TAKE.match(c) or _PUT.match(c):
      items.add(m.group(1))
      if m.group(2):
        receptacles.add(m.group(2))
    elif m := _RECEPTACLE.match(c):
      receptacles.add(m.group(1))
  return items, receptacles - items


@dataclasses.dataclass(frozen=True)
class NamePool:
  """The words new names are made of, and the names they must never be."""

  heads: tuple[str, ...]  # last words of real item names
  modifiers: tuple[str, ...]  # their other words
  taken: frozenset[str]  # every real item and receptacle name

  @classmethod
  def of(cls, records: Sequence[TrajectoryRecord]) -> NamePool:
    items, receptacles = set(), set()
    for r in records:
      i, c = episode_names(r)
      items |= i
      receptacles |= c
    words = [n.split() for n in sorted(items)]
    return cls(tuple(sorted({w[-1] for w in words})), tuple(sorted({x for w in words for x in w[:-1]})),
               frozenset(items | receptacles))

  def draw(self, old: str, rng: np.random.Generator, avoid: set[str]) -> str:
    n = len(old.split())
    for _ in range(_TRIES if self.heads and (n == 1 or self.modifiers) else 0):
      parts = [self.modifiers[i] for i in rng.integers(len(self.modifiers), size=n - 1)] if n > 1 else []
      new = " ".join([*parts, self.heads[rng.integers(len(self.heads))]])
      if new not in self.taken and new not in avoid:
        return new
    raise ValueError(f"renamed copies: no new name for {old!r} after {_TRIES} draws; the training records' item names "
                     f"have too few words ({len(self.heads)} last words, {len(self.modifiers)} others)")


def names_pattern(names: Iterable[str]) -> re.Pattern:
  """Any of `names` standing as whole words. The alternation lists the longest names first, so at any position the
  longest name wins: a receptacle that contains an item's name ("wastepaper basket") is matched whole."""
  return re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, sorted(names, key=lambda n: (-len(n), n)))) + r")(?!\w)")


def rename_text(text: str, mapping: Mapping[str, str], pattern: re.Pattern) -> str:
  """`text` with each match of `pattern` that `mapping` holds replaced (receptacles match, and stay)."""
  return pattern.sub(lambda m: mapping.get(m.group(0), m.group(0)), text)


def renamed(record: TrajectoryRecord, annotation: Annotation, pool: NamePool,
            rng: np.random.Generator) -> tuple[TrajectoryRecord, Annotation, dict[str, str]]:
  """`record` and its annotation with every item the episode names replaced by a new name drawn from `pool`, and
  the mapping (old name to new)."""
  items, receptacles = episode_names(record)
  mapping: dict[str, str] = {}
  for old in sorted(items):
    mapping[old] = pool.draw(old, rng, set(mapping.values()) | receptacles)
  if not mapping:
    return record, annotation, mapping
  pattern = names_pattern(items | receptacles)

  def text(s: str) -> str:
    return rename_text(s, mapping, pattern)

  def actions(a: tuple[str, ...]) -> tuple[str, ...]:
    out = tuple(text(x) for x in a)
    return tuple(sorted(out)) if list(a) == sorted(a) else out

  steps = tuple(dataclasses.replace(s, state=text(s.state), action=text(s.action), next_state=text(s.next_state),
                                    admissible=actions(s.admissible)) for s in record.steps)
  note = dataclasses.replace(annotation, tutorial=text(annotation.tutorial),
                             reasons=tuple(text(r) for r in annotation.reasons))
  return dataclasses.replace(record, instruction=text(record.instruction), steps=steps), note, mapping


def renamed_copies(records: Sequence[TrajectoryRecord], annotations: Mapping[str, Annotation], copies: int,
                   seed: int) -> list[tuple[list[TrajectoryRecord], dict[str, Annotation]]]:
  """`copies` renamed copies of `records`, each as (records, annotations by episode id), with new names drawn anew
  for every episode of every copy (seeded)."""
  pool = NamePool.of(records)
  if copies and not pool.heads:
    raise ValueError("renamed copies: the training records' commands name no items (take/put), so there is nothing "
                     "to rename")
  out = []
  for j in range(copies):
    rng = np.random.default_rng([seed, j])
    pairs = [renamed(r, annotations[r.episode_id], pool, rng)[:2] for r in records]
    out.append(([r for r, _ in pairs], {r.episode_id: a for r, a in pairs}))
  return out
