"""Real-env RL (GRPO and PPO) on TextWorld-Express coin games from an SFT warm start made here, and evaluation.

The warm start is a one-layer Qwen2 with a BPE trained on the games' text, behaviour-cloned for a few steps on expert
episodes of two-room coin games (collected by `dreamjax.data.collect` from the real env), through the same SFT
objective and jitted TrainStep as every other loop. The runs are tiny (2 iterations, 2 tasks x 4 rollouts, 3 turns)
but take the whole path: real env, rollout engine, reference and value scoring, batch, update, held-out evaluation,
checkpoint, summary and curve.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.commands.rl import run
from dreamjax.config import load_config
from dreamjax.curriculum.source import draw_tasks
from dreamjax.data.collect import CollectConfig, collect
from dreamjax.data.records import read_trajectories
from dreamjax.envs.base import SerialBatchEnv, Task
from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks
from dreamjax.loop.evaluate import evaluate, unparsed_rows, wilson_interval
from dreamjax.loop.checkpoint import RunCheckpointer
from dreamjax.loop.learner import PolicyLearner
from dreamjax.loop.learner import (RLConfig, TaskSpec, as_ppo, episode_returns, silent_groups, take_rows,
                                   zero_variance_groups)
from dreamjax.loop.model import ModelSource, load_model
from dreamjax.loop.track import read_metrics
from dreamjax.models import init_params, load_hf_checkpoint
from dreamjax.parallel import make_mesh
from dreamjax.rl.critic import CriticConfig
from dreamjax.rl.keys import PHASE_ROLLOUT, phase_key
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig
from dreamjax.text import Kind
from tests.jax_settings import jax_config, persistent_cache
from tests.warm_start import behaviour_clone

pytest.importorskip("textworld_express")

TWO_ROOMS = "numLocations=2, includeDoors=0"
FMT = AgentFormat(think=False, history_turns=2, history_token_budget=200)
ROLLOUT = RolloutConfig(group_size=4, max_turns=3, max_action_tokens=12, max_episode_tokens=36, prompt_buckets=(384,),
                        temperature=1.0)
ROWS = 2 * ROLLOUT.group_size  # B * G


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache for this module: runs with the same shapes (the rerun from the same seed, the
  learner below) load the executables the first run compiled instead of compiling again on a shared 2-core CPU."""
  with jax_config(**persistent_cache(str(tmp_path_factory.mktemp("xla_cache")))):
    yield


@pytest.fixture(scope="module")
def twx():
  """One JVM per row, shared by every run here (starting a JVM costs seconds)."""
  env = SerialBatchEnv([TextWorldExpressEnv(step_limit=10) for _ in range(ROWS)])
  yield env
  env.close()


@pytest.fixture(scope="module")
def warm_start(twx, tmp_path_factory):
  """An HF folder holding a weak behaviour-cloned policy (and its tokenizer)."""
  root = tmp_path_factory.mktemp("warm")
  cfg = CollectConfig(games=("coin",), split="train", game_params=TWO_ROOMS, policies=("expert:12",), num_workers=0,
                      rows_per_worker=ROWS, env_kwargs=("step_limit=10",), out_dir=str(root / "data"),
                      build_tfds=False, progress=False)
  collect(cfg, batch=twx)
  records = read_trajectories(root / "data" / "trajectories.jsonl")
  return behaviour_clone(records, FMT, ROLLOUT, root)


def _config(warm_start, out: Path, algorithm: str = "grpo", **kw) -> RLConfig:
  folder, _ = warm_start
  base = dict(model=ModelSource(checkpoint=str(folder)), objective=PolicyGradientConfig(kl_coef=0.05),
              env_kwargs=("step_limit=10",), train_tasks=TaskSpec(("coin",), "train", 20, 6, TWO_ROOMS),
              eval_tasks=TaskSpec(("coin",), "dev", 0, 4, TWO_ROOMS), agent=FMT, rollout=ROLLOUT,
              tasks_per_iteration=2, optim=OptimConfig(lr=1e-3), rows_per_step=16, pad_to=400, score_batch=8,
              iterations=2, eval_every=1, eval_sampled=True, out_dir=str(out), seed=3, devices=1)
  cfg = RLConfig(**{**base, **kw})
  if algorithm == "ppo":
    # PPO as the paper ran it (`as_ppo`: a separate critic, GAE with gamma = lambda = 1, one epoch), with a critic
    # rate that moves a tiny model in two iterations.
    cfg = as_ppo(cfg, critic=CriticConfig(optim=OptimConfig(lr=1e-3, clip_norm=1.0)))
  return cfg


