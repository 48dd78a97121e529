"""The rollout engine on real TextWorld-Express games (coin, in-process JVMs) with tiny Qwen2 policies.

A random policy never answers in the format, which exercises masks, log-probs, budgets, buckets and the unparseable
path; a policy fine-tuned for a few dozen steps on expert answers exercises real actions reaching the env.
"""

import dataclasses
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dreamjax.envs import SerialBatchEnv
from dreamjax.envs.textworld_express import INVALID_FEEDBACK, TextWorldExpressEnv, tasks
from dreamjax.loop.evaluate import evaluate
from dreamjax.models import Transformer, init_params, tiny
from dreamjax.rl.batch import rl_batch
from dreamjax.rollout.agent import INVALID_ANSWER, AgentFormat, build_turn_prompt, format_answer, parse_answer, user_text
from dreamjax.rl.logprobs import LogpScorer
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine, allowed_tokens, answer_ids, pack_choices
from dreamjax.sampling import SpeculativeConfig, sampling_params, speculation_rates
from dreamjax.text import Kind, SegmentBuilder, train_bpe_tokenizer

ONE_ROOM = "numLocations=1, includeDoors=0"  # the coin lies in the start room: gold path "look around", "take coin"
TWO_ROOMS = "numLocations=2, includeDoors=0"
FMT = AgentFormat(think=False, history_turns=3, history_token_budget=400)
ROWS = 4


@pytest.fixture(scope="module")
def twx():
  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=3) for _ in range(ROWS)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def expert_turns(twx):
  """(instruction, history, observation, expert action) of every turn of gold episodes on one-room coin games."""
  env, out = twx.envs[0], []
  for task in tasks("coin", "train", 8, params=ONE_ROOM, env=env):
    obs, history = env.reset(task), []
    while (action := env.expert_action()) is not None:
      out.append((obs.instruction, tuple(history), obs, action))
      result = env.step(action)
      history.append((obs.state, action))
      obs = result.observation
      if result.done:
        break
  return out


@pytest.fixture(scope="module")
def tok(twx, expert_turns, tmp_path_factory):
  texts = [FMT.system_text(), INVALID_ANSWER, INVALID_FEEDBACK]
  for instruction, history, obs, action in expert_turns:
    texts += [user_text(FMT, instruction, len(history), history, obs.state, obs.admissible), format_answer(action)]
  for task in tasks("coin", "train", 4, params=TWO_ROOMS, env=twx.envs[0]):
    texts.append(twx.envs[0].reset(task).state)
  return train_bpe_tokenizer(texts * 3, tmp_path_factory.mktemp("tok"), vocab_size=600)


