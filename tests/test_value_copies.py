"""Copies of demonstrations with the goal's quoted values replaced (dreamjax.loop.value_copies), on episodes written
like MiniWoB's recorded ones: new values from the records' own of the same shape (made up where there is none), one
mapping over every text, the values' shapes kept (so a password field's bullets stay right), upper- and lower-case
forms mapped alike, dates stated unquoted made up and typed in the date field's form, nothing copied where nothing is
quoted or dated, and the copies' behaviour-cloning answers typing the new value; and ALFWorld pick-and-place episodes
with the goal's object class replaced by another goal's, everywhere."""

import dataclasses
import string

import numpy as np
import pytest

from dreamjax.commands.train_policy import PolicySftConfig
from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.envs.base import Task
from dreamjax.envs.miniwob_experts import iso_date
from dreamjax.experience.rename import names_pattern, rename_text
from dreamjax.loop.policy_data import RowConfig, policy_texts, sft_rows
from dreamjax.loop.value_copies import (ValuePool, goal_objects, made_up, quoted_values, shape, stated_dates, value_copies,
                                       value_copy)
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig
from dreamjax.text.tokenizer import train_bpe_tokenizer

ADM = ("click('16')", "fill('16', <text>)", "click('19')", "fill('19', <text>)", "click('20')")


def _record(task: str, goal: str, pages: list[str], actions: list[str]) -> TrajectoryRecord:
  states = [f"Goal: {goal}\nPage: {p}" for p in pages]
  steps = tuple(StepRecord(states[i], a, states[i + 1], float(i == len(actions) - 1), i == len(actions) - 1,
                           i == len(actions) - 1, False, ADM, "expert") for i, a in enumerate(actions))
  return TrajectoryRecord(f"expert:{task}/train/0", "miniwob", Task.make("miniwob", f"{task}/train/0", task=task),
                          goal, "expert", 0, steps, True, len(steps), None)


def login_user() -> TrajectoryRecord:
  goal = 'Enter the username "cierra" and the password "11L" into the text fields and press login.'
  fields = ['[16] textbox: Username\n[19] textbox: Password', '[16] textbox: Username (value: "cierra")\n'
            '[19] textbox: Password', '[16] textbox: Username (value: "cierra")\n[19] textbox: Password (value: "•••")']
  return _record("login-user", goal, [f"Login User Task\n{f}\n[20] button: Login" for f in fields] + ["Done"],
                 ["fill('16', 'cierra')", "fill('19', '11L')", "click('20')"])


def enter_text_2() -> TrajectoryRecord:
  goal = 'Type "myron" in all upper case letters in the text input and press Submit.'
  return _record("enter-text-2", goal, ["Enter Text Task\n[16] textbox: (unlabelled)",
                                        'Enter Text Task\n[16] textbox: (unlabelled) (value: "MYRON")', "Done"],
                 ["fill('16', 'MYRON')", "click('20')"])


def enter_date() -> TrajectoryRecord:
  return _record("enter-date", "Enter 02/04/2012 as the date and hit submit.",
                 ["Enter Date Task\n[14] Date: (unlabelled)",
                  'Enter Date Task\n[14] Date: (unlabelled) (value: "2012-02-04", focused)', "Done"],
                 ["fill('14', '2012-02-04')", "click('15')"])


def click_button_sequence() -> TrajectoryRecord:
  return _record("click-button-sequence", "Click button ONE, then click button TWO.",
                 ["[16] button: ONE\n[19] button: TWO"] * 3, ["click('16')", "click('19')"])


def _texts(r: TrajectoryRecord) -> list[str]:
  return [r.instruction, *(t for s in r.steps for t in (s.state, s.action, s.next_state))]


def _shape(value: str) -> list[str]:
  return [next((n for n, p in (("lower", string.ascii_lowercase), ("upper", string.ascii_uppercase),
                                ("digit", string.digits)) if c in p), c) for c in value]


