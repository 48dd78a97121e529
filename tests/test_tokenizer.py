"""Tokenizer loading/training and chat formats derived from real (Llama 3.1, Qwen2.5) chat templates."""

import json
import pathlib
import random
import shutil

import pytest

from dreamjax.text import ChatFormat, Tokenizer, load_tokenizer, train_bpe_tokenizer

LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *LLAMA_SPECIALS)

# Structure of meta-llama/Llama-3.1-8B-Instruct's template (tools branches kept): BOS, a system block that is always
# emitted (knowledge/today dates, then the first system message if any), every content trimmed.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Structure of Qwen/Qwen2.5-7B-Instruct's template: no BOS, a default system message injected when the first message
# is not a system one, every message closed by "<|im_end|>\n".
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# meta-llama/Meta-Llama-3-8B-Instruct's template verbatim: BOS glued to the first message only, no system block.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONFIGS = {
    "llama3": {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    },
    "llama31": {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,  # as in the real checkpoint; decode must not apply it
        "model_max_length": 131072,
        "chat_template": LLAMA31_TEMPLATE,
    },
    "qwen25": {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": QWEN25_TEMPLATE,
    },
}

WORDS = "you are in a kitchen the fridge is closed open take apple from table go to sink north east look".split()
UNICODE = ["héllo wörld", "中文字符 and 日本語", "emoji 🤖🚀 zwj 👩‍💻", "tabs\tand\r\nnewlines\n\n", "  spaced  . , ! ",
           "a\u0301\x00"]


def corpus(n: int = 400) -> list[str]:
  rng = random.Random(0)
  sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) for _ in range(n))
  return [s + rng.choice([".", "?", "\n"]) for s in sentences]


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory) -> pathlib.Path:
  folder = tmp_path_factory.mktemp("chatml")
  train_bpe_tokenizer(corpus(), folder, vocab_size=400, special_tokens=SPECIALS)
  return folder


def template_folder(trained: pathlib.Path, target: pathlib.Path, name: str) -> pathlib.Path:
  """A checkpoint-like folder: our trained vocabulary under a real model family's config and template."""
  target.mkdir()
  shutil.copy(trained / "tokenizer.json", target / "tokenizer.json")
  (target / "tokenizer_config.json").write_text(json.dumps(CONFIGS[name]))
  return target


def build(tok: Tokenizer, messages: list[dict], generation: bool = False) -> list[int]:
  """A conversation assembled from the ChatFormat wrappers alone."""
  fmt: ChatFormat = tok.chat_format
  ids: list[int] = []
  for i, m in enumerate(messages):
    role = fmt.role(m["role"])
    content = m["content"].strip() if role.strip else m["content"]
    ids += [*(role.first if i == 0 else role.prefix), *tok.encode(content), *role.suffix]
  return ids + list(fmt.generation_prompt) * generation


CONVERSATIONS = [
    [("system", "You play a text game."), ("user", "Task: put a clean apple in the fridge."),
     ("user", "You see a table."), ("assistant", "go to table"), ("user", "On the table: an apple."),
     ("assistant", "take apple from table"),
     ("user", "You take the apple.")],
    [("user", "Task: look around.\n"), ("assistant", "  look  "), ("user", "Nothing happens. 🤖 中文"),
     ("system", "Late system note."), ("assistant", "open fridge")],
]


