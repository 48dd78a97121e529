"""Curriculum: variance statistics against NumPy and on the binary outcome (not penalty-shaped returns), selection
(preference, lambda cap, exploration, no recompiles), the task pool (JSON, eviction), M_task's propose-filter-select
generation (parsing, validation, the selection prompt, its total parser and fallback, the log) with a tiny random
Qwen2, and k-means against NumPy."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.curriculum import clusters, task_gen
from dreamjax.curriculum.pool import TaskPool
from dreamjax.curriculum.source import CurriculumConfig, CurriculumTasks, outcome_rewards
from dreamjax.curriculum.state import (
    add,
    compilations,
    generated_cap,
    init,
    remove,
    select,
    selection_logp,
    seeds_for_generation,
    update,
)
from dreamjax.envs.base import Task
from dreamjax.loop.learner import episode_returns
from dreamjax.models import init_params, tiny
from dreamjax.rollout.trajectory import Trajectories
from dreamjax.sampling import Sampler
from dreamjax.text import train_bpe_tokenizer


CAPACITY = 32  # one capacity for the selection tests, so they share compiled programs


def make_state(var, tried=None, generated=None):
  """A state whose first slots hold tasks with the given variances, measured (tried) or not; the rest are free."""
  n = len(var)
  s = add(init(CAPACITY), np.arange(n), is_generated=np.asarray(generated if generated is not None else [False] * n),
          parent=np.full(n, -1), depth=np.zeros(n, np.int32))
  tried = np.ones(n, bool) if tried is None else np.asarray(tried)
  pad = CAPACITY - n
  return s.replace(times_sampled=jnp.asarray(np.pad(tried, (0, pad)).astype(np.int32)),
                   reward_var=jnp.asarray(np.pad(np.asarray(var, np.float32), (0, pad))))


def numpy_update(mean, var, times, slots, rewards, valid, ema, groups=None):
  mean, var, times = mean.copy(), var.copy(), times.copy()
  ok = valid & (slots >= 0)
  g = slots if groups is None else groups
  stats = {}
  for gid in set(g[ok]):
    r = rewards[ok & (g == gid)].astype(np.float64)
    stats[gid] = (r.mean(), ((r - r.mean()) ** 2).mean())
  for s in set(slots[ok]):
    rows = ok & (slots == s)
    m = np.mean([stats[x][0] for x in g[rows]])
    v = np.mean([stats[x][1] for x in g[rows]])
    d = ema if times[s] > 0 else 0.0
    mean[s], var[s] = d * mean[s] + (1 - d) * m, d * var[s] + (1 - d) * v
    times[s] += 1
  return mean, var, times


@pytest.mark.parametrize("use_groups", [False, True])
def test_update_matches_numpy_reference(use_groups):
  rng = np.random.RandomState(0)
  c, n = 12, 40
  state = add(init(c), np.arange(10), is_generated=np.zeros(10, bool), parent=np.full(10, -1),
              depth=np.zeros(10, np.int32))  # slots 10, 11 are free: their episodes must be ignored
  mean, var, times = np.zeros(c), np.zeros(c), np.zeros(c, np.int64)
  cluster = rng.randint(0, 3, c)
  for it in range(3):
    slots = rng.randint(-1, c, n).astype(np.int32)
    rewards = (rng.rand(n) * 4 - 1).astype(np.float32)
    valid = rng.rand(n) > 0.2
    groups = cluster[np.clip(slots, 0, c - 1)] if use_groups else None
    state = update(state, slots, rewards, valid, ema=0.7, groups=groups)
    live = valid & (slots < 10)
    mean, var, times = numpy_update(mean, var, times, slots, rewards, live, 0.7,
                                    None if groups is None else np.asarray(groups))
    np.testing.assert_allclose(state.reward_mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.reward_var, var, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state.times_sampled, times)
    seen = np.isin(np.arange(c), slots[live])
    assert np.all(np.asarray(state.last_seen)[seen] == it) and int(state.iteration) == it + 1
  assert np.all(np.asarray(state.times_sampled)[10:] == 0)


def test_binary_rewards_give_p_times_one_minus_p():
  state = make_state([0.0] * 3, tried=[False] * 3)
  slots = np.repeat(np.arange(3), 8)
  rewards = np.array([1] * 3 + [0] * 5 + [1] * 8 + [0, 1] * 4, np.float32)
  state = update(state, slots, rewards, np.ones(24, bool), ema=0.9)  # first batch: no decay applied
  np.testing.assert_allclose(state.reward_var[:3], [3 / 8 * 5 / 8, 0.0, 0.25], atol=1e-7)
  np.testing.assert_allclose(state.reward_mean[:3], [3 / 8, 1.0, 0.5], atol=1e-7)


def episodes(turns):
  """Trajectories of hand-made episodes: `turns[e]` lists episode e's turns as (reward, invalid); an episode succeeds
  when its last turn has reward 1. Only the fields the curriculum and the returns read are meaningful."""
  rows = [(e, t, r, inv) for e, ep in enumerate(turns) for t, (r, inv) in enumerate(ep)]
  m, n = len(rows), len(turns)
  turn_rows = np.full((n, max(len(ep) for ep in turns)), -1, np.int32)
  for i, (e, t, _, _) in enumerate(rows):
    turn_rows[e, t] = i
  zeros = np.zeros((m, 1), np.int32)
  success = np.array([ep[-1][0] == 1.0 for ep in turns])
  return Trajectories(
      tokens=zeros, kinds=zeros, loss_mask=zeros, rollout_logp=np.zeros((m, 1), np.float32),
      lengths=np.ones(m, np.int32), prompt_lengths=np.zeros(m, np.int32), episode=np.array([r[0] for r in rows]),
      turn=np.array([r[1] for r in rows]), reward=np.array([r[2] for r in rows], np.float32),
      done=np.array([t == len(turns[e]) - 1 for e, t, _, _ in rows]),
      invalid=np.array([r[3] for r in rows]), truncated=np.zeros(m, bool), group=np.zeros(n, np.int32),
      task_index=np.zeros(n, np.int32), num_turns=np.array([len(ep) for ep in turns], np.int32), turn_rows=turn_rows,
      episode_reward=np.array([sum(r for r, _ in ep) for ep in turns], np.float32), success=success,
      ended=success.copy(), env_error=np.zeros(n, bool), records=())


def test_task_statistics_use_the_binary_outcome_not_penalised_returns():
  # Four episodes of one task: all succeed, two after invalid actions; then four of another: none succeed, two with
  # invalid actions. The returns the advantages see (penalty 0.1) differ within each group; the outcomes do not.
  won, lost = [(0.0, True), (1.0, False)], [(0.0, True), (0.0, True), (0.0, False)]
  traj = episodes([won, [(1.0, False)], won, [(0.0, False), (1.0, False)], lost, [(0.0, False)], lost,
                   [(0.0, False)] * 2])
  np.testing.assert_array_equal(outcome_rewards(traj), [1, 1, 1, 1, 0, 0, 0, 0])
  assert outcome_rewards(traj).dtype == np.float32
  returns = episode_returns(traj, 0.1)
  assert np.ptp(returns[:4]) > 0 and np.ptp(returns[4:]) > 0  # what the statistics used to see
  seeds = seed_tasks(2)
  cur = CurriculumTasks(CurriculumConfig(capacity=8, generate_every=0), seeds, [], tasks_per_iteration=2,
                        algorithm="grpo", seed=0, root=jax.random.key(0), sampler=None, exp_params=None, exp_tok=None,
                        encode=None)
  slots = cur.slots([seeds[0]] * 4 + [seeds[1]] * 4)
  out = cur.update(slots, outcome_rewards(traj), 0, ~traj.env_error)
  s = jax.device_get(cur.pool.state)
  np.testing.assert_array_equal(s.reward_mean[:2], [1.0, 0.0])
  np.testing.assert_array_equal(s.reward_var[:2], [0.0, 0.0])  # nothing left to learn on either: not preferred
  assert out["batch_reward_var"] == 0.0 and "generated" not in out
  # The statistics of the penalised returns would have ranked both tasks as feasible-yet-challenging.
  shaped = update(cur.pool.state, slots, returns, np.ones(8, bool), ema=0.5)
  assert (np.asarray(shaped.reward_var)[:2] > 0).all()


def test_selection_matches_its_mixture_and_prefers_high_variance():
  var = [0.25, 0.2, 0.1, 0.0, 0.0, 0.05]
  state = make_state(var, tried=[True, True, True, True, False, True])  # slot 4: never tried
  kw = dict(temperature=0.05, min_variance=0.0, explore_prob=0.2, prior_variance=0.25)  # a finite, soft prior
  p = np.exp(np.asarray(selection_logp(state, **kw)))
  assert (p[6:] == 0).all()
  p = p[:6]
  pref = np.exp(np.array([0.25, 0.2, 0.1, -np.inf, 0.25, 0.05]) / 0.05)
  np.testing.assert_allclose(p, 0.8 * pref / pref.sum() + 0.2 / 6, rtol=1e-5)
  keys = jax.random.split(jax.random.key(1), 20000)
  picks = np.asarray(jax.vmap(lambda k: select(state, k, num_tasks=3, num_generated_max=0, **kw))(keys))
  # Gumbel-top-k: the first pick is one draw from the mixture.
  freq = np.bincount(picks[:, 0], minlength=CAPACITY)[:6] / len(picks)
  assert (np.abs(freq - p) <= 4 * np.sqrt(p * (1 - p) / len(picks)) + 1e-3).all(), (freq, p)
  assert all(len(set(row)) == 3 for row in picks[:200])
  hits = np.bincount(picks.reshape(-1), minlength=CAPACITY)
  assert hits[0] > hits[1] > hits[2] > hits[5] > hits[3] and hits[4] > hits[2]


def test_lambda_cap_is_exact():
  # Ten generated tasks at the highest variance, eight seeds at lower ones: the cap binds every time.
  state = make_state([0.25] * 10 + [0.1] * 8, generated=[True] * 10 + [False] * 8)
  gen = np.asarray(state.is_generated)
  for lam, cap in ((0.0, 0), (0.25, 2), (0.5, 4)):
    assert generated_cap(8, lam) == cap
    keys = jax.random.split(jax.random.key(2), 300)
    picks = np.asarray(jax.vmap(lambda k, c=cap: select(state, k, num_tasks=8, num_generated_max=c))(keys))
    assert (picks >= 0).all() and all(len(set(r)) == 8 for r in picks)
    assert (gen[picks].sum(1) == cap).all()
  with pytest.raises(ValueError, match="lambda"):
    generated_cap(8, 1.5)


def test_never_sampled_tasks_are_all_tried_and_the_pool_fills():
  rng = np.random.RandomState(3)
  p_success = rng.rand(30)
  state, key = make_state([0.0] * 30, tried=[False] * 30), jax.random.key(3)
  for it in range(5):
    slots = np.asarray(select(state, jax.random.fold_in(key, it), num_tasks=6, num_generated_max=0))
    ep_slots = np.repeat(slots, 4)
    rewards = (rng.rand(24) < p_success[ep_slots]).astype(np.float32)
    state = update(state, ep_slots, rewards, np.ones(24, bool), ema=0.5)
  # The default (infinite) prior takes untried tasks first: 30 tasks are all tried within 5 rounds of 6, each once.
  assert (np.asarray(state.times_sampled)[:30] == 1).all()
  small = make_state([0.0, 0.0, 0.0])  # all tried at zero variance, no exploration: filled, then -1
  out = np.asarray(select(small, key, num_tasks=6, num_generated_max=0, explore_prob=0.0))
  assert sorted(out[:3]) == [0, 1, 2] and (out[3:] == -1).all()
  out = np.asarray(select(remove(small, np.array([1])), key, num_tasks=6, num_generated_max=0))
  assert sorted(out[:2]) == [0, 2] and (out[2:] == -1).all()


def test_jitted_functions_do_not_recompile():
  state = make_state([0.1] * 8, generated=[False, True] * 4)
  update(state, np.zeros(24, np.int32), np.zeros(24, np.float32), np.ones(24, bool), ema=0.5)
  select(state, jax.random.key(0), num_tasks=6, num_generated_max=1)
  seeds_for_generation(state, k=4)
  sizes = compilations()
  for i in range(4):
    rng = np.random.RandomState(i)
    state = update(state, rng.randint(0, 8, 24).astype(np.int32), rng.rand(24).astype(np.float32),
                   rng.rand(24) > 0.5, ema=0.1 * i)
    select(state, jax.random.key(i), num_tasks=6, num_generated_max=i, temperature=0.1 + i, explore_prob=0.05 * i,
           min_variance=0.01 * i)
    seeds_for_generation(state, k=4, min_variance=0.01 * i, max_depth=i)
    select(state, jax.random.key(i), num_tasks=6, num_generated_max=np.int64(2))
  assert compilations() == sizes


def test_seeds_for_generation_ranks_by_variance():
  state = make_state([0.1, 0.25, 0.0, 0.25, 0.2, 0.3], tried=[True, True, True, True, True, False])
  state = state.replace(depth=state.depth.at[4].set(2))
  # Slot 5 untried, slot 2 zero variance, slot 4 too deep; the 0.25 tie goes to the lower slot.
  np.testing.assert_array_equal(seeds_for_generation(state, k=4), [1, 3, 0, -1])
  np.testing.assert_array_equal(seeds_for_generation(state, k=4, min_variance=0.15), [1, 3, -1, -1])
  # Slot 1 already has a live variant: it now ranks after slot 3 and is excluded at max_children=1.
  state = add(state, np.array([6]), is_generated=np.array([True]), parent=np.array([1]), depth=np.array([1]))
  np.testing.assert_array_equal(seeds_for_generation(state, k=4), [3, 1, 0, -1])
  np.testing.assert_array_equal(seeds_for_generation(state, k=4, max_children=1), [3, 0, -1, -1])


def seed_tasks(n):
  return [Task.make("textworld_express", f"coin/train/{i}", f"Your task is to find a coin in room {i}.",
                    game="coin", seed=i) for i in range(n)]


def variant(seed: Task, i: int) -> Task:
  return task_gen.variant_task(seed, f"Find the coin in room {i} without opening doors.", i)


def test_task_pool_eviction_and_json_round_trip(tmp_path):
  pool = TaskPool(6)
  seeds = seed_tasks(3)
  np.testing.assert_array_equal(pool.add_seeds(seeds), [0, 1, 2])
  with pytest.raises(ValueError, match="coin/train/0"):
    pool.add_seeds(seeds[:1])
  v = [variant(seeds[0], 0), variant(seeds[0], 1), variant(seeds[1], 0)]
  np.testing.assert_array_equal(pool.add_generated(v), [3, 4, 5])
  assert pool.variant_counters == {"coin/train/0": 2, "coin/train/1": 1}
  # Variants 3 and 5 were tried (variance 0.05 and 0.0), variant 4 never: slot 5 is the least useful.
  pool.state = update(pool.state, np.array([3, 3, 5, 5]), np.array([1, 0, 1, 1], np.float32), np.ones(4, bool),
                      ema=0.0)
  pool.state = pool.state.replace(reward_var=pool.state.reward_var.at[3].set(0.05))
  grand = task_gen.variant_task(v[0], "Find the coin in room 0 twice without opening doors.", 0)
  assert pool.add_generated([grand])[0] == 5 and pool.slot_of(v[2].task_id) == -1
  assert int(pool.state.parent[5]) == 3 and int(pool.state.depth[5]) == 2
  # Full again: slot 4 (untried, prior 0.25) outranks slot 3 (0.05), so 3 goes and its variant is re-parented to 0.
  pool.add_generated([variant(seeds[2], 0)])
  assert pool.slot_of(v[0].task_id) == -1 and int(pool.state.parent[5]) == 0
  assert [t.task_id for t in pool.tasks[:3]] == [t.task_id for t in seeds]  # seeds are never evicted
  pool.save(tmp_path / "pool.json")
  back = TaskPool.load(tmp_path / "pool.json")
  assert back.tasks == pool.tasks and back.variant_counters == pool.variant_counters
  for a, b in zip(jax.tree.leaves(back.state), jax.tree.leaves(pool.state)):
    np.testing.assert_array_equal(a, b)
  assert back.slot_of(grand.task_id) == 5
  bad = pool.to_json()
  bad["state"]["reward_var"] = [0.0]
  with pytest.raises(ValueError, match=r"state\.reward_var"):
    TaskPool.from_json(bad)
  bad = pool.to_json()
  bad["tasks"][1] = None
  with pytest.raises(ValueError, match=r"tasks\[1\]"):
    TaskPool.from_json(bad)


def test_parser_is_total_on_fuzzed_strings():
  rng = random.Random(0)
  pieces = ["<task>", "</task>", "<TASK>", "<", ">", "/", "task", " ", "\n", "go east", "é", "\x00", "<task", "</"]
  for _ in range(2000):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
    blocks, malformed = task_gen.parse_variants(text)
    assert all(isinstance(b, str) for b in blocks) and malformed >= 0 and len(blocks) + malformed >= 1
  assert task_gen.parse_variants(None) == ([], 1)


def test_parser_on_valid_and_partial_outputs():
  text = "Sure!\n<task>Find the  coin\n in the kitchen.</task>\n<task>Open the door first.</task><task>Take the"
  assert task_gen.parse_variants(text) == (["Find the coin in the kitchen.", "Open the door first."], 1)
  assert task_gen.parse_variants("no tags at all") == ([], 1)
  assert task_gen.parse_variants("<task></task>") == ([""], 0)
  assert task_gen.parse_variants("<task>a <task>Open the door.</task>") == (["Open the door."], 1)


def test_validation_and_bookkeeping():
  seed = task_gen.SeedExample(seed_tasks(1)[0], initial_state="Location: kitchen\nYou see: fridge, counter\n"
                                                                "Exits: north (closed door)", actions=("open door",))
  cfg = task_gen.ValidationConfig(max_words=12)
  check = lambda text, taken=frozenset(): task_gen.check_variant(text, seed, set(taken), cfg)  # noqa: E731
  assert check("Find a coin in the kitchen without opening the door.") is None
  assert check("  ") == "empty"
  assert check("Find coin") == "too_short"
  assert check(" ".join(["find the coin"] * 5)) == "too_long"
  assert check("your task is to FIND a coin in room 0!") == "duplicate"
  assert check("Find the coin in the garden.") == "vocabulary"
  out = ("<task>Find a coin in the kitchen.</task><task>find a coin in the  KITCHEN</task><task>Open the fridge "
         "then find a coin.</task><task>x</task><task>Find a coin north of the kitchen.</task><task>oops")
  # Four proposals asked for: the fifth block is surplus; two survive, which k=2 keeps without a selection prompt.
  res = task_gen.variants_from_outputs([seed, seed], [out, "garbage"], k=2, proposals=4, existing=["Open the door."],
                                       counters={"coin/train/0": 5}, cfg=cfg)
  assert res.counts == {"accepted": 2, "unparsed": 2, "empty": 0, "too_short": 1, "too_long": 0, "duplicate": 1,
                        "vocabulary": 0, "surplus": 1, "not_selected": 0}
  assert res.selection == {"prompts": 0, "fallbacks": 0} and [r["selection"] for r in res.log] == ["all", "none"]
  assert [t.task_id for t in res.tasks] == ["coin/train/0/v5", "coin/train/0/v6"]
  t = res.tasks[1]
  assert t.instruction == "Open the fridge then find a coin." and t.env == "textworld_express"
  assert t.param == {"game": "coin", "seed": 0, "generated_from": "coin/train/0", "generation": 1}
  assert task_gen.variant_task(t, "again", 0).param["generation"] == 2
  np.testing.assert_array_equal(res.seed_index, [0, 0])


KITCHEN = "Location: kitchen\nYou see: fridge, counter, coin\nExits: north (closed door)"


def kitchen_seed(i: int = 0) -> task_gen.SeedExample:
  return task_gen.SeedExample(seed_tasks(i + 1)[i], initial_state=KITCHEN, actions=("open door", "take coin"))


def test_selection_prompt_shows_the_seed_and_numbered_candidates():
  seed, cands = kitchen_seed(), ["Find a coin in the kitchen.", "Open the door, then take the coin."]
  text = task_gen.selection_text(seed, cands)
  assert text.startswith("Seed task: Your task is to find a coin in room 0.\nInitial state:\nLocation: kitchen")
  assert "A successful action sequence: open door; take coin" in text
  assert "Candidates:\n1. Find a coin in the kitchen.\n2. Open the door, then take the coin.\n" in text
  assert text.endswith("feasible and harder than the seed task? Answer as <choice>N</choice>.")
  two = task_gen.selection_text(seed, cands + ["Take the coin twice."], k=2)
  assert "3. Take the coin twice." in two and "Which 2 candidates" in two and "best first" in two
  # The system segment asks for feasible-yet-harder in the paper's sense; the proposal prompt asks for `proposals`.
  assert "feasible" in task_gen.SELECTION_PROMPT and "harder than the seed" in task_gen.SELECTION_PROMPT
  assert "<choice>N</choice>" in task_gen.SELECTION_PROMPT


def test_choice_parser_is_total_and_keeps_valid_distinct_choices():
  parse = task_gen.parse_choices
  assert parse("<choice>2</choice>", 3) == [1]
  assert parse("I pick <CHOICE> candidate #3. </choice> because it is harder", 3) == [2]
  assert parse("<choice>2</choice><choice>2</choice><choice>1</choice>", 3) == [1, 0]  # repeats dropped
  assert parse("<choice>4</choice><choice>0</choice><choice>1</choice>", 3) == [0]  # out of range dropped
  for junk in ("", "2", "choice 2", "<choice>two</choice>", "<choice>2", "<choice>-1</choice>", "<choice>1e3</choice>",
               "<choice>99999999999</choice>", None, 3):
    assert parse(junk, 3) == [], junk
  rng = random.Random(1)
  pieces = ["<choice>", "</choice>", "<CHOICE>", "1", "2", "9", "0", " ", "#", ".", "candidate", "<", "/", "é", "\x00"]
  for _ in range(2000):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
    got = parse(text, 3)
    assert len(set(got)) == len(got) and all(0 <= i < 3 for i in got)


def test_fallback_rule_fills_in_proposal_order():
  assert task_gen.choose([2], 4, 1) == ([2], False)
  assert task_gen.choose([], 4, 1) == ([0], True)  # nothing parsed: the first surviving candidate
  assert task_gen.choose([3, 1, 2], 4, 2) == ([3, 1], False)
  assert task_gen.choose([2], 4, 2) == ([2, 0], True)  # the model's choice first, filled by the rule
  assert task_gen.choose([], 1, 2) == ([0], True)
  assert task_gen.choose([5, -1], 3, 1) == ([0], True)


def test_proposals_filter_then_selection_with_the_log():
  seeds = [kitchen_seed(i) for i in range(4)]
  outputs = [
      # seed 0: three survivors, one duplicate, one surplus (five blocks for four proposals), one unclosed
      "<task>Find a coin in the kitchen.</task><task>Open the door, then take the coin.</task><task>find a coin in "
      "the KITCHEN</task><task>Take the coin after you open the fridge.</task><task>Take the coin.</task><task>oops",
      # seed 1: two survivors, one vocabulary failure
      "<task>Open the fridge and take the coin.</task><task>Take the coin from the garden.</task><task>Open the "
      "door and the fridge, then take the coin.</task>",
      # seed 2: one survivor (k=1 keeps it without asking)
      "<task>Take the coin, then open the door.</task><task>x</task>",
      # seed 3: nothing parses
      "no tags",
  ]
  props = task_gen.filter_proposals(seeds, outputs, 4, existing=["Take the coin and go north."])
  assert [p.survivors for p in props] == [
      ("Find a coin in the kitchen.", "Open the door, then take the coin.", "Take the coin after you open the fridge."),
      ("Open the fridge and take the coin.", "Open the door and the fridge, then take the coin."),
      ("Take the coin, then open the door.",), ()]
  assert props[0].reasons[2:] == ("duplicate", None, "surplus") and props[0].unparsed == 1
  answers = ["Harder: <choice>3</choice>", "<choice>7</choice> none of them", None, None]
  res = task_gen.select_variants(props, answers, 1, counters={"coin/train/1": 2}, texts=outputs)
  assert [t.instruction for t in res.tasks] == ["Take the coin after you open the fridge.",
                                                "Open the fridge and take the coin.",
                                                "Take the coin, then open the door."]
  assert [t.task_id for t in res.tasks] == ["coin/train/0/v0", "coin/train/1/v2", "coin/train/2/v0"]
  np.testing.assert_array_equal(res.seed_index, [0, 1, 2])
  assert res.counts == {"accepted": 3, "unparsed": 2, "empty": 0, "too_short": 1, "too_long": 0, "duplicate": 1,
                        "vocabulary": 1, "surplus": 1, "not_selected": 3}
  candidates = sum(len(p.texts) + p.unparsed for p in props)
  assert sum(res.counts.values()) == candidates == 12
  assert res.selection == {"prompts": 2, "fallbacks": 1} and res.texts == tuple(outputs)
  assert [r["selection"] for r in res.log] == ["model", "fallback", "all", "none"]
  r0 = res.log[0]
  assert r0["seed"] == "coin/train/0" and r0["proposed"] == list(props[0].texts)
  assert r0["selected"] == ["Take the coin after you open the fridge."]
  assert r0["rejected"] == [{"text": "Find a coin in the kitchen.", "reason": "not selected"},
                            {"text": "Open the door, then take the coin.", "reason": "not selected"},
                            {"text": "find a coin in the KITCHEN", "reason": "filter: duplicate"},
                            {"text": "Take the coin.", "reason": "filter: surplus"}]
  assert r0["unparsed"] == 1 and r0["selection_answer"] == "Harder: <choice>3</choice>"
  assert res.log[1]["rejected"] == [{"text": "Take the coin from the garden.", "reason": "filter: vocabulary"},
                                    {"text": "Open the door and the fridge, then take the coin.",
                                     "reason": "not selected"}]
  assert res.log[2]["selection_answer"] is None and res.log[3]["selected"] == [] and res.log[3]["unparsed"] == 1
  # Every proposed candidate is selected or rejected exactly once, and the log is plain JSON.
  for r in res.log:
    assert sorted(r["selected"] + [x["text"] for x in r["rejected"]]) == sorted(r["proposed"])
  assert json.loads(json.dumps(res.log)) == list(res.log)
  with pytest.raises(ValueError, match="2 selection answers for 4 seeds"):
    task_gen.select_variants(props, answers[:2], 1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  rooms, things = ["kitchen", "garden", "hallway", "pantry"], ["coin", "door", "fridge", "apple", "key", "table"]
  texts = [f"<task>Find the {a} in the {r} and take the {b}.</task> You see a {b}." for r in rooms for a in things
           for b in things]
  tok = train_bpe_tokenizer(texts * 4, tmp_path_factory.mktemp("tok"), vocab_size=400)
  cfg = tiny("qwen2", vocab_size=tok.vocab_size, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
             num_kv_heads=1, head_dim=16)
  return tok, cfg, init_params(cfg, jax.random.key(0))


LOG_KEYS = {"seed", "seed_instruction", "proposed", "selected", "rejected", "unparsed", "selection",
            "selection_answer"}


def check_log(res, seeds):
  """The log's structure: a record per seed, every candidate accounted for once, counts that match the records."""
  assert [r["seed"] for r in res.log] == [s.task.task_id for s in seeds]
  for r in res.log:
    assert set(r) == LOG_KEYS and r["selection"] in task_gen.SELECTION_METHODS
    assert sorted(r["selected"] + [x["text"] for x in r["rejected"]]) == sorted(r["proposed"])
    assert all(x["reason"] == "not selected" or x["reason"].removeprefix("filter: ") in task_gen.FILTER_REASONS
               for x in r["rejected"])
    assert (r["selection_answer"] is not None) == (r["selection"] in ("model", "fallback"))
  assert res.counts["accepted"] == sum(len(r["selected"]) for r in res.log) == len(res.tasks)
  assert res.counts["not_selected"] == sum(x["reason"] == "not selected" for r in res.log for x in r["rejected"])
  assert res.counts["unparsed"] == sum(r["unparsed"] for r in res.log)
  assert sum(res.counts.values()) == sum(len(r["proposed"]) + r["unparsed"] for r in res.log)
  assert res.selection["prompts"] == sum(r["selection_answer"] is not None for r in res.log)
  assert res.selection["fallbacks"] == sum(r["selection"] == "fallback" for r in res.log)
  json.dumps(res.log)