def renamed_login(user: str, password: str) -> TrajectoryRecord:
  """login_user() as a page quoting other values (another episode of the pool)."""
  r = login_user()
  text = lambda t: t.replace("cierra", user).replace("11L", password).replace("•••", "•" * len(password))  # noqa: E731
  return dataclasses.replace(r, instruction=text(r.instruction), steps=tuple(
      dataclasses.replace(s, state=text(s.state), action=text(s.action), next_state=text(s.next_state))
      for s in r.steps))


POOL = ValuePool.of([login_user(), enter_text_2()])  # one value of each shape: the new ones are made up


def test_quoted_values_in_order_once():
  assert quoted_values(login_user().instruction) == ["cierra", "11L"]
  assert quoted_values('Enter "a b" and "a b" then "c"') == ["a b", "c"]
  assert quoted_values("Click button ONE, then click button TWO.") == []


def test_dates_stated_outside_quotes_and_their_iso_form():
  assert stated_dates(enter_date().instruction) == ["02/04/2012"]
  assert stated_dates('Enter "02/04/2012" by 03/05/2013, not 3/5/2013 or 103/05/2013 or 03/05/20134') == ["03/05/2013"]
  assert iso_date("02/04/2012") == "2012-02-04"


def test_a_date_copy_types_the_new_date_and_its_year_is_made_up():
  copies = value_copies([enter_date()] * 20, 1, seed=0)  # the records' own dates are never drawn
  years = set()
  for copy in copies:
    (date,) = stated_dates(copy.instruction)
    month, day, year = map(int, date.split("/"))
    assert 1 <= month <= 12 and 1 <= day <= 28 and 1000 <= year <= 2999 and date != "02/04/2012"
    assert copy.steps[0].action == f"fill('14', '{iso_date(date)}')" and copy.steps[1].action == "click('15')"
    assert f'(value: "{iso_date(date)}", focused)' in copy.steps[0].next_state
    assert not any("2012" in t for t in _texts(copy))
    years.add(year)
  assert len(years) > 10
  copy, mapping = value_copy(enter_date(), POOL, np.random.default_rng(0))
  (date,) = stated_dates(copy.instruction)
  assert mapping == {"02/04/2012": date, "2012-02-04": iso_date(date)}
  inverse = {n: o for o, n in mapping.items()}
  assert [rename_text(t, inverse, names_pattern(inverse)) for t in _texts(copy)] == _texts(enter_date())


def test_made_up_values_keep_the_shape():
  rng = np.random.default_rng(0)
  for value in ("Myron", "aGikC", "11L", "x-7 Y", "2012-02-04"):
    news = {made_up(value, rng) for _ in range(20)}
    assert all(len(n) == len(value) and _shape(n) == _shape(value) for n in news), (value, news)
    assert len(news) > 1  # drawn, not fixed
    assert shape(value) == "".join({"lower": "a", "upper": "A", "digit": "0"}.get(k, k) for k in _shape(value))


def test_new_values_come_from_the_records_of_the_same_shape():
  records = [login_user(), renamed_login("tulane", "42Q"), renamed_login("kenda", "7Z")]
  pool = ValuePool.of(records)
  assert pool.by_shape == {"aaaaaa": ("cierra", "tulane"), "00A": ("11L", "42Q"), "aaaaa": ("kenda",), "0A": ("7Z",)}
  rng = np.random.default_rng(0)
  assert {pool.draw("cierra", rng) for _ in range(10)} == {"tulane"}  # never the value itself
  assert {pool.draw("11L", rng) for _ in range(10)} == {"42Q"}
  made = {pool.draw("kenda", rng) for _ in range(10)}  # the only value of its shape: made up
  assert "kenda" not in made and all(shape(m) == "aaaaa" for m in made)
  copy, mapping = value_copy(records[0], pool, rng)
  assert mapping == {"cierra": "tulane", "CIERRA": "TULANE", "11L": "42Q", "11l": "42q"}
  assert copy.instruction == records[1].instruction and copy.steps == records[1].steps


