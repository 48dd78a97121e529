"""The policy sees one prompt layout in DreamGym and in the real env (issue 16, item 1).

A real TextWorld-Express coin episode is played with the env's expert; the same episode is then replayed in a
SyntheticEnv whose M_exp is scripted to write each recorded transition's target (what a perfect M_exp writes, actions
block included). The policy's turn prompt (dreamjax.rollout.agent) built from each side's observations must have the
same segments, the same kinds and the same sections, with the admissible actions listed on every turn, and here even
the same ids, since the states and lists are the same. `ScriptedSampler` (M_exp's sampler with scripted answers) is
shared with tests/test_synthetic_env.py.
"""

from collections.abc import Callable

import jax
import numpy as np
import pytest

from dreamjax.data.collect import play_expert
from dreamjax.data.records import TrajectoryRecord, transitions
from dreamjax.envs.base import Observation
from dreamjax.experience.format import ExpFormatConfig, action_lists, render_user, system_prompt, transition_target
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from
from dreamjax.models import tiny
from dreamjax.rollout.agent import AgentFormat, build_turn_prompt, user_text
from dreamjax.sampling.sampler import SampleOutput
from dreamjax.text import Kind, Tokenizer, train_bpe_tokenizer

COIN = "numLocations=2,includeDoors=0,numDistractorItems=0"  # two rooms; in task 1 the coin is in the other one
FMT = ExpFormatConfig(reasoning=False, retrieval=False)
AFMT = AgentFormat(think=False)
MAX_NEW = 256


class ScriptedSampler:
  """Stands in for M_exp's jitted sampler: in call c, each row r given a budget writes `script(c, r)` and the
  end-of-turn token (cut to the budget); rows without one write nothing. Each call's prompts, budgets, temperatures
  and key data are kept in `calls`."""

  def __init__(self, tokenizer: Tokenizer, script: Callable[[int, int], str], max_new_tokens: int):
    self.tokenizer, self.script, self.max_new_tokens = tokenizer, script, max_new_tokens
    self.calls: list[dict[str, np.ndarray]] = []

  def __call__(self, params, tokens, mask, keys, sp) -> SampleOutput:
    rows = np.shape(tokens)[0]
    budget = np.asarray(sp.max_new_tokens)
    out = np.full((rows, self.max_new_tokens), self.tokenizer.pad_id, np.int32)
    lengths, stopped = np.zeros(rows, np.int32), np.zeros(rows, bool)
    for r in range(rows):
      if budget[r] > 0:
        ids = self.tokenizer.encode(self.script(len(self.calls), r)) + [self.tokenizer.chat_format.end_of_turn]
        kept = ids[:budget[r]]
        out[r, :len(kept)], lengths[r], stopped[r] = kept, len(kept), len(kept) == len(ids)
    self.calls.append({"tokens": np.asarray(tokens), "mask": np.asarray(mask), "budget": budget,
                       "temperature": np.asarray(sp.temperature), "keys": np.asarray(jax.random.key_data(keys))})
    return SampleOutput(tokens=out, logps=np.zeros(out.shape, np.float32), lengths=lengths, stopped=stopped)

  def compilations(self) -> int:
    return 0


@pytest.fixture(scope="module")
def played() -> tuple[TrajectoryRecord, list[Observation]]:
  """The expert's coin episode on the real env (each step with the admissible actions of its state), and the real
  observations the policy acted on (reset's, then each step's but the last)."""
  pytest.importorskip("textworld_express")
  from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks

  env = TextWorldExpressEnv(step_limit=8)
  try:
    task = tasks("coin", "train", 1, start=1, params=COIN, env=env)[0]  # look around, move east, take coin
    record, seen = play_expert(env, task)
  finally:
    env.close()
  steps = record.steps
  assert record.success and record.num_steps >= 2
  assert len({s.admissible for s in steps}) > 1  # the list changes with the state: a stale list would show
  return record, seen


@pytest.fixture(scope="module")
def episode(played) -> TrajectoryRecord:
  return played[0]


