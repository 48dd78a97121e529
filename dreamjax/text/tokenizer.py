"""Tokenizer loading and training, and the chat format read off a tokenizer's own chat template.

Everything that turns text into ids goes through `Tokenizer`, so the rollout engine, the samplers and the trainers agree
on one vocabulary, one set of stop ids and one chat layout. The layout (`ChatFormat`) is derived by rendering the
template on sentinel messages, so Llama 3, Qwen2/ChatML and our own trained tokenizers work without per-family code.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
from collections.abc import Iterable, Sequence

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

ROLES = ("system", "user", "assistant")
REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2's split regex (Llama 3's up to digit grouping): newlines never merge into the letters that follow them, so a
# wrapper ending in "\n" tokenizes the same alone as glued to the content after it.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Distinct, whitespace-free and never produced by a template, so each occurs exactly once in a rendering.
_SENTINELS = ("<<dreamjax-sentinel-0>>", "<<dreamjax-sentinel-1>>", "<<dreamjax-sentinel-2>>")


@dataclasses.dataclass(frozen=True)
class RoleFormat:
  """Token ids around one message's content, for one role."""

  first: tuple[int, ...]  # before the content of a conversation's first message: BOS, injected system block, header
  prefix: tuple[int, ...]  # before the content anywhere later
  suffix: tuple[int, ...]  # after the content (end-of-turn token and whatever the template appends)
  strip: bool  # the template trims whitespace around content, so text must be stripped to match it


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """A chat template split into per-role wrappers, so conversations can be extended token by token."""

  system: RoleFormat
  user: RoleFormat
  assistant: RoleFormat
  generation_prompt: tuple[int, ...]  # equals assistant.prefix (checked), so prompts and stored actions agree
  end_of_turn: int  # first special token in assistant.suffix: where the policy stops

  def role(self, name: str) -> RoleFormat:
    if name not in ROLES:
      raise ValueError(f"unknown chat role {name!r}; expected one of {ROLES}")
    return getattr(self, name)


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
  """A thin frozen wrapper over a Hugging Face fast tokenizer; `hf` is kept for tools and tests only."""

  hf: transformers.PreTrainedTokenizerBase
  vocab_size: int
  bos_id: int | None
  eos_ids: tuple[int, ...]  # the eos token and the template's end-of-turn token: every id the sampler stops on
  pad_id: int
  chat_format: ChatFormat | None  # None when the tokenizer has no chat template (base models)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    # Special-token strings inside `text` become their single ids, as in `apply_chat_template`, so wrappers and
    # rendered templates tokenise alike. `add_special_tokens` adds the post-processor's BOS/EOS (Llama 3 adds BOS).
    return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    # No space clean-up: it rewrites " ." to "." and would break decode(encode(s)) == s.
    return self.hf.decode(
        [int(i) for i in ids], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def load_tokenizer(folder: str | pathlib.Path) -> Tokenizer:
  """Loads the tokenizer of an HF checkpoint folder, from local files only, and derives its chat format."""
  path = pathlib.Path(folder)
  if not path.is_dir():
    raise FileNotFoundError(f"tokenizer folder {str(path)!r} does not exist or is not a directory")
  missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
  if missing:
    raise FileNotFoundError(f"tokenizer folder {str(path)!r} has no {' and no '.join(missing)}")
  try:
    hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  except Exception as e:  # malformed JSON, unknown tokenizer class, ...: report which folder broke
    raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {e}") from e
  chat_format = derive_chat_format(hf) if hf.chat_template else None
  eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
  if chat_format is not None and chat_format.end_of_turn not in eos:
    eos.append(chat_format.end_of_turn)
  if not eos:
    raise ValueError(f"tokenizer in {str(path)!r} has neither an eos token nor a chat template with an end of turn")
  return Tokenizer(
      hf=hf,
      vocab_size=len(hf),  # counts added special tokens, which sit above the base vocabulary
      bos_id=hf.bos_token_id,
      eos_ids=tuple(eos),
      pad_id=hf.pad_token_id if hf.pad_token_id is not None else eos[0],
      chat_format=chat_format,
  )


def train_bpe_tokenizer(
    texts: Iterable[str],
    folder: str | pathlib.Path,
    vocab_size: int = 512,
    special_tokens: Sequence[str] = CHATML_SPECIAL_TOKENS,
) -> Tokenizer:
  """Trains a byte-level BPE with a ChatML template, saves it as an HF folder and loads it back with `load_tokenizer`.

  Byte-level, so every string round-trips. `special_tokens` get the lowest ids in order and must include the ChatML
  three; extras (e.g. Llama 3 header tokens) let tests swap in other templates over the same vocabulary.
  """
  missing = [t for t in CHATML_SPECIAL_TOKENS if t not in special_tokens]
  if missing:
    raise ValueError(f"special_tokens must include the ChatML tokens; missing {missing}")
  minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(special_tokens)
  if vocab_size < minimum:
    raise ValueError(f"vocab_size={vocab_size} is below the {minimum} byte and special tokens it must hold")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(tokenizers.Regex(_SPLIT_PATTERN), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
  )
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=list(special_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer)
  hf = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok,
      bos_token="<|endoftext|>",
      pad_token="<|endoftext|>",
      eos_token="<|im_end|>",
      extra_special_tokens=[t for t in special_tokens if t not in CHATML_SPECIAL_TOKENS[::2]],
      clean_up_tokenization_spaces=False,
      chat_template=CHATML_TEMPLATE,
  )
  # The template stays inside tokenizer_config.json, the layout HF checkpoints of every vintage share.
  hf.save_pretrained(str(folder), save_jinja_files=False)
  return load_tokenizer(folder)