@pytest.mark.parametrize("make", [login_user, enter_text_2])
def test_one_mapping_over_every_text_undone_by_its_inverse(make):
  record = make()
  copy, mapping = value_copy(record, POOL, np.random.default_rng(1))
  values = quoted_values(record.instruction)
  new_values = quoted_values(copy.instruction)
  assert len(new_values) == len(values) and all(n != v and _shape(n) == _shape(v) for n, v in zip(new_values, values))
  # every form of every value is gone from every text, and undoing the mapping gives the record back exactly
  inverse = {n: o for o, n in mapping.items()}
  for old, new in zip(_texts(record), _texts(copy)):
    assert not any(f in new for v in values for f in (v, v.upper(), v.lower()))
    assert rename_text(new, inverse, names_pattern(inverse)) == old
  assert (copy.episode_id, copy.task, copy.success, copy.num_steps) == (record.episode_id, record.task, True,
                                                                      record.num_steps)
  assert [s.reward for s in copy.steps] == [s.reward for s in record.steps]
  assert [s.admissible for s in copy.steps] == [s.admissible for s in record.steps]


def test_the_typed_value_follows_the_goal_in_every_form():
  copy, _ = value_copy(login_user(), POOL, np.random.default_rng(2))
  user, password = quoted_values(copy.instruction)
  assert [s.action for s in copy.steps] == [f"fill('16', '{user}')", f"fill('19', '{password}')", "click('20')"]
  assert f'Username (value: "{user}")' in copy.steps[1].state
  assert 'Password (value: "•••")' in copy.steps[2].state  # the bullets show the length, which is kept
  copy, mapping = value_copy(enter_text_2(), POOL, np.random.default_rng(2))
  (name,) = quoted_values(copy.instruction)
  assert name.islower() and copy.steps[0].action == f"fill('16', '{name.upper()}')"
  assert mapping["MYRON"] == name.upper() and mapping["myron"] == name


def test_copies_only_of_quoting_episodes_seeded_and_drawn_anew():
  records = [login_user(), click_button_sequence(), enter_text_2(), enter_date()]
  assert value_copy(click_button_sequence(), POOL, np.random.default_rng(0)) is None
  copies = value_copies(records, 3, seed=5)
  assert [c.task.task_id for c in copies] == ["login-user/train/0", "enter-text-2/train/0", "enter-date/train/0"] * 3
  assert copies == value_copies(records, 3, seed=5) and copies != value_copies(records, 3, seed=6)
  assert len({c.instruction for c in copies}) == 9
  assert value_copies(records, 0, seed=5) == []
  with pytest.raises(ValueError, match="PolicySftConfig.value_copies must be >= 0"):
    PolicySftConfig(value_copies=-1)


def test_made_up_copies_never_draw_the_records_values():
  # two episodes quoting values of the same shapes: drawn from the records, each copy takes the other's values
  records = [login_user(), renamed_login("tulane", "42Q")]
  drawn = {v for c in value_copies(records, 5, seed=0) for v in quoted_values(c.instruction)}
  assert drawn == {"cierra", "tulane", "11L", "42Q"}
  made = [quoted_values(c.instruction) for c in value_copies(records, 5, seed=0, made_up_values=True)]
  values = [v for vs in made for v in vs]
  assert len(made) == 10 and not set(values) & drawn and len(set(values)) == len(values)
  assert all([shape(u), shape(p)] == ["aaaaaa", "00A"] for u, p in made)


