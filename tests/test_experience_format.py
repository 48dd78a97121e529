"""The experience model's prompt/target format: exact rendering, round trips, a total parser (fuzzed), SFT masks."""

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest

from dreamjax.data.records import StepRecord, TrajectoryRecord, Transition, transitions
from dreamjax.envs.base import Task
from dreamjax.experience.format import (
    FAILURE_STATE,
    TAGS,
    ExpFormatConfig,
    ExpPrediction,
    action_lists,
    action_edit_text,
    apply_action_edits,
    apply_state_changes,
    build_prompt,
    parse_output,
    render_target,
    render_user,
    sft_example,
    state_change_text,
    system_prompt,
    transition_example,
    transition_target,
)
from dreamjax.text import Kind, load_tokenizer, train_bpe_tokenizer
from tests.test_segments import LLAMA_STYLE, SPECIALS

STATE = "Location: kitchen\nYou see: fridge (closed), counter (knife, apple 🍎)\nInventory: nothing"
NEXT = "Location: kitchen\nYou see: fridge (open: milk), counter (knife, apple 🍎)\nInventory: nothing\nFeedback: Ok."
ON, OFF = ExpFormatConfig(), ExpFormatConfig(reasoning=False)
BARE = ExpFormatConfig(reasoning=False, actions=False)  # neither think nor actions block
CHANGES = ExpFormatConfig(state_changes=True)  # the next state as its changed lines
EDITS = ExpFormatConfig(state_changes=True, list_edits=True)  # and changed comma lists as item edits
ACTS = ("open fridge", "take apple 🍎", "go  north ")  # kept verbatim, in the env's order
ACTION_EDITS = ExpFormatConfig(action_edits=True)  # the next list as edits of the current one


@pytest.fixture(scope="module", params=["chatml", "llama"])
def tok(request, tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  rng = random.Random(0)
  words = "location kitchen you see fridge open closed take apple reward done true false think state".split()
  texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".\n" for _ in range(300)]
  train_bpe_tokenizer(texts, root / "chatml", vocab_size=380, special_tokens=SPECIALS)
  if request.param == "llama":
    config = json.loads((root / "chatml" / "tokenizer_config.json").read_text())
    (root / "llama").mkdir()
    shutil.copy(root / "chatml" / "tokenizer.json", root / "llama")
    variant = config | {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA_STYLE}
    (root / "llama" / "tokenizer_config.json").write_text(json.dumps(variant))
  return load_tokenizer(root / request.param)


def _transition(i: int, reward: float = 0.0, done: bool = False, success: bool = False) -> Transition:
  task = Task.make("textworld_express", f"coin/train/{i}", "Find the coin.", game="coin", seed=i)
  return Transition(f"expert:coin/train/{i}", i, task, "Find the coin.", f"Location: room {i}", f"move {i}",
                    f"Location: room {i + 1}", reward, done, success, False)


# --- target and parser -----------------------------------------------------------------------------------------------


def test_target_text_is_exact():
  assert render_target(ON, "The fridge opens.", NEXT, 0.0, False, False, admissible=ACTS[:2]) == (
      f"<think>\nThe fridge opens.\n</think>\n<next_state>\n{NEXT}\n</next_state>\n"
      "<actions>\nopen fridge\ntake apple 🍎\n</actions>\n<invalid>false</invalid>\n"
      "<reward>0</reward>\n<done>false</done>\n<success>false</success>")
  assert render_target(OFF, "ignored", "s", 1.0, True, True) == (
      "<next_state>\ns\n</next_state>\n<actions>\n</actions>\n<invalid>false</invalid>\n<reward>1</reward>\n"
      "<done>true</done>\n<success>true</success>")
  assert render_target(BARE, "ignored", "s", 1.0, True, True, admissible=ACTS) == (
      "<next_state>\ns\n</next_state>\n<invalid>false</invalid>\n<reward>1</reward>\n<done>true</done>\n"
      "<success>true</success>")
  assert "</actions>\n<invalid>true</invalid>\n<reward>0</reward>" in render_target(ON, "", "s", 0.0, True, False,
                                                                                   invalid=True)


