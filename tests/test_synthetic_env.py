"""SyntheticEnv on real TextWorld-Express data (simonsays, two commands a game) with tiny Qwen2 experience models.

A random model never writes the format, which exercises the retries and the env failures they end in, the protocol
(None rows, finished rows), the prompts and retrieval. A scripted sampler (tests/test_agent_view.py) pins the retry
rule: which rows are resampled, with which keys and shapes, and what a row that never parses becomes. One tiny model
fine-tuned both as M_exp (on `transition_example` of the recorded transitions, retrieved examples and admissible
actions included) and as the policy (on the expert's answers, with the admissible actions every turn), until every
supervised token is its argmax by a margin, must then replay the recorded episodes exactly under greedy decoding,
admissible lists included, stepped directly and driven by the real RolloutEngine.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dreamjax.data.collect import play_expert
from dreamjax.data.records import transitions
from dreamjax.envs.base import ENV_ERROR, Observation, Task, env_failed
from dreamjax.experience.format import (
    FAILURE_STATE,
    ExpFormatConfig,
    action_lists,
    build_prompt,
    render_user,
    system_prompt,
    transition_example,
    transition_target,
)
from dreamjax.envs.textworld_express import state_fields
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from
from dreamjax.models import Transformer, init_params, tiny
from dreamjax.replay.encoder import BackbonePooledEncoder
from dreamjax.replay.index import make_index
from dreamjax.replay.retriever import Retriever
from dreamjax.rollout.agent import AgentFormat, build_turn_prompt, format_answer, user_text
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine
from dreamjax.sampling import SpeculativeConfig
from dreamjax.text import Kind, train_bpe_tokenizer
from tests.jax_settings import optimized
from tests.test_agent_view import ScriptedSampler

GAME, PARAMS = "simonsays", "gameLength=2"  # short states; each game's commands differ, so transitions are distinct
EPISODES = 3
FMT = ExpFormatConfig(k=1, max_history=2)
AFMT = AgentFormat(think=False, history_turns=2, history_token_budget=300)
BUCKETS = (512,)
MAX_NEW = 96


def _reason(t) -> str:
  return f"Simon said {t.action}." + (" The game is won." if t.success else "")


@pytest.fixture(scope="module")
def records():
  from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks

  env = TextWorldExpressEnv(step_limit=5)
  try:
    out = [play_expert(env, task)[0] for task in tasks(GAME, "train", EPISODES, params=PARAMS, env=env)]
  finally:
    env.close()
  assert all(r.success and r.num_steps == 2 for r in out)
  # What the models must memorise has to be a function of what they are shown: M_exp maps (instruction, history,
  # state, action) to the rest of the transition, the policy maps (instruction, history, state) to the action. Two
  # records that agree on the inputs but not on what follows could not both be replayed. Histories as short as the
  # shorter of the two prompts keeps them.
  exp, policy = {}, {}
  for t in transitions(out, max_history=min(FMT.max_history, AFMT.history_turns)):
    seen = (t.instruction, t.history, t.state)
    outcome = (t.next_state, t.reward, t.done, t.success, t.invalid)
    assert exp.setdefault(seen + (t.action,), outcome) == outcome, f"{t.episode_id}:{t.step} has the inputs of an " \
        f"earlier transition but another outcome: the records cannot be memorised"
    assert policy.setdefault(seen, t.action) == t.action, f"{t.episode_id}:{t.step}: the expert chose another action " \
        f"in the same situation before: the policy cannot replay both"
  return out


@pytest.fixture(scope="module")
def tok(records, tmp_path_factory):
  texts = [system_prompt(FMT), AFMT.system_text(), FAILURE_STATE]
  for t, (shown, following) in zip(transitions(records), action_lists(records)):
    texts += [render_user(FMT, t.instruction, t.history, [t], t.state, t.action, admissible=shown),
              transition_target(FMT, t, _reason(t), following),
              user_text(AFMT, t.instruction, t.step, t.history, t.state, shown), format_answer(t.action)]
  return train_bpe_tokenizer(texts * 3, tmp_path_factory.mktemp("tok"), vocab_size=700)


@pytest.fixture(scope="module")
def cfg(tok):
  return tiny("qwen2", vocab_size=tok.vocab_size, max_position_embeddings=1024, hidden_size=128, head_dim=32,
              intermediate_size=256)


@pytest.fixture(scope="module")
def random_params(cfg):
  return init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def retriever(cfg, random_params, tok, records):
  r = Retriever(BackbonePooledEncoder(cfg, random_params, tok), make_index("exact", cfg.hidden_size))
  r.add(list(transitions(records, max_history=0)))
  return r


def _env(cfg, params, tok, retriever, records, fmt=FMT, **kw) -> SyntheticEnv:
  kw = dict(initial_states=initial_states_from(records), max_new_tokens=MAX_NEW, temperature=0.0,
            prompt_buckets=BUCKETS, key=jax.random.key(0)) | kw
  return SyntheticEnv(cfg, params, tok, fmt, retriever, **kw)


def _own(records):
  return {r.task.task_id: r.episode_id for r in records}


# --- construction, reset, errors ----------------------------------------------------------------------------------


def test_initial_states_and_task_lookup(cfg, random_params, tok, retriever, records):
  empty = dataclasses.replace(records[1], episode_id="cut", steps=(), num_steps=0)
  later = dataclasses.replace(records[0], episode_id="later", instruction="another run")
  states = initial_states_from([empty, records[0], later] + records[1:])
  assert list(states) == [r.task.task_id for r in records]
  for r in records:
    assert states[r.task.task_id] == Observation(r.steps[0].state, r.instruction, r.steps[0].admissible)
  env = _env(cfg, random_params, tok, retriever, records)
  seed = records[0].task
  variant = Task.make(seed.env, f"{seed.task_id}/v0", "Do what Simon says twice.", **seed.param,
                      generated_from=seed.task_id, generation=1)
  obs = env.reset_batch([records[1].task, variant])
  assert obs[0] == states[records[1].task.task_id]
  assert obs[1] == dataclasses.replace(states[seed.task_id], instruction="Do what Simon says twice.")
  with pytest.raises(ValueError, match=r"task 'nope' has no recorded initial state"):
    env.reset_batch([Task.make(seed.env, "nope")])
  with pytest.raises(ValueError, match=r"task 'x/v1' was generated from 'gone', which has no recorded"):
    env.reset_batch([Task.make(seed.env, "x/v1", "new", generated_from="gone")])
  with pytest.raises(ValueError, match="initial state alone makes a"):
    _env(cfg, random_params, tok, retriever, records, prompt_buckets=(64,)).reset_batch([seed])
  with pytest.raises(ValueError, match="max_position_embeddings"):
    _env(cfg, random_params, tok, retriever, records, prompt_buckets=(1000,))
  with pytest.raises(ValueError, match="the format has no actions block"):
    SyntheticEnv(cfg, random_params, tok, dataclasses.replace(FMT, actions=False), retriever,
                 initial_states=initial_states_from(records), prompt_buckets=BUCKETS, max_new_tokens=MAX_NEW,
                 key=jax.random.key(0))
  with pytest.raises(ValueError, match="exp_retries, temperature and retry_temperature must be >= 0"):
    _env(cfg, random_params, tok, retriever, records, exp_retries=-1)
  with pytest.raises(ValueError, match="call reset_batch first"):
    _env(cfg, random_params, tok, retriever, records).step_batch(["x"])
  env.reset_batch([seed])
  with pytest.raises(ValueError, match="2 actions for 1 episodes"):
    env.step_batch(["a", "b"])
  # tutorials by task id; a generated variant gets none (its seed's plan may not solve it)
  env = _env(cfg, random_params, tok, retriever, records, tutorials={seed.task_id: "Follow Simon."})
  assert env.initial_observation(seed) == (states[seed.task_id], "Follow Simon.")
  assert env.initial_observation(variant)[1] == "" and env.initial_observation(records[1].task)[1] == ""


# --- a random model: every output is malformed -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_env(cfg, random_params, tok, retriever, records):
  return _env(cfg, random_params, tok, retriever, records, max_new_tokens=12, temperature=1.0,
              key=jax.random.key(3))


def test_malformed_outputs_are_retried_then_env_failures(random_env, tok, retriever, records):
  env = random_env
  env.reset_stats()
  rows = [records[0], records[1], records[0]]  # rows 0 and 2 run one task: a batch may repeat a task
  own = [r.episode_id for r in rows]
  env.reset_batch([r.task for r in rows], exclude_episodes=own)
  actions = [rows[0].steps[0].action, None, "dance"]
  results = env.step_batch(actions)
  assert results[1] is None
  for i in (0, 2):
    r = results[i]
    assert r.done and r.reward == 0.0 and not r.success and not r.invalid
    assert r.observation == Observation(FAILURE_STATE, rows[i].instruction, ())
    # three answers, none parsed: the simulator failed, so the episode is an env failure (left out of the update)
    assert r.info["exp_attempts"] == 3 and env_failed(r)
    assert r.info[ENV_ERROR] == "experience model: " + r.info["exp_error"]
    assert not r.info["truncated"] and r.info["step"] == 1
    assert 3 <= r.info["generated_tokens"] <= 3 * 12
    # the prompt is build_prompt's, with the row's retrieved transition (never its own episode)
    found = retriever.query([rows[i].steps[0].state], [actions[i]], FMT.k, exclude_episodes=[own[i]])[0]
    assert r.info["retrieved"] == tuple(f"{x.episode_id}:{x.step}" for x in found) and len(found) == 1
    assert found[0].episode_id != own[i]
    expected = build_prompt(tok, FMT, rows[i].instruction, [], found, rows[i].steps[0].state, actions[i],
                            step=0, admissible=rows[i].steps[0].admissible).prompt()
    np.testing.assert_array_equal(env.last_prompts[i], expected)
    assert r.info["prompt_tokens"] == len(expected)
    assert f"Next state:\n{found[0].next_state}" in tok.decode(expected)
  assert env.last_prompts[1] is None
  # finished rows must get None; a None row keeps its last result
  with pytest.raises(ValueError, match="row 0 is done"):
    env.step_batch(["look", "x", None])
  again = env.step_batch([None, "eat banana", None])
  assert again[0] is results[0] and again[2] is results[2] and again[1].done
  assert env.step_batch([None, None, None]) == again
  s = env.stats
  assert (s["steps"], s["parse_failures"], s["calls"], s["overflows"], s["truncations"]) == (3, 9, 2, 0, 0)
  assert (s["exp_retries"], s["exp_failures"]) == (6, 3)
  assert s["generated_tokens"] == sum(r.info["generated_tokens"] for r in again)
  assert s["mean_generated_tokens"] == s["generated_tokens"] / 3
  # every call packs its rows: programs for the first step's 2 rows (and their retries) and for the second's 1
  assert s["retrieval_s"] > 0 and s["prompt_s"] > 0 and s["sample_s"] > 0 and s["compilations"] == 2


def test_reproducible_from_the_key_and_rows_independent(random_env, cfg, random_params, tok, retriever, records):
  rows = [records[0], records[1], records[0]]
  tasks = [r.task for r in rows]
  actions = [r.steps[0].action for r in rows]

  def outputs(env, batch, **kw):
    env.reset_batch(batch, **kw)
    return [r.info["output"] for r in env.step_batch(actions[:len(batch)])]

  envs = [_env(cfg, random_params, tok, retriever, records, max_new_tokens=12, temperature=1.0,
               key=jax.random.key(5)) for _ in range(2)]
  for env in envs:
    env.sampler = random_env.sampler  # the same jitted function: saves a compilation, changes nothing else
  runs = [[outputs(env, tasks) for _ in range(2)] for env in envs]
  assert runs[0] == runs[1]  # two envs from one key: the same batches
  assert runs[0][0] != runs[0][1]  # the next batch folds in its index: other draws
  assert len(set(runs[0][0])) == 3  # rows draw from their own keys (rows 0 and 2 have the same prompt)
  key = jax.random.key(11)
  pinned = outputs(random_env, tasks, key=key)
  assert outputs(random_env, tasks, key=key) == pinned
  swapped = outputs(random_env, [tasks[0], tasks[2], tasks[1]], key=key)
  assert swapped[0] == pinned[0]  # a row's draws do not depend on its neighbours


def test_prompt_overflow_is_an_env_failure_at_once(random_env, tok, records):
  env = random_env
  r = records[0]
  shortest = len(build_prompt(tok, FMT, r.instruction, [], [], r.steps[0].state, "", step=0,
                              admissible=r.steps[0].admissible).prompt())
  env.prompt_buckets = (shortest + 10,)  # reset's check passes; a long action cannot fit even without the example
  try:
    env.reset_stats()
    env.reset_batch([r.task, r.task, r.task])
    results = env.step_batch(["jump " * 200, None, "jump " * 100])
  finally:
    env.prompt_buckets = BUCKETS
  for i in (0, 2):
    assert results[i].done and results[i].reward == 0 and results[i].observation.state == FAILURE_STATE
    assert "does not fit the largest prompt bucket" in results[i].info["exp_error"] and env_failed(results[i])
    assert results[i].info["generated_tokens"] == results[i].info["exp_attempts"] == 0
    assert env.last_prompts[i] is None
  s = env.stats  # resampling the same prompt cannot fix it: no retries
  assert (s["overflows"], s["exp_failures"], s["exp_retries"], s["parse_failures"], s["steps"]) == (2, 2, 0, 0, 2)


# --- the retry rule, with scripted answers -----------------------------------------------------------------------


def _scripted(cfg, tok, retriever, records, answers, **kw) -> tuple[SyntheticEnv, ScriptedSampler]:
  """An env whose M_exp writes `answers[call][row]` (rows not listed write nothing: they get no budget). A retry call
  packs the rows it resamples into its first rows, in order: its `row` is that slot."""
  env = _env(cfg, None, tok, retriever, records, **({"temperature": 1.0} | kw))
  env.sampler = ScriptedSampler(tok, lambda call, row: answers[call][row], MAX_NEW)
  return env, env.sampler


def _target(records, e: int, j: int) -> str:
  t = list(transitions([records[e]]))[j]
  return transition_target(FMT, t, _reason(t), list(action_lists([records[e]]))[j][1])


def test_a_malformed_answer_is_resampled_with_a_fresh_key(cfg, tok, retriever, records):
  good0, good1 = _target(records, 0, 0), _target(records, 1, 0)
  env, sampler = _scripted(cfg, tok, retriever, records,
                           [{0: good0, 1: "<next_state>\ncut off"}, {0: good1}])
  env.reset_batch([records[0].task, records[1].task], exclude_episodes=[r.episode_id for r in records[:2]])
  results = env.step_batch([records[0].steps[0].action, records[1].steps[0].action])
  for r, rec in zip(results, records):  # both answers read: the recorded next state and its admissible actions
    s = rec.steps[0]
    assert (r.observation.state, r.observation.admissible, r.done) == (s.next_state, rec.steps[1].admissible, False)
    assert "exp_error" not in r.info and not env_failed(r)
  assert [r.info["exp_attempts"] for r in results] == [1, 2] and results[1].info["output"] == good1
  first, retry = sampler.calls
  # the retry resamples only row 1, packed into a call of one row with the first call's prompt width, its prompt,
  # and its key folded with attempt 1
  np.testing.assert_array_equal(first["budget"], [MAX_NEW, MAX_NEW])
  np.testing.assert_array_equal(retry["budget"], [MAX_NEW])
  assert retry["tokens"].shape == (1, first["tokens"].shape[1])
  np.testing.assert_array_equal(retry["tokens"][0], first["tokens"][1])
  np.testing.assert_array_equal(retry["mask"][0], first["mask"][1])
  row_key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 0), 1)
  np.testing.assert_array_equal(first["keys"][1], jax.random.key_data(row_key))
  np.testing.assert_array_equal(retry["keys"][0], jax.random.key_data(jax.random.fold_in(row_key, 1)))
  s = env.stats
  assert (s["parse_failures"], s["exp_retries"], s["exp_failures"], s["steps"]) == (1, 1, 0, 2)


def test_a_call_of_few_rows_is_packed(cfg, tok, retriever, records):
  """A step with one live row of three decodes one row (the decode loop's cost follows the batch's rows), its
  prompt and its key as in a call of the whole batch."""
  rows = [records[0], records[1], records[0]]
  answers = [{r: _target(records, [0, 1, 0][r], 0) for r in range(3)}, {0: _target(records, 1, 1)}]
  env, sampler = _scripted(cfg, tok, retriever, records, answers)
  env.reset_batch([r.task for r in rows], exclude_episodes=[r.episode_id for r in rows])
  env.step_batch([r.steps[0].action for r in rows])
  result = env.step_batch([None, records[1].steps[1].action, None])[1]
  assert result.done and result.success and not env_failed(result)
  first, second = sampler.calls
  assert first["tokens"].shape[0] == 3 and second["tokens"].shape[0] == 1
  np.testing.assert_array_equal(second["tokens"][0][second["mask"][0]], env.last_prompts[1])
  row_key = jax.random.fold_in(jax.random.fold_in(env._batch_key, 1), 1)  # call 1 of the batch, row 1
  np.testing.assert_array_equal(second["keys"][0], jax.random.key_data(row_key))


def test_a_row_that_never_parses_ends_as_an_env_failure(cfg, tok, retriever, records):
  good1 = _target(records, 1, 0)
  bad = {0: "no tags at all"}
  env, sampler = _scripted(cfg, tok, retriever, records, [bad | {1: good1}, bad, bad, bad])
  env.reset_batch([records[0].task, records[1].task])
  results = env.step_batch([records[0].steps[0].action, records[1].steps[0].action])
  r = results[0]
  assert len(sampler.calls) == 3 and r.info["exp_attempts"] == 3  # exp_retries=2 by default
  assert (r.done, r.reward, r.success, r.invalid, r.observation.state, r.observation.admissible) == (
      True, 0.0, False, False, FAILURE_STATE, ())
  assert env_failed(r) and r.info[ENV_ERROR] == "experience model: missing <think>"
  assert r.info["exp_error"] == "missing <think>" and r.info["output"] == "no tags at all"
  assert not env_failed(results[1]) and not results[1].done
  s = env.stats
  assert (s["parse_failures"], s["exp_retries"], s["exp_failures"]) == (3, 2, 1)
  assert env.failures == [{"task_id": records[0].task.task_id, "step": 1, "state": records[0].steps[0].state,
                           "action": records[0].steps[0].action, "output": "no tags at all",
                           "error": "missing <think>", "attempts": 3}]
  env.reset_stats()
  assert env.failures == []
  # no retries: with exp_retries=0, or at temperature 0 (greedy decoding would write the same answer again) unless
  # resamples have a temperature of their own
  for kw in ({"exp_retries": 0}, {"temperature": 0.0}, {"temperature": 0.0, "retry_temperature": 0.0}):
    env = _env(cfg, None, tok, retriever, records, **({"temperature": 1.0} | kw))
    env.sampler = sampler = ScriptedSampler(tok, lambda call, row: "no tags at all", MAX_NEW)
    env.reset_batch([records[0].task])
    assert env_failed(env.step_batch([records[0].steps[0].action])[0]) and len(sampler.calls) == 1
    assert (env.stats["exp_retries"], env.stats["exp_failures"]) == (0, 1)


def test_greedy_answers_are_resampled_at_the_retry_temperature(cfg, tok, retriever, records):
  """At temperature 0 with a retry temperature, the first answer is greedy and only a malformed row is drawn again,
  at the retry temperature, in calls of the same shapes; a row that parsed keeps its greedy answer."""
  good0, good1 = _target(records, 0, 0), _target(records, 1, 0)
  env, sampler = _scripted(cfg, tok, retriever, records, [{0: "no tags at all", 1: good1}, {0: good0}],
                           temperature=0.0, retry_temperature=0.7)
  env.reset_batch([records[0].task, records[1].task])
  results = env.step_batch([records[0].steps[0].action, records[1].steps[0].action])
  assert [r.info["exp_attempts"] for r in results] == [2, 1] and not any(env_failed(r) for r in results)
  assert [r.info["output"] for r in results] == [good0, good1]
  first, retry = sampler.calls
  np.testing.assert_array_equal(first["temperature"], [0.0, 0.0])
  np.testing.assert_allclose(retry["temperature"], [0.7])  # row 0 alone
  np.testing.assert_array_equal(retry["tokens"][0], first["tokens"][0])
  with pytest.raises(ValueError, match="retry_temperature must be >= 0"):
    _env(cfg, None, tok, retriever, records, retry_temperature=-1.0)


def _replay_two_rows(cfg, tok, retriever, records, fmt, answers, bad):
  """Steps the first two records' first two actions through a SyntheticEnv whose M_exp answers `answers[j][row]`,
  except row 1's second answer, which is `bad` on every attempt (it is retried twice); returns (both steps' results,
  the env)."""
  env, _ = _scripted(cfg, tok, retriever, records, [answers[0], {0: answers[1][0], 1: bad}, {0: bad}, {0: bad}],
                     fmt=fmt)
  env.reset_batch([r.task for r in records[:2]])
  return [env.step_batch([r.steps[j].action for r in records[:2]]) for j in (0, 1)], env


def test_prompts_follow_the_format_s_instructions_switch(cfg, tok, retriever, records):
  """M_exp trained without the format's explanation (`ExpFormatConfig.instructions=False`) reads the same short
  system message in its episodes as in training."""
  fmt = dataclasses.replace(FMT, instructions=False)
  env, _ = _scripted(cfg, tok, retriever, records, [{0: _target(records, 0, 0)}], fmt=fmt)
  r, step = records[0], records[0].steps[0]
  env.reset_batch([r.task], exclude_episodes=[r.episode_id])
  env.step_batch([step.action])
  found = retriever.query([step.state], [step.action], fmt.k, exclude_episodes=[r.episode_id])[0]
  expected = build_prompt(tok, fmt, r.instruction, [], found, step.state, step.action, step=0,
                          admissible=step.admissible).prompt()
  np.testing.assert_array_equal(env.last_prompts[0], expected)
  assert len(expected) < len(build_prompt(tok, FMT, r.instruction, [], found, step.state, step.action, step=0,
                                          admissible=step.admissible).prompt())


def test_state_changes_are_applied_to_each_row_s_own_state(cfg, tok, retriever, records):
  """With `ExpFormatConfig.state_changes` M_exp writes only the changed lines, and the env applies them to the row's
  current state: the policy reads whole states, as with the whole-state format. Changes that do not apply are a
  malformed answer (resampled, then an env failure)."""
  fmt = dataclasses.replace(FMT, state_changes=True)
  steps = [[(t, following) for t, (_, following) in zip(transitions([r]), action_lists([r]))] for r in records[:2]]
  answers = [{e: transition_target(fmt, t, _reason(t), following) for e, (t, following) in enumerate(s[j] for s in steps)}
             for j in (0, 1)]
  first = records[0].steps[0]
  assert f"<next_state>\nFeedback: {state_fields(first.next_state)['Feedback']}\n</next_state>" in answers[0][0]
  bad = "<think>\nx\n</think>\n<next_state>\n-Nope\n</next_state>\n<actions>\n</actions>\n<invalid>false</invalid>\n" \
        "<reward>0</reward>\n<done>false</done>\n<success>false</success>"
  by_step, env = _replay_two_rows(cfg, tok, retriever, records, fmt, answers, bad)
  for j, results in enumerate(by_step):
    for e in range(2 - j):  # row 1's second answer never applies
      s = records[e].steps[j]
      assert (results[e].observation.state, results[e].reward, results[e].done) == (s.next_state, s.reward, s.done)
      assert results[e].observation.admissible == steps[e][j][1] and not env_failed(results[e])
  assert env_failed(results[1]) and "removes a field the current state does not hold once" in results[1].info[
      "exp_error"]
  assert (env.stats["parse_failures"], env.stats["exp_failures"]) == (3, 1)


def test_action_edits_are_applied_to_each_row_s_own_list(cfg, tok, retriever, records):
  """With `ExpFormatConfig.action_edits` M_exp writes how the row's current list changes (the recorded list at
  reset, its own prediction after), and the env applies the edits to that row's list: the policy reads whole lists.
  Edits that do not apply are a malformed answer (resampled, then an env failure)."""
  fmt = dataclasses.replace(FMT, action_edits=True)
  steps = [list(zip(transitions([r]), action_lists([r]))) for r in records[:2]]
  answers = [{e: transition_target(fmt, t, _reason(t), following, shown)
              for e, (t, (shown, following)) in enumerate(s[j] for s in steps)} for j in (0, 1)]
  assert "<actions>\n(no change)\n</actions>" in answers[0][0] or "\n- " in answers[0][0] or "\n+ " in answers[0][0]
  bad = answers[1][1].replace("<actions>\n", "<actions>\n- no such action\n", 1)
  by_step, env = _replay_two_rows(cfg, tok, retriever, records, fmt, answers, bad)
  for j, results in enumerate(by_step):
    for e in range(2 - j):  # row 1's second answer never applies
      assert results[e].observation.admissible == steps[e][j][1][1] and not env_failed(results[e])
  assert env_failed(results[1]) and "removes an action the current list does not hold" in results[1].info["exp_error"]
  assert (env.stats["parse_failures"], env.stats["exp_failures"]) == (3, 1)


# --- a fine-tuned model replays the records ----------------------------------------------------------------------


def _sft(cfg, tok, retriever, records, lr: float, max_steps: int, margin: float):
  """Masked cross-entropy on M_exp examples (retrieved transitions excluding their own episode, as the env shows them,
  and the recorded admissible actions) and on the policy's expert answers (with the admissible actions every turn).

  Stops at the first parameters whose every supervised target token beats the runner-up logit by `margin` (greedy
  decoding of the training prompts then reproduces every target), else after `max_steps`. Returns (params, steps
  taken, the worst token's margin). A fixed step count with a mean-loss bound is not enough: the mean falls below 0.02
  while the one token per step-0 transition that only memorisation gives (the next command's verb: "touch" after
  "eat banana") is still a near tie, and whether it tips the right way then depends on the machine's float rounding.
  """
  exp, policy = [], []
  for t, (shown, following) in zip(transitions(records), action_lists(records)):
    found = retriever.query([t.state], [t.action], FMT.k, exclude_episodes=[t.episode_id])[0]
    ex = transition_example(tok, FMT, t, found, reasoning=_reason(t), admissible=shown, next_admissible=following)
    exp.append((ex.ids, ex.loss_mask))
    ids, kinds = build_turn_prompt(tok, AFMT, t.instruction, t.step, t.history, t.state, shown).append(
        Kind.ACTION, format_answer(t.action)).arrays()
    policy.append((ids, (kinds == Kind.ACTION).astype(np.int32)))

  def pack(rows):
    t = max(len(ids) for ids, _ in rows)
    ids = np.full((len(rows), t), tok.pad_id, np.int32)
    mask, valid = np.zeros((len(rows), t), np.float32), np.zeros((len(rows), t), bool)
    for i, (row, m) in enumerate(rows):
      ids[i, :len(row)], mask[i, :len(row)], valid[i, :len(row)] = row, m, True
    return ids, mask, valid

  batches = [pack(exp), pack(policy)]  # two widths: the short policy rows are not padded to M_exp's length
  # Warmup, then a constant rate: at 1e-2 (with or without a cosine decay) the rare tokens oscillate and may settle on
  # a three-way tie; at 3e-3 every token led by 2 logits after 95-125 steps from each of 6 initialisations.
  opt = optax.adam(optax.linear_schedule(0.0, lr, 10))

  def loss_fn(params):
    total = count = 0.0
    worst = jnp.inf
    for ids, mask, valid in batches:
      positions = np.broadcast_to(np.arange(ids.shape[1] - 1), (ids.shape[0], ids.shape[1] - 1))
      logits = Transformer(cfg).apply({"params": params}, ids[:, :-1], positions, valid[:, :-1]).logits
      target = ids[:, 1:, None]
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), target, -1)[..., 0]
      total, count = total + jnp.sum(nll * mask[:, 1:]), count + mask[:, 1:].sum()
      chosen = jnp.take_along_axis(logits, target, -1)[..., 0]
      runner_up = jnp.max(jnp.where(jnp.arange(logits.shape[-1]) == target, -jnp.inf, logits), -1)
      worst = jnp.minimum(worst, jnp.min(jnp.where(mask[:, 1:] > 0, chosen - runner_up, jnp.inf)))
    return total / count, worst

  @jax.jit
  def step(params, state):
    (_, worst), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, worst  # worst is that of the params passed in

  params = init_params(cfg, jax.random.key(1))
  state = opt.init(params)
  for n in range(max_steps + 1):
    updated, state, worst = step(params, state)
    if float(worst) >= margin or n == max_steps:
      return params, n, float(worst)
    params = updated


MARGIN = 2.0  # logits; the sampler's cached decoding rounds differently from the training forward, by far less


@pytest.fixture(scope="module")
def trained(cfg, tok, retriever, records):
  with optimized():  # up to 300 steps: worth XLA's full optimisation
    params, steps, worst = _sft(cfg, tok, retriever, records, lr=3e-3, max_steps=300, margin=MARGIN)
  assert worst >= MARGIN, f"SFT did not memorise the records in {steps} steps: the worst supervised token leads the " \
      f"runner-up by {worst:.3f} logits, below {MARGIN}"
  return params


@pytest.fixture(scope="module")
def trained_env(cfg, trained, tok, retriever, records):
  return _env(cfg, trained, tok, retriever, records, exclude_episodes=_own(records))


def test_fine_tuned_model_replays_recorded_transitions(trained_env, tok, retriever, records):
  env = trained_env
  env.reset_stats()
  env.reset_batch([r.task for r in records])  # exclusion from the constructor's mapping
  for j in range(2):
    results = env.step_batch([r.steps[j].action for r in records])
    for i, (r, res) in enumerate(zip(records, results)):
      s = r.steps[j]
      t = next(t for t in transitions([r]) if t.step == j)
      shown, following = list(action_lists([r]))[j]
      assert "exp_error" not in res.info and not env_failed(res) and res.info["stopped"], res.info["output"]
      assert (res.observation.state, res.reward, res.done, res.success, res.invalid) == (
          s.next_state, s.reward, s.done, s.success, s.invalid)
      # the predicted admissible actions are the recorded ones of the next state (none after the end)
      assert res.observation.admissible == following and res.info["reasoning"] == _reason(t)
      assert res.info["exp_attempts"] == 1
      # the prompt is exactly the SFT example's prompt: same history, step index, retrieved transition and the
      # current state's admissible actions (the recorded ones at reset, M_exp's own prediction after)
      found = retriever.query([s.state], [s.action], FMT.k, exclude_episodes=[r.episode_id])[0]
      ex = transition_example(tok, FMT, t, found, reasoning=_reason(t), admissible=shown, next_admissible=following)
      np.testing.assert_array_equal(env.last_prompts[i], ex.ids[:len(env.last_prompts[i])])
      assert all(not x.startswith(r.episode_id + ":") for x in res.info["retrieved"])
  assert env.stats["parse_failures"] == 0 and env.stats["steps"] == 2 * len(records)


def test_speculative_m_exp_writes_the_same_greedy_answers(trained_env, cfg, trained, tok, retriever, records):
  """M_exp with copy-speculative decoding: its next states and action lists copy the prompt, so most drafts are
  accepted, and every greedy answer is the plain sampler's."""
  spec = _env(cfg, trained, tok, retriever, records, exclude_episodes=_own(records),
              speculative=SpeculativeConfig(draft_tokens=6))
  for env in (trained_env, spec):
    env.reset_stats()
    env.reset_batch([r.task for r in records])
  for j in range(2):
    actions = [r.steps[j].action for r in records]
    plain, fast = trained_env.step_batch(actions), spec.step_batch(actions)
    assert [r.info["output"] for r in fast] == [r.info["output"] for r in plain]
    assert fast == plain
  s = spec.stats
  assert s["generated_tokens"] == trained_env.stats["generated_tokens"] == s["answer_tokens"]
  assert s["accepted_per_step"] > 1 and s["tokens_per_forward"] > 1.5, s  # measured 1.42 and about 2.4
  assert trained_env.stats["tokens_per_forward"] == 1.0


def test_kv_reuse_gives_the_same_answers_and_prefills_less(trained_env, random_env, cfg, trained, random_params, tok,
                                                           retriever, records):
  """KV reuse across steps: the trained M_exp's greedy answers (speculative, as DreamGym runs it) are the plain
  env's, in calls that fill the batch (reusing the caches) and in a packed call of fewer rows (prefilled whole); the
  random M_exp's sampled malformed answers and their retries too, each retry of the whole batch prefilling only the
  last token of the prompt its cache holds."""
  fast = _env(cfg, trained, tok, retriever, records, exclude_episodes=_own(records),
              speculative=SpeculativeConfig(draft_tokens=6), kv_reuse=True)
  rows = [*records, records[0]]
  for env in (trained_env, fast):
    env.reset_stats()
    env.reset_batch([r.task for r in rows])
  for actions in ([r.steps[0].action for r in rows], [r.steps[1].action for r in rows[:3]] + [None]):
    assert fast.step_batch(actions) == trained_env.step_batch(actions)  # 4 rows, then 3 of 4: the whole batch
  s = fast.stats
  assert s["prompt_tokens"] == trained_env.stats["prompt_tokens"] == trained_env.stats["prefilled_tokens"]
  # the second step reuses each row's system message and task (the retrieved example after them changes)
  second = sum(len(p) for p in fast.last_prompts if p is not None)
  assert s["prefilled_tokens"] < s["prompt_tokens"] - 0.1 * second
  last = [None] * 3 + [rows[3].steps[1].action]
  assert fast.step_batch(last) == trained_env.step_batch(last)
  # one row of four: a packed call of one row, its prompt prefilled whole
  assert fast.stats["prefilled_tokens"] - s["prefilled_tokens"] == len(fast.last_prompts[3])

  rows = [records[0], records[1], records[0]]
  actions = [r.steps[0].action for r in rows]
  reuse_env = _env(cfg, random_params, tok, retriever, records, max_new_tokens=12, temperature=1.0,
                   key=jax.random.key(3), kv_reuse=True)
  reuse_env.sampler._fn = random_env.sampler._fn  # the plain path's compilation is shared; the reuse path's is new
  outs = []
  for env in (random_env, reuse_env):
    env.reset_stats()
    env.reset_batch([r.task for r in rows], exclude_episodes=[r.episode_id for r in rows], key=jax.random.key(11))
    outs.append(env.step_batch(actions))
  assert [r.info["output"] for r in outs[1]] == [r.info["output"] for r in outs[0]]
  s = reuse_env.stats
  assert s["exp_retries"] == 6 and s["prompt_tokens"] == random_env.stats["prompt_tokens"]
  assert s["prefilled_tokens"] == sum(len(p) for p in reuse_env.last_prompts) + 6  # retries: one token each


def test_rollout_engine_drives_the_synthetic_env(trained_env, cfg, trained, tok, records):
  engine = RolloutEngine(cfg, tok, AFMT, RolloutConfig(max_turns=3, max_action_tokens=12, max_episode_tokens=64,
                                                       prompt_buckets=(256,), temperature=0.0))
  traj = engine.run(trained, trained_env, [r.task for r in records], jax.random.key(0))
  assert traj.stats["parse_failures"] == 0
  np.testing.assert_array_equal(traj.num_turns, [2] * len(records))
  assert traj.success.all() and traj.ended.all()
  for e, r in enumerate(records):
    got = traj.records[e]
    assert [(s.state, s.action, s.next_state, s.reward, s.done, s.success) for s in got.steps] == [
        (s.state, s.action, s.next_state, s.reward, s.done, s.success) for s in r.steps]
    np.testing.assert_array_equal(traj.reward[traj.turn_rows[e, :2]], [0.0, 1.0])


def test_step_limit_and_history_dropped_to_fit(trained_env, tok, retriever, records):
  env = trained_env
  env.max_steps = 1
  try:
    env.reset_stats()
    env.reset_batch([r.task for r in records])
    for r, res in zip(records, env.step_batch([r.steps[0].action for r in records])):
      assert res.observation.state == r.steps[0].next_state  # the model's prediction, cut by the step limit
      assert res.done and not res.success and res.reward == 0 and res.info["truncated"]
    assert env.stats["truncations"] == len(records)
  finally:
    env.max_steps = 50
  # a bucket that holds the second step's prompt only without its history: the history goes first
  r = records[0]
  s0, s1 = r.steps
  found = retriever.query([s1.state], [s1.action], FMT.k, exclude_episodes=[r.episode_id])[0]
  full = build_prompt(tok, FMT, r.instruction, [(s0.state, s0.action)], found, s1.state, s1.action, step=1,
                      admissible=s1.admissible).prompt()
  bare = build_prompt(tok, FMT, r.instruction, [], found, s1.state, s1.action, step=1,
                      admissible=s1.admissible).prompt()
  first = env.last_prompts[0]  # step 0 of this record, from the step-limit run above
  width = max(len(first), len(bare))
  assert width < len(full)
  env.prompt_buckets = (width,)
  try:
    env.reset_batch([r.task])
    assert env.step_batch([s0.action])[0].observation.state == s1.state
    env.step_batch([s1.action])
    np.testing.assert_array_equal(env.last_prompts[0], bare)
  finally:
    env.prompt_buckets = BUCKETS