def test_generate_variants_end_to_end(tiny_model):
  tok, cfg, params = tiny_model
  sampler = Sampler(cfg, max_new_tokens=24, pad_id=tok.pad_id)
  seeds = [task_gen.SeedExample(t, "Location: kitchen\nYou see: coin", ("take coin",)) for t in seed_tasks(3)]
  key = jax.random.key(7)
  res = task_gen.generate_variants(sampler, params, tok, seeds, key, k=2)
  assert len(res.texts) == 3 and res.counts["accepted"] == len(res.tasks) == len(res.seed_index)
  assert set(res.counts) == {"accepted", *task_gen.REJECTION_REASONS}
  # Every row is at least one candidate; each candidate is counted once (accepted or one reason).
  blocks = [task_gen.parse_variants(t) for t in res.texts]
  assert sum(res.counts.values()) == sum(len(b) + m for b, m in blocks) >= 3
  check_log(res, seeds)
  again = task_gen.generate_variants(sampler, params, tok, seeds, key, k=2)
  assert again.texts == res.texts and again.counts == res.counts and again.log == res.log
  # Four seeds pad to the same batch (4) and length bucket: no new program; a row's sample depends on its own key.
  # (A random model writes no <task> block that survives, so no selection prompt is sampled here.)
  four = task_gen.generate_variants(sampler, params, tok, seeds + seeds[:1], key, k=2)
  assert sampler.compilations() == 1 and four.texts[:3] == res.texts
  assert four.texts[3] != res.texts[0]  # same prompt, another row key
  empty = task_gen.generate_variants(sampler, params, tok, [], key, k=2)
  assert empty.tasks == () and empty.log == ()