@pytest.mark.parametrize("cfg", [ON, OFF, BARE], ids=["reasoning", "no_reasoning", "no_actions"])
@pytest.mark.parametrize("outcome", [(0.0, False, False, False), (0.0, True, False, False), (1.0, True, True, False),
                                     (0.0, False, False, True), (0.0, True, False, True)])
@pytest.mark.parametrize("reasoning, state", [
    ("why", NEXT), ("", "x"), ("  two\nlines  \n", "\nleading and trailing newline\n"), ("é ✓ 🍎 \t", "Ünïcødé: ✓")])
@pytest.mark.parametrize("admissible", [(), ACTS[:1], ACTS], ids=["no_actions", "one_action", "actions"])
def test_round_trip(cfg, outcome, reasoning, state, admissible):
  reward, done, success, invalid = outcome
  admissible = () if done else admissible  # a finished episode lists none
  target = render_target(cfg, reasoning, state, reward, done, success, invalid=invalid, admissible=admissible)
  p = parse_output(target, cfg)
  assert p == ExpPrediction(state, reward, done, success, reasoning if cfg.reasoning else "", True, "", invalid,
                            admissible if cfg.actions else ())
  # Whitespace around the whole output (a decoded stop token's neighbourhood) does not matter.
  assert parse_output("\n  " + target + " \n", cfg) == p


@pytest.mark.parametrize("args, message", [
    (("r", "s", 1.0, False, True), "success is true but done is false"),
    (("r", "s", 1.0, True, False), "reward is 1 but success is false"),
    (("r", "s", 0.0, True, True), "success is true but the reward is 0"),
    (("r", "s", 0.5, True, False), "not 0 or 1"),
    (("r", "s", 1.0, True, True, True), "invalid is true but success is true"),
    (("a </think> b", "s", 0.0, False, False), "reasoning contains the format tag '</think>'"),
    (("r", "s <reward>1</reward>", 0.0, False, False), "next_state contains the format tag '<reward>'"),
    (("r", " \n", 0.0, False, False), "next_state is empty"),
    (("r", "s", 0.0, True, False, False, ("look",)), "done is true but 1 admissible actions are listed"),
    (("r", "s", 0.0, False, False, False, ("a", " ")), "the admissible action ' ' is not one non-empty line"),
    (("r", "s", 0.0, False, False, False, ("a\nb",)), "the admissible action 'a.{2}b' is not one non-empty line"),
    (("r", "s", 0.0, False, False, False, ("a\r",)), "is not one non-empty line"),
    (("r", "s", 0.0, False, False, False, ("say </actions>",)), "contains the format tag '</actions>'"),
])
def test_render_target_refuses_bad_targets(args, message):
  with pytest.raises(ValueError, match=message):
    render_target(ON, *args)


def test_state_changes_are_exact_and_round_trip():
  assert state_change_text(STATE, NEXT) == "You see: fridge (open: milk), counter (knife, apple 🍎)\nFeedback: Ok."
  assert state_change_text(NEXT, STATE) == "-Feedback\nYou see: fridge (closed), counter (knife, apple 🍎)"
  assert state_change_text(STATE, STATE) == "(no change)"
  assert state_change_text(STATE, "Location: hall") == "-You see\n-Inventory\nLocation: hall"
  for before, after in [(STATE, NEXT), (NEXT, STATE), (STATE, STATE), (NEXT, "Location: hall")]:
    assert apply_state_changes(before, state_change_text(before, after)) == (after, "")
    target = render_target(CHANGES, "why", after, 0.0, False, False, admissible=ACTS, state=before)
    assert f"<next_state>\n{state_change_text(before, after)}\n</next_state>\n<actions>" in target
    # The parser applies the changes: a prediction always holds the whole next state.
    assert parse_output(target, CHANGES, before) == ExpPrediction(after, 0.0, False, False, "why", True, "", False,
                                                                  ACTS)
  assert "\"-Field\"" in system_prompt(CHANGES) and "the whole next state" not in system_prompt(CHANGES)
  # A recorded transition's target is taken against its own state.
  t = _transition(3)
  assert "<next_state>\nLocation: room 4\n</next_state>" in transition_target(CHANGES, t, "", ())


