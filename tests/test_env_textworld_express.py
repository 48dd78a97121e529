"""TextWorld-Express adapter on real JVM episodes: expert, random and invalid play, limits, states, tasks, lifecycle."""

import json
import os
import random
import re
from collections import Counter

import pytest

from dreamjax.envs import Env, Task, make_env
from dreamjax.envs.textworld_express import (
    INVALID_FEEDBACK,
    TextWorldExpressEnv,
    abstract_state,
    canonical_params,
    state_fields,
    tasks,
)
from dreamjax.experience.format import (action_edit_text, apply_action_edits, apply_state_changes, list_items,
                                       state_change_text)

GAMES = ("cookingworld", "twc", "coin")


@pytest.fixture(scope="module")
def env():
  env = TextWorldExpressEnv(step_limit=200)  # cookingworld gold paths run up to about 100 steps
  yield env
  env.close()


def _task(env, game, seed=0, split="train"):
  offset = {"train": 0, "dev": 10000, "test": 20000}[split]
  return tasks(game, split, 1, start=seed - offset, env=env)[0]


def _java_children() -> set[int]:
  pids = set()
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    if comm == "java" and int(rest[1]) == os.getpid() and rest[0] != "Z":
      pids.add(int(pid))
  return pids


def _run_expert(env, task):
  obs = env.reset(task)
  results = []
  while (action := env.expert_action()) is not None:
    assert action.lower() in [a.lower() for a in obs.admissible]
    result = env.step(action)
    results.append(result)
    obs = result.observation
    if result.done:
      break
  return results


@pytest.mark.parametrize("game", GAMES)
def test_gold_expert_wins(env, game):
  for task in (_task(env, game, 0), _task(env, game, 1), _task(env, game, 20000, "test")):
    results = _run_expert(env, task)
    last = results[-1]
    assert last.done and last.success and last.info["ended_by"] == "success" and not last.info["truncated"]
    assert [r.reward for r in results] == [0.0] * (len(results) - 1) + [1.0]
    assert not any(r.invalid or r.done for r in results[:-1])
    assert last.info["score"] == 1.0 and last.info["numMoves"] == len(results)
    # every real observation on the way parsed into the regular fields; nothing fell back to raw sentences
    for r in results:
      fields = state_fields(r.observation.state)
      assert "Notes" not in fields and not any(w in fields["You see"] for w in (" that ", "you see"))
    assert env.expert_action() is None
    with pytest.raises(RuntimeError, match="episode ended"):
      env.step("look around")


@pytest.mark.parametrize("game", GAMES)
def test_uniform_random_policy_mostly_fails(env, game, monkeypatch):
  monkeypatch.setattr(env, "step_limit", 10)
  rng = random.Random(0)
  wins = 0
  for seed in range(5):
    obs = env.reset(_task(env, game, seed))
    while True:
      result = env.step(rng.choice(obs.admissible))
      obs = result.observation
      assert not result.invalid and result.reward == (1.0 if result.success else 0.0)
      if result.done:
        break
    wins += result.success
  assert wins <= 1


@pytest.mark.parametrize("game", GAMES)
def test_every_real_transition_is_its_state_with_fields_changed(env, game):
  """M_exp's state-changes format (ExpFormatConfig.state_changes) holds for these states: each next state is the
  current one with some "Field: value" lines set or removed, rebuilt exactly, in random and expert play; so do the
  list edits (ExpFormatConfig.list_edits), which random play uses, and the action edits of the admissible lists
  (ExpFormatConfig.action_edits: TWX lists them sorted, so an added action's place is known)."""
  rng = random.Random(0)
  edited = 0
  for seed in range(3):
    state = (obs := env.reset(_task(env, game, seed))).state
    for _ in range(12):
      shown = obs.admissible
      result = env.step(rng.choice(obs.admissible))
      obs = result.observation
      listed = action_edit_text(shown, obs.admissible)  # raises where its text does not rebuild the list
      assert list(obs.admissible) == sorted(obs.admissible) and apply_action_edits(shown, listed)[0] == obs.admissible
      text = state_change_text(state, obs.state)  # raises where the changes do not rebuild the next state
      assert apply_state_changes(state, text) == (obs.state, "")
      edits = state_change_text(state, obs.state, list_edits=True)
      assert apply_state_changes(state, edits) == (obs.state, "")
      edited_fields = Counter(re.match(r"(.+?) [-+~]= ", line).group(1) for line in edits.splitlines()
                              if re.match(r".+? [-+~]= ", line))
      after = state_fields(obs.state)
      assert all(n <= len(list_items(after[name])) for name, n in edited_fields.items()), edits
      edited += edits != text
      state = obs.state
      if result.done:
        break
  state = env.reset(task := _task(env, game, 5)).state
  for result in _run_expert(env, task):  # resets to the same first state
    assert apply_state_changes(state, state_change_text(state, result.observation.state))[0] == result.observation.state
    state = result.observation.state
  assert edited or game == "coin", game  # coin's random walk changes rooms, which rewrites whole lists


