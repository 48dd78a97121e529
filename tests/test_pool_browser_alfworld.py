"""Crash recovery for the envs with heavy children: Chromium (MiniWoB) and ALFWorld's game engine, through the pool
(the worker killed, or only its browser) and in this process (the browser killed under a SerialBatchEnv)."""

import os
import signal

import psutil
import pytest

from dreamjax.envs import alfworld, miniwob
from dreamjax.envs.base import ENV_ERROR, env_failed
from dreamjax.envs.chromium import INSTALL_HINT
from dreamjax.envs.pool import EnvPool
from dreamjax.envs.registry import make_batch_env


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


def _chromium(root: int) -> set[int]:
  out = set()
  for p in psutil.Process(root).children(recursive=True):
    try:
      if "chrom" in p.name().lower() and p.status() != psutil.STATUS_ZOMBIE:
        out.add(p.pid)
    except psutil.NoSuchProcess:
      pass
  return out


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason=f"needs Debian's Chromium: {INSTALL_HINT}")
@pytest.mark.parametrize("pooled", [False, True])
def test_a_killed_browser_is_an_env_failure_and_is_relaunched(pooled):
  """Only the browser dies (its processes killed by pid mid-episode): the row ends as an env failure, not as an
  invalid action charged to the agent, and the next reset plays on a new browser."""
  tasks = miniwob.tasks("click-button", "train", 1)
  before = set() if pooled else _chromium(os.getpid())
  env = (EnvPool("miniwob", {}, num_workers=1, step_timeout_s=60, reset_timeout_s=120) if pooled
         else make_batch_env("miniwob", [], rows=1))
  try:
    obs = env.reset_batch(tasks)
    action = env.expert_actions()[0]
    browsers = _chromium(env.pids[0] if pooled else os.getpid()) - before
    assert browsers and action
    for pid in browsers:
      os.kill(pid, signal.SIGKILL)
    result = env.step_batch([action])[0]
    assert env_failed(result) and result.done and not result.invalid and not result.success and result.reward == 0
    assert "the browser failed" in result.info[ENV_ERROR], result.info
    obs = env.reset_batch(tasks)
    assert obs[0].admissible and not env_failed(env.step_batch([env.expert_actions()[0]])[0])
  finally:
    env.close()