@pytest.mark.parametrize("before, after, message", [
    ("A: 1\nB: 2", "B: 2\nA: 1", "fields reordered"),
    ("A: 1\nA: 2", "A: 1\nA: 3", "sets a field the current state holds 2 times"),
    ("A: 1", "A: 1\nfree text", "neither \"Field: value\" nor \"-Field\""),
])
def test_state_changes_refuse_states_they_cannot_rebuild(before, after, message):
  with pytest.raises(ValueError, match=message):
    state_change_text(before, after)
  t = dataclasses.replace(_transition(2), state=before, next_state=after)
  with pytest.raises(ValueError, match="episode 'expert:coin/train/2', step 2: .*state_changes=False"):
    transition_target(CHANGES, t, "", ())
  with pytest.raises(ValueError, match="no current state is given"):
    render_target(CHANGES, "why", NEXT, 0.0, False, False)


# twc's own transitions (runs/reproduce/twc/data): take, take, put in.
PANTRY = "Location: pantry\nYou see: folding chair (empty), shelf (empty), flour, yellow onion\nInventory: nothing"
TOOK = "Location: pantry\nYou see: folding chair (empty), shelf (empty), yellow onion\nInventory: flour\nFeedback: Hm."
TOOK2 = "Location: pantry\nYou see: folding chair (empty), shelf (empty)\nInventory: flour, yellow onion\nFeedback: Hm."
PUT = "Location: pantry\nYou see: folding chair (empty), shelf (flour)\nInventory: yellow onion\nFeedback: Hm."


def test_list_edits_write_only_the_items_that_change():
  assert state_change_text(PANTRY, TOOK, list_edits=True) == "You see -= flour\nInventory: flour\nFeedback: Hm."
  assert state_change_text(TOOK, TOOK2, list_edits=True) == "You see -= yellow onion\nInventory += yellow onion"
  assert state_change_text(TOOK2, PUT, list_edits=True) == "You see ~= shelf (flour)\nInventory -= flour"
  # Commas (and colons) inside parentheses stay in their item; edits naming more items than the line give the line,
  # and the count, not the length, decides: "Inventory -= white coat" though "Inventory: beret" is shorter.
  assert state_change_text(STATE, NEXT, list_edits=True) == "You see ~= fridge (open: milk)\nFeedback: Ok."
  assert state_change_text("A: x (1, 2), y", "A: x (1, 2, 3), y", list_edits=True) == "A ~= x (1, 2, 3)"
  assert state_change_text("A: big table, chair, long bench, stool", "A: big table, long bench",
                           list_edits=True) == "A -= chair\nA -= stool"
  assert state_change_text("A: p, q, r, s", "A: q, r", list_edits=True) == "A -= p\nA -= s"
  assert state_change_text("A: p, q, r, s", "A: q", list_edits=True) == "A: q"
  assert state_change_text("Inventory: beret, white coat", "Inventory: beret", list_edits=True) \
      == "Inventory -= white coat"
  assert state_change_text("Inventory: nothing", "Inventory: flour", list_edits=True) == "Inventory: flour"
  for before, after in [(PANTRY, TOOK), (TOOK, TOOK2), (TOOK2, PUT), (PUT, PANTRY), (STATE, NEXT), (NEXT, STATE)]:
    text = state_change_text(before, after, list_edits=True)
    assert apply_state_changes(before, text) == (after, "")
    target = render_target(EDITS, "why", after, 0.0, False, False, admissible=ACTS, state=before)
    assert f"<next_state>\n{text}\n</next_state>" in target
    assert parse_output(target, EDITS, before).next_state == after
    assert parse_output(target, CHANGES, before).next_state == after  # the parser reads edits without the switch
  assert "\"Field ~= item\"" in system_prompt(EDITS) and "~=" not in system_prompt(CHANGES)
  with pytest.raises(ValueError, match="needs state_changes=True"):
    ExpFormatConfig(list_edits=True)


# A sorted list, as TextWorld-Express lists them: an added action goes in its sorted place.
HERE = ("inventory", "look around", "open fridge", "take apple", "take flour")
TAKEN = ("inventory", "look around", "open fridge", "put flour in shelf", "put flour in table", "take apple")