@pytest.fixture(scope="module")
def grpo_runs(twx, warm_start, tmp_path_factory):
  out = tmp_path_factory.mktemp("grpo")
  return [(run(_config(warm_start, out / name), twx), out / name) for name in ("a", "b")]


def _params_differ(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _check_run(summary, out: Path, warm_start, algorithm: str):
  rows = read_metrics(out / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert np.isfinite([r["loss"], r["pg_loss"], r["grad_norm"], r["entropy"]]).all()
    assert r["update_steps"] >= 1 and r["grad_norm"] > 0 and r["rows"] == r["rows_updated"]
  losses = [r[k] for r in rows for k in ("loss_first", "loss_last")]
  assert len(set(losses)) > 1  # the loss moves
  assert rows[0]["real_transitions"] > 0 and rows[1]["real_transitions"] > rows[0]["real_transitions"]
  # The update changed the parameters: the saved final policy differs from the warm start.
  _, warm = load_hf_checkpoint(warm_start[0])
  _, final = load_hf_checkpoint(out / "final")  # the policy (PPO's separate critic lives in the checkpoints)
  assert _params_differ({k: final[k] for k in warm}, warm) > 1e-4
  evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
  assert [e["iteration"] for e in evals] == [0, 1, 2] == [e["iteration"] for e in summary["evals"]]
  assert [e["real_transitions"] for e in evals] == [0, rows[0]["real_transitions"], rows[1]["real_transitions"]]
  for e in evals:
    for r, outcomes in ((e, e["outcomes"]), (e["sampled"], e["sampled_outcomes"])):
      assert r["episodes"] == 4 and len(outcomes) == 4 and r["successes"] == sum(ok for _, ok, _ in outcomes)
      assert (r["ci_low"], r["ci_high"]) == pytest.approx(wilson_interval(r["successes"], 4))
    assert e["temperature"] == 0.0 and e["sampled"]["temperature"] == ROLLOUT.temperature
  assert summary["final"]["iteration"] == 2 and summary["algorithm"] == algorithm
  assert "held-out success (95% CI)" in (out / "learning_curve.svg").read_text()  # the figure, titled
  return rows, final


def test_grpo_run_learns_and_writes_its_folder(grpo_runs, warm_start):
  rows, _ = _check_run(*grpo_runs[0], warm_start, "grpo")
  for r in rows:
    assert r["kl"] >= 0 and np.isfinite(r["kl"]) and 0 <= r["zero_variance_group_frac"] <= 1
  assert rows[0]["kl_first"] < 1e-6 < rows[1]["kl"]  # the first step starts at the reference; later ones do not


def test_same_seed_same_metrics(grpo_runs):
  (_, a), (_, b) = grpo_runs
  def untimed(row):  # timings (keys ending in "_s") differ between runs, also inside nested evaluations
    return {k: untimed(v) if isinstance(v, dict) else v for k, v in row.items() if not k.endswith("_s")}

  assert [untimed(r) for r in read_metrics(a / "metrics.jsonl")] == [untimed(r) for r in read_metrics(b / "metrics.jsonl")]
  assert [untimed(r) for r in read_metrics(a / "evals.jsonl")] == [untimed(r) for r in read_metrics(b / "evals.jsonl")]


def test_ppo_run_trains_policy_and_critic(twx, warm_start, tmp_path):
  summary = run(_config(warm_start, tmp_path, "ppo"), twx)
  rows, final = _check_run(summary, tmp_path, warm_start, "ppo")
  assert "value_head" not in final  # the policy has none: the critic is a model of its own
  for r in rows:
    assert np.isfinite(r["vf_loss"]) and r["vf_loss"] > 0 and r["critic_grad_norm"] > 0
    assert r["critic_lr"] == pytest.approx(1e-3) and r["critic_update_steps"] == r["update_steps"]
    assert r["value_explained_variance"] <= 1 and r["kl"] >= 0
  assert rows[0]["value_explained_variance"] == 0.0  # the zero-initialised head predicts nothing yet
  # The last checkpoint holds the critic, which learned: its value head left zero and its backbone left the warm start.
  with RunCheckpointer(tmp_path / "checkpoints") as ckpt:
    arrays, _ = ckpt.restore()
  critic = arrays["critic"]["params"]
  assert "lm_head" not in critic and float(np.max(np.abs(critic["value_head"]))) > 0
  _, warm = load_hf_checkpoint(warm_start[0])
  backbone = [k for k in critic if k != "value_head"]
  assert _params_differ({k: critic[k] for k in backbone}, {k: warm[k] for k in backbone}) > 1e-4


@pytest.fixture(scope="module")
def learner(warm_start, tmp_path_factory):
  """The learner `run` builds for the GRPO config (same mesh and shapes, so its executables come from the cache)."""
  cfg = _config(warm_start, tmp_path_factory.mktemp("learner"))
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  model_cfg, params, tok = load_model(cfg.model.checkpoint, mesh=mesh)
  return PolicyLearner(cfg, model_cfg, params, tok, mesh)


@pytest.fixture(scope="module")
def rollout(learner, twx):
  pool = learner.cfg.train_tasks.tasks(learner.cfg.env)
  return learner.engine.run(learner.params, twx, pool[:2], jax.random.key(11))


def test_only_action_tokens_carry_weight_and_logps_do_not_drift(learner, rollout):
  traj = rollout
  batch, _ = learner.build_batch(traj)
  m, t = traj.tokens.shape
  action = traj.kinds == Kind.ACTION
  np.testing.assert_array_equal(np.asarray(batch.loss_mask)[:m, :t] > 0, action)
  assert not np.asarray(batch.loss_mask)[:, t:].any() and not np.asarray(batch.loss_mask)[m:].any()
  for field in ("advantages", "old_logp"):  # (reference log-probs are scored everywhere; the mask selects them)
    assert not np.asarray(getattr(batch, field))[:m, :t][~action].any(), field
  # No re-tokenisation drift: the reference (the warm start, i.e. the rollout policy) scores the stored ids to the
  # sampler's own log-probs.
  np.testing.assert_allclose(np.asarray(batch.ref_logp)[:m, :t][action], traj.rollout_logp[action], atol=2e-5)
  # Whatever sits at non-action positions, one update gives the same loss and parameters.
  rows = np.arange(min(m, learner.cfg.rows_per_step))
  mb = take_rows(batch, rows, learner.cfg.rows_per_step, learner.cfg.pad_to)
  noise = np.random.RandomState(0).randn(*mb.tokens.shape).astype(np.float32)
  on = np.asarray(mb.loss_mask) > 0
  noisy = mb.replace(**{f: np.where(on, getattr(mb, f), noise) for f in ("advantages", "old_logp", "ref_logp")})
  results = []
  for b in (mb, noisy):
    state = jax.tree.map(jnp.copy, learner.state)  # the step donates its state
    results.append(learner.step(state, b, jax.random.key(0)))
  (s0, m0), (s1, m1) = results
  assert float(m0["loss"]) == float(m1["loss"]) and float(m0["grad_norm"]) > 0
  assert _params_differ(s0.params, s1.params) == 0.0


def test_reference_log_probs_are_scored_for_the_updated_rows_only(learner, rollout):
  """`build_batch(traj, rows)`, as the iteration calls it with the rows it will update: those rows get the reference
  log-probs a whole scoring gives them, the rows of dropped groups none (they were not scored)."""
  traj = rollout
  m, t = traj.tokens.shape
  rows = np.flatnonzero(traj.group[traj.episode] == 1)
  whole = np.asarray(learner.build_batch(traj)[0].ref_logp)[:m, :t]
  part = np.asarray(learner.build_batch(traj, rows)[0].ref_logp)[:m, :t]
  np.testing.assert_allclose(part[rows], whole[rows], rtol=1e-5, atol=1e-6)
  dropped = np.setdiff1d(np.arange(m), rows)
  assert whole[dropped].any() and not part[dropped].any() and part[rows].any()
  assert not learner.build_batch(traj, rows[:0])[0].ref_logp.any()


def test_zero_variance_groups_have_zero_advantage(learner, rollout):
  cfg = learner.cfg
  traj = rollout
  # The real rollout, and a copy with group 0 made flat (every turn valid, reward 0) and group 1 not (one success).
  reward, invalid = np.zeros_like(traj.reward), np.zeros_like(traj.invalid)
  reward[traj.turn_rows[np.flatnonzero(traj.group == 1)[0], 0]] = 1.0
  made = dataclasses.replace(traj, reward=reward, invalid=invalid)
  for t in (traj, made):
    returns = episode_returns(t, cfg.invalid_penalty).astype(np.float64)
    flat = zero_variance_groups(t, returns)
    batch, _ = learner.build_batch(t)
    adv = np.asarray(batch.advantages)[:t.num_rows, :t.tokens.shape[1]]
    for g in range(2):
      r = returns[t.group == g]
      assert flat[g] == (r.max() == r.min())
      expected = np.zeros_like(r) if flat[g] else (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # verl's GRPO
      for e, a in zip(np.flatnonzero(t.group == g), expected):
        rows = t.turn_rows[e, :t.num_turns[e]]
        action = t.loss_mask[rows] > 0
        np.testing.assert_allclose(adv[rows][action], a, atol=1e-5)
        assert not adv[rows][~action].any()
  assert flat[0] and not flat[1]


def test_an_update_moves_log_probs_along_the_advantages(learner, rollout):
  """The sign convention end to end: one step raises sum(advantage * log-prob) over the action tokens it trained on."""
  traj = rollout
  reward = np.zeros_like(traj.reward)
  reward[traj.turn_rows[np.flatnonzero(traj.group == 1)[0], 0]] = 1.0  # one success in group 1, the rest fail
  made = dataclasses.replace(traj, reward=reward, invalid=np.zeros_like(traj.invalid))
  batch, _ = learner.build_batch(made)
  rows = np.flatnonzero(made.group[made.episode] == 1)
  state, _ = learner.step(jax.tree.map(jnp.copy, learner.state), take_rows(batch, rows, learner.cfg.rows_per_step,
                                                                          learner.cfg.pad_to), jax.random.key(0))
  valid = np.arange(traj.tokens.shape[1])[None] < traj.lengths[:, None]
  before, _ = learner.ref_scorer(learner.params, traj.tokens[rows], None, valid[rows])
  after, _ = learner.ref_scorer(state.params, traj.tokens[rows], None, valid[rows])
  adv = np.asarray(batch.advantages)[rows, :traj.tokens.shape[1]]
  assert (adv > 0).any() and (adv < 0).any()
  assert np.sum(adv * after) > np.sum(adv * before)


@pytest.mark.parametrize("credit, advantage", [("episode", "grpo"), ("turn", "grpo"), ("episode", "gigpo")])
def test_dropping_zero_variance_groups_updates_only_the_others(warm_start, learner, twx, tmp_path, credit, advantage):
  cfg = dataclasses.replace(learner.cfg, drop_zero_variance_groups=True, invalid_credit=credit, advantage=advantage,
                            gamma=0.9, out_dir=str(tmp_path))
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  model_cfg, params, tok = load_model(cfg.model.checkpoint, mesh=mesh)
  other = PolicyLearner(cfg, model_cfg, params, tok, mesh)
  pool = cfg.train_tasks.tasks(cfg.env)
  # The iteration's own draw and key, rolled out by hand to know which groups are flat.
  traj = other.engine.run(other.params, twx, draw_tasks(pool, 2, 0, cfg.seed), phase_key(other.root, 0, PHASE_ROLLOUT))
  flat = silent_groups(traj, cfg.invalid_penalty, credit, advantage, cfg.gamma)
  if credit == "episode" and advantage == "grpo":
    assert (flat == zero_variance_groups(traj, episode_returns(traj, cfg.invalid_penalty))).all()
  metrics, _ = other.iteration(twx, draw_tasks(pool, 2, 0, cfg.seed), 0)
  assert metrics["rows"] == traj.num_rows
  assert metrics["rows_updated"] == int((~flat[traj.group[traj.episode]]).sum())
  assert metrics["zero_variance_group_frac"] == flat.mean()
  won = [traj.success[(traj.group == g) & ~traj.left_out].any() for g in range(len(flat))]
  assert metrics["failed_group_frac"] == 1 - np.mean(won)
  if advantage == "gigpo":  # a group's episodes all start in its task's first state
    assert 0 < metrics["step_group_shared_frac"] <= 1
    batch, _ = other.build_batch(traj)  # the rows of silent groups are exactly those with no advantage anywhere
    moving = np.abs(np.asarray(batch.advantages)[:traj.num_rows]).sum(1) > 0
    np.testing.assert_array_equal(np.bincount(traj.group[traj.episode[moving]], minlength=len(flat)) == 0, flat)


def test_evaluate_counts_intervals_and_outcomes(learner, twx, capsys):
  eval_tasks = tasks("coin", "dev", ROWS + 3, params=TWO_ROOMS)  # two batches, the second filled up
  result = evaluate(learner.eval_engine, learner.params, twx, eval_tasks, jax.random.key(0), batch_size=ROWS,
                    progress=True)
  n, outcomes = len(eval_tasks), result["outcomes"]
  assert result["episodes"] == n and [o[0] for o in outcomes] == [t.task_id for t in eval_tasks]
  k = sum(o[1] for o in outcomes)
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluation: ")]
  assert [line.split(" won")[0] for line in lines] == [
      f"evaluation: {ROWS}/{n} episodes, {sum(o[1] for o in outcomes[:ROWS])}",
      f"evaluation: {n}/{n} episodes, {k}"]
  assert result["successes"] == k and result["success_rate"] == k / n
  assert (result["ci_low"], result["ci_high"]) == wilson_interval(k, n)
  assert result["ci_low"] <= k / n <= result["ci_high"]
  assert result["turns"] == sum(o[2] for o in outcomes) and result["mean_turns"] == result["turns"] / n
  assert result["env_steps"] + result["parse_failures"] == result["turns"]
  assert result["per_game"] == {"coin[includeDoors=0,numLocations=2]": {
      k2: result[k2] for k2 in ("episodes", "successes", "success_rate", "ci_low", "ci_high")}}
  # The first batch is exactly one greedy engine run of its tasks; parse failures follow the engine's own rule.
  traj = learner.eval_engine.run(learner.params, twx, eval_tasks[:ROWS], jax.random.key(5))
  assert [[t.task_id, bool(s), int(k)] for t, s, k in zip(eval_tasks, traj.success, traj.num_turns)] == \
      outcomes[:ROWS]
  assert int(unparsed_rows(traj, learner.tokenizer).sum()) == traj.stats["parse_failures"]
  # An untrained policy never answers in the format: every turn is a parse failure and no env step is taken.
  untrained = init_params(learner.model_cfg, jax.random.key(9))
  bad = evaluate(learner.eval_engine, untrained, twx, eval_tasks[:3], jax.random.key(0), batch_size=ROWS)
  assert bad["parse_failure_rate"] == 1.0 and bad["env_steps"] == 0 and bad["successes"] == 0
  assert bad["turns"] == 3 * ROLLOUT.max_turns and (bad["ci_low"], bad["ci_high"]) == wilson_interval(0, 3)
  with pytest.raises(ValueError, match="group_size 4"):
    evaluate(learner.engine, learner.params, twx, eval_tasks, jax.random.key(0))
  with pytest.raises(ValueError, match="no tasks"):
    evaluate(learner.eval_engine, learner.params, twx, [], jax.random.key(0))


def test_task_draws_cover_the_pool_once_per_pass():
  pool = [Task.make("textworld_express", f"coin/train/{i}") for i in range(5)]
  draws = [t for it in range(5) for t in draw_tasks(pool, 2, it, seed=1)]
  assert sorted(t.task_id for t in draws[:5]) == sorted(t.task_id for t in pool) == sorted(t.task_id for t in draws[5:])
  assert draws == [t for it in range(5) for t in draw_tasks(pool, 2, it, seed=1)]
  assert draws != [t for it in range(5) for t in draw_tasks(pool, 2, it, seed=2)]


def test_configs_load_and_bad_settings_are_clear_errors(tmp_path):
  root = Path(__file__).resolve().parents[1]
  for name, algorithm in (("grpo_real_twx", "grpo"), ("ppo_real_twx", "ppo")):
    cfg = load_config(root / "configs" / f"{name}.py", ["iterations=3", "rollout.group_size=2"])
    assert cfg.algorithm == algorithm and cfg.iterations == 3 and cfg.rollout.group_size == 2
  with pytest.raises(ValueError, match="does not go with algorithm 'ppo'"):
    RLConfig(algorithm="ppo", objective=PolicyGradientConfig(vf_coef=0.5))
  with pytest.raises(ValueError, match="vf_coef > 0"):
    RLConfig(algorithm="ppo", advantage="gae_turn", critic=CriticConfig(mode="shared_head"))
  with pytest.raises(ValueError, match="equal to objective.temperature"):
    RLConfig(rollout=dataclasses.replace(RLConfig().rollout, temperature=0.7))
  with pytest.raises(ValueError, match="multiple of micro_batches"):
    RLConfig(rows_per_step=10, micro_batches=4)
  with pytest.raises(ValueError, match="held-out"):
    run(RLConfig(train_tasks=TaskSpec(split="dev", count=3), eval_tasks=TaskSpec(split="dev", count=2),
                 out_dir=str(tmp_path)))


def test_model_source_sets_how_the_loaded_policy_computes(tmp_path):
  """dtype, remat and attention blocks from the config reach the loaded model; the weights stay float32."""
  from dreamjax.loop.model import build_tiny_checkpoint

  source = ModelSource(dtype="bfloat16", remat="full", attention_chunk=64)
  folder = build_tiny_checkpoint(source, ["go north", "take key", "open door"] * 20, tmp_path / "m", seed=0)
  cfg, params, _ = load_model(folder, overrides=source.overrides())
  assert (cfg.dtype, cfg.remat, cfg.attention_chunk, cfg.param_dtype) == ("bfloat16", "full", 64, "float32")
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  with pytest.raises(ValueError, match="ModelSource.dtype must be"):
    ModelSource(dtype="float16")