def test_invalid_action_continues_without_reaching_twx(env):
  obs = env.reset(_task(env, "coin", 3))
  result = env.step("fly to the moon")
  assert result.invalid and result.reward == 0.0 and not result.done and not result.success
  assert result.info["observation"] == INVALID_FEEDBACK and result.info["action"] is None
  assert result.info["numMoves"] == 0  # not forwarded: TWX's own move count stays put
  assert state_fields(result.observation.state)["Feedback"] == INVALID_FEEDBACK
  assert result.observation.admissible == obs.admissible
  assert state_fields(result.observation.state)["Location"] == state_fields(obs.state)["Location"]
  after = env.step("look around")
  assert not after.invalid and after.info["numMoves"] == 1 and after.info["steps"] == 2


def test_invalid_action_fails_episode(env, monkeypatch):
  monkeypatch.setattr(env, "invalid_action", "fail")
  env.reset(_task(env, "cookingworld", 2))
  env.step("look around")
  result = env.step("fly to the moon")
  assert result.invalid and result.done and not result.success and result.reward == 0.0
  assert result.info["ended_by"] == "invalid_action" and not result.info["truncated"]
  assert "Feedback: " + INVALID_FEEDBACK in result.observation.state


def test_actions_are_normalised_to_twx_strings(env):
  # twc train seed 18 starts next to a TV remote control; TWX itself rejects the lower-cased string
  obs = env.reset(_task(env, "twc", 18))
  assert "take TV remote control" in obs.admissible and obs.admissible == tuple(sorted(obs.admissible))
  result = env.step("  Take   tv REMOTE control ")
  assert not result.invalid and result.info["action"] == "take TV remote control"
  assert result.info["observation"] == "You take the TV remote control."
  assert not env.step("LOOK AROUND").invalid


def test_step_limit_truncates(env, monkeypatch):
  monkeypatch.setattr(env, "step_limit", 3)
  env.reset(_task(env, "twc", 4))
  results = [env.step(a) for a in ("look around", "fly to the moon", "inventory")]
  assert [r.done for r in results] == [False, False, True]
  last = results[-1]
  assert last.info["truncated"] and last.info["ended_by"] == "step_limit" and not last.success and last.reward == 0.0


def test_expert_is_open_loop(env):
  env.reset(_task(env, "cookingworld", 5))
  first = env.expert_action()
  env.step("fly to the moon")  # invalid actions change nothing in TWX, so the gold path still holds
  assert env.expert_action() == first
  env.step(first)
  second = env.expert_action()
  off_path = next(a for a in env.reset(_task(env, "cookingworld", 5)).admissible if a != first)
  assert env.expert_action() == first and second is not None
  env.step(off_path)
  assert env.expert_action() is None


def test_states_of_real_observations(env):
  assert env.reset(_task(env, "cookingworld", 0)).state == (
      "Location: kitchen\n"
      "You see: stove, oven, fridge (closed), counter (knife, green hot pepper, cookbook), kitchen cupboard (closed), "
      "cutlery drawer (closed), trash can (closed), dishwasher (closed), dining chair (empty)\n"
      "Exits: north (closed plain door), south (closed screen door), east (closed wood door)\n"
      "Inventory (max 5): nothing")
  env.step("take cookbook")
  recipe = state_fields(env.step("read cookbook").observation.state)
  assert recipe["Feedback"] == (
      "Gather all following ingredients and follow the directions to prepare this tasty meal. Ingredients: olive oil, "
      "red hot pepper, block of cheese. Directions: slice the red hot pepper, roast the red hot pepper, fry the block of "
      "cheese, prepare meal")
  assert recipe["Inventory"] == "cookbook"
  opened = state_fields(env.step("open fridge").observation.state)
  assert "fridge (open: block of cheese)" in opened["You see"]
  assert opened["Feedback"] == "You open the fridge. The fridge contains a block of cheese."
  moved = state_fields(env.step("open door to north").observation.state)
  assert moved["Exits"].startswith("north to pantry (open plain door), ")

  twc = env.reset(_task(env, "twc", 0)).state
  assert twc.splitlines()[0] == "Location: bedroom" and twc.endswith("bed (empty), clean blue socks\n"
                                                                       "Exits: north to bathroom, west to corridor\n"
                                                                       "Inventory: nothing")
  env.step("take clean blue socks")
  env.step("open chest of drawers")
  put = state_fields(env.step("put clean blue socks in chest of drawers").observation.state)
  assert "chest of drawers (open: clean blue socks)" in put["You see"] and put["Inventory"] == "nothing"

  coin = state_fields(env.reset(_task(env, "coin", 0)).state)
  assert coin == {"Location": "kitchen", "You see": coin["You see"], "Inventory": "nothing",
                  "Exits": "north (closed wood door), east (closed frosted-glass door), west to corridor"}
  assert env.reset(_task(env, "coin", 0)).state.splitlines()[3] == "Inventory (max 2): nothing"
  moved = env.step("move west").observation.state  # moving only shows the new room: no feedback line
  assert moved.startswith("Location: corridor\n") and "Feedback" not in moved