@pytest.fixture(scope="module")
def policy_cfg(tok):
  return tiny("qwen2", vocab_size=tok.vocab_size, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def random_params(policy_cfg):
  return init_params(policy_cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def far_tasks(twx):
  return tasks("coin", "dev", 3, params=TWO_ROOMS, env=twx.envs[0])


RANDOM_CFG = RolloutConfig(group_size=2, max_turns=4, max_action_tokens=8, max_episode_tokens=20,
                           prompt_buckets=(512,), temperature=1.0)


@pytest.fixture(scope="module")
def random_runs(twx, tok, policy_cfg, random_params, far_tasks):
  engine = RolloutEngine(policy_cfg, tok, FMT, RANDOM_CFG)
  key = jax.random.key(7)
  first = engine.run(random_params, twx, far_tasks[:2], key, policy_version=3)
  stats = first.stats
  # the env is untouched by unparseable turns: its next step is its first
  steps_after = [e.step("look around").info["steps"] for e in twx.envs]
  again = engine.run(random_params, twx, far_tasks[:2], key, policy_version=3)
  other_tasks = engine.run(random_params, twx, [far_tasks[0], far_tasks[2]], key, policy_version=3)
  other_key = engine.run(random_params, twx, far_tasks[:2], jax.random.key(8), policy_version=3)
  return engine, first, stats, steps_after, again, other_tasks, other_key


def _expected_prompts(tok, traj, fmt):
  """Each row's prompt rebuilt from the records, with the history the engine shows (parsed action or the marker)."""
  out = []
  for m in range(traj.num_rows):
    e, t = int(traj.episode[m]), int(traj.turn[m])
    record = traj.records[e]
    history = []
    for j in range(t):
      row = traj.turn_rows[e, j]
      sampled = traj.tokens[row, traj.prompt_lengths[row]:traj.lengths[row]]
      parsed = parse_answer(tok.decode(sampled[:-1] if not traj.truncated[row] else sampled))
      history.append((record.steps[j].state, parsed.action or INVALID_ANSWER))
    step = record.steps[t]
    out.append((record.instruction, t, history, step.state, step.admissible))
  return out


def test_rows_masks_and_ids(random_runs, tok):
  engine, traj, *_ = random_runs
  n = 2 * RANDOM_CFG.group_size
  assert traj.num_episodes == n and traj.num_rows == int(traj.num_turns.sum())
  np.testing.assert_array_equal(traj.group, [0, 0, 1, 1])
  np.testing.assert_array_equal(traj.task_index, [0, 0, 1, 1])
  for e in range(n):
    rows = traj.turn_rows[e, :traj.num_turns[e]]
    assert (traj.turn_rows[e, traj.num_turns[e]:] == -1).all()
    np.testing.assert_array_equal(traj.episode[rows], e)
    np.testing.assert_array_equal(traj.turn[rows], np.arange(traj.num_turns[e]))
  cols = np.arange(traj.tokens.shape[1])[None]
  sampled = (cols >= traj.prompt_lengths[:, None]) & (cols < traj.lengths[:, None])
  np.testing.assert_array_equal(traj.loss_mask, sampled.astype(np.int32))
  np.testing.assert_array_equal(traj.kinds == Kind.ACTION, sampled)
  padding = cols >= traj.lengths[:, None]
  assert (traj.kinds[padding] == Kind.PAD).all() and (traj.tokens[padding] == tok.pad_id).all()
  assert (traj.rollout_logp[~sampled] == 0).all() and (traj.rollout_logp[sampled] < 0).all()
  prompt = cols < traj.prompt_lengths[:, None]
  assert set(np.unique(traj.kinds[prompt])) == {Kind.SYSTEM, Kind.OBSERVATION, Kind.ACTION_FRAME}
  assert traj.tokens.dtype == np.int32 and traj.rollout_logp.dtype == np.float32 and traj.done.dtype == bool
  ids = [r.episode_id for r in traj.records]
  assert len(set(ids)) == n and all(i.startswith(f"policy:{r.task.task_id}:v3:") for i, r in zip(ids, traj.records))
  assert all(r.policy == "policy" and all(s.source == "policy" for s in r.steps) for r in traj.records)


def test_prompts_are_exactly_build_turn_prompt(random_runs, tok):
  _, traj, *_ = random_runs
  for m, (instruction, t, history, state, admissible) in enumerate(_expected_prompts(tok, traj, FMT)):
    expected = build_turn_prompt(tok, FMT, instruction, t, history, state, admissible).prompt()
    np.testing.assert_array_equal(traj.tokens[m, :traj.prompt_lengths[m]], expected)
    if t:
      assert f"| action: {INVALID_ANSWER}" in tok.decode(expected)


def test_logps_are_the_samplers_and_match_teacher_forcing(random_runs, random_params, policy_cfg):
  engine, traj, *_ = random_runs
  key = jax.random.key(7)
  # Turn 0 resampled directly: same rows (right-padded this time), keys fold_in(fold_in(key, 0), row).
  rows = traj.turn_rows[:, 0]
  width = RANDOM_CFG.prompt_buckets[0]
  prompts = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, m in enumerate(rows):
    prompts[i, :traj.prompt_lengths[m]], mask[i, :traj.prompt_lengths[m]] = traj.tokens[m, :traj.prompt_lengths[m]], 1
  keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(key, 0), r) for r in range(len(rows))])
  out = engine.sampler(random_params, prompts, mask, keys,
           sampling_params(len(rows), RANDOM_CFG.max_action_tokens, 1.0, stop=[[i] for i in engine.stop_ids]))
  for i, m in enumerate(rows):
    p, n = traj.prompt_lengths[m], traj.lengths[m] - traj.prompt_lengths[m]
    assert int(out.lengths[i]) == n
    np.testing.assert_array_equal(np.asarray(out.tokens[i, :n]), traj.tokens[m, p:p + n])
    np.testing.assert_array_equal(np.asarray(out.logps[i, :n]), traj.rollout_logp[m, p:p + n])
  # Every row: the log-prob an update recomputes from a full forward over the stored ids.
  t = traj.tokens.shape[1]
  valid = np.arange(t)[None] < traj.lengths[:, None]

  @jax.jit
  def token_logps(params, tokens, valid):
    positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    logits = Transformer(policy_cfg).apply({"params": params}, tokens, positions, valid).logits
    return jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), tokens[:, 1:, None], -1)[..., 0]

  recomputed = np.asarray(token_logps(random_params, traj.tokens, valid))
  m = traj.loss_mask[:, 1:] == 1
  np.testing.assert_allclose(traj.rollout_logp[:, 1:][m], recomputed[m], atol=2e-5, rtol=0)


