"""experiments/choice_accuracy.py: the teacher-forced restricted choice, checked on hand-made logits."""

import numpy as np

from dreamjax.loop.policy_data import TurnRow
from experiments.choice_accuracy import chosen_as_demonstrated, verb

# Three admissible answers as token ids: [5, 6, 9], [5, 7, 9], [8, 9] (-1 padded).
CHOICES = np.array([[5, 6, 9], [5, 7, 9], [8, 9, -1]], np.int32)
PROMPT = [1, 2, 3]


def _row(answer):
  ids = np.array(PROMPT + answer, np.int32)
  return TurnRow(ids, (np.arange(len(ids)) >= len(PROMPT)).astype(np.int32), len(PROMPT), "e", 0)


def _logits(best):
  """[T, V] logits whose position prompt_len - 1 + j scores token best[j] highest, every other token 0."""
  out = np.zeros((len(PROMPT) + len(best), 12), np.float32)
  for j, token in enumerate(best):
    out[len(PROMPT) - 1 + j, token] = 1.0
  return out


def test_every_choice_must_be_the_demonstrations():
  row = _row([5, 7, 9])
  assert chosen_as_demonstrated(_logits([5, 7, 9]), row, CHOICES)
  assert not chosen_as_demonstrated(_logits([8, 7, 9]), row, CHOICES)  # the first token chose another action
  assert not chosen_as_demonstrated(_logits([5, 6, 9]), row, CHOICES)  # the second did


def test_tokens_outside_the_allowed_set_and_forced_tokens_do_not_count():
  row = _row([5, 7, 9])
  # Token 11 scores highest at the first position but no action allows it; 5 beats 8 among the allowed.
  logits = _logits([11, 7, 0])
  logits[len(PROMPT) - 1, 5] = 0.5
  assert chosen_as_demonstrated(logits, row, CHOICES)
  # After [8], token 9 is forced: whatever the policy scores there is no choice.
  assert chosen_as_demonstrated(_logits([8, 3]), _row([8, 9]), CHOICES)


def test_verb_keeps_the_preposition_of_go_to():
  assert [verb(a) for a in ("go to drawer 1", "take mug 1 from shelf 2", "move mug 1 to fridge 1", "look", "")] == [
      "go to", "take", "move", "look", ""]