def test_abstract_state_keeps_what_it_cannot_parse():
  look = ("You are in the attic. In one part of the room you see a crate, glowing faintly. A ghost waves at you. \n"
          "To the Up you see the roof. ")
  state = abstract_state(look, "Inventory: \n  a lamp\n", "Boo!")
  assert state == ("Location: attic\nYou see: a crate, glowing faintly\nExits: up to roof\nInventory: lamp\n"
                   "Feedback: Boo!\nNotes: A ghost waves at you.")
  assert state_fields(state)["Notes"] == "A ghost waves at you."
  assert abstract_state("", "")  == "Location: unknown\nYou see: nothing\nExits: none\nInventory: nothing"
  with pytest.raises(ValueError, match="line 2"):
    state_fields("Location: attic\nSmell: dust")


def test_tasks_are_unique_stable_and_round_trip(env):
  dev = tasks("coin", "dev", 5, start=2, env=env)
  assert [t.task_id for t in dev] == [f"coin/dev/{s}" for s in range(10002, 10007)]
  assert dev == tasks("coin", "dev", 5, start=2, env=env)
  assert tasks("coin", "dev", 2, start=2) == dev[:2]  # the module-wide instance: another JVM, the same tasks
  assert all(t.instruction.startswith("Your task is to search the environment and find the coin") for t in dev)
  ids = [t.task_id for g in GAMES for s in ("train", "test") for t in tasks(g, s, 20, env=env)]
  assert len(set(ids)) == len(ids) == 120
  small = tasks("cookingworld", "train", 2, start=7, params="numLocations=1, numIngredients=2", env=env)
  assert small[1].task_id == "cookingworld[numIngredients=2,numLocations=1]/train/8"
  for task in (dev[0], small[1]):
    back = Task.from_json(json.loads(task.dumps()))
    assert back == task and hash(back) == hash(task)
  assert state_fields(env.reset(Task.from_json(json.loads(small[1].dumps()))).state)["Exits"] == "none"


def test_bad_tasks_are_clear_errors(env):
  with pytest.raises(ValueError, match="the fold has 1000"):
    tasks("twc", "train", 2, start=999, env=env)
  with pytest.raises(ValueError, match="split must be one of"):
    tasks("twc", "valid", 1, env=env)
  with pytest.raises(ValueError, match="Unrecognized property name"):
    tasks("coin", "train", 1, params="rooms=3", env=env)
  with pytest.raises(ValueError, match="Unknown game"):
    env.reset(Task.make("textworld_express", "chess/train/0", game="chess", split="train", seed=0))
  with pytest.raises(ValueError, match="not a textworld_express task"):
    env.reset(Task.make("alfworld", "x", game="coin"))
  with pytest.raises(ValueError, match="key=value"):
    canonical_params("numLocations")
  assert env.reset(_task(env, "coin", 1)).state.startswith("Location: ")  # the env still works after the errors


def test_make_env_builds_lazily_and_close_ends_the_jvm(env):
  before = _java_children()
  built = make_env("textworld_express", step_limit=7, invalid_action="fail")
  assert isinstance(built, TextWorldExpressEnv) and isinstance(built, Env)
  assert built.step_limit == 7 and built.invalid_action == "fail" and _java_children() == before
  task = Task.make("textworld_express", "coin/train/0", game="coin", split="train", seed=0)
  state = built.reset(task).state
  assert len(_java_children() - before) == 1
  assert state == env.reset(task).state  # games are the same in every JVM
  built.close()
  assert _java_children() == before
  built.close()  # closing twice is harmless
  with pytest.raises(ValueError, match="invalid_action"):
    make_env("textworld_express", invalid_action="ignore")