def test_token_budgets_and_truncation(random_runs):
  engine, traj, stats, *_ = random_runs
  sampled = traj.lengths - traj.prompt_lengths
  last = traj.tokens[np.arange(traj.num_rows), traj.lengths - 1]
  stops = np.isin(last, engine.stop_ids)
  # a row is truncated exactly when it did not end with a stop token
  np.testing.assert_array_equal(traj.truncated, ~stops)
  assert (sampled <= RANDOM_CFG.max_action_tokens).all()
  for e in range(traj.num_episodes):
    rows = traj.turn_rows[e, :traj.num_turns[e]]
    used = sampled[rows].sum()
    assert used <= RANDOM_CFG.max_episode_tokens and not traj.ended[e]
    if traj.num_turns[e] < RANDOM_CFG.max_turns:  # ended early: only the episode token budget does that here
      assert used == RANDOM_CFG.max_episode_tokens
  # a random policy rarely stops, so the 20-token budget ends most episodes on turn 3 with a 4-token turn
  assert (traj.num_turns == 3).sum() >= 3 and (traj.truncated & (sampled == 4)).sum() >= 3
  assert stats["sampled_tokens"] == sampled.sum() and stats["turns"] == traj.num_turns.max()
  assert stats["sample_s"] > 0 and stats["env_s"] > 0 and stats["host_s"] > 0


def test_unparseable_answers_are_recorded_and_not_stepped(random_runs, tok):
  _, traj, stats, steps_after, *_ = random_runs
  assert traj.invalid.all() and (traj.reward == 0).all() and not traj.done.any() and not traj.success.any()
  assert stats["parse_failures"] == traj.num_rows and stats["env_invalid"] == 0
  assert steps_after == [1] * ROWS  # the engine never stepped the env
  for e, record in enumerate(traj.records):
    assert record.num_steps == traj.num_turns[e] and not record.success and record.score is None
    first = record.steps[0].state
    for j, step in enumerate(record.steps):
      row = traj.turn_rows[e, j]
      sampled = traj.tokens[row, traj.prompt_lengths[row]:traj.lengths[row]]
      assert step.action == tok.decode(sampled if traj.truncated[row] else sampled[:-1])
      assert step.invalid and step.reward == 0 and step.state == step.next_state == first
      assert step.admissible == record.steps[0].admissible


def test_reproducible_from_the_key_and_rows_independent(random_runs):
  _, first, _, _, again, other_tasks, other_key = random_runs
  for f in dataclasses.fields(first):
    if f.name == "stats":  # how the rollout went (timings), not what it produced
      continue
    a, b = getattr(first, f.name), getattr(again, f.name)
    if isinstance(a, np.ndarray):
      np.testing.assert_array_equal(a, b, err_msg=f.name)
    else:
      assert a == b, f.name
  # Episodes 0 and 1 ran the same task with the same key in both batches: other rows do not change them.
  for e in (0, 1):
    ra, rb = first.turn_rows[e, :first.num_turns[e]], other_tasks.turn_rows[e, :other_tasks.num_turns[e]]
    assert len(ra) == len(rb)
    for i, j in zip(ra, rb):
      n = first.lengths[i]
      assert other_tasks.lengths[j] == n
      np.testing.assert_array_equal(first.tokens[i, :n], other_tasks.tokens[j, :n])
      np.testing.assert_array_equal(first.rollout_logp[i, :n], other_tasks.rollout_logp[j, :n])
  assert not np.array_equal(first.tokens[first.turn_rows[2, :1]], other_tasks.tokens[other_tasks.turn_rows[2, :1]])
  assert not np.array_equal(first.tokens[first.loss_mask == 1], other_key.tokens[other_key.loss_mask == 1])
  # the two rollouts of one task differ (per-row keys)
  assert not np.array_equal(first.tokens[first.turn_rows[0, 0]], first.tokens[first.turn_rows[1, 0]])


def test_one_compilation_per_bucket(random_runs):
  engine, _, stats, *_ = random_runs
  assert stats["buckets"] == [512] and engine.sampler.compilations() == 1  # four runs of several turns each