def test_action_edits_write_only_the_actions_that_change():
  assert action_edit_text(HERE, TAKEN) == "- take flour\n+ put flour in shelf\n+ put flour in table"
  assert action_edit_text(HERE, HERE) == "(no change)"
  assert action_edit_text(HERE, ()) == ""  # the episode ended: an empty block
  assert action_edit_text(("a", "b", "c", "d"), ("b",)) == "b"  # edits no shorter than the list give the list
  assert action_edit_text(("b", "a"), ("b", "a", "c")) == "+ c"
  assert action_edit_text(("b", "a"), ("c", "b", "a")) == "c\nb\na"  # an order the insertion rule cannot rebuild
  assert action_edit_text((), ACTS) == "\n".join(ACTS)
  for before, after in [(HERE, TAKEN), (TAKEN, HERE), (HERE, HERE), (HERE, ()), ((), ACTS), (ACTS, ACTS[1:])]:
    text = action_edit_text(before, after)
    assert apply_action_edits(before, text) == (after, "")
    target = render_target(ACTION_EDITS, "why", NEXT, 0.0, not after, False, admissible=after,
                           current_admissible=before)
    assert f"<actions>\n{text}\n</actions>" in target if text else "<actions>\n</actions>" in target
    assert parse_output(target, ACTION_EDITS, admissible=before).admissible == after
  # Without the switch the block is the whole list, read as it is, and the system prompt is the one earlier M_exp
  # checkpoints were trained on.
  assert parse_output(render_target(ON, "why", NEXT, 0.0, False, False, admissible=TAKEN, current_admissible=HERE),
                      ON).admissible == TAKEN
  assert "\"- action\"" in system_prompt(ACTION_EDITS) and "- action" not in system_prompt(ON)
  assert ("<actions>\nthe actions admissible in the next state, one per line, in the environment's order (none when "
          "the episode ends)\n</actions>") in system_prompt(ON)
  with pytest.raises(ValueError, match="needs actions=True"):
    ExpFormatConfig(actions=False, action_edits=True)
  with pytest.raises(ValueError, match="read as action edits; this env needs ExpFormatConfig\\(action_edits=False\\)"):
    action_edit_text(("x",), ("- y", "+ z"))


@pytest.mark.parametrize("block, error", [
    ("\n- take coin\n", "the edit '- take coin' removes an action the current list does not hold"),
    ("\n+ take flour\n", "the edit '+ take flour' adds an action the current list already holds"),
    ("\n- take flour\n- take flour\n", "the edit '- take flour' removes an action the current list does not hold"),
])
def test_unusable_action_edits_are_failure_outcomes(block, error):
  p = parse_output(_good(actions=block), ACTION_EDITS, admissible=HERE)
  assert not p.ok and p.next_state == FAILURE_STATE and p.error == f"<actions>: {error}"
  assert parse_output(_good(actions=block), ON, admissible=HERE).ok  # read as a whole list without the switch


@pytest.mark.parametrize("changes, state, error", [
    ("You see -= milk", STATE, "removes the item 'milk', which the field does not hold"),
    ("You see ~= table (clean)", STATE, "replaces the item named 'table', which the field holds 0 times"),
    ("Exits += north", STATE, "edits a field the current state does not hold once"),
    ("-Nope", STATE, "removes a field the current state does not hold once"),
    ("garbage", STATE, "is neither \"Field: value\" nor \"-Field\""),
    ("-Location\n-You see\n-Inventory", STATE, "the changes remove every line of the state"),
    ("Location: hall", "", "no current state to apply the <next_state> changes to"),
])
def test_unusable_state_changes_are_failure_outcomes(changes, state, error):
  text = _good(next_state=changes)
  p = parse_output(text, CHANGES, state)
  assert not p.ok and p.next_state == FAILURE_STATE and error in p.error
  assert parse_output(text, ON, state).ok  # the whole-state format reads the same block as a state


def _good(**parts) -> str:
  blocks = {"think": "\nwhy\n", "next_state": "\nstate\n", "actions": "\nlook\n", "invalid": "false", "reward": "0",
            "done": "false", "success": "false"} | parts
  return "\n".join(f"<{t}>{blocks[t]}</{t}>" for t in TAGS if blocks[t] is not None)


