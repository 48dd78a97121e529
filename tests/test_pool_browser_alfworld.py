"""Crash recovery through the pool for the envs with heavy children: Chromium (MiniWoB) and ALFWorld's game engine."""

import os
import signal

import pytest

from dreamjax.envs import alfworld, miniwob
from dreamjax.envs.pool import EnvPool


def _tasks(env, tmp_path_factory):
  if env == "miniwob":
    return miniwob.tasks("click-button", "train", 1)
  root = str(tmp_path_factory.mktemp("alfworld_games"))
  return alfworld.tasks("train", ("pick_and_place_simple",), 1, root=root)


@pytest.mark.parametrize("env", ["miniwob", "alfworld"])
def test_killed_worker_fails_the_episode_and_the_pool_recovers(env, tmp_path_factory):
  tasks = _tasks(env, tmp_path_factory)
  with EnvPool(env, {}, num_workers=1, step_timeout_s=60, reset_timeout_s=120) as pool:
    obs = pool.reset_batch(tasks)
    assert obs[0].state and obs[0].admissible
    victim = pool.pids[0]
    os.kill(victim, signal.SIGKILL)  # takes the worker's browser / game engine down with it
    result = pool.step_batch([pool.expert_actions()[0] or obs[0].admissible[0]])[0]
    assert result.done and not result.success and result.reward == 0.0
    assert "SIGKILL" in result.info["error"] and pool.pids[0] != victim
    obs = pool.reset_batch(tasks)  # a fresh worker builds a fresh env and plays on
    result = pool.step_batch([obs[0].admissible[0]])[0]
    assert "error" not in result.info
