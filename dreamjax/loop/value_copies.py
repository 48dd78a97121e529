"""Copies of demonstrations with the values their goals quote or name replaced by others: teaching a policy to copy.

Why: a small policy trained from scratch on MiniWoB's typing tasks learns the values it saw, not how to copy the
goal's value into its answer. On held-out pages it typed names from its training pages (`fill('14', 'Livia')` for
Enter "Tula"), and passwords of the right length with the wrong characters (experiments/RESULTS.md, twenty-fourth
stop). In a copy that quotes another episode's value, only copying from the prompt predicts the answer.

What is replaced: every value the instruction quotes (`Enter "Tula" into the text field`, `the username "cierra" and
the password "11L"`), wherever it stands as whole words in the episode's texts (instruction, states, actions), and
its upper- and lower-case forms too (enter-text-2 asks for "myron" typed as MYRON). The new value has the old one's
shape (the same length, and a lower-case letter, an upper-case letter or a digit wherever the old one has one), so a
password field's bullets, which show only the length, stay right, and so does the episode's reward: these tasks are
won by typing the quoted value, whatever it is. It is drawn from the values of the same shape that the records quote
elsewhere (`ValuePool`: names the tokenizer knows as words), and made up character by character where the records
quote no other value of that shape. A value is drawn again if its forms occur in the episode's texts already.
With `made_up_values` every new value is made up, so none comes back and memorising cannot predict a copy's answer.

Dates the instruction states unquoted as MM/DD/YYYY (enter-date: `Enter 02/04/2012 as the date`) are values too,
in two forms: as stated, and as YYYY-MM-DD, which the date field's fill types and its value shows. A new date is
always made up (any month, day 1-28, year 1000-2999), so its year, too, can only be copied. Without date copies a
policy trained with copies of the other tasks typed enter-date's month and day and a wrong year
(experiments/RESULTS.md, twenty-eighth stop): the copies had outnumbered enter-date's own episodes.

Measured on MiniWoB's eight headroom tasks (experiments/RESULTS.md, twenty-fifth and twenty-sixth stops), 2-layer
policy, 3,600 steps: three copies 0.494 held-out, no copies 0.506, so at equal steps the copies gave nothing there.
Training that long (17 passes without copies) taught the policy to copy names from the goal by itself; 1,200 steps
without copies (0.375) had not. Neither run ever types a password (random characters) right. Trained on
enter-password alone with 30 made-up copies, the policy still typed passwords at chance after 6,000 steps; what
taught it to copy was the prompt's tokens in the loss (`RowConfig.prompt_loss`: 0.31 of the characters in place
after 3,000 steps, against 0.03; twenty-eighth stop). With both, 5 copies and 3,600 steps on the eight tasks, the
policy types passwords (enter-password 18 and login-user 20 of 20, from 0); with the dates' copies too, 0.713 on the
eight tasks, enter-date 20 of 20 again (twenty-ninth stop): configs/train_policy_miniwob.py:copying.
The option stays off by default and in that config's main variant, whose numbers earlier stops measured.

ALFWorld's pick-and-place goals (`put a mug in microwave`, `put some pen on drawer`) name an object class, and the
policy must take that object where it sees it among others. A tiny policy learned the class's usual places instead
and almost never chose `take` where the expert did (experiments/RESULTS.md, thirty-third stop). So the goal's object
class is a value too: it is replaced, as a whole word everywhere (`mug 1` in states, actions and admissible lists
becomes `pen 1`), by another class the records' goals name, one absent from the episode's texts. In a copy the
object then sits where its class is not usually found, and only matching the goal's word against the objects in
view predicts `take`. Classes are never made up (a made-up word is no object the tokenizer or the env knows), so
with `made_up_values` ALFWorld episodes get no copy.

The copy keeps its episode id and task (it stands for the same demonstration), so evaluating on the demonstrated
tasks is unchanged. Episodes whose instruction quotes nothing and states no date (TextWorld-Express, MiniWoB's
click tasks) get no copy. The tokenizer is trained on the real records only: the copies are a lesson in copying,
not text the policy will meet.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Sequence

import numpy as np

from dreamjax.data.records import TrajectoryRecord
from dreamjax.envs.miniwob_experts import STATED_DATE, iso_date
from dreamjax.experience.rename import names_pattern, rename_text

_QUOTED = re.compile(r'"([^"\n]+)"')
# An ALFWorld pick-and-place goal, the whole instruction: "put a mug in microwave", "put some pen on drawer".
_GOAL_OBJECT = re.compile(r"put (?:a|an|some) (\w+) (?:in|on) \w+")
_TRIES = 100  # draws of a new value before giving up (only a value of one or two characters can run out)


def quoted_values(instruction: str) -> list[str]:
  """The values `instruction` quotes, in order, each once."""
  return list(dict.fromkeys(_QUOTED.findall(instruction)))


def stated_dates(instruction: str) -> list[str]:
  """The MM/DD/YYYY dates `instruction` states outside quotes, in order, each once."""
  return list(dict.fromkeys(STATED_DATE.findall(_QUOTED.sub("", instruction))))


def goal_objects(instruction: str) -> list[str]:
  """The object class an ALFWorld pick-and-place goal names (`put a mug in microwave`: mug), or none."""
  match = _GOAL_OBJECT.fullmatch(" ".join(instruction.split()))
  return [match.group(1)] if match else []


def made_up_date(rng: np.random.Generator) -> str:
  """An MM/DD/YYYY date drawn at random: any month, a day every month has, a year of 1000-2999."""
  return f"{rng.integers(1, 13):02d}/{rng.integers(1, 29):02d}/{rng.integers(1000, 3000)}"


def _texts(record: TrajectoryRecord) -> list[str]:
  return [record.instruction] + [t for s in record.steps for t in (s.state, s.action, s.next_state, *s.admissible)]


_CASES = (str, str.upper, str.lower)  # the forms of a quoted value: enter-text-2 asks for "myron" typed as MYRON
_DATE_FORMS = (str, iso_date)


_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits)


def shape(value: str) -> str:
  """`value` with every lower-case letter as "a", upper-case letter as "A" and digit as "0"."""
  return "".join(next((p[0] for p in _CLASSES if c in p), c) for c in value)


def made_up(value: str, rng: np.random.Generator) -> str:
  """A value of `value`'s shape, each letter or digit drawn at random from its class."""
  return "".join(next((p[rng.integers(len(p))] for p in _CLASSES if c in p), c) for c in value)