def test_buckets_grow_and_history_is_dropped_to_fit(twx, tok, policy_cfg, random_params, far_tasks):
  obs = twx.envs[0].reset(far_tasks[0])
  probe = build_turn_prompt(tok, FMT, obs.instruction, 0, [], obs.state, obs.admissible).prompt()
  small = len(probe) + 80  # turn 0 (no history) fits; later turns with full history do not
  cfg = RolloutConfig(group_size=1, max_turns=3, max_action_tokens=4, max_episode_tokens=100,
                      prompt_buckets=(small, small + 40))
  engine = RolloutEngine(policy_cfg, tok, FMT, cfg)
  traj = engine.run(random_params, twx, far_tasks[:2], jax.random.key(1))
  assert traj.stats["buckets"] == [small, small + 40] and engine.sampler.compilations() == 2
  np.testing.assert_array_equal(traj.num_turns, [3, 3])  # max_turns ends them, truncated
  assert not traj.ended.any() and (traj.prompt_lengths <= small + 40).all()
  dropped = 0
  for m, (instruction, t, history, state, admissible) in enumerate(_expected_prompts(tok, traj, FMT)):
    # the prompt keeps the longest suffix of the history that fits the largest bucket
    fits = [k for k in range(len(history) + 1)
            if len(build_turn_prompt(tok, FMT, instruction, t, history[k:], state, admissible).prompt()) <= small + 40]
    expected = build_turn_prompt(tok, FMT, instruction, t, history[fits[0]:], state, admissible).prompt()
    np.testing.assert_array_equal(traj.tokens[m, :traj.prompt_lengths[m]], expected)
    dropped += fits[0] > 0
  assert dropped >= 1


def test_bad_configs_are_clear_errors(twx, tok, policy_cfg, random_params, far_tasks):
  engine = RolloutEngine(policy_cfg, tok, FMT, RolloutConfig(prompt_buckets=(16,), max_action_tokens=4))
  with pytest.raises(ValueError, match=r"turn 0: the prompt is \d+ tokens without any history, beyond the largest"):
    engine.run(random_params, twx, far_tasks[:1], jax.random.key(0))
  with pytest.raises(ValueError, match="strictly increasing"):
    RolloutConfig(prompt_buckets=(512, 256))
  with pytest.raises(ValueError, match="max_turns"):
    RolloutConfig(max_turns=0)
  with pytest.raises(ValueError, match="vocab_size 300 is below"):
    RolloutEngine(policy_cfg.replace(vocab_size=300), tok, FMT, RolloutConfig())
  with pytest.raises(ValueError, match="max_position_embeddings"):
    RolloutEngine(policy_cfg, tok, FMT, RolloutConfig(prompt_buckets=(1024,)))
  with pytest.raises(ValueError, match="no tasks"):
    engine.run(random_params, twx, [], jax.random.key(0))


def test_constrained_rollouts_only_take_admissible_actions(twx, tok, policy_cfg, random_params, far_tasks):
  """With constrain_actions a random policy, which never answers in the format unconstrained, answers every turn
  with one of its admissible actions exactly as SFT would write it; each answer token's allowed set holds the next
  tokens of the admissible answers it still matched; the log-probs are the model's renormalised over those sets, and
  the update's scorer gives them back; and KV reuse with grouped prefill changes nothing."""
  base = dataclasses.replace(RANDOM_CFG, max_action_tokens=24, max_episode_tokens=96, constrain_actions=True)
  runs = {on: RolloutEngine(policy_cfg, tok, FMT, dataclasses.replace(base, kv_reuse=on, group_prefill=on)).run(
      random_params, twx, far_tasks[:2], jax.random.key(5)) for on in (False, True)}
  traj = runs[False]
  assert traj.stats["parse_failures"] == 0 and not traj.truncated.any()
  chosen = set()
  for e, record in enumerate(traj.records):
    for j, step in enumerate(record.steps):
      assert step.action in step.admissible, step.action
      chosen.add(step.action)
      row = traj.turn_rows[e, j]
      p = traj.prompt_lengths[row]
      answer = traj.tokens[row, p:traj.lengths[row]]
      assert tok.decode(answer[:-1]) == format_answer(step.action) and answer[-1] in (tok.chat_format.end_of_turn,)
      answers = [SegmentBuilder(tok).answer_ids(format_answer(a)) for a in step.admissible]
      for k in range(len(answer)):
        want = {a[k] for a in answers if len(a) > k and list(a[:k]) == list(answer[:k])}
        got = traj.allowed[row, p + k]
        assert set(got[got >= 0]) == want and answer[k] in want
  assert len(chosen) >= 3  # a random policy spreads over the actions
  # Forced tokens (the end-of-turn after "</action>" always is) leave the loss; the choices were real elsewhere.
  action = traj.kinds == Kind.ACTION
  assert not (traj.loss_mask.astype(bool) & ~action).any()
  assert traj.stats["forced_tokens"] == action.sum() - traj.loss_mask.sum() > 0
  last = traj.tokens[np.arange(traj.num_rows), traj.lengths - 1]
  assert (last == tok.chat_format.end_of_turn).all() and (traj.loss_mask[np.arange(traj.num_rows),
                                                                           traj.lengths - 1] == 0).all()
  assert (traj.loss_mask.sum(1) >= 1).all()
  t = traj.tokens.shape[1]
  valid = np.arange(t)[None] < traj.lengths[:, None]
  logits = Transformer(policy_cfg).apply({"params": random_params}, traj.tokens,
                                         jnp.broadcast_to(jnp.arange(t), traj.tokens.shape), valid).logits
  logsm = np.asarray(jax.nn.log_softmax(logits[:, :-1], -1), np.float64)
  action = traj.kinds[:, 1:] == Kind.ACTION
  for r, c in zip(*np.nonzero(action)):
    allowed = traj.allowed[r, c + 1][traj.allowed[r, c + 1] >= 0]
    want = logsm[r, c, traj.tokens[r, c + 1]] - np.log(np.exp(logsm[r, c, allowed]).sum())
    np.testing.assert_allclose(traj.rollout_logp[r, c + 1], want, atol=2e-5, rtol=0)
  scored, _ = LogpScorer(policy_cfg, 4, pad_to=64)(random_params, traj.tokens, None, valid, mask=traj.loss_mask,
                                                     allowed=traj.allowed)
  np.testing.assert_allclose(scored, traj.rollout_logp * traj.loss_mask, atol=2e-5, rtol=0)
  # The update's batch carries the sets, its width a power of two (a few compilations per run).
  batch = rl_batch(traj, pad_to=64)
  a = traj.allowed.shape[-1]
  assert batch.allowed.shape[-1] == 1 << (a - 1).bit_length() >= a > 1
  np.testing.assert_array_equal(batch.allowed[:traj.num_rows, :t, :a], traj.allowed)
  assert (batch.allowed[:, :, a:] == -1).all() and (batch.allowed[:, t:] == -1).all()
  for name in ("tokens", "lengths", "reward", "invalid"):
    np.testing.assert_array_equal(getattr(runs[True], name), getattr(traj, name), err_msg=name)
  with pytest.raises(ValueError, match="constrain_actions .* needs AgentFormat.think=False"):
    RolloutEngine(policy_cfg, tok, dataclasses.replace(FMT, think=True), base)