@pytest.mark.parametrize("text, error", [
    ("", "missing <think>"),
    ("just some words", "missing <think>"),
    (_good(think=None), "missing <think>"),
    (_good(next_state=None), "missing <next_state>"),
    (_good(success=None), "missing <success>"),
    (_good(invalid=None), "missing <invalid>"),
    (_good(invalid="no"), "<invalid> is 'no', expected true or false"),
    (_good(invalid="true", reward="1", done="true", success="true"),
     "inconsistent outcome: invalid is true but success is true"),
    (_good()[:-3], "missing </success> (output cut off?)"),
    ("Sure! " + _good(), "unexpected text before <think>: 'Sure!'"),
    (_good() + " and more", "unexpected text after </success>: 'and more'"),
    (_good() + "\n<reward>1</reward>", "duplicated <reward>"),
    (_good(next_state="a<next_state>b"), "<next_state> block contains <next_state> (duplicated or nested tag)"),
    (_good(think="a<reward>1</reward>"), "<think> block contains <reward> (duplicated or nested tag)"),
    ("<think>x</think><think>y</think>" + _good(think=None), "duplicated or misplaced <think> before <next_state>"),
    (_good(reward="yes"), "<reward> is 'yes', expected 0 or 1"),
    (_good(reward="0.5"), "<reward> is '0.5', expected 0 or 1"),
    (_good(reward="nan"), "<reward> is 'nan', expected 0 or 1"),
    (_good(reward=""), "<reward> is '', expected 0 or 1"),
    (_good(done="maybe"), "<done> is 'maybe', expected true or false"),
    (_good(success="1"), "<success> is '1', expected true or false"),
    (_good(next_state="\n  \n"), "empty <next_state>"),
    (_good(reward="1", done="false", success="false"), "inconsistent outcome: reward is 1 but success is false"),
    (_good(reward="1", done="false", success="true"), "inconsistent outcome: success is true but done is false"),
    (_good(reward="0", done="true", success="true"), "inconsistent outcome: success is true but the reward is 0"),
    (_good(reward="1", done="true", success="false"), "inconsistent outcome: reward is 1 but success is false"),
    ("<THINK>x</THINK>", "missing <think>"),
    (_good(actions=None), "missing <actions>"),
    (_good(actions="\nlook\n\ntake coin\n"), "an empty line in <actions>"),
    (_good(actions="\nlook\r\n"), "<actions>: the admissible action 'look\\r' is not one non-empty line"),
    (_good(actions="\nlook<done>\n"), "<actions> block contains <done> (duplicated or nested tag)"),
    (_good(actions="\nlook\n</actions>\n<actions>"), "duplicated or misplaced <actions> before <invalid>"),
    (_good()[:_good().index("</actions>")], "missing </actions> (output cut off?)"),
    (_good(actions=None).replace("</invalid>", "</invalid>\n<actions>\n</actions>"),
     "duplicated or misplaced <invalid> before <actions>"),
    (_good(reward="0", done="true"), "inconsistent outcome: done is true but 1 admissible actions are listed"),
])
def test_malformed_outputs_are_failure_outcomes(text, error):
  p = parse_output(text, ON)
  assert (p.ok, p.error, p.next_state, p.reward, p.done, p.success, p.invalid) == (
      False, error, FAILURE_STATE, 0.0, True, False, False)


def test_parser_edge_cases():
  # lenient on value spelling only
  assert parse_output(_good(actions="\n", reward=" 1.0 ", done="TRUE", success="True"), ON).ok
  assert parse_output(_good(invalid=" True "), ON).invalid
  assert parse_output(_good(think=None), OFF).ok
  assert parse_output(_good(), OFF).error == "unexpected <think> block: reasoning is off in this format"
  assert parse_output(_good(think=None, actions=None), BARE).ok
  assert parse_output(_good(think=None), BARE).error == "unexpected <actions> block: actions are off in this format"
  # The actions block is read line by line, verbatim; an empty block (with or without its newlines) lists none.
  assert parse_output(_good(actions="\n a b \nc\n"), ON).admissible == (" a b ", "c")
  for empty in ("", "\n", "\n\n"):
    p = parse_output(_good(actions=empty, reward="1", done="true", success="true"), ON)
    assert p.ok and p.admissible == (), empty
  assert parse_output(None, ON).error == "output is a NoneType, not text"  # type: ignore[arg-type]
  # The reasoning read before the failure is kept, for logs.
  assert parse_output(_good(reward="x"), ON).reasoning == "why"