def test_behaviour_cloning_rows_of_a_copy_type_the_new_value(tmp_path):
  records = [login_user(), enter_text_2()]
  fmt = AgentFormat(think=False, history_turns=2, history_token_budget=128)
  rollout = RolloutConfig(max_turns=4, max_action_tokens=32, max_episode_tokens=96, prompt_buckets=(512,))
  tok = train_bpe_tokenizer(policy_texts(records, fmt), tmp_path, vocab_size=384)  # the real records' text only
  copies = value_copies(records, 1, seed=0)
  rows, stats = sft_rows(records + copies, tok, fmt, RowConfig(), rollout)
  assert stats["rows"] == 2 * (3 + 2)
  answers = [tok.decode([int(i) for i, m in zip(r.ids, r.loss_mask) if m]) for r in rows[5:]]
  user, password = quoted_values(copies[0].instruction)
  (name,) = quoted_values(copies[1].instruction)
  assert [user in answers[0], password in answers[1], name.upper() in answers[3]] == [True] * 3, answers
  assert dataclasses.replace(copies[0], instruction=records[0].instruction) != records[0]  # states renamed too


def alfworld_pick(goal_object: str, seen: tuple[str, ...], receptacle: str = "drawer") -> TrajectoryRecord:
  """An ALFWorld pick-and-place episode written like the recorded ones: the goal's object is found among others on
  the armchair, taken and put in the drawer; admissible lists sorted, as ALFWorld's are."""
  goal = f"put some {goal_object} on {receptacle}"
  objects = ", ".join(f"{o} 1" for o in seen)
  states = [f"Location: armchair 1\nYou see: {objects}\nInventory: nothing",
            f"Location: armchair 1\nYou see: {objects}\nInventory: {goal_object} 1",
            f"Location: {receptacle} 1\nYou see: nothing\nInventory: {goal_object} 1", "Done"]
  actions = [f"take {goal_object} 1 from armchair 1", f"go to {receptacle} 1",
             f"move {goal_object} 1 to {receptacle} 1"]
  admissible = [tuple(sorted(["look", f"go to {receptacle} 1", *(f"take {o} 1 from armchair 1" for o in seen)])),
                ("go to drawer 1", "look"), (f"move {goal_object} 1 to {receptacle} 1", "look")]
  steps = tuple(StepRecord(states[i], a, states[i + 1], float(i == 2), i == 2, i == 2, False, admissible[i], "expert")
                for i, a in enumerate(actions))
  return TrajectoryRecord(f"expert:{goal_object}", "alfworld",
                          Task.make("alfworld", f"pick_and_place_simple/train/{goal_object}"), goal, "expert", 0,
                          steps, True, len(steps), None)


def test_alfworld_goal_object_is_replaced_by_another_goals_class_everywhere():
  records = [alfworld_pick("remotecontrol", ("newspaper", "remotecontrol")), alfworld_pick("pen", ("pen",)),
             alfworld_pick("mug", ("mug",)), alfworld_pick("newspaper", ("newspaper",))]
  pool = ValuePool.of(records)
  assert pool.objects == ("mug", "newspaper", "pen", "remotecontrol")
  assert goal_objects("put a  mug in microwave") == ["mug"] and goal_objects("put a hot mug in microwave") == []
  for seed in range(5):
    copy, mapping = value_copy(records[0], pool, np.random.default_rng(seed))
    (new,) = mapping.values()
    # never the goal itself, nor a class the episode shows already (newspaper)
    assert list(mapping) == ["remotecontrol"] and new in ("mug", "pen")
    assert copy.instruction == f"put some {new} on drawer" and copy.steps[0].action == f"take {new} 1 from armchair 1"
    assert f"You see: newspaper 1, {new} 1" in copy.steps[0].state and f"Inventory: {new} 1" in copy.steps[1].state
    assert copy.steps[0].admissible == tuple(sorted(copy.steps[0].admissible))  # sorted again, as ALFWorld's are
    assert f"take {new} 1 from armchair 1" in copy.steps[0].admissible
    assert not any("remotecontrol" in t for t in _texts(copy) + list(copy.steps[0].admissible))
  # A goal naming the only class of the records, or made-up values (a class is never made up): no copy.
  assert value_copy(records[1], ValuePool.of(records[1:2]), np.random.default_rng(0)) is None
  assert value_copies(records, 2, seed=0, made_up_values=True) == []
