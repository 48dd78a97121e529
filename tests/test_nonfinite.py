"""Non-finite values: the update step skips a step whose loss or gradient is not finite (state unchanged, bit for bit),
the policy learner counts skips and stops after `max_nonfinite_updates` in a row, checkpoints and exported models
refuse NaN weights, and run files are strict JSON (a non-finite metric is written as null).

One tiny one-layer model; the learner is built through `prepare_model` on a few texts (the tiny-run path) and updated
on hand-built batches, so no env runs and each test compiles one step.
"""

import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.loop.checkpoint import RunCheckpointer
from dreamjax.loop.learner import PolicyLearner, RLConfig
from dreamjax.loop.model import ModelSource, prepare_model, save_model
from dreamjax.loop.track import Tracker, json_dumps, read_metrics, truncate_jsonl
from dreamjax.models import abstract_params, tiny
from dreamjax.rl.batch import TokenBatch
from dreamjax.rl.logprobs import row_positions
from dreamjax.rl.objectives import PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state, nonfinite_leaves
from dreamjax.rl.update import NonFiniteUpdateError, SkipCounter
from dreamjax.rollout.engine import RolloutConfig

B, T = 8, 16
TINY = tiny("qwen2", vocab_size=97, num_layers=1)  # checkpoint and export tests: no compilation


def strict_rows(path: Path) -> list[dict]:
  """Rows of a JSONL file read by a parser that refuses NaN and Infinity, as JSON does."""

  def refuse(word):
    raise ValueError(f"not JSON: {word}")

  return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines() if line.strip()]