def test_parser_is_total_under_fuzzing():
  rng = random.Random(0)
  cfgs = (ON, OFF, BARE, CHANGES, EDITS, ACTION_EDITS)  # every output is read against STATE and ACTS
  nexts = {cfg: [("why", NEXT), ("", "Location: é")] if cfg.state_changes else [("why", NEXT), ("", "é")]
           for cfg in cfgs}
  valid = {cfg: [render_target(cfg, r, s, *o, admissible=() if o[1] else ACTS[1:], state=STATE, current_admissible=ACTS)
                 for r, s in nexts[cfg]
                 for o in [(0.0, False, False, False), (1.0, True, True, False), (0.0, True, False, True)]]
           for cfg in cfgs}
  # Every strict prefix of a valid output is a failure (the last tag is cut), and never raises.
  for cfg in cfgs:
    for text in valid[cfg]:
      assert parse_output(text, cfg, STATE, ACTS).ok
      for n in range(len(text)):
        p = parse_output(text[:n], cfg, STATE, ACTS)
        assert not p.ok and p.error and p.next_state == FAILURE_STATE, (n, text[:n])
  pieces = ["<think>", "</think>", "<next_state>", "</next_state>", "<actions>", "</actions>", "<invalid>", "</invalid>",
            "<reward>", "</reward>", "<done>", "</done>", "<success>", "</success>", "0", "1", "true", "false", "\n",
            " ", "é", "🍎", "\x00", "<", ">", "/", "\u202e",
            "nan", "1e0", "-0", "𝟙", "\ud800"]
  for _ in range(3000):
    kind = rng.random()
    if kind < 0.4:  # random token soup
      text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
    elif kind < 0.8:  # a valid output with random edits
      chars = list(rng.choice(valid[rng.choice(cfgs)]))
      for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(chars) + 1)
        op = rng.random()
        if op < 0.4 and chars:
          del chars[min(at, len(chars) - 1)]
        elif op < 0.8:
          chars.insert(at, rng.choice(pieces))
        else:
          chars[at:at] = list(rng.choice(valid[rng.choice(cfgs)]))  # duplicated blocks
      text = "".join(chars)
    else:  # arbitrary unicode
      text = "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randint(0, 40)))
    for cfg in cfgs:
      p = parse_output(text, cfg, STATE, ACTS)
      assert isinstance(p, ExpPrediction) and isinstance(p.error, str)
      if p.ok:  # whatever parses is a consistent outcome, a real state and a renderable list
        assert p.error == "" and p.next_state.strip() and p.next_state != FAILURE_STATE
        assert (p.reward, p.done, p.success) in [(0.0, False, False), (0.0, True, False), (1.0, True, True)]
        assert not (p.invalid and p.success) and not (p.done and p.admissible)
        assert all(a.strip() and "\n" not in a and "\r" not in a for a in p.admissible)
        assert cfg.actions or not p.admissible
      else:
        assert p.error and (p.reward, p.done, p.success, p.invalid, p.next_state, p.admissible) == (
            0.0, True, False, False, FAILURE_STATE, ())


# --- prompt ----------------------------------------------------------------------------------------------------------


def test_user_message_is_exact():
  cfg = ExpFormatConfig(max_history=2, k=1, tutorial=True)
  history = [("s0", "a0"), ("s1", "a1"), ("s2", "a2")]
  retrieved = [_transition(7, 1.0, True, True), _transition(8)]
  text = render_user(cfg, "Find the coin.", history, retrieved, "s3", "take coin", tutorial="Plan: look.")
  assert text == (
      "# Task\nFind the coin.\n\n"
      "# Tutorial\nPlan: look.\n\n"
      "# Similar past transitions\n## Example 1\nState:\nLocation: room 7\nAction: move 7\nNext state:\n"
      "Location: room 8\nInvalid: false, reward: 1, done: true, success: true\n\n"
      "# History, oldest first (1 earlier steps not shown)\n## Step 2\nState:\ns1\nAction: a1\n\n"
      "## Step 3\nState:\ns2\nAction: a2\n\n"
      "# Current state (step 4)\ns3\n\n# Action\ntake coin")