def test_allowed_tokens_are_the_continuations_of_the_choices_still_matched():
  choices = np.array([[5, 6, 7, 2], [5, 6, 8, 2], [9, 2, -1, -1], [-1, -1, -1, -1]], np.int32)

  def sets(c, ids):
    return [a.tolist() for a in allowed_tokens(c, np.array(ids))]

  assert sets(choices, [5, 6, 8, 2]) == [[5, 9], [6], [7, 8], [2]]
  assert sets(choices, [9, 2]) == [[5, 9], [2]]
  assert sets(choices[:1], [5, 6, 7, 2]) == [[5], [6], [7], [2]]
  assert sets(choices[3:], [4, 4]) == [[], []]  # not limited
  assert sets(choices[2:3], [9, 2, 4]) == [[9], [2], []]  # past the end of its choice (and of L): any token


def test_packed_choices_are_each_rows_answers_in_a_power_of_two_width(tok):
  take, look = answer_ids(tok, "take coin"), answer_ids(tok, "look around")
  assert take == tuple(SegmentBuilder(tok).answer_ids(format_answer("take coin")))
  assert answer_ids(tok, "take </action> coin") == ()  # holds an answer tag: no answer parses back to it
  width = max(len(take), len(look)) - 1  # cuts the longer answer, as the action budget does
  out = pack_choices({1: [take] * 9, 2: [look, (), take]}, 4, width)
  assert out.shape == (4, 16, width)  # 9 choices round up to 16; never below 8
  assert (out[0] == -1).all() and (out[3] == -1).all()  # rows without choices are not limited
  for r, c, ids in ((1, 0, take), (1, 8, take), (2, 0, look), (2, 2, take)):
    n = min(len(ids), width)
    assert out[r, c, :n].tolist() == list(ids[:n]) and (out[r, c, n:] == -1).all()
  assert (out[1, 9:] == -1).all() and (out[2, 1] == -1).all() and (out[2, 3:] == -1).all()
  assert pack_choices({0: [take]}, 1, width).shape == (1, 8, width)


def _sft(cfg, tok, expert_turns, steps: int, lr: float):
  """Plain masked cross-entropy on format_answer(expert action) after each turn's exact prompt."""
  seqs = []
  for instruction, history, obs, action in expert_turns:
    builder = build_turn_prompt(tok, FMT, instruction, len(history), history, obs.state, obs.admissible)
    seqs.append(builder.append(Kind.ACTION, format_answer(action)).arrays())
  t = max(len(ids) for ids, _ in seqs)
  ids = np.full((len(seqs), t), tok.pad_id, np.int32)
  target_mask = np.zeros((len(seqs), t), np.float32)
  valid = np.zeros((len(seqs), t), bool)
  for i, (row, kinds) in enumerate(seqs):
    ids[i, :len(row)], target_mask[i, :len(row)], valid[i, :len(row)] = row, kinds == Kind.ACTION, True
  positions = np.broadcast_to(np.arange(t - 1), (len(seqs), t - 1))
  opt = optax.adam(lr)

  def loss_fn(params):
    logits = Transformer(cfg).apply({"params": params}, ids[:, :-1], positions, valid[:, :-1]).logits
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * target_mask[:, 1:]) / jnp.sum(target_mask[:, 1:])

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params = init_params(cfg, jax.random.key(1))
  state = opt.init(params)
  for _ in range(steps):
    params, state, loss = step(params, state)
  return params, float(loss)


