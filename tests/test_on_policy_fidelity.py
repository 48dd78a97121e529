"""The on-policy audit of a DreamGym run: synthetic episodes replayed in real TextWorld-Express games
(dreamjax.experience.fidelity.on_policy, experiments/on_policy_fidelity.py)."""

import dataclasses
import json

import pytest

from dreamjax.data.records import Transition
from dreamjax.envs.base import Task
from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks
from dreamjax.experience.fidelity import on_policy, replay_in_env, synthetic_episodes
from dreamjax.replay.buffer import ReplayBuffer
from experiments import on_policy_fidelity

ENV_KWARGS = ["step_limit=8"]


@pytest.fixture(scope="module")
def env():
  env = TextWorldExpressEnv(step_limit=8)
  yield env
  env.close()


@pytest.fixture(scope="module")
def games(env):
  return tasks("twc", "train", 2, start=0, env=env, params="includeDoors=0,numItemsToPutAway=2,numLocations=1")


def _gold(env, task: Task, tag: str = "a", version: int = 0) -> list[Transition]:
  """The gold path as a synthetic episode: an M_exp that was right on every step."""
  obs, out = env.reset(task), []
  while (action := env.expert_action()) is not None:
    r = env.step(action)
    out.append(Transition(f"policy:{task.task_id}:{tag}", len(out), task, obs.instruction, obs.state, action,
                          r.observation.state, r.reward, r.done, r.success, r.invalid, "synthetic", version))
    obs = r.observation
    if r.done:
      break
  return out


def test_a_faithful_episode_scores_exactly(env, games):
  episode = _gold(env, games[0])
  assert [t.action.split()[0] for t in episode][-2:] == ["put", "put"] and episode[-1].success
  m = on_policy(replay_in_env(env, [episode]))
  assert (m["episodes"], m["ended_by_m_exp"], m["n"], m["exact_match"]) == (1, 1, len(episode), 1.0)
  assert (m["m_exp_success"], m["real_success"], m["success_precision"], m["success_recall"]) == (1.0, 1.0, 1.0, 1.0)
  assert (m["reward_precision"], m["eps_R_mean"], m["real_ended_first"], m["real_invalid"]) == (1.0, 0.0, 0, 0.0)
  assert m["exact_by_step"] == [1.0] * len(episode)


def test_a_success_m_exp_granted_too_early_is_caught(env, games):
  """M_exp ends the episode in success at the first put, which in the real game leaves one item to put away: the
  next state is right, the outcome is not."""
  gold = _gold(env, games[0])
  first_put = next(j for j, t in enumerate(gold) if t.action.startswith("put"))
  early = gold[:first_put] + [dataclasses.replace(gold[first_put], reward=1.0, done=True, success=True)]
  wrong_state = [dataclasses.replace(t, next_state=t.next_state + "\nBogus: line") if t.step == 1 else t
                 for t in _gold(env, games[1], "b")]
  m = on_policy(replay_in_env(env, [early, wrong_state]))
  assert (m["episodes"], m["ended_by_m_exp"], m["m_exp_success"], m["real_success"]) == (2, 2, 1.0, 0.5)
  assert (m["success_precision"], m["success_recall"]) == (0.5, 1.0)
  assert m["reward_precision"] == 0.5 and m["reward_recall"] == 1.0 and m["eps_R_mean"] == 1 / m["n"]
  assert m["exact_by_step"][1] == 0.5 and m["exact_by_step"][0] == 1.0
  assert m["exact_count"] == m["n"] - 1


def test_an_action_the_game_refuses_counts_against_m_exp(env, games):
  """M_exp listed and accepted "take teapot", which names nothing in the game: the real env refuses it."""
  first = _gold(env, games[0])[0]
  accepted = dataclasses.replace(first, action="take teapot", next_state=first.state + "\nInventory: teapot")
  m = on_policy(replay_in_env(env, [[accepted]]))
  assert (m["n"], m["real_invalid"], m["invalid_recall"], m["exact_match"], m["ended_by_m_exp"]) == (1, 1.0, 0.0,
                                                                                                        0.0, 0)
  assert m["m_exp_success"] is None and m["success_precision"] is None


def test_steps_after_the_real_end_and_generated_tasks(env, games):
  gold = _gold(env, games[0])
  longer = gold + [dataclasses.replace(gold[-1], step=len(gold), action="look around", reward=0.0, done=True,
                                       success=False)]
  variant = Task.make("textworld_express", games[1].task_id + "/v1", "Put away the flour.",
                      **games[1].param, generated_from=games[1].task_id)
  generated = [dataclasses.replace(t, task=variant) for t in _gold(env, games[1], "g")]
  m = on_policy(replay_in_env(env, [longer, generated]))
  assert (m["episodes"], m["skipped_generated"], m["real_ended_first"], m["n"]) == (1, 1, 1, len(gold))
  assert (m["m_exp_success"], m["real_success"]) == (0.0, 1.0)  # M_exp's last step said failure; the game had won
  assert m["success_precision"] is None and m["success_recall"] == 0.0


def test_synthetic_episodes_group_the_write_back(env, games):
  a, b = _gold(env, games[0]), _gold(env, games[1], "b")
  offline = dataclasses.replace(a[0], episode_id="expert:x", origin="offline", policy_version=-1)
  grouped = synthetic_episodes([b[1], a[2], offline, a[0], b[0], a[1]] + a[3:] + b[2:])
  assert grouped == [b, a]
  # a turn whose answer did not parse never reached M_exp: its step is missing, the rest replay in order
  assert synthetic_episodes([a[2], a[0]]) == [[a[0], a[2]]]
  with pytest.raises(ValueError, match=r"steps \[0, 1, 1\] repeat a step"):
    synthetic_episodes([a[0], a[1], a[1]])


def test_the_experiment_audits_a_run_folder(env, games, tmp_path, capsys):
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"rl": {"env": "textworld_express", "env_kwargs": ENV_KWARGS}}))
  out = tmp_path / "audit"
  assert on_policy_fidelity.main(["--run", str(run), "--out", str(out)]) == 2  # no replay buffer yet
  assert "replay" in capsys.readouterr().err
  gold = _gold(env, games[0])
  with ReplayBuffer(run / "replay") as buffer:
    buffer.append([dataclasses.replace(t, episode_id="expert:x", origin="offline", policy_version=-1) for t in gold])
  assert on_policy_fidelity.main(["--run", str(run), "--out", str(out)]) == 2
  assert "no synthetic episodes" in capsys.readouterr().err
  with ReplayBuffer(run / "replay") as buffer:
    buffer.append(gold + _gold(env, games[1], "b", version=1))
  assert on_policy_fidelity.main(["--run", str(run), "--out", str(out)]) == 0
  results = json.loads((out / "results.json").read_text())
  assert list(results) == ["iteration 1", "iteration 2", "all"]
  assert [results[k]["episodes"] for k in results] == [1, 1, 2] and results["all"]["success_precision"] == 1.0
  assert "| iteration 2 | 1 | 1 | 1.000 | 1.000 |" in (out / "table.md").read_text()