def test_admissible_actions_section():
  cfg = ExpFormatConfig(max_state_chars=24)
  text = render_user(cfg, "t", [], [], "s", "look", admissible=ACTS)
  # just before the current state, clipped like a state
  assert text.endswith("# Admissible actions in the current state\nopen fridge\ntake appl...\n\n"
                       "# Current state (step 1)\ns\n\n# Action\nlook")
  for off in (dataclasses.replace(cfg, actions=False), cfg):  # the switch off, or an env that lists nothing
    shown = render_user(off, "t", [], [], "s", "look", admissible=ACTS if off is not cfg else ())
    assert "# Admissible" not in shown and shown.endswith("# Current state (step 1)\ns\n\n# Action\nlook")
  assert "<actions>" in system_prompt(ON) and "<actions>" not in system_prompt(BARE)


def test_switches_drop_sections_entirely():
  args = ("Find the coin.", [("s0", "a0")], [_transition(1)], "s1", "look")
  full = render_user(ExpFormatConfig(tutorial=True), *args, tutorial="T")
  assert all(h in full for h in ("# Tutorial", "# Similar past transitions", "# History"))
  for cfg, gone in [(ExpFormatConfig(retrieval=False), "# Similar"), (ExpFormatConfig(k=0), "# Similar"),
                    (ExpFormatConfig(history=False), "# History"), (ExpFormatConfig(max_history=0), "# History"),
                    (ExpFormatConfig(), "# Tutorial")]:
    text = render_user(cfg, *args, tutorial="T")
    assert gone not in text and text.endswith("# Current state (step 2)\ns1\n\n# Action\nlook")
  assert render_user(ExpFormatConfig(tutorial=True), *args, tutorial="  ") == render_user(ExpFormatConfig(), *args)
  assert "<think>" in system_prompt(ON) and "<think>" not in system_prompt(OFF)
  assert "# History" not in render_user(ON, "t", [], [], "s", "a") and "# Similar" not in render_user(ON, "t", [], [],
                                                                                                      "s", "a")


def test_states_are_clipped_in_prompts_only():
  cfg = ExpFormatConfig(max_state_chars=20)
  long = "x" * 50
  text = render_user(cfg, "t", [(long, "a")], [_transition(1)], long, "a")
  assert "x" * 17 + "..." in text and "x" * 18 not in text
  assert long in render_target(cfg, "", long, 0.0, False, False)
  with pytest.raises(ValueError, match="max_history"):
    ExpFormatConfig(max_history=-1)


def test_step_index_numbers_a_truncated_history():
  cfg = ExpFormatConfig(max_history=1)
  assert "# History, oldest first (9 earlier steps not shown)\n## Step 10\n" in render_user(
      cfg, "t", [("s", "a")], [], "s", "b", step=10)
  assert "# Current state (step 11)" in render_user(cfg, "t", [("s", "a")], [], "s", "b", step=10)


# --- SFT examples ----------------------------------------------------------------------------------------------------


def test_sft_example_masks_exactly_the_target(tok):
  target = render_target(ON, "The fridge opens.", NEXT, 0.0, False, False)
  builder = build_prompt(tok, ON, "Open the fridge.", [("s0", "look")], [_transition(1)], STATE, "open fridge")
  ex = sft_example(tok, ON, "Open the fridge.", [("s0", "look")], [_transition(1)], STATE, "open fridge", target)
  prompt = builder.prompt()
  start = int(np.argmax(ex.loss_mask))
  assert start == len(prompt) and np.array_equal(ex.ids[:start], prompt)  # sampling prompt == training prefix
  eot = tok.decode([tok.chat_format.end_of_turn])
  assert tok.decode(ex.ids[ex.loss_mask == 1]) == target + eot
  assert ex.loss_mask.sum() == len(tok.encode(target)) + 1
  assert set(np.unique(ex.kinds[: len(prompt)])) <= {Kind.SYSTEM, Kind.TASK, Kind.ACTION_FRAME}
  assert ex.ids.dtype == ex.kinds.dtype == ex.loss_mask.dtype == np.int32
  # Sampled ids of the same target give the same tokens (token-in/token-out for M_exp as for the policy).
  sampled = builder.append_generated(tok.encode(target) + [tok.chat_format.end_of_turn])
  assert np.array_equal(sampled.arrays()[0], ex.ids)
  # Deterministic: a rebuild gives identical ids.
  again = sft_example(tok, ON, "Open the fridge.", [("s0", "look")], [_transition(1)], STATE, "open fridge", target)
  assert np.array_equal(again.ids, ex.ids)