@pytest.fixture(scope="module")
def tuned_params(tok, policy_cfg, expert_turns):
  params, loss = _sft(policy_cfg, tok, expert_turns, steps=40, lr=5e-3)
  assert loss < 0.1
  return params


GREEDY = RolloutConfig(group_size=1, max_turns=3, max_action_tokens=16, max_episode_tokens=64, prompt_buckets=(512,),
                       temperature=0.0)


def test_fine_tuned_policy_acts_in_the_real_env(twx, tok, policy_cfg, tuned_params, far_tasks):
  params, engine = tuned_params, RolloutEngine(policy_cfg, tok, FMT, GREEDY)
  # two unseen one-room games (the coin is in sight) and a two-room game whose coin is in the other room
  near = tasks("coin", "test", 2, params=ONE_ROOM, env=twx.envs[0])
  far = next(t for t in far_tasks if "coin" not in twx.envs[0].reset(t).state.split("\n")[1])
  traj = engine.run(params, twx, near + [far], jax.random.key(0))
  for e in (0, 1):  # look around, then take the coin: reward 1 on the last turn, and the row stops there
    record, rows = traj.records[e], traj.turn_rows[e, :traj.num_turns[e]]
    assert [s.action for s in record.steps] == ["look around", "take coin"]
    np.testing.assert_array_equal(traj.reward[rows], [0.0, 1.0])
    np.testing.assert_array_equal(traj.done[rows], [False, True])
    assert not traj.invalid[rows].any() and not traj.truncated[rows].any()
    assert traj.success[e] and traj.ended[e] and traj.episode_reward[e] == 1.0 and traj.num_turns[e] == 2
    assert record.success and record.steps[-1].success and record.steps[-1].done and record.score == 1.0
    assert record.steps[0].next_state == record.steps[1].state and "take coin" in record.steps[1].admissible
  # the far game: whatever the policy does, the env's verdicts are what the trajectory holds
  record, rows = traj.records[2], traj.turn_rows[2, :traj.num_turns[2]]
  assert not traj.success[2] and traj.episode_reward[2] == 0.0
  for j, row in enumerate(rows):
    step = record.steps[j]
    assert traj.invalid[row] == step.invalid and traj.done[row] == step.done and traj.reward[row] == step.reward
    if step.invalid and step.action in step.admissible:
      pytest.fail("an admissible action came back invalid")
  assert traj.ended[2] == bool(traj.done[rows[-1]])
  assert traj.stats["parse_failures"] + traj.stats["env_invalid"] == int(traj.invalid.sum())


