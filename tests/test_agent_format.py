"""The agent's prompt and answer format: prompt layout against the HF chat template, history and admissible caps, and
a total answer parser (tabled errors, round trips, fuzzing, every truncation of a valid answer)."""

import random
import re

import pytest

from dreamjax.rollout.agent import (
    AgentFormat,
    ParsedAnswer,
    build_turn_prompt,
    choose_admissible,
    fit_history,
    format_answer,
    parse_answer,
    render_history,
    user_text,
)
from dreamjax.text import Kind, SegmentBuilder, train_bpe_tokenizer

STATE = "Location: kitchen\nYou see: stove, fridge (closed), coin\nExits: north to pantry\nInventory: nothing"
INSTRUCTION = "Your task is to find the coin.  Once you find the coin, take it."
ADMISSIBLE = ("inventory", "look around", "move north", "open fridge", "take coin")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  rooms = ["kitchen", "pantry", "corridor", "bedroom", "garden"]
  texts = [AgentFormat().system_text(), AgentFormat(think=False).system_text()]
  for i in range(200):
    state = STATE.replace("kitchen", rooms[i % 5]).replace("pantry", rooms[(i + 2) % 5])
    texts.append(user_text(AgentFormat(), INSTRUCTION, i % 7, [(state, "move north")] * (i % 3), state, ADMISSIBLE))
    texts.append(format_answer(ADMISSIBLE[i % 5], f"I am in the {rooms[i % 5]}."))
  return train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=500)


def _history(n):
  return [(STATE.replace("kitchen", f"room {i}"), f"move {i}") for i in range(n)]


def test_prompt_is_the_chat_template_of_system_and_user_messages(tok):
  fmt = AgentFormat(history_turns=2)
  history = _history(3)
  builder = build_turn_prompt(tok, fmt, INSTRUCTION, 5, history, STATE, ADMISSIBLE)
  messages = [{"role": "system", "content": fmt.system_text()},
              {"role": "user", "content": user_text(fmt, INSTRUCTION, 5, history[1:], STATE, ADMISSIBLE)}]
  expected = tok.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
  assert builder.prompt().tolist() == list(expected)
  ids, kinds = builder.arrays()
  system_len = len(SegmentBuilder(tok).append(Kind.SYSTEM, fmt.system_text()))
  assert set(kinds[:system_len]) == {Kind.SYSTEM} and set(kinds[system_len:]) == {Kind.OBSERVATION}
  text = tok.decode(builder.prompt())
  # the user message in the paper's order: task, steps taken, history (most recent last), state, admissible actions
  user = text[text.index("<|im_start|>user\n"):]
  order = [INSTRUCTION.replace("  ", " "), "Steps taken: 5", "Step 4 state: Location: room 1; You see:",
           "| action: move 1", "Step 5 state: Location: room 2", "| action: move 2", "Current state:\n" + STATE,
           "Admissible actions: inventory | look around | move north | open fridge | take coin"]
  positions = [user.index(s) for s in order]
  assert positions == sorted(positions) and "room 0" not in user and "move 0" not in user
  assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_system_text_follows_the_think_flag():
  assert "<think>" in AgentFormat().system_text() and "<think>" not in AgentFormat(think=False).system_text()
  assert AgentFormat(system_prompt="You cook.").system_text().startswith("You cook.\nAnswer as ")


def test_no_history_and_bad_step(tok):
  text = tok.decode(build_turn_prompt(tok, AgentFormat(), INSTRUCTION, 0, [], STATE, ()).prompt())
  assert "History: none" in text and "Admissible actions" not in text
  with pytest.raises(ValueError, match="step=1 with 2 history pairs"):
    build_turn_prompt(tok, AgentFormat(), INSTRUCTION, 1, _history(2), STATE, ADMISSIBLE)


def test_history_fits_its_token_budget_dropping_oldest_first(tok):
  history = _history(8)
  for budget in (0, 30, 100, 250, 10_000):
    fmt = AgentFormat(history_turns=6, history_token_budget=budget)
    kept = fit_history(tok, fmt, history, 8)
    assert kept == tuple(history[len(history) - len(kept):])  # a suffix: the most recent pairs
    assert len(tok.encode(render_history(fmt, kept, 8))) <= budget
    if len(kept) < 6:  # one more (older) pair would not fit
      assert len(tok.encode(render_history(fmt, history[len(history) - len(kept) - 1:], 8))) > budget
  assert len(fit_history(tok, AgentFormat(history_turns=6, history_token_budget=10_000), history, 8)) == 6
  assert fit_history(tok, AgentFormat(history_turns=0), history, 8) == ()
  assert render_history(AgentFormat(), history[-2:], 8).splitlines()[0].startswith(
      "Step 7 state: Location: room 6; You see: ")


