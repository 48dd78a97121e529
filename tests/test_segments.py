"""Token-in/token-out segment building: template fidelity, prefix stability, policy masks, verbatim samples."""

import json
import pathlib
import random
import shutil

import numpy as np
import pytest

from dreamjax.text import Kind, SegmentBuilder, Tokenizer, load_tokenizer, policy_mask, train_bpe_tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>")
# Llama-3 structure in brief: BOS, an always-present system block, trimmed content, nothing after <|eot_id|>.
LLAMA_STYLE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content']|trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
EPISODE = [
    (Kind.SYSTEM, "You play a text game. Answer with one action."),
    (Kind.TASK, "Task: put a clean apple in the fridge."),
    (Kind.OBSERVATION, "You are in a kitchen. You see a table and a fridge."),
    (Kind.ACTION, "go to table"),
    (Kind.OBSERVATION, "On the table you see an apple 🍎."),
    (Kind.ACTION, "take apple from table"),
    (Kind.OBSERVATION, "  You pick up the apple.\n"),  # Llama-style templates trim it, ChatML keeps it
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
  root = tmp_path_factory.mktemp("tok")
  rng = random.Random(0)
  words = "you are in a kitchen the fridge table apple take go to open look see on".split()
  texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".\n" for _ in range(300)]
  train_bpe_tokenizer(texts, root / "chatml", vocab_size=360, special_tokens=SPECIALS)
  config = json.loads((root / "chatml" / "tokenizer_config.json").read_text())
  variants = {"llama": config | {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                 "chat_template": LLAMA_STYLE},
              "plain": {k: v for k, v in config.items() if k != "chat_template"}}
  for name, variant in variants.items():
    (root / name).mkdir()
    shutil.copy(root / "chatml" / "tokenizer.json", root / name)
    (root / name / "tokenizer_config.json").write_text(json.dumps(variant))
  return {name: root / name for name in ("chatml", "llama", "plain")}


@pytest.fixture(params=["chatml", "llama"])
def tok(request, folders) -> Tokenizer:
  return load_tokenizer(folders[request.param])


def sample(tok: Tokenizer, text: str) -> list[int]:
  """What a sampler returns for `text`: its ids followed by the end-of-turn stop token."""
  return tok.encode(text) + [tok.chat_format.end_of_turn]


def play(tok: Tokenizer, episode=EPISODE) -> list[SegmentBuilder]:
  """Builders after each segment, actions appended as sampled ids."""
  builders = [SegmentBuilder(tok)]
  for kind, text in episode:
    last = builders[-1]
    builders.append(last.append_generated(sample(tok, text)) if kind == Kind.ACTION else last.append(kind, text))
  return builders


def messages(episode) -> list[dict]:
  role = {Kind.SYSTEM: "system", Kind.TASK: "user", Kind.OBSERVATION: "user", Kind.ACTION: "assistant"}
  return [{"role": role[kind], "content": text} for kind, text in episode]


def render(tok: Tokenizer, episode, generation: bool = False) -> list[int]:
  msgs = messages(episode)
  return list(tok.hf.apply_chat_template(msgs, tokenize=True, return_dict=False, add_generation_prompt=generation))


def test_kind_codes_are_stable():
  assert {k.name: int(k) for k in Kind} == {
      "PAD": 0, "SYSTEM": 1, "TASK": 2, "OBSERVATION": 3, "ACTION": 4, "ACTION_FRAME": 5}


@pytest.mark.parametrize("start", [0, 1])  # with and without a system segment (template-injected opening)
def test_incremental_build_matches_template(tok, start):
  episode = EPISODE[start:]
  builders = play(tok, episode)
  for n in range(1, len(episode) + 1):
    ids, kinds = builders[n].arrays()
    assert ids.dtype == kinds.dtype == np.int32 and ids.shape == kinds.shape
    assert ids.tolist() == render(tok, episode[:n])
    assert builders[n].prompt().tolist() == render(tok, episode[:n], generation=True)


def test_text_and_sampled_actions_agree(tok):
  sampled = play(tok)[-1]
  text = SegmentBuilder(tok)
  for kind, content in EPISODE:
    text = text.append(kind, content)
  assert text.ids == sampled.ids and text.kinds == sampled.kinds