def test_speculative_rollouts_equal_plain_ones_under_greedy_decoding(twx, tok, policy_cfg, tuned_params, far_tasks):
  """Copy-speculative decoding in the engine: the tuned policy's answers copy actions listed in its prompt, so some
  drafts are accepted, and the greedy trajectories are the plain engine's token for token, log-probs to float
  rounding."""
  near = tasks("coin", "test", 2, params=ONE_ROOM, env=twx.envs[0])
  plain = RolloutEngine(policy_cfg, tok, FMT, GREEDY).run(tuned_params, twx, near + far_tasks[:1], jax.random.key(0))
  spec_cfg = dataclasses.replace(GREEDY, speculative=SpeculativeConfig(draft_tokens=4))
  engine = RolloutEngine(policy_cfg, tok, FMT, spec_cfg)
  traj = engine.run(tuned_params, twx, near + far_tasks[:1], jax.random.key(0))
  for name in ("tokens", "lengths", "loss_mask", "reward", "done", "invalid"):
    np.testing.assert_array_equal(getattr(traj, name), getattr(plain, name), err_msg=name)
  np.testing.assert_allclose(traj.rollout_logp, plain.rollout_logp, rtol=1e-5, atol=1e-5)
  rates = speculation_rates(traj.stats)  # answers are two or three tokens here: little to draft, but some
  assert rates["accepted_per_step"] > 0.1 and rates["tokens_per_forward"] > 1.1, rates
  assert speculation_rates(plain.stats) == {"accepted_per_step": 0.0, "tokens_per_forward": 1.0}
  assert traj.stats["answer_tokens"] == traj.stats["sampled_tokens"]
  with pytest.raises(ValueError, match="speculative settings"):
    RolloutEngine(policy_cfg, tok, FMT, GREEDY, sampler=engine.sampler)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_reuse_and_grouped_prefill_rollouts_equal_full_prefill_ones(twx, tok, policy_cfg, tuned_params, far_tasks,
                                                                        temperature):
  """KV reuse across turns (with grouped prefill, as the defaults of dreamjax rl run them) gives the full-prefill
  engine's trajectories: token for token, log-probs to float rounding; the prompts after turn 0 reuse the system
  message and task line the row's cache holds."""
  near = tasks("coin", "test", 2, params=ONE_ROOM, env=twx.envs[0])
  base = dataclasses.replace(GREEDY, group_size=2, temperature=temperature)
  runs = {}
  for on in (False, True):
    engine = RolloutEngine(policy_cfg, tok, FMT, dataclasses.replace(base, kv_reuse=on, group_prefill=on))
    runs[on] = engine.run(tuned_params, twx, near[:1] + far_tasks[:1], jax.random.key(3))
  plain, traj = runs[False], runs[True]
  for name in ("tokens", "lengths", "loss_mask", "reward", "done", "invalid"):
    np.testing.assert_array_equal(getattr(traj, name), getattr(plain, name), err_msg=name)
  np.testing.assert_allclose(traj.rollout_logp, plain.rollout_logp, rtol=1e-5, atol=1e-5)
  s, p = traj.stats, plain.stats
  assert s["prompt_tokens"] == p["prompt_tokens"] == p["prefilled_tokens"] == int(plain.prompt_lengths.sum())
  turn0 = int(plain.prompt_lengths[plain.turn == 0].sum())
  # Turn 0 is prefilled whole (the cache starts empty); later turns only past the shared system message and task.
  assert turn0 < s["prefilled_tokens"] < s["prompt_tokens"] - 0.2 * (s["prompt_tokens"] - turn0)
  assert s["grouped_turns"] >= 1 and p["grouped_turns"] == 0


def test_an_env_step_budget_is_exact_and_cuts_rows_in_order(twx, tok, policy_cfg, tuned_params, far_tasks):
  """Uncapped, the two near games take 2 steps each and the far one more. With 4 steps: turn 0 steps all three rows
  (1 left), turn 1 steps row 0 (it takes the coin) and cuts rows 1 and 2 before their action reaches the env."""
  engine = RolloutEngine(policy_cfg, tok, FMT, GREEDY)
  near = tasks("coin", "test", 2, params=ONE_ROOM, env=twx.envs[0])
  whole = engine.run(tuned_params, twx, near + far_tasks[:1], jax.random.key(0))
  assert int(whole.num_turns.sum()) > 4 and not whole.budget_cut.any()
  traj = engine.run(tuned_params, twx, near + far_tasks[:1], jax.random.key(0), max_env_steps=4)
  assert traj.num_turns.tolist() == [2, 1, 1] and traj.num_rows == 4 and traj.stats["budget_cut"] == 2
  assert traj.budget_cut.tolist() == [False, True, True] and traj.left_out.tolist() == [False, True, True]
  assert traj.success[0] and not traj.success[1:].any() and not traj.ended[1:].any()
  assert [len(r.steps) for r in traj.records] == [2, 1, 1]
  # Rows the budget left alone are the uncapped run's, token for token.
  np.testing.assert_array_equal(traj.tokens[0, :traj.lengths[0]], whole.tokens[0, :whole.lengths[0]])
  # A budget spent in the first turn stops every row after it.
  first = engine.run(tuned_params, twx, near + far_tasks[:1], jax.random.key(0), max_env_steps=2)
  assert first.num_turns.tolist() == [1, 1, 0] and first.budget_cut.all() and first.num_rows == 2


class _RowsSeen:
  """A BatchEnv wrapper that records how many rows each reset_batch asked for."""

  def __init__(self, inner):
    self.inner, self.resets = inner, []

  def reset_batch(self, tasks):
    self.resets.append(len(tasks))
    return self.inner.reset_batch(tasks)

  def step_batch(self, actions):
    return self.inner.step_batch(actions)

  def close(self):
    pass


