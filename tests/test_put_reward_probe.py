"""The counterfactual probe of M_exp's reward for a final put (experiments/put_reward_probe.py): which item a put
moves, the alternative puts replayed in a real twc game, and the pay rates."""

import pytest

from dreamjax.data.records import StepRecord, TrajectoryRecord
from dreamjax.envs.base import Task
from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks
from experiments.put_reward_probe import FINAL_PUTS, alternatives, final_puts, put_item, put_place, summarize

STATE = "Location: pantry\nYou see: shelf (empty)\nExits: none\nInventory: flour, yellow onion, onion"


def test_put_item_is_the_longest_inventory_item_the_action_names():
  assert put_item(STATE, "put yellow onion in shelf") == "yellow onion"
  assert put_item(STATE, "put onion in shelf") == "onion"
  assert put_item(STATE, "take flour") is None
  assert put_item("Location: pantry\nInventory: nothing", "put flour in shelf") is None


@pytest.fixture(scope="module")
def env():
  env = TextWorldExpressEnv(step_limit=8)
  yield env
  env.close()


def test_alternatives_replay_every_put_of_the_final_item(env):
  task = tasks("twc", "train", 1, start=0, env=env, params="includeDoors=0,numItemsToPutAway=2,numLocations=1")[0]
  obs, gold = env.reset(task), []
  while (action := env.expert_action()) is not None:
    gold.append(action)
    if env.step(action).done:
      break
  rows = alternatives(env, "expert", "e0", task, obs.instruction, gold)
  assert len(rows) >= 2 and sum(r["original"] for r in rows) == 1
  item = put_item(rows[0]["transition"].state, gold[-1])
  assert {r["transition"].action for r in rows} == {a for a in rows[0]["admissible"] if a.startswith(f"put {item} ")}
  for r in rows:  # every put is asked from the same real state and history
    t = r["transition"]
    assert t.state == rows[0]["transition"].state and t.step == len(gold) - 1 == len(t.history)
    assert [a for _, a in t.history] == gold[:-1]
    assert (r["next_admissible"] == ()) == t.done
  original = next(r["transition"] for r in rows if r["original"])
  assert original.reward == 1.0 and original.success
  assert any(r["transition"].reward == 0.0 for r in rows)  # some place is wrong for the item
  assert alternatives(env, "expert", "e0", task, obs.instruction, gold[:1]) == []  # "look around" is not a put


def _row(episode, rewarded, paid, original=False, ok=True):
  return {"episode_id": episode, "real_reward": float(rewarded), "real_rewarded": rewarded, "m_exp_paid": paid,
          "original": original, "ok": ok, "neighbour_synthetic": False, "neighbour_same_task": episode == "b"}


def test_summarize_counts_pay_rates_by_what_the_game_rewarded():
  rows = [_row("a", True, True, original=True), _row("a", False, True), _row("a", False, False),
          _row("b", False, True, original=True), _row("b", False, False, ok=False)]
  s = summarize(rows)
  assert s["episodes"] == 2 and s["episodes_with_a_rewarded_put"] == 1 and s["puts"] == 5
  assert s["rewarded_puts"] == 1 and s["paid_when_rewarded"] == 1.0
  assert s["unrewarded_puts"] == 4 and s["paid_when_unrewarded"] == 0.5
  assert s["original_real_rewarded"] == 0.5 and s["original_paid"] == 1.0
  assert s["episodes_paid_exactly_the_rewarded"] == 0 and s["malformed"] == 1
  assert s["neighbour_same_task"] == 0.4


def _episode(task, policy, actions, reward=0.0):
  """A twc-like record of `actions` in a room with a shelf and a bin: each take moves the item to the inventory, each
  put empties it of that item; only the last step pays `reward`."""
  steps, inventory = [], []
  for i, a in enumerate(actions):
    state = f"Location: pantry\nInventory: {', '.join(inventory) or 'nothing'}"
    if a.startswith("take "):
      inventory.append(a[5:])
    elif (put := put_place(state, a)) is not None:
      inventory.remove(put[0])
    last = i == len(actions) - 1
    steps.append(StepRecord(state, a, f"Location: pantry\nInventory: {', '.join(inventory) or 'nothing'}",
                            reward if last else 0.0, last, last and reward > 0, False, (), policy))
  return TrajectoryRecord(f"{policy}/{task}", "textworld_express", Task.make("textworld_express", task), "", policy,
                          0, tuple(steps), reward > 0, len(steps), None)


def test_final_puts_split_the_unrewarded_by_where_the_earlier_items_went():
  gold = ["take flour", "take onion", "put flour in shelf", "put onion in bin"]
  records = [_episode("t0", "expert", gold, 1.0), _episode("t1", "expert", gold, 1.0),
             _episode("t0", "random", gold, 1.0),  # rewarded
             _episode("t0", "random", gold[:3] + ["put onion in shelf"]),  # flour right, onion wrong
             _episode("t1", "eps0.3", ["take flour", "take onion", "put flour in bin", "put onion in bin"]),
             _episode("t1", "random", ["take flour", "put flour in bin", "take onion", "put onion in bin"]),
             _episode("t0", "random", ["take flour", "put flour in shelf"]),  # the onion never taken: not final
             _episode("t2", "random", gold[:3] + ["put onion in shelf"])]  # no expert success says where items go
  assert put_place("Inventory: flour", "put flour in shelf") == ("flour", "shelf")
  assert put_place("Inventory: flour", "take flour") is None
  assert final_puts(records) == dict(zip(FINAL_PUTS, (1, 1, 2)))