@dataclasses.dataclass(frozen=True)
class ValuePool:
  """The values the records quote, by shape, and the object classes their goals name: what new values are drawn
  from."""

  by_shape: dict[str, tuple[str, ...]]
  objects: tuple[str, ...] = ()

  @classmethod
  def of(cls, records: Sequence[TrajectoryRecord]) -> ValuePool:
    by_shape: dict[str, set[str]] = {}
    for r in records:
      for v in quoted_values(r.instruction):
        by_shape.setdefault(shape(v), set()).add(v)
    objects = sorted({o for r in records for o in goal_objects(r.instruction)})
    return cls({k: tuple(sorted(v)) for k, v in sorted(by_shape.items())}, tuple(objects))

  def draw(self, value: str, rng: np.random.Generator) -> str:
    """Another quoted value of `value`'s shape, or one made up where the records quote none."""
    others = [v for v in self.by_shape.get(shape(value), ()) if v != value]
    return others[rng.integers(len(others))] if others else made_up(value, rng)

  def draw_object(self, value: str, rng: np.random.Generator) -> str | None:
    """Another object class of the records' goals, or None where they name no other."""
    others = [o for o in self.objects if o != value]
    return others[rng.integers(len(others))] if others else None


def value_copy(record: TrajectoryRecord, pool: ValuePool, rng: np.random.Generator
               ) -> tuple[TrajectoryRecord, dict[str, str]] | None:
  """`record` with its quoted values, stated dates and goal object replaced (module docstring) and the mapping of
  every form replaced, or None when the instruction has none of them or no new value avoids the episode's words."""
  values = [(v, _CASES, pool.draw) for v in quoted_values(record.instruction)] + \
      [(d, _DATE_FORMS, lambda _, r: made_up_date(r)) for d in stated_dates(record.instruction)] + \
      [(o, (str,), pool.draw_object) for o in goal_objects(record.instruction)]
  if not values:
    return None
  texts = _texts(record)
  old_forms = {f(v) for v, fs, _ in values for f in fs}
  mapping: dict[str, str] = {}
  for value, fs, draw in values:
    for _ in range(_TRIES):
      new = draw(value, rng)
      if new is None:
        return None
      forms = {f(value): f(new) for f in fs}
      # no new form may already be a word of the episode, another value's form, or another form's replacement
      if not any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", t) for n in forms.values() for t in texts) and \
          not set(forms.values()) & (old_forms | set(mapping.values())) and \
          all(mapping.get(o, n) == n for o, n in forms.items()):
        mapping |= forms
        break
    else:
      return None
  pattern = names_pattern(mapping)

  def text(s: str) -> str:
    return rename_text(s, mapping, pattern)

  def admissible(actions: tuple[str, ...]) -> tuple[str, ...]:
    new = tuple(text(a) for a in actions)
    return tuple(sorted(new)) if list(actions) == sorted(actions) else new  # ALFWorld lists its commands sorted

  steps = tuple(dataclasses.replace(s, state=text(s.state), action=text(s.action), next_state=text(s.next_state),
                                    admissible=admissible(s.admissible)) for s in record.steps)
  return dataclasses.replace(record, instruction=text(record.instruction), steps=steps), mapping


def value_copies(records: Sequence[TrajectoryRecord], copies: int, seed: int, made_up_values: bool = False
                 ) -> list[TrajectoryRecord]:
  """`copies` copies of each record whose instruction quotes values, states dates or names a goal object, with
  values drawn anew for every copy (seeded by `seed` and the copy's number): from the records' own, or all made up
  when `made_up_values` (an empty pool, so no goal object is replaced); dates are always made up."""
  pool, out = ValuePool({}) if made_up_values else ValuePool.of(records), []
  for j in range(copies):
    rng = np.random.default_rng([seed, j])
    out += [c[0] for r in records if (c := value_copy(r, pool, rng)) is not None]
  return out