def test_max_rows_plays_whole_groups_in_turn_with_the_same_draws(twx, tok, policy_cfg, tuned_params, far_tasks):
  """max_rows 2 with G = 2 plays one group at a time on env rows 0-1; each row keeps its key, so the trajectories are
  those of all rows at once. An env-step budget is spent in play order: the first chunk's rows step first."""
  near = tasks("coin", "test", 2, params=ONE_ROOM, env=twx.envs[0])
  base = dataclasses.replace(GREEDY, group_size=2, temperature=1.0)
  together = RolloutEngine(policy_cfg, tok, FMT, base).run(tuned_params, twx, near[:1] + far_tasks[:1],
                                                           jax.random.key(5))
  env = _RowsSeen(twx)
  chunked = RolloutEngine(policy_cfg, tok, FMT, dataclasses.replace(base, max_rows=3))
  traj = chunked.run(tuned_params, env, near[:1] + far_tasks[:1], jax.random.key(5))
  assert env.resets == [2, 2] and traj.stats["episodes"] == 4
  for name in ("tokens", "lengths", "loss_mask", "reward", "done", "invalid", "episode", "turn", "group",
               "task_index", "turn_rows", "success"):
    np.testing.assert_array_equal(getattr(traj, name), getattr(together, name), err_msg=name)
  np.testing.assert_allclose(traj.rollout_logp, together.rollout_logp, rtol=1e-5, atol=1e-5)
  assert [r.task for r in traj.records] == [r.task for r in together.records]
  one = RolloutEngine(policy_cfg, tok, FMT, dataclasses.replace(GREEDY, max_rows=1))
  capped = one.run(tuned_params, twx, near + far_tasks[:1], jax.random.key(0), max_env_steps=4)
  assert capped.num_turns.tolist() == [2, 2, 0] and capped.budget_cut.tolist() == [False, False, True]
  assert capped.success[:2].all()
  assert RolloutConfig(group_size=4, max_rows=6).rows_at_once(16) == 4
  assert RolloutConfig(group_size=4).rows_at_once(16) == 16
  with pytest.raises(ValueError, match="max_rows must be 0"):
    RolloutConfig(group_size=4, max_rows=3)


class _KillJvm:
  """A SerialBatchEnv of TWX envs whose row `row` JVM is killed (SIGKILL, by pid) before the `at`-th step_batch of
  each of the first `times` episode batches: the env process dying mid-episode, as it does in a long run."""

  def __init__(self, rows: int, row: int, at: int, times: int):
    make = lambda: TextWorldExpressEnv(step_limit=3)  # noqa: E731
    self.inner = SerialBatchEnv([make() for _ in range(rows)], make)
    self.row, self.at, self.times, self.killed = row, at, times, []

  def reset_batch(self, tasks):
    self.steps = 0
    return self.inner.reset_batch(tasks)

  def step_batch(self, actions):
    self.steps += 1
    if self.steps == self.at and len(self.killed) < self.times:
      proc = self.inner.envs[self.row]._twx._gateway.java_process
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait()
      self.killed.append(proc.pid)
    return self.inner.step_batch(actions)

  def close(self):
    self.inner.close()


def test_an_env_that_dies_mid_episode_is_marked_left_out_and_rerun(twx, tok, policy_cfg, tuned_params):
  engine = RolloutEngine(policy_cfg, tok, FMT, GREEDY)
  near = tasks("coin", "test", 2, params=ONE_ROOM, env=twx.envs[0])
  env = _KillJvm(rows=2, row=0, at=2, times=1)
  try:
    # Row 0's JVM dies before its second action ("take coin"): the row ends as an env failure, the other is untouched.
    traj = engine.run(tuned_params, env, near, jax.random.key(0))
    assert env.killed and env.inner.failures == 1
    assert traj.env_error.tolist() == [True, False] and traj.stats["env_errors"] == 1
    assert not traj.success[0] and traj.success[1] and traj.num_turns.tolist() == [2, 2]
    batch = rl_batch(traj, advantage="grpo", pad_to=64)
    rows0 = traj.turn_rows[0, :2]
    assert not np.asarray(batch.loss_mask)[rows0].any() and np.asarray(batch.loss_mask)[traj.turn_rows[1, :2]].any()
    # The failed env was rebuilt: the next batch runs on a new JVM, and both games are won.
    again = engine.run(tuned_params, env, near, jax.random.key(0))
    assert not again.env_error.any() and again.success.all() and env.inner.restarts == 1
  finally:
    env.close()
  # Evaluation reruns a task the env failed on; a task it fails on twice is left out of the rates and named.
  for times, reruns, lost in ((1, 1, []), (2, 1, [near[0].task_id])):
    env = _KillJvm(rows=2, row=0, at=2, times=times)
    try:
      result = evaluate(engine, tuned_params, env, near, jax.random.key(0))
    finally:
      env.close()
    assert result["env_error_reruns"] == reruns and result["env_error_tasks"] == lost
    assert result["episodes"] == 2 - len(lost) and result["success_rate"] == 1.0
    assert [o[0] for o in result["outcomes"]] == [t.task_id for t in near if t.task_id not in lost]