def derive_chat_format(hf: transformers.PreTrainedTokenizerBase) -> ChatFormat:
  """Splits `hf`'s chat template into per-role wrappers by rendering sentinel conversations and diffing them.

  Raises ValueError when the template is not a concatenation of per-message wrappers (e.g. it rewrites earlier
  messages as the conversation grows), since token-in/token-out conversations could then not be extended in place.
  """
  where = f"chat template of tokenizer {hf.name_or_path!r}"
  s0, s1, _ = _SENTINELS
  context = _render(hf, [("user", s0)], where)
  strings: dict[str, tuple[str, str, str, bool]] = {}
  for role in ROLES:
    first, _ = _split(_render(hf, [(role, s1)], where), s1, where, role)
    prefix, suffix = _split(_after(context, _render(hf, [("user", s0), (role, s1)], where), where), s1, where, role)
    padded = _after(context, _render(hf, [("user", s0), (role, f" {s1} ")], where), where)
    if padded not in (prefix + f" {s1} " + suffix, prefix + s1 + suffix):
      raise ValueError(f"{where} cannot be split into wrappers: it rewrites {role} content beyond trimming it")
    strings[role] = (first, prefix, suffix, padded == prefix + s1 + suffix)
  generation = _after(context, _render(hf, [("user", s0)], where, generation=True), where)
  if generation != strings["assistant"][1]:
    raise ValueError(
        f"{where} cannot be split into wrappers: its generation prompt {generation!r} differs from the assistant "
        f"header {strings['assistant'][1]!r}, so a sampled turn would not match a stored one"
    )
  _check_wrappers(hf, strings, generation, where)
  encode = lambda s: tuple(hf.encode(s, add_special_tokens=False))  # noqa: E731 -- special tokens are parsed
  roles = {r: RoleFormat(encode(f), encode(p), encode(s), strip) for r, (f, p, s, strip) in strings.items()}
  special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
  end_of_turn = next((i for i in roles["assistant"].suffix if i in special), None)
  if end_of_turn is None:
    raise ValueError(f"{where}: assistant turns end with {strings['assistant'][2]!r}, which has no special token")
  return ChatFormat(**roles, generation_prompt=encode(generation), end_of_turn=end_of_turn)


def _check_wrappers(hf, strings: dict, generation: str, where: str) -> None:
  """Re-renders every role sequence up to three messages long and checks the wrappers reproduce it exactly."""
  for length in (1, 2, 3):
    for roles in itertools.product(ROLES, repeat=length):
      messages = list(zip(roles, _SENTINELS))
      expected = "".join(
          strings[r][0 if i == 0 else 1] + content + strings[r][2] for i, (r, content) in enumerate(messages)
      )
      for add in (False, True):
        if _render(hf, messages, where, generation=add) != expected + (generation if add else ""):
          raise ValueError(
              f"{where} cannot be split into per-message wrappers: rendering roles {roles} "
              f"(generation prompt {add}) differs from the wrappers derived from shorter conversations"
          )


def _render(hf, messages: Sequence[tuple[str, str]], where: str, generation: bool = False) -> str:
  conversation = [{"role": role, "content": content} for role, content in messages]
  try:
    return hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
  except Exception as e:  # templates raise on role orders they reject
    roles = [role for role, _ in messages]
    raise ValueError(f"{where} cannot be split into wrappers: rendering roles {roles} failed: {e}") from e


def _after(context: str, text: str, where: str) -> str:
  if not text.startswith(context):
    raise ValueError(f"{where} cannot be split into wrappers: adding a message changes the text before it")
  return text[len(context) :]


def _split(text: str, sentinel: str, where: str, role: str) -> tuple[str, str]:
  if text.count(sentinel) != 1:
    raise ValueError(f"{where} cannot be split into wrappers: a {role} message's content is not rendered verbatim")
  before, after = text.split(sentinel)
  return before, after