@pytest.fixture(scope="module")
def tok(episode, tmp_path_factory):
  texts = [system_prompt(FMT), AFMT.system_text()]
  for t, (shown, following) in zip(transitions([episode]), action_lists([episode])):
    texts += [render_user(FMT, t.instruction, t.history, [], t.state, t.action, admissible=shown),
              transition_target(FMT, t, next_admissible=following),
              user_text(AFMT, t.instruction, t.step, t.history, t.state, shown)]
  return train_bpe_tokenizer(texts * 3, tmp_path_factory.mktemp("tok"), vocab_size=600)


def _layout(tok: Tokenizer, builder) -> tuple:
  """(segment kinds in order, the user message's section heads in order)."""
  ids, kinds = builder.arrays()
  runs = [int(k) for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
  user = tok.decode(ids[kinds == Kind.OBSERVATION])
  heads = [line.split(":")[0] for line in user.splitlines()
           if line.split(":")[0] in ("Task", "Steps taken", "History", "History (oldest first)", "Current state",
                                     "Admissible actions")]
  return tuple(runs), tuple(heads)


def _prompts(tok: Tokenizer, episode: TrajectoryRecord, observations) -> list:
  """The policy's turn prompt before each step, built from the observations an env gave (reset's, then steps')."""
  history, out = [], []
  for turn, (obs, step) in enumerate(zip(observations, episode.steps)):
    out.append(build_turn_prompt(tok, AFMT, episode.instruction, turn, history, obs.state, obs.admissible))
    history.append((obs.state, step.action))
  return out


def test_the_policy_prompt_has_one_layout_in_the_real_env_and_in_dreamgym(played, tok):
  episode, seen = played
  real = _prompts(tok, episode, seen)
  targets = [transition_target(FMT, t, next_admissible=following)
             for t, (_, following) in zip(transitions([episode]), action_lists([episode]))]
  cfg = tiny("qwen2", vocab_size=tok.vocab_size, max_position_embeddings=2048)
  env = SyntheticEnv(cfg, None, tok, FMT, None, initial_states=initial_states_from([episode]), max_new_tokens=MAX_NEW,
                     prompt_buckets=(1024,), key=jax.random.key(0))
  env.sampler = ScriptedSampler(tok, lambda call, row: targets[call], MAX_NEW)  # a perfect M_exp
  observations = env.reset_batch([episode.task])
  for step in episode.steps[:-1]:
    result = env.step_batch([step.action])[0]
    assert not result.done and "exp_error" not in result.info
    observations.append(result.observation)
  synthetic = _prompts(tok, episode, observations)
  assert len(real) == len(synthetic) == episode.num_steps
  for turn, (a, b) in enumerate(zip(real, synthetic)):
    runs, heads = _layout(tok, a)
    assert (runs, heads) == _layout(tok, b), turn
    assert runs == (Kind.SYSTEM, Kind.OBSERVATION) and heads[-1] == "Admissible actions", turn  # listed every turn
    np.testing.assert_array_equal(a.prompt(), b.prompt())  # same state and list: the very same prompt
  # The check can fail: the former modes, no list after reset ("none") or the reset list repeated ("keep"), give
  # another layout and another prompt on a turn whose list has changed.
  turn = next(j for j, s in enumerate(episode.steps) if s.admissible != episode.steps[0].admissible)
  history = [(s.state, s.action) for s in episode.steps[:turn]]
  state = episode.steps[turn].state
  bare = build_turn_prompt(tok, AFMT, episode.instruction, turn, history, state, ())
  stale = build_turn_prompt(tok, AFMT, episode.instruction, turn, history, state, episode.steps[0].admissible)
  np.testing.assert_array_equal(
      build_turn_prompt(tok, AFMT, episode.instruction, turn, history, state, episode.steps[turn].admissible).prompt(),
      real[turn].prompt())
  assert _layout(tok, bare) != _layout(tok, real[turn])
  assert not np.array_equal(stale.prompt(), real[turn].prompt())