def test_earlier_tokens_never_change(tok):
  builders = play(tok)
  final_ids, final_kinds = builders[-1].arrays()
  for b in builders:
    ids, kinds = b.arrays()
    np.testing.assert_array_equal(final_ids[: len(ids)], ids)
    np.testing.assert_array_equal(final_kinds[: len(kinds)], kinds)
  appended = builders[3]  # immutability: appending to an old builder leaves it as it was
  appended.append(Kind.OBSERVATION, "more")
  assert appended.ids == builders[3].ids and len(appended) == len(builders[3].ids)


def test_prompt_is_prefix_of_the_sampled_turn(tok):
  builders = play(tok)
  for i, (kind, _) in enumerate(EPISODE):
    if kind == Kind.ACTION:
      prompt = builders[i].prompt().tolist()
      assert list(builders[i + 1].ids[: len(prompt)]) == prompt


def test_policy_mask_is_action_content_and_end_of_turn(tok):
  ids, kinds = play(tok)[-1].arrays()
  mask = policy_mask(kinds)
  assert mask.dtype == np.int32
  eot = tok.chat_format.end_of_turn
  actions = [text for kind, text in EPISODE if kind == Kind.ACTION]
  assert ids[mask == 1].tolist() == [i for a in actions for i in tok.encode(a) + [eot]]
  # Each policy span is contiguous, preceded by the assistant header and followed by non-policy tokens only.
  starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
  header = tok.chat_format.generation_prompt
  for s in starts:
    assert tuple(ids[s - len(header) : s]) == header
    assert set(kinds[s - len(header) : s].tolist()) == {Kind.ACTION_FRAME}
  assert len(starts) == len(actions)
  # Wrapper tokens of env segments carry their segment's kind: no PAD and no frame outside actions.
  assert Kind.PAD not in kinds and {Kind.SYSTEM, Kind.TASK, Kind.OBSERVATION} <= set(kinds.tolist())


def test_chatml_newline_after_end_of_turn_is_frame(folders):
  tok = load_tokenizer(folders["chatml"])
  b = SegmentBuilder(tok).append(Kind.TASK, "go").append_generated(sample(tok, "look"))
  assert tok.decode(b.ids[-2:]) == "<|im_end|>\n"
  assert b.kinds[-2:] == (Kind.ACTION, Kind.ACTION_FRAME)


def test_append_generated_stores_ids_verbatim(tok):
  base = SegmentBuilder(tok).append(Kind.TASK, "Task: look.")
  text = "open the fridge"
  # Byte-by-byte ids decode to the same text but are not what encode() gives: they must survive untouched.
  odd = [i for ch in text for i in tok.encode(ch)] + [tok.chat_format.end_of_turn]
  assert odd != sample(tok, text)
  b = base.append_generated(odd)
  start = len(base) + len(tok.chat_format.generation_prompt)
  assert list(b.ids[start : start + len(odd)]) == odd
  assert b.ids[start + len(odd) :] == tok.chat_format.assistant.suffix[1:]


def test_truncated_generation_gets_the_whole_suffix_as_frame(tok):
  base = SegmentBuilder(tok).append(Kind.TASK, "Task: look.")
  cut = tok.encode("open the fri")  # stopped by the length limit: no end-of-turn sampled
  b = base.append_generated(cut)
  suffix = tok.chat_format.assistant.suffix
  assert b.ids[-len(suffix) :] == suffix
  assert b.kinds[-len(suffix) :] == (Kind.ACTION_FRAME,) * len(suffix)
  assert policy_mask(b.arrays()[1]).sum() == len(cut)


def test_errors(tok, folders):
  empty = SegmentBuilder(tok)
  with pytest.raises(ValueError, match="prompt"):
    empty.prompt()
  with pytest.raises(ValueError, match="prompt"):
    empty.append_generated([1, 2])
  with pytest.raises(ValueError, match="kind"):
    empty.append(Kind.ACTION_FRAME, "x")
  with pytest.raises(ValueError, match="kind"):
    empty.append("task", "x")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    empty.append(Kind.TASK, "x").append_generated([tok.vocab_size])
  plain = load_tokenizer(folders["plain"])
  assert plain.chat_format is None
  with pytest.raises(ValueError, match="no chat template"):
    SegmentBuilder(plain).append(Kind.TASK, "x")