def test_history_fields_keep_only_those_lines_of_history_states(tok):
  history = [(STATE.replace("Inventory:", "Inventory (max 5):") + "\nFeedback: The door is now open.", "move north")]
  fmt = AgentFormat(history_fields=("Location", "Inventory"))
  assert render_history(fmt, history, 1) == ("Step 1 state: Location: kitchen; Inventory (max 5): nothing "
                                             "| action: move north")
  text = user_text(fmt, INSTRUCTION, 1, history, STATE, ADMISSIBLE)
  assert text.count("You see: ") == 1 and "Current state:\n" + STATE in text  # the current state stays whole
  # A whole episode fits a budget that holds only a few whole states.
  long = _history(12)
  compact = fit_history(tok, AgentFormat(history_turns=12, history_token_budget=300, history_fields=("Location",)),
                        long, 12)
  assert len(compact) == 12 and len(fit_history(tok, AgentFormat(history_turns=12, history_token_budget=300),
                                                long, 12)) < 8
  for bad in ("Location", ("Location", ""), (3,)):
    with pytest.raises(ValueError, match="history_fields"):
      AgentFormat(history_fields=bad)


def test_repeat_task_puts_the_task_line_just_before_the_admissible_actions():
  lines = user_text(AgentFormat(repeat_task=True), INSTRUCTION, 0, (), STATE, ADMISSIBLE).splitlines()
  task = "Task: Your task is to find the coin. Once you find the coin, take it."
  assert lines[0] == lines[-2] == task and lines[-1].startswith("Admissible actions: ")
  assert user_text(AgentFormat(), INSTRUCTION, 0, (), STATE, ADMISSIBLE).count("Task: ") == 1


def test_admissible_actions_are_capped_deterministically():
  actions = tuple(f"take object {i:02d}" for i in range(60))
  fmt = AgentFormat(max_admissible=10)
  shown = choose_admissible(fmt, 3, STATE, actions)
  assert len(shown) == 10 and set(shown) <= set(actions) and list(shown) == sorted(shown, key=actions.index)
  assert shown == choose_admissible(fmt, 3, STATE, actions)
  assert shown != choose_admissible(fmt, 4, STATE, actions)  # another step draws another subset
  assert shown != actions[:10]
  assert choose_admissible(fmt, 3, STATE, actions[:10]) == actions[:10]
  text = user_text(fmt, INSTRUCTION, 3, [], STATE, actions)
  assert f"Admissible actions (10 of 60 shown): {' | '.join(shown)}" in text
  assert "Admissible" not in user_text(AgentFormat(max_admissible=0), INSTRUCTION, 3, [], STATE, actions)
  with pytest.raises(ValueError, match="max_admissible"):
    AgentFormat(max_admissible=-1)


@pytest.mark.parametrize("text, action, think", [
    ("<think>coin is here</think><action>take coin</action>", "take coin", "coin is here"),
    ("<action> take coin \n</action>", "take coin", ""),
    ("Sure. <think>x</think>\n<action>move north</action>", "move north", "x"),  # leading text is tolerated
    ("<think>a</think><action>open fridge</action><action>move north</action>", "open fridge", "a"),  # first wins
    ("<action>open fridge</action> trailing words", "open fridge", ""),
    ("</think><action>look</action>", "look", ""),  # a stray closing think tag outside the blocks is junk
    ("<action>put mug in/on table 1 < 2</action>", "put mug in/on table 1 < 2", ""),
])
def test_parse_answer_accepts(text, action, think):
  assert parse_answer(text) == ParsedAnswer(action, think, "")


