"""EnvPool on real TextWorld-Express workers: equal to in-process stepping, and crashes, hangs and shutdown handled."""

import gc
import os
import random
import signal
import time

import pytest

pytest.importorskip("textworld_express")

from dreamjax.envs import textworld_express as twx  # noqa: E402
from dreamjax.envs.base import ENV_ERROR, env_failed  # noqa: E402
from dreamjax.envs.pool import TAG_VAR, EnvPool  # noqa: E402

KWARGS = {"step_limit": 12}


def _alive(pid: int) -> bool:
  """Exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _pool_processes(prefix: str) -> list[int]:
  """Live processes carrying any of the pool's tags: everything the workers started (a worker's own /proc environ is
  the one it was exec'd with, before it tagged itself)."""
  needle = f"{TAG_VAR}={prefix}-".encode()
  pids = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/environ", "rb") as f:
          if any(v.startswith(needle) for v in f.read().split(b"\0")) and _alive(int(name)):
            pids.append(int(name))
      except OSError:
        pass
  return pids


def _wait_gone(pids, timeout=10.0) -> list[int]:
  deadline = time.monotonic() + timeout
  while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
    time.sleep(0.1)
  return left


@pytest.fixture(scope="module")
def tasks():
  env = twx.TextWorldExpressEnv(**KWARGS)
  try:
    yield (twx.tasks("cookingworld", "train", 2, env=env) + twx.tasks("coin", "train", 1, env=env)
           + twx.tasks("twc", "train", 1, env=env))
  finally:
    env.close()


@pytest.fixture(scope="module")
def pool():
  p = EnvPool("textworld_express", KWARGS, num_workers=2, step_timeout_s=30.0, reset_timeout_s=60.0)
  yield p
  p.close()


def test_batched_rows_equal_serial_episodes(pool, tasks):
  # 4 rows on 2 workers: each worker holds two envs and steps them in turn.
  rng = random.Random(0)
  observations = pool.reset_batch(tasks)
  actions_per_step, results_per_step = [], []
  while True:
    last = results_per_step[-1] if results_per_step else None
    actions = [None if last and last[i].done else rng.choice(o.admissible) for i, o in enumerate(observations)]
    if all(a is None for a in actions):
      break
    results = pool.step_batch(actions)
    observations = [r.observation for r in results]
    actions_per_step.append(actions)
    results_per_step.append(results)
  assert not any("error" in r.info for r in results_per_step[-1])
  first = pool.reset_batch(tasks)  # resets are repeatable: same observations as the first time
  env = twx.TextWorldExpressEnv(**KWARGS)
  try:
    for i, task in enumerate(tasks):
      assert env.reset(task) == first[i]
      for actions, results in zip(actions_per_step, results_per_step):
        if actions[i] is not None:
          assert env.step(actions[i]) == results[i], f"row {i} ({task.task_id}) differs at action {actions[i]!r}"
  finally:
    env.close()


def test_expert_actions_pass_through(pool, tasks):
  pool.reset_batch(tasks[:2])
  for _ in range(3):
    experts = pool.expert_actions()
    assert all(isinstance(a, str) and a for a in experts)
    results = pool.step_batch(experts)
    assert not any(r.invalid for r in results)


def test_replies_to_an_abandoned_request_are_dropped(pool, tasks):
  pool.reset_batch(tasks[:2])
  expected = pool.expert_actions()
  pool._workers.conns[0].send(("expert", -1, [(0, None), (0, None)]))  # as if a caller was interrupted mid-request
  assert pool.expert_actions() == expected


def test_killed_worker_fails_its_rows_and_pool_recovers(pool, tasks):
  obs = pool.reset_batch(tasks[:2])  # row 0 on worker 0, row 1 on worker 1
  pool.step_batch([o.admissible[0] for o in obs])
  victim = pool.pids[0]
  restarts = pool.restarts
  os.kill(victim, signal.SIGKILL)
  results = pool.step_batch(["look around", "look around"])
  assert results[0].done and not results[0].success and results[0].reward == 0.0
  assert "worker 0" in results[0].info["error"] and "SIGKILL" in results[0].info["error"]
  assert "error" not in results[1].info and not results[1].done
  assert pool.restarts == restarts + 1 and pool.pids[0] != victim and not _alive(victim)
  with pytest.raises(ValueError, match="row 0 is done"):
    pool.step_batch(["look around", "look around"])
  obs = pool.reset_batch(tasks[:2])  # the restarted worker builds a fresh env
  results = pool.step_batch([o.admissible[0] for o in obs])
  assert not any("error" in r.info for r in results)


def _children(pid: int) -> list[int]:
  out = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(name))
      except OSError:
        pass
  return out


def test_killed_jvm_fails_its_row_and_its_env_is_rebuilt(pool, tasks):
  """The env's own process (TWX's JVM) dies, not the worker: the row ends as an env failure (ENV_ERROR), the
  worker lives on, and its next reset builds a new env."""
  obs = pool.reset_batch(tasks[:2])
  pool.step_batch([o.admissible[0] for o in obs])
  worker = pool.pids[0]
  jvms = _children(worker)
  assert len(jvms) == 1, jvms
  os.kill(jvms[0], signal.SIGKILL)
  assert not _wait_gone(jvms)
  results = pool.step_batch(["look around", "look around"])
  assert env_failed(results[0]) and results[0].done and results[0].reward == 0.0 and not results[0].invalid
  assert "step raised" in results[0].info[ENV_ERROR] and not env_failed(results[1])
  assert pool.pids[0] == worker
  obs = pool.reset_batch(tasks[:2])
  assert not any(env_failed(r) for r in pool.step_batch([o.admissible[0] for o in obs]))
  assert _children(worker) and _children(worker) != jvms


def test_hung_worker_times_out_and_is_replaced(pool, tasks):
  obs = pool.reset_batch(tasks[:2])
  victim = pool.pids[1]
  pool.step_timeout_s = 2.0
  try:
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    results = pool.step_batch([o.admissible[0] for o in obs])
    assert time.monotonic() - t0 < 10.0
  finally:
    pool.step_timeout_s = 30.0
  assert results[1].done and not results[1].success and "timed out" in results[1].info["error"]
  assert "error" not in results[0].info
  assert pool.pids[1] != victim and not _wait_gone([victim])
  obs = pool.reset_batch(tasks[:2])
  assert all(o.admissible for o in obs)


def test_env_errors_are_failed_rows_not_exceptions(pool, tasks):
  bad = twx.Task.make("textworld_express", "nope/train/0", game="nope", seed=0)
  obs = pool.reset_batch([tasks[0], bad])
  assert obs[1].state == "" and obs[0].admissible
  results = pool.step_batch([obs[0].admissible[0], "look around"])
  assert results[1].done and not results[1].success and "reset raised" in results[1].info["error"]
  assert "error" not in results[0].info
  with pytest.raises(ValueError, match="2 actions for 1 episodes"):
    pool.reset_batch(tasks[:1]) and pool.step_batch(["a", "b"])


def test_close_and_garbage_collection_leave_no_processes(tasks):
  for how in ("close", "gc"):
    p = EnvPool("textworld_express", KWARGS, num_workers=2)
    p.reset_batch(tasks[:3])
    prefix = p._workers.prefix
    started = p.pids + _pool_processes(prefix)
    assert len(started) == 5, started  # 2 workers and a JVM for each of the 3 env slots
    if how == "close":
      p.close()
      p.close()  # idempotent
    else:
      del p
      gc.collect()
    assert not _wait_gone(started), f"left after {how}"
    assert not _pool_processes(prefix)