@pytest.mark.parametrize("name", ["chatml", "llama3", "llama31", "qwen25"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation", [False, True])
def test_chat_format_rebuilds_template(trained_folder, tmp_path, name, conversation, generation):
  folder = trained_folder if name == "chatml" else template_folder(trained_folder, tmp_path / name, name)
  tok = load_tokenizer(folder)
  messages = [{"role": r, "content": c} for r, c in conversation]
  expected = tok.hf.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=generation)
  assert build(tok, messages, generation) == list(expected)


def test_template_specifics(trained_folder, tmp_path):
  llama = load_tokenizer(template_folder(trained_folder, tmp_path / "llama", "llama31"))
  qwen = load_tokenizer(template_folder(trained_folder, tmp_path / "qwen", "qwen25"))
  tid = llama.hf.convert_tokens_to_ids
  # Llama 3.1 trims content, has no text after <|eot_id|>, and opens with BOS plus its dated system block.
  assert llama.chat_format.assistant.strip and llama.chat_format.assistant.suffix == (tid("<|eot_id|>"),)
  assert llama.bos_id == tid("<|begin_of_text|>") and llama.eos_ids == (tid("<|eot_id|>"),)
  assert llama.decode(llama.chat_format.user.first).startswith("<|begin_of_text|><|start_header_id|>system")
  assert "Cutting Knowledge Date" in llama.decode(llama.chat_format.system.first)
  assert llama.chat_format.user.prefix == tuple(llama.encode("<|start_header_id|>user<|end_header_id|>\n\n"))
  llama3 = load_tokenizer(template_folder(trained_folder, tmp_path / "llama3", "llama3"))
  fmt = llama3.chat_format  # Llama 3.0 glues BOS to whichever message comes first and injects nothing else.
  assert all(r.first == (tid("<|begin_of_text|>"), *r.prefix) for r in (fmt.system, fmt.user, fmt.assistant))
  # Qwen2.5 keeps whitespace, closes every turn with "<|im_end|>\n", injects a default system message, has no BOS.
  assert not qwen.chat_format.user.strip
  assert qwen.decode(qwen.chat_format.assistant.suffix) == "<|im_end|>\n"
  assert "You are Qwen" in qwen.decode(qwen.chat_format.user.first)
  assert qwen.decode(qwen.chat_format.system.first) == "<|im_start|>system\n"
  assert qwen.bos_id is None and qwen.eos_ids == (tid("<|im_end|>"),)
  assert qwen.pad_id == tid("<|endoftext|>")


def test_trained_tokenizer_loads_back(trained_folder):
  tok = load_tokenizer(trained_folder)
  again = load_tokenizer(trained_folder)
  assert sorted(p.name for p in trained_folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
  ids = tok.hf.convert_tokens_to_ids
  assert 256 + len(SPECIALS) <= tok.vocab_size <= 400
  assert (tok.bos_id, tok.pad_id, tok.eos_ids) == (ids("<|endoftext|>"), ids("<|endoftext|>"), (ids("<|im_end|>"),))
  assert tok.chat_format.end_of_turn == ids("<|im_end|>")
  assert tok.encode("go to the fridge") == again.encode("go to the fridge")
  assert len(tok.encode("go to the fridge")) < len("go to the fridge")  # merges were learned


def test_training_is_deterministic(tmp_path):
  a = train_bpe_tokenizer(corpus(), tmp_path / "a", vocab_size=320)
  b = train_bpe_tokenizer(corpus(), tmp_path / "b", vocab_size=320)
  assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
  assert a.encode("open the fridge") == b.encode("open the fridge")


@pytest.mark.parametrize("text", UNICODE)
def test_unicode_round_trip(trained_folder, text):
  tok = load_tokenizer(trained_folder)
  assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_and_skippable(trained_folder):
  tok = load_tokenizer(trained_folder)
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_ids[0]
  assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_missing_folder_and_files(tmp_path, trained_folder):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    load_tokenizer(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty.*tokenizer\.json and no tokenizer_config\.json"):
    load_tokenizer(tmp_path / "empty")
  half = tmp_path / "half"
  half.mkdir()
  shutil.copy(trained_folder / "tokenizer_config.json", half)
  with pytest.raises(FileNotFoundError, match=r"half.*no tokenizer\.json"):
    load_tokenizer(half)


def test_broken_config_names_folder(tmp_path, trained_folder):
  broken = tmp_path / "broken"
  broken.mkdir()
  shutil.copy(trained_folder / "tokenizer.json", broken)
  (broken / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="broken"):
    load_tokenizer(broken)


@pytest.mark.parametrize(
    "template, message",
    [
        # The message count is rendered after the messages: adding one rewrites earlier text.
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages|length }}", "changes the text before"),
        # Role alternation enforced: some role orders cannot be rendered at all.
        ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}{{ raise_exception('user first') }}"
         "{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}", "failed"),
        # The content is rewritten (upper-cased), so it cannot be found in the rendering.
        ("{% for m in messages %}{{ m['content']|upper }}<|im_end|>{% endfor %}", "not rendered verbatim"),
    ],
)
def test_unsplittable_template_is_a_clear_error(tmp_path, trained_folder, template, message):
  folder = tmp_path / "odd"
  folder.mkdir()
  shutil.copy(trained_folder / "tokenizer.json", folder)
  config = json.loads((trained_folder / "tokenizer_config.json").read_text()) | {"chat_template": template}
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=f"cannot be split.*{message}"):
    load_tokenizer(folder)


def test_bad_training_arguments(tmp_path):
  with pytest.raises(ValueError, match="ChatML"):
    train_bpe_tokenizer(corpus(10), tmp_path / "x", special_tokens=("<|endoftext|>",))
  with pytest.raises(ValueError, match="vocab_size"):
    train_bpe_tokenizer(corpus(10), tmp_path / "y", vocab_size=100)