def test_instructions_switch_shortens_only_the_system_message(tok):
  # Off, the system message names the job and nothing else; the user message and the target are the same tokens.
  brief = dataclasses.replace(ON, instructions=False)
  assert system_prompt(brief) == "You simulate an interactive environment for an agent."
  assert system_prompt(ON).startswith(system_prompt(brief) + " You are given the agent's task")
  assert len(system_prompt(ON)) > 10 * len(system_prompt(brief))
  target = render_target(ON, "The fridge opens.", NEXT, 0.0, False, False, admissible=ACTS)
  args = ("Open the fridge.", [("s0", "look")], [_transition(1)], STATE, "open fridge", target)
  full, short = sft_example(tok, ON, *args), sft_example(tok, brief, *args)
  rest = [len(ex.ids) - int(np.argmax(ex.kinds == Kind.TASK)) for ex in (full, short)]  # from the user message on
  assert rest[0] == rest[1] and np.array_equal(full.ids[-rest[0]:], short.ids[-rest[1]:])
  assert np.array_equal(full.loss_mask[-rest[0]:], short.loss_mask[-rest[1]:])
  assert render_target(brief, "The fridge opens.", NEXT, 0.0, False, False, admissible=ACTS) == target


def test_transition_example_from_records(tok):
  task = Task.make("textworld_express", "coin/train/0", "Find the coin.", game="coin", seed=0)
  steps = (StepRecord("Location: a", "move east", "Location: b", 0.0, False, False, False, ("move east",), "expert"),
           StepRecord("Location: b", "take coin", "Location: b\nInventory: coin", 1.0, True, True, False,
                      ("take coin", "move west"), "expert"))
  record = TrajectoryRecord("expert:coin/train/0", "textworld_express", task, "Find the coin.", "expert", 0, steps,
                            True, 2, 1.0)
  first, last = list(transitions([record]))
  lists = list(action_lists([record]))
  # Step t's record holds the list of its own state: the target of step 0 lists step 1's; the end lists none.
  assert lists == [(("move east",), ("take coin", "move west")), (("take coin", "move west"), ())]
  cut = dataclasses.replace(record, steps=steps[:1], num_steps=1, success=False)  # stopped before its next step
  assert list(action_lists([cut])) == [(("move east",), None)]
  assert parse_output(transition_target(ON, first, "East.", lists[0][1]), ON).admissible == ("take coin", "move west")
  with pytest.raises(ValueError, match=r"episode 'expert:coin/train/0', step 0: the actions admissible after it are "
                                       r"not recorded"):
    transition_target(ON, first, "East.")
  assert "<actions>" not in transition_target(BARE, first)  # no block, nothing needed
  target = transition_target(ON, last, "Taking the coin completes the task.")
  assert parse_output(target, ON) == ExpPrediction("Location: b\nInventory: coin", 1.0, True, True,
                                                   "Taking the coin completes the task.", True, "")
  # The env's invalid flag reaches the target (SyntheticEnv reports what M_exp predicts).
  bad = dataclasses.replace(last, reward=0.0, done=False, success=False, invalid=True)
  assert parse_output(transition_target(ON, bad, next_admissible=lists[1][0]), ON).invalid
  # A record no target can express is refused naming where it is (a MiniWoB click once came back invalid and won).
  with pytest.raises(ValueError, match=r"episode 'expert:coin/train/0', step 1: .*invalid is true but success is true"):
    transition_target(ON, dataclasses.replace(last, invalid=True))
  ex = transition_example(tok, dataclasses.replace(ON, reasoning=False), last, admissible=lists[1][0],
                          next_admissible=lists[1][1])
  text = tok.decode(ex.ids)
  assert "## Step 1\nState:\nLocation: a\nAction: move east" in text and "# Current state (step 2)" in text
  assert "\n# Admissible actions in the current state\ntake coin\nmove west\n\n# Current state (step 2)" in text
  assert tok.decode(ex.ids[ex.loss_mask == 1]).startswith(
      "<next_state>\nLocation: b\nInventory: coin\n</next_state>\n<actions>\n</actions>\n")
