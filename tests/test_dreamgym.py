"""The DreamGym loop end to end on a tiny scale: real TextWorld-Express data, an M_exp and a policy trained here.

Offline data comes from the real env (`dreamjax.data.collect`); the experience model is trained on it by
`dreamjax.commands.train_exp` (200 steps, enough for most answers to parse: these tests check the loop's bookkeeping,
not the model's fidelity, which tests/test_exp_sft.py covers); the policy warm start is behaviour-cloned for a few
steps. Then short DreamGym runs (2 iterations, 2 tasks x 4 rollouts) take the whole path: curriculum draw, rollouts against SyntheticEnv, update,
replay write-back, curriculum update, M_task generation, and evaluation on the real env.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.commands.dreamgym import DreamGymConfig, run
from dreamjax.commands.train_exp import run as train_exp
from dreamjax.config import load_config
from dreamjax.curriculum.pool import TaskPool
from dreamjax.curriculum.source import CurriculumConfig
from dreamjax.data.collect import CollectConfig, collect
from dreamjax.data.records import StepRecord, TrajectoryRecord, read_trajectories
from dreamjax.envs.base import SerialBatchEnv, Task
from dreamjax.envs.textworld_express import TextWorldExpressEnv
from dreamjax.experience.exp_model import load_exp_model
from dreamjax.loop.dreamgym import PlacementConfig, make_meshes
from dreamjax.loop.learner import RLConfig, TaskSpec
from dreamjax.loop.model import ModelSource
from dreamjax.loop.track import read_metrics
from dreamjax.models import load_hf_checkpoint
from dreamjax.parallel import MeshConfig, make_mesh
from dreamjax.replay.buffer import ReplayBuffer
from dreamjax.replay.write_back import write_back_transitions
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig
from dreamjax.rollout.trajectory import Trajectories
from tests.jax_settings import optimized
from tests.warm_start import behaviour_clone

pytest.importorskip("textworld_express")

COIN = "numLocations=2, includeDoors=0, numDistractorItems=0"
FMT = AgentFormat(think=False, history_turns=2, history_token_budget=200)
ROLLOUT = RolloutConfig(group_size=4, max_turns=3, max_action_tokens=12, max_episode_tokens=36, prompt_buckets=(384,),
                        temperature=1.0)
ROWS = 2 * ROLLOUT.group_size


@pytest.fixture(scope="module")
def twx():
  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=4) for _ in range(ROWS)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def parts(twx, tmp_path_factory):
  """(offline data path, M_exp checkpoint, policy warm start)."""
  root = tmp_path_factory.mktemp("dreamgym")
  collect(CollectConfig(games=("coin",), split="train", game_params=COIN, policies=("expert:12", "random:4"),
                        num_workers=0, rows_per_worker=ROWS, env_kwargs=("step_limit=4",), out_dir=str(root / "data"),
                        build_tfds=False, progress=False), batch=twx)
  data = root / "data" / "trajectories.jsonl"
  records = read_trajectories(data)
  # Enough steps that most answers parse: an answer that never parses ends its episode as an env failure, and a run
  # whose every episode failed would leave nothing to check in the books.
  exp = load_config("configs/train_exp_twx.py:tiny", [f"trajectories={data}", f"out_dir={root / 'exp'}", "steps=200",
                                                      "optim.total_steps=200", "eval_every=0", "held_out_fraction=0",
                                                      "max_len=512"])
  with optimized():  # 200 steps: worth XLA's full optimisation
    exp_summary = train_exp(exp)
  policy, _ = behaviour_clone([r for r in records if r.policy == "expert"], FMT, ROLLOUT, root)
  return data, Path(exp_summary["checkpoint"]), policy


def _config(parts, out: Path, **kw) -> DreamGymConfig:
  data, exp, policy = parts
  rl = dict(model=ModelSource(checkpoint=str(policy)), objective=PolicyGradientConfig(kl_coef=0.05),
            env_kwargs=("step_limit=4",), eval_tasks=TaskSpec(games=("coin",), split="dev", count=4, game_params=COIN),
            agent=FMT, rollout=ROLLOUT, tasks_per_iteration=2, optim=OptimConfig(lr=1e-3), rows_per_step=24,
            pad_to=128, score_batch=8, iterations=2, eval_every=1, devices=1)
  rl = RLConfig(**(rl | kw.pop("rl", {})))
  # 128 tokens hold a whole answer (next state, actions, flags) and leave the prompts 384 of the 512 positions
  base = dict(rl=rl, exp_model=str(exp), offline_data=(str(data),), reasoning=False, exp_max_new_tokens=128,
              curriculum=CurriculumConfig(capacity=64, generate_every=1, seeds_per_round=2, variants_per_seed=2,
                                          max_new_tokens=24, lam=0.5, min_variance=-1.0),
              out_dir=str(out))
  return DreamGymConfig(**(base | kw))


@pytest.fixture(scope="module")
def uninterrupted(parts, tmp_path_factory):
  cfg = _config(parts, tmp_path_factory.mktemp("dreamgym_run"), rl=dict(iterations=3, checkpoint_every=1))
  return cfg, run(cfg)


def test_grpo_in_the_experience_model_keeps_its_books(uninterrupted):
  cfg, summary = uninterrupted
  out = Path(cfg.out_dir)
  metrics = [m for m in read_metrics(out / "metrics.jsonl") if "rollout_success" in m]
  assert [m["step"] for m in metrics] == [1, 2, 3]
  # Synthetic transitions: every answer that parsed went to M_exp; none went to the real env in training.
  assert summary["real_transitions"] == 0 and all(e["real_transitions"] == 0 for e in summary["evals"])
  assert summary["synthetic_transitions"] == metrics[-1]["synthetic_transitions"] > 0
  assert [e["iteration"] for e in summary["evals"]] == [0, 1, 2, 3]
  # Write-back: the buffer holds the offline seed plus exactly the synthetic transitions M_exp answered, tagged with
  # the iteration. An M_exp step still unreadable after its retries is an env failure: counted, never written back.
  offline = sum(r.num_steps for r in read_trajectories(cfg.offline_data[0]))
  with ReplayBuffer(out / "replay", read_only=True) as buffer:
    items = list(buffer.iter_from(0))
  synthetic = [t for t in items if t.origin == "synthetic"]
  assert all(m["env_errors"] == m["exp_failures"] for m in metrics)
  # each unreadable failure took 1 + exp_retries answers that did not parse (an overflow takes none)
  unreadable = [m["exp_failures"] - m["exp_overflows"] for m in metrics]
  assert all(m["exp_retries"] >= n * cfg.exp_retries for m, n in zip(metrics, unreadable))
  assert all(m["exp_parse_failures"] >= n * (cfg.exp_retries + 1) for m, n in zip(metrics, unreadable))
  failed = sum(m["exp_failures"] for m in metrics)
  # ...and each is a row of exp_failures.jsonl: what M_exp was asked, what it wrote, and why that failed
  logged = _rows(out / "exp_failures.jsonl")
  assert [sum(r["iteration"] == m["step"] for r in logged) for m in metrics] == [m["exp_failures"] for m in metrics]
  assert all(r["error"] and r["state"] and r["action"] and r["task_id"] and r["step"] >= 1 for r in logged)
  assert len(items) - len(synthetic) == offline and len(synthetic) == summary["synthetic_transitions"] - failed
  assert sorted({t.policy_version for t in synthetic}) == [0, 1, 2]
  assert summary["replay_size"] == len(items) == metrics[-1]["replay_size"]
  # Curriculum: every drawn task that measured something got statistics; M_task's candidates are all accounted for.
  pool = TaskPool.load(out / "task_pool.json")
  state = jax.device_get(pool.state)
  assert int(np.asarray(state.iteration)) == 3
  # (a drawn task whose every episode M_exp failed on measured nothing: the curriculum skips it)
  sampled = int(np.asarray(state.times_sampled).sum())
  assert sampled == 3 * cfg.rl.tasks_per_iteration if failed == 0 else 0 < sampled <= 3 * cfg.rl.tasks_per_iteration
  counts = summary["generation"]
  assert all("generation_candidates" in m for m in metrics)  # M_task ran on the drawn tasks every iteration
  assert sum(v for k, v in counts.items()) == sum(m.get("generation_candidates", 0) for m in metrics)
  assert counts.get("accepted", 0) >= sum(m.get("generated", 0) for m in metrics)
  assert len(pool) == len({r.task.task_id for r in read_trajectories(cfg.offline_data[0])}) + metrics[-1][
      "pool_generated"]
  # The update changed the policy.
  _, before = load_hf_checkpoint(cfg.rl.model.checkpoint)
  _, after = load_hf_checkpoint(summary["checkpoint"])
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  assert (out / "learning_curve.svg").is_file() and json.loads((out / "summary.json").read_text())["iterations"] == 3


def _rows(path: Path) -> list[dict]:
  """JSONL rows without timings, which differ between runs."""
  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if not (k.endswith("_s") or k == "time_s")}
    return x
  return [strip(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def test_a_synthetic_transition_budget_is_spent_exactly(parts, uninterrupted, tmp_path):
  """Capped one transition past the uninterrupted run's first iteration, the second iteration steps M_exp once and
  the run stops there, as a real-env run stops at `max_real_transitions` (the tables give DreamGym real-env RL's
  budget, `Budgets.synthetic_rl`)."""
  _, summary_whole = uninterrupted
  first = summary_whole["evals"][1]["synthetic_transitions"]
  summary = run(_config(parts, tmp_path, rl=dict(iterations=3, max_synthetic_transitions=first + 1)))
  rows = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "rollout_success" in m]
  assert summary["synthetic_transitions"] == first + 1 == rows[-1]["synthetic_transitions"]
  assert summary["iterations"] == len(rows) == 2 and summary["real_transitions"] == 0
  assert rows[-1]["budget_cut_episodes"] > 0


def test_a_run_resumed_after_a_crash_equals_the_uninterrupted_run(parts, uninterrupted, tmp_path):
  """Two iterations, then the leftovers of a crash inside the third (its episodes written back, its metrics row
  logged, no checkpoint), then the same config to three iterations: the run rewinds to its checkpoint and ends equal
  to the uninterrupted run: parameters bit for bit, metrics, evaluations, replay buffer and task pool."""
  full_cfg, full = uninterrupted
  out = tmp_path / "resumed"
  run(_config(parts, out, rl=dict(iterations=2, checkpoint_every=1)))
  with ReplayBuffer(out / "replay") as buffer:
    buffer.append(list(buffer.iter_from(len(buffer) - 3)))  # what the killed iteration 3 wrote back
  with open(out / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n")
  with open(out / "exp_failures.jsonl", "a") as f:
    f.write(json.dumps({"iteration": 3, "error": "written by the killed iteration"}) + "\n")
  summary = run(_config(parts, out, rl=dict(iterations=3, checkpoint_every=1)))
  assert summary["resumed_from"] == 2 and summary["synthetic_transitions"] == full["synthetic_transitions"]
  _, a = load_hf_checkpoint(summary["checkpoint"])
  _, b = load_hf_checkpoint(full["checkpoint"])
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  for name in ("metrics.jsonl", "evals.jsonl", "exp_failures.jsonl"):
    assert _rows(out / name) == _rows(Path(full_cfg.out_dir) / name), name
  with ReplayBuffer(out / "replay", read_only=True) as x, \
      ReplayBuffer(Path(full_cfg.out_dir) / "replay", read_only=True) as y:
    assert list(x.iter_from(0)) == list(y.iter_from(0))
  assert (out / "task_pool.json").read_text() == (Path(full_cfg.out_dir) / "task_pool.json").read_text()


def test_m_exp_on_its_own_devices_gives_the_colocated_run(parts, tmp_path):
  """Placement: the policy on devices 0-3 and M_exp on 4-7 (split) against both on 0-3 (colocated). The meshes have
  the same shape, so every computation is the same: equal metrics and parameters bit for bit."""
  rl = dict(devices=4, iterations=1, eval_every=0)
  split = _config(parts, tmp_path / "split", rl=rl, placement=PlacementConfig(mode="split"))
  policy_mesh, exp_mesh = make_meshes(split.rl, split.placement)
  assert {d.id for d in policy_mesh.devices.flat} == {0, 1, 2, 3} and {d.id for d in exp_mesh.devices.flat} == {
      4, 5, 6, 7}
  a, b = run(_config(parts, tmp_path / "colocated", rl=rl)), run(split)
  assert a["synthetic_transitions"] == b["synthetic_transitions"] > 0
  assert _rows(tmp_path / "colocated" / "metrics.jsonl") == _rows(tmp_path / "split" / "metrics.jsonl")
  _, x = load_hf_checkpoint(a["checkpoint"])
  _, y = load_hf_checkpoint(b["checkpoint"])
  assert all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
  with pytest.raises(ValueError, match="only 4 devices are left"):
    make_meshes(split.rl, PlacementConfig(mode="split", exp_devices=5))
  with pytest.raises(ValueError, match="rl.devices must leave devices for M_exp"):
    make_meshes(dataclasses.replace(split.rl, devices=0), split.placement)


@pytest.fixture(scope="module")
def exp_no_replay(parts, tmp_path_factory) -> Path:
  """The "w/o replay" row's own M_exp: trained like `parts`' but without retrieved transitions in its prompts."""
  data, _, _ = parts
  root = tmp_path_factory.mktemp("exp_no_replay")
  exp = load_config("configs/train_exp_twx.py:tiny", [f"trajectories={data}", f"out_dir={root}", "steps=12",
                                                      "eval_every=0", "held_out_fraction=0", "max_len=512",
                                                      "format.retrieval=false"])
  return Path(train_exp(exp)["checkpoint"])


def test_ablations_ppo_without_replay_or_curriculum(parts, exp_no_replay, tmp_path):
  # An M_exp trained with retrieval cannot stand in for the ablation's, nor the ablation's for a run with replay.
  with pytest.raises(ValueError, match="replay is False but .* records format.retrieval=True"):
    run(_config(parts, tmp_path / "mixed", replay=False))
  with pytest.raises(ValueError, match="replay is True but .* records format.retrieval=False"):
    run(_config(parts, tmp_path / "mixed2", exp_model=str(exp_no_replay)))
  cfg = _config(parts, tmp_path / "ablation", replay=False, exp_model=str(exp_no_replay),
                curriculum=CurriculumConfig(enabled=False, capacity=64, clusters=2),
                rl=dict(algorithm="ppo", advantage="gae_turn", objective=PolicyGradientConfig(vf_coef=0.5)))
  summary = run(cfg)
  out = Path(cfg.out_dir)
  with ReplayBuffer(out / "replay", read_only=True) as buffer:
    assert len(buffer) == 0  # no seed (M_exp retrieves nothing) and nothing written back
  metrics = [m for m in read_metrics(out / "metrics.jsonl") if "rollout_success" in m]
  assert all(m["pool_generated"] == 0 and "generated" not in m for m in metrics)
  assert summary["generation"] == {} and summary["synthetic_transitions"] > 0
  assert all("vf_loss" in m for m in metrics if m["update_steps"])


def test_bad_settings_are_clear_errors(parts, tmp_path):
  with pytest.raises(ValueError, match="records format.reasoning=False"):
    run(_config(parts, tmp_path / "a", reasoning=True))
  with pytest.raises(ValueError, match="has no exp_model.json"):
    run(_config(parts, tmp_path / "b", exp_model=str(tmp_path)))
  base = _config(parts, tmp_path / "c")
  leaked = TaskSpec(games=("coin",), split="train", count=4, game_params=COIN)  # the offline data's tasks
  with pytest.raises(ValueError, match="held-out evaluation tasks"):
    run(dataclasses.replace(base, rl=dataclasses.replace(base.rl, eval_tasks=leaked)))
  with pytest.raises(ValueError, match="lambda"):
    CurriculumConfig(lam=1.5)
  cfg = load_config("configs/dreamgym_twx.py:tiny", ["curriculum.lam=0.5", "rl.iterations=3"])
  assert cfg.curriculum.lam == 0.5 and cfg.rl.iterations == 3 and not cfg.reasoning


def test_m_exp_may_load_in_bfloat16(parts, tmp_path):
  """exp_dtype: the frozen M_exp holds bfloat16 weights and computes in bfloat16 (half its memory)."""
  cfg = _config(parts, tmp_path, exp_dtype="bfloat16")
  model_cfg, params, *_ = load_exp_model(cfg.exp_model, reasoning=cfg.reasoning, replay=cfg.replay, dtype=cfg.exp_dtype,
                                         mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
  assert (model_cfg.dtype, model_cfg.param_dtype) == ("bfloat16", "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
  with pytest.raises(ValueError, match="exp_dtype must be"):
    _config(parts, tmp_path, exp_dtype="float16")


def test_m_exp_decoding_settings_are_checked():
  """Greedy M_exp (exp_temperature 0) is allowed, with resamples at a temperature of their own; negatives are not."""
  assert DreamGymConfig(exp_temperature=0.0, exp_retry_temperature=1.0).exp_retry_temperature == 1.0
  for kw in ({"exp_temperature": -1.0}, {"exp_retry_temperature": -0.5}, {"exp_retries": -1}):
    with pytest.raises(ValueError, match="must be >= 0"):
      DreamGymConfig(**kw)


def test_write_back_keeps_the_steps_m_exp_answered():
  """Episode 0's second answer did not parse (M_exp never saw it); M_exp's output for episode 1's last step did not
  parse (an env failure): neither is written back, and the others keep their step index."""
  task = Task.make("textworld_express", "coin/train/0", "Find the coin.", game="coin", seed=0)

  def record(e: int, n: int) -> TrajectoryRecord:
    steps = tuple(StepRecord(f"room {e}{j}", f"move {j}", f"room {e}{j + 1}", 0.0, False, False, False, (), "policy")
                  for j in range(n))
    return TrajectoryRecord(f"policy:{e}", task.env, task, task.instruction, "policy", e, steps, False, n, None)

  m, zeros = 5, np.zeros(5, np.int32)
  traj = Trajectories(
      tokens=np.zeros((m, 1), np.int32), kinds=np.zeros((m, 1), np.int32), loss_mask=np.zeros((m, 1), np.int32),
      rollout_logp=np.zeros((m, 1), np.float32), lengths=zeros, prompt_lengths=zeros,
      episode=np.array([0, 0, 1, 1, 1], np.int32), turn=np.array([0, 1, 0, 1, 2], np.int32),
      reward=np.zeros(m, np.float32), done=np.zeros(m, bool), invalid=np.zeros(m, bool), truncated=np.zeros(m, bool),
      group=np.zeros(2, np.int32), task_index=np.zeros(2, np.int32), num_turns=np.array([2, 3], np.int32),
      turn_rows=np.array([[0, 1, -1], [2, 3, 4]], np.int32), episode_reward=np.zeros(2, np.float32),
      success=np.zeros(2, bool), ended=np.array([False, True]), env_error=np.array([False, True]),
      records=(record(0, 2), record(1, 3)))
  out = write_back_transitions(traj, np.array([False, True, False, False, False]), iteration=4)
  assert [(t.episode_id, t.step, t.state) for t in out] == [("policy:0", 0, "room 00"), ("policy:1", 0, "room 10"),
                                                            ("policy:1", 1, "room 11")]
  assert all(t.origin == "synthetic" and t.policy_version == 4 and not t.history for t in out)


def test_multiturn_rollout_bench_fast_paths_give_the_same_trajectories(parts, tmp_path):
  """experiments/bench/multiturn_rollout.py on this file's policy and M_exp, grouped prefill and KV reuse against
  full prefill: the same sampled trajectories, fewer prefilled tokens, a table for each."""
  from experiments.bench import multiturn_rollout as bench

  data, exp, policy = parts
  cfg = _config(parts, tmp_path / "unused", exp_temperature=1.0)
  args = bench.parse_args(["--tasks", "2", "--group", "2", "--turns", "3", "--settings", "off,both"])
  off, both = bench.bench(args, cfg, str(policy), str(exp), str(data))
  np.testing.assert_array_equal(both["tokens"], off["tokens"])
  assert both["exp_steps"] == off["exp_steps"] > 0
  prefilled = {r["setting"]: sum(t["policy_prefilled"] + t["exp_prefilled"] for t in r["turns"]) for r in (off, both)}
  prompt = sum(t["policy_prompt"] + t["exp_prompt"] for t in off["turns"])
  assert prefilled["off"] == prompt > prefilled["both"]
  table = bench.tables([off, both])
  assert table.count("| yes |") == 2 and "| 0 | 4 |" in table