def pg_batch(seed: int, vocab: int, bad: float | None = None) -> TokenBatch:
  """Full rows with advantages on a suffix of 13 to 15 tokens (one score-length bucket, so one compilation); `bad`
  (NaN, inf) replaces one loss token's advantage."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, (B, T)).astype(np.int32)
  valid = np.ones((B, T), bool)
  mask = (np.arange(T)[None] >= rng.integers(1, 4, B)[:, None]).astype(np.float32)
  adv = (rng.normal(size=(B, T)) * mask).astype(np.float32)
  if bad is not None:
    adv[3, T - 2] = bad
  zeros = np.zeros((B, T), np.float32)
  return TokenBatch(tokens=tokens, positions=row_positions(valid), valid=valid, loss_mask=mask,
                    old_logp=zeros - 4.0 * mask, ref_logp=zeros, advantages=adv, returns=zeros, old_values=zeros,
                    pair=np.zeros(B, np.int32), chosen=np.zeros(B, bool))


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_skip_counter_counts_streaks_and_names_the_step():
  counter = SkipCounter(3, "RL update")
  for i, flag in enumerate([1.0, 1.0, 0.0, 1.0]):
    counter.add({"skipped": jnp.float32(flag)}, f"step {i + 1}")
  assert counter.check() == {"skipped_updates": 3, "nonfinite_streak": 1}
  counter.add({"skipped": 1.0}, "step 5")
  counter.add({"skipped": 1.0}, "step 6")
  with pytest.raises(NonFiniteUpdateError, match=r"RL update: 3 updates in a row .* at step 6"):
    counter.check()
  with pytest.raises(ValueError, match="max_nonfinite_updates must be >= 1"):
    SkipCounter(0, "x")


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
  """A GRPO learner on a tiny model with a BPE trained on a few texts, skipping twice in a row at most; and a host copy
  of its initial parameters. Every test here runs its jitted step on batches of one shape: one compilation."""
  texts = [f"You are in room {i}. Take the coin, go north, open the door {i}." for i in range(40)]
  source = ModelSource(tiny=tiny("qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=256))
  _, model_cfg, params, tok = prepare_model(source, tmp_path_factory.mktemp("init"), lambda: texts, seed=0)
  cfg = RLConfig(model=source, objective=PolicyGradientConfig(kl_coef=0.0),
                 optim=OptimConfig(lr=1e-2, schedule="cosine", total_steps=10),
                 rollout=RolloutConfig(group_size=2, max_turns=1, prompt_buckets=(64,)), tasks_per_iteration=4,
                 rows_per_step=B, pad_to=T, max_nonfinite_updates=2)
  initial = host(params)
  return PolicyLearner(cfg, model_cfg, params, tok), initial


def test_step_skips_nonfinite_updates_and_leaves_no_trace(learner):
  learner, initial = learner
  optimizer, vocab, rng = make_optimizer(learner.cfg.optim), learner.model_cfg.vocab_size, jax.random.key(1)

  def fresh():
    return create_train_state(learner.model_cfg, jax.tree.map(jnp.array, initial), optimizer)

  before = host(fresh())
  state, m = learner.step(fresh(), pg_batch(0, vocab, bad=math.nan), rng)
  assert m["skipped"] == 1 and not np.isfinite(m["loss"]) and int(state.step) == 0
  assert_same(host(state), before)  # parameters, Adam moments, counts and the schedule's step: all unchanged
  state, m = learner.step(state, pg_batch(0, vocab, bad=math.inf), rng)
  assert m["skipped"] == 1 and int(state.step) == 0
  assert_same(host(state), before)

  # A finite step after the skipped ones is exactly the step taken from the untouched state.
  after_skips, m = learner.step(state, pg_batch(1, vocab), rng)
  direct, m2 = learner.step(fresh(), pg_batch(1, vocab), rng)
  assert m["skipped"] == 0 and m2["skipped"] == 0 and int(after_skips.step) == 1
  assert_same(host(after_skips), host(direct))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host(direct.params)),
                                                      jax.tree.leaves(before.params)))


def test_learner_skips_counts_and_stops_after_the_limit(learner, tmp_path, capsys):
  learner, _ = learner
  vocab, rows = learner.model_cfg.vocab_size, np.arange(B)
  before = host(learner.state)
  m = learner.update(pg_batch(0, vocab, bad=math.nan), rows, iteration=0)
  assert (m["skipped_updates"], m["nonfinite_streak"], m["update_steps"]) == (1, 1, 1)
  assert math.isnan(m["loss"])  # no step applied: the loss shows what happened
  assert_same(host(learner.state), before)
  assert "iteration 1: update step 1 skipped: non-finite loss nan" in capsys.readouterr().out

  # The iteration's row goes to metrics.jsonl as strict JSON, the NaN as null.
  with Tracker(tmp_path, {}) as tracker:
    tracker.log(1, m)
  (row,) = strict_rows(tmp_path / "metrics.jsonl")
  assert row["loss"] is None and row["skipped_updates"] == 1 and read_metrics(tmp_path / "metrics.jsonl") == [row]

  m = learner.update(pg_batch(1, vocab), rows, iteration=1)  # a finite step ends the streak
  assert (m["skipped_updates"], m["nonfinite_streak"]) == (0, 0) and np.isfinite(m["loss"])
  applied = host(learner.state)
  assert int(applied.step) == 1
  m = learner.update(pg_batch(2, vocab, bad=-math.inf), rows, iteration=2)
  assert (m["skipped_updates"], m["nonfinite_streak"]) == (1, 1)
  with pytest.raises(NonFiniteUpdateError, match=r"2 updates in a row .* iteration 4, update step 1"):
    learner.update(pg_batch(3, vocab, bad=math.nan), rows, iteration=3)
  assert_same(host(learner.state), applied)  # the weights a checkpoint would hold are the last finite ones


def test_nonfinite_leaves_names_float_leaves_only():
  tree = {"a": jnp.ones(3), "b": {"c": jnp.array([1.0, jnp.nan])}, "n": np.array([np.inf]), "i": jnp.arange(3),
          "key": jax.random.key(0)}
  assert nonfinite_leaves(tree) == ["b/c", "n"]
  assert nonfinite_leaves({"a": jnp.ones(2)}) == []


def test_checkpoints_and_exports_refuse_nonfinite_weights(tmp_path):
  rng = np.random.default_rng(0)  # drawn with NumPy: compiling the model's init would dominate this test
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.02, x.shape), x.dtype), nn.unbox(abstract_params(TINY)))
  with RunCheckpointer(tmp_path / "ckpt", keep=1) as ckpt:
    ckpt.save(1, {"params": params}, {"iteration": 1})
    bad = jax.tree.map(lambda x: x, params)
    bad["layers_0"]["mlp"]["down"] = bad["layers_0"]["mlp"]["down"].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"step 2 .*refusing to save non-finite values: "
                                         r"'params/layers_0/mlp/down' holds NaN"):
      ckpt.save(2, {"params": bad}, {"iteration": 2})
    assert ckpt.steps() == [1]  # keep=1: the good step was not rotated out for a bad one
  with pytest.raises(ValueError, match=r"refusing to export non-finite weights: 'layers_0/mlp/down'"):
    save_model(bad, TINY, tmp_path / "nowhere", tmp_path / "final")
  assert not (tmp_path / "final").exists()


def test_run_files_are_strict_json(tmp_path):
  with Tracker(tmp_path, {"lr": math.inf}) as tracker:
    row = tracker.log(1, {"loss": np.float32("nan"), "kl": math.inf, "ok": 0.5, "v": np.array([1.0, -np.inf])},
                      eval={"success": math.nan})
    assert math.isnan(row["loss"])  # the caller's copy keeps its floats
    tracker.log(2, {"loss": 1.0})
    tracker.summary({"final": {"loss": math.nan}, "steps": 2})
  rows = strict_rows(tmp_path / "metrics.jsonl")
  assert rows[0]["loss"] is None and rows[0]["kl"] is None and rows[0]["v"] == [1.0, None]
  assert rows[0]["eval"] == {"success": None} and rows[0]["ok"] == 0.5
  assert json.loads((tmp_path / "summary.json").read_text())["final"]["loss"] is None
  assert json.loads((tmp_path / "config.json").read_text()) == {"lr": None}
  # A resume rewrites the file through the same writer.
  (tmp_path / "evals.jsonl").write_text('{"iteration": 1, "rate": NaN}\n{"iteration": 2, "rate": 1.0}\n')
  truncate_jsonl(tmp_path / "evals.jsonl", lambda r: r["iteration"] <= 1)
  assert strict_rows(tmp_path / "evals.jsonl") == [{"iteration": 1, "rate": None}]
  assert json_dumps({"x": [math.nan, 1]}) == '{"x": [null, 1]}'