class ScriptedProposals:
  """The tiny model's sampler, with the first call's rows (the proposals) replaced by given texts: a random model
  writes no `<task>` block, so the selection round would never run. Later calls (the selection) are the model's
  own. Records each call's batch shape, temperatures and budgets."""

  def __init__(self, sampler: Sampler, tok, texts: list[str]):
    self.sampler, self.tok, self.texts, self.calls = sampler, tok, texts, []
    self.max_new_tokens = sampler.max_new_tokens

  def __call__(self, params, tokens, mask, keys, sp):
    out = self.sampler(params, tokens, mask, keys, sp)
    self.calls.append((np.shape(tokens), np.asarray(sp.temperature), np.asarray(sp.max_new_tokens)))
    if len(self.calls) > 1:
      return out
    ids, lengths = np.asarray(out.tokens).copy(), np.asarray(out.lengths).copy()
    for r, text in enumerate(self.texts):
      row = self.tok.encode(text)
      assert len(row) <= ids.shape[1], "scripted proposal longer than the sampler's buffer"
      ids[r], lengths[r] = self.tok.pad_id, len(row)
      ids[r, :len(row)] = row
    return out.replace(tokens=jnp.asarray(ids), lengths=jnp.asarray(lengths))


def test_selection_round_is_one_greedy_batched_call(tiny_model):
  tok, cfg, params = tiny_model
  seeds = [kitchen_seed(i) for i in range(3)]
  texts = ["<task>Take the coin.</task><task>Open the door and take the coin.</task><task>Open the fridge, then take "
           "the coin.</task>",  # three survivors: asked
           "<task>Open the door.</task><task>Take the coin from the garden.</task>",  # one survivor: kept unasked
           "<task>Take the coin and open the fridge.</task><task>Open the fridge and the door.</task>"]  # asked
  gen = task_gen.GenerationConfig(selection_max_tokens=12)
  runs, inner = [], Sampler(cfg, max_new_tokens=48, pad_id=tok.pad_id)
  for _ in range(2):
    sampler = ScriptedProposals(inner, tok, texts)
    runs.append((sampler, task_gen.generate_variants(sampler, params, tok, seeds, jax.random.key(3), k=1, cfg=gen)))
  sampler, res = runs[0]
  assert res.texts == tuple(texts)
  check_log(res, seeds)
  assert [r["selection"] for r in res.log][1] == "all" and res.selection["prompts"] == 2
  # Two sampler calls over one batch size (4 rows for 3 seeds): the proposals sampled at temperature 1 with the full
  # budget, then the selection prompts of seeds 0 and 2 only, greedy, with the selection budget.
  (shape1, temp1, budget1), (shape2, temp2, budget2) = sampler.calls
  assert shape1[0] == shape2[0] == 4
  np.testing.assert_array_equal(temp1, [1.0] * 4)
  np.testing.assert_array_equal(budget1, [48, 48, 48, 0])
  np.testing.assert_array_equal(temp2[[0, 2]], [0.0, 0.0])
  np.testing.assert_array_equal(budget2, [12, 0, 12, 0])
  # A random model rarely names a candidate: each asked seed ends with the model's choice or the fallback rule.
  for i in (0, 2):
    r, survivors = res.log[i], task_gen.filter_proposals([seeds[i]], [texts[i]], 4)[0].survivors
    chosen = task_gen.parse_choices(r["selection_answer"], len(survivors))
    assert r["selected"] == [survivors[chosen[0] if chosen else 0]]
    assert r["selection"] == ("model" if chosen else "fallback")
  assert len(res.tasks) == 3 and res.counts["not_selected"] == 3
  assert runs[1][1].log == res.log  # greedy: the same answers again
  assert inner.compilations() == len({shape1[1], shape2[1]})  # once per prompt bucket, none for the rerun
  with pytest.raises(ValueError, match="variants_per_seed \\(3\\) must not exceed proposals_per_seed \\(2\\)"):
    CurriculumConfig(variants_per_seed=3, proposals_per_seed=2)


