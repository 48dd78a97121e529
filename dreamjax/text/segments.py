"""Token-in/token-out conversations: segments appended one at a time, never re-tokenised.

A rollout alternates env text (task, observations) with policy samples. Re-rendering the chat template after every
turn could re-tokenise earlier text differently from what the policy saw and scored, which silently corrupts
importance ratios; so each segment is tokenised once, wrapped with the ids of the tokenizer's `ChatFormat`, and
appended. Sampled actions are stored as the exact ids the sampler produced.

Because content is tokenised apart from its wrapper, text that starts with whitespace right after a wrapper ending in a
newline (Qwen's "<|im_start|>user\n") can get other ids than a whole-string rendering would give. That never breaks
token-in/token-out, since the stored ids are exactly what the policy conditions on; for ordinary text the ids equal
`apply_chat_template(..., tokenize=True)` (tested).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from dreamjax.text.tokenizer import ChatFormat, Tokenizer


class Kind(enum.IntEnum):
  """Per-token code of the segment a token belongs to; stored in int32 kind arrays."""

  PAD = 0  # reserved for batch padding; never produced by the builder
  SYSTEM = 1  # system prompt, with its wrapper (and the conversation opening when it comes first)
  TASK = 2  # task instruction, sent as a user message
  OBSERVATION = 3  # env observation, sent as a user message
  ACTION = 4  # the policy's tokens: action content and the end-of-turn token closing it
  ACTION_FRAME = 5  # template tokens of an action segment the policy did not produce: the assistant header and
  # anything after end-of-turn (e.g. Qwen's "\n")


ROLE_OF_KIND = {Kind.SYSTEM: "system", Kind.TASK: "user", Kind.OBSERVATION: "user", Kind.ACTION: "assistant"}


def policy_mask(kinds: np.ndarray) -> np.ndarray:
  """1 on the tokens the policy produced (the `loss_mask` of a trajectory), 0 elsewhere, as int32."""
  return (np.asarray(kinds) == Kind.ACTION).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentBuilder:
  """An immutable conversation under construction; each `append*` returns a longer builder.

  Immutability makes the prefix property structural: appending cannot change tokens already stored, and a rollout
  can keep the builder of every turn.
  """

  tokenizer: Tokenizer
  ids: tuple[int, ...] = ()
  kinds: tuple[int, ...] = ()

  def __len__(self) -> int:
    return len(self.ids)

  @property
  def chat_format(self) -> ChatFormat:
    if self.tokenizer.chat_format is None:
      raise ValueError(f"tokenizer {self.tokenizer.hf.name_or_path!r} has no chat template to build segments with")
    return self.tokenizer.chat_format

  def append(self, kind: Kind, text: str) -> SegmentBuilder:
    """Appends a text segment wrapped as a message of the kind's chat role.

    Text actions (expert demonstrations, replayed actions) are tokenised here and their content plus
    end-of-turn token are marked ACTION, so SFT and RL share one mask.
    """
    if kind not in ROLE_OF_KIND:
      raise ValueError(f"cannot append a segment of kind {kind!r}; expected one of {[k.name for k in ROLE_OF_KIND]}")
    kind = Kind(kind)
    role = self.chat_format.role(ROLE_OF_KIND[kind])
    head = role.first if not self.ids else role.prefix
    if kind != Kind.ACTION:
      body = head + tuple(self.tokenizer.encode(text.strip() if role.strip else text)) + role.suffix
      return self._extend(body, (kind,) * len(body))
    answer = self.answer_ids(text)
    tail = role.suffix[len(self._closing()) :]
    frame = Kind.ACTION_FRAME
    kinds = (frame,) * len(head) + (Kind.ACTION,) * len(answer) + (frame,) * len(tail)
    return self._extend(head + answer + tail, kinds)

  def answer_ids(self, text: str) -> tuple[int, ...]:
    """The ids a policy trained on `append(Kind.ACTION, text)` emits for `text` after `prompt()`: the text's tokens
    and the closing up to end-of-turn, exactly the tokens that append marks ACTION."""
    role = self.chat_format.assistant
    return tuple(self.tokenizer.encode(text.strip() if role.strip else text)) + self._closing()

  def append_generated(self, ids: Sequence[int]) -> SegmentBuilder:
    """Appends a sampled action: the generation prompt, `ids` verbatim, then the rest of the assistant wrapper.

    `ids` are exactly the sampled tokens up to and including the stop token, without padding. When they end with
    the template's end-of-turn closing, only what follows it is appended (e.g. "\\n"); otherwise (length limit, or
    a different eos) the whole assistant suffix is appended as frame tokens so the conversation stays well formed.
    Every sampled id is marked ACTION: it has a log-probability from the rollout.
    """
    if not self.ids:
      raise ValueError("append_generated needs a prompt: append the system/task segments first")
    sampled = tuple(int(i) for i in ids)
    bad = [i for i in sampled if not 0 <= i < self.tokenizer.vocab_size]
    if bad:
      raise ValueError(f"sampled ids {bad[:5]} are outside the vocabulary [0, {self.tokenizer.vocab_size})")
    fmt = self.chat_format
    closing = self._closing()
    ended = len(sampled) >= len(closing) and sampled[len(sampled) - len(closing) :] == closing
    tail = fmt.assistant.suffix[len(closing) :] if ended else fmt.assistant.suffix
    head = fmt.generation_prompt
    return self._extend(
        head + sampled + tail,
        (Kind.ACTION_FRAME,) * len(head) + (Kind.ACTION,) * len(sampled) + (Kind.ACTION_FRAME,) * len(tail),
    )

  def prompt(self) -> np.ndarray:
    """int32 ids the policy conditions on for its next turn: the conversation so far plus the generation prompt."""
    if not self.ids:
      raise ValueError("an empty conversation has no prompt: append the system/task segments first")
    return np.asarray(self.ids + self.chat_format.generation_prompt, dtype=np.int32)

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, kind codes), both int32 of shape [T]."""
    return np.asarray(self.ids, dtype=np.int32), np.asarray(self.kinds, dtype=np.int32)

  def _closing(self) -> tuple[int, ...]:
    # The policy must emit everything up to and including end-of-turn; for Llama 3 and Qwen that is one token.
    suffix = self.chat_format.assistant.suffix
    return suffix[: suffix.index(self.chat_format.end_of_turn) + 1]

  def _extend(self, ids: tuple[int, ...], kinds: tuple[int, ...]) -> SegmentBuilder:
    return dataclasses.replace(self, ids=self.ids + ids, kinds=self.kinds + tuple(int(k) for k in kinds))