@pytest.mark.parametrize("text, error", [
    ("", "empty answer"),
    ("  \n", "empty answer"),
    ("take coin", "no '<action>' tag"),
    ("<think>take coin</think>", "no '<action>' tag"),
    ("take coin</action>", "'</action>' without '<action>'"),
    ("</action><action>take coin</action>", "'</action>' before the first '<action>'"),
    ("<action>take coin", "unclosed '<action>'"),
    ("<action>take coin</act", "unclosed '<action>'"),
    ("<action>  </action>", "empty action"),
    ("<action><action>take coin</action></action>", "'<action>' nested inside the action"),
    ("<action>take <think>coin</think></action>", "'<think>' nested inside the action"),
    ("<think>I will <action>take coin</action>", "inside an unclosed '<think>'"),
    ("<think>a</think><think>b <action>x</action>", "inside an unclosed '<think>'"),
    ("<think>a <think>b</think></think><action>x</action>", "nested '<think>' tags"),
])
def test_parse_answer_rejects_with_a_named_error(text, error):
  parsed = parse_answer(text)
  assert parsed.action is None and error in parsed.error


def test_parse_answer_of_a_non_string():
  assert parse_answer(None).action is None and "NoneType" in parse_answer(None).error  # type: ignore[arg-type]


@pytest.mark.parametrize("action, think", [("take coin", ""), ("  move   north ", "the exit\nis north"),
                                           ("click [12]", "é ✓ <b>bold</b>"), ("a", "t")])
def test_format_answer_round_trips(action, think):
  text = format_answer(action, think)
  assert parse_answer(text) == ParsedAnswer(action.strip(), think.strip(), "")
  assert text.startswith("<think>" if think else "<action>") and text.endswith("</action>")


def test_format_answer_refuses_what_cannot_round_trip():
  for action, think in (("", ""), ("  ", "x"), ("take <action>", ""), ("go", "</think>")):
    with pytest.raises(ValueError, match="format_answer"):
      format_answer(action, think)


def test_every_truncation_of_a_valid_answer(tok):
  rng = random.Random(0)
  for _ in range(20):
    action = " ".join(rng.choice(["take", "coin", "move", "north", "1", "é"]) for _ in range(rng.randint(1, 4)))
    think = rng.choice(["", "I see the coin.", "multi\nline <b> reasoning"])
    text = format_answer(action, think)
    for cut in range(len(text)):
      parsed = parse_answer(text[:cut])
      assert parsed.action is None and parsed.error, text[:cut]
    assert parse_answer(text).action == action
    # the same holds on the token level, as a sampler cut by its token budget produces it
    ids = tok.encode(text)
    for cut in range(len(ids)):
      assert parse_answer(tok.decode(ids[:cut])).action is None
    assert parse_answer(tok.decode(ids)).action == action


def test_fuzzed_answers_never_raise_and_obey_the_rules():
  pieces = ["<action>", "</action>", "<think>", "</think>", "<", ">", "/", "action", "think", "take coin", " ", "\n",
            "x", "é", "<act", "ion>", "</", "\x00"]
  rng = random.Random(1)
  parsed_count = 0
  for i in range(4000):
    if i % 2:
      text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
    else:
      text = "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 30)))
    parsed = parse_answer(text)
    assert isinstance(parsed.think, str) and isinstance(parsed.error, str)
    assert (parsed.action is None) == bool(parsed.error)
    first = re.search(r"<action>(.*?)</action>", text, re.S)
    if parsed.action is not None:
      parsed_count += 1
      # the first complete block, stripped, with no tags in it and no stray closing tag before it
      assert first and parsed.action == first.group(1).strip() and parsed.action
      assert not any(t in parsed.action for t in ("<action>", "</action>", "<think>", "</think>"))
      assert "</action>" not in text[:first.start()]
  assert parsed_count > 20  # the fuzzer does reach the accepting paths


def test_valid_answers_inside_tag_free_junk():
  rng = random.Random(2)
  junk_pieces = ["<", ">", "/", "action", "think", " ", "\n", "x", "<act", "ion>", "</", "é"]
  for _ in range(500):
    junk = ["".join(rng.choice(junk_pieces) for _ in range(rng.randint(0, 6))) for _ in range(2)]
    if any(t in junk[0] + "<" for t in ("<action>", "</action>", "<think>", "</think>")):
      continue  # the junk must not form a tag, even glued to the answer's first "<"
    action, think = rng.choice(["take coin", "move north"]), rng.choice(["", "why"])
    assert parse_answer(junk[0] + format_answer(action, think) + junk[1]) == ParsedAnswer(action, think, "")