def numpy_lloyd(x, c, iters):
  for _ in range(iters):
    a = np.argmin(((x[:, None] - c[None]) ** 2).sum(-1), 1)
    c = np.stack([x[a == j].mean(0) if (a == j).any() else c[j] for j in range(len(c))])
  return c, np.argmin(((x[:, None] - c[None]) ** 2).sum(-1), 1)


def test_kmeans_matches_numpy_on_separated_clusters():
  rng = np.random.RandomState(0)
  centers = rng.randn(3, 8) * 5
  labels = np.repeat(np.arange(3), 12)
  x = centers[labels] + rng.randn(36, 8) * 0.1
  xn = x / np.linalg.norm(x, axis=1, keepdims=True)
  valid = np.ones(40, bool)
  valid[36:] = False
  padded = np.concatenate([x, np.zeros((4, 8))]).astype(np.float32)
  res = clusters.kmeans(padded, jax.random.key(0), k=3, iters=5, valid=valid)
  ref_c, ref_a = numpy_lloyd(xn, np.asarray(res.init, np.float64), 5)
  np.testing.assert_allclose(res.centroids, ref_c, atol=1e-5)
  np.testing.assert_array_equal(res.assign[:36], ref_a)
  assert (np.asarray(res.assign[36:]) == -1).all()
  # k-means++ on well separated clusters recovers them (up to renaming).
  assert len({(int(a), int(b)) for a, b in zip(res.assign[:36], labels)}) == 3
  np.testing.assert_allclose(res.inertia, ((xn - ref_c[ref_a]) ** 2).sum(), rtol=1e-4)


def test_pool_groups_cluster_instructions():
  words = ["coin", "apple", "key", "door", "room", "find", "take", "open", "kitchen", "garden"]

  def encode(texts):  # bag of words: instructions sharing their nouns land together
    return np.array([[t.lower().count(w) for w in words] for t in texts], np.float32)

  pool = TaskPool(8)
  texts = ["find the coin", "find a coin in the kitchen", "open the door", "open the kitchen door",
           "take the apple", "take an apple from the garden"]
  pool.add_seeds([Task.make("x", str(i), t) for i, t in enumerate(texts)])
  pool.evict([1])
  groups = clusters.pool_groups(pool, encode, jax.random.key(0), k=3)
  assert groups[1] == -1 and (groups[6:] == -1).all()
  g = groups[[0, 2, 3, 4, 5]]
  assert g[1] == g[2] and g[3] == g[4] and len({g[0], g[1], g[3]}) == 3
  with pytest.raises(ValueError, match="encode returned shape"):
    clusters.cluster_texts(lambda t: np.zeros((1, 2)), ["a", "b"], jax.random.key(0), k=2)
  assert json.dumps(groups.tolist())  # plain ints, ready for logs
