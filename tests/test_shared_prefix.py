"""Shared group prompts (issue 17, item 3): the sampler's grouped prefill and the update's shared-prefix forward equal
their per-row paths (tokens exactly; log-probs, losses and gradients to float32 rounding).

Tiny one- or two-layer models and one batch shape per test keep compilation, which dominates on 2 cores, short.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dreamjax.envs.base import Observation, StepResult, Task
from dreamjax.loop.learner import PolicyLearner, RLConfig, tokenizer_texts
from dreamjax.loop.model import ModelSource, prepare_model
from dreamjax.models import init_params, tiny
from dreamjax.parallel import MeshConfig, make_mesh
from dreamjax.rl.batch import TokenBatch, _empty, _finish, prefix_stats, shared_prefix_batch
from dreamjax.rl.logprobs import LogpScorer, score_len_for
from dreamjax.rl.objectives import PolicyGradientConfig, make_objective
from dreamjax.rl.optim import OptimConfig
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.rollout.engine import RolloutConfig
from dreamjax.sampling import Sampler, SpeculativeConfig, left_pad, sampling_params

CFG = tiny("qwen2", vocab_size=97, num_layers=2)
CFG_V = CFG.replace(value_head=True)
G = 4
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


# --- sampler: grouped prefill ---------------------------------------------------------------------------------------


def group_prompts(groups: int, width: int, seed: int = 0):
  """groups x G rows, each group one random prompt (lengths differ between groups), left-padded to `width`."""
  rng = np.random.RandomState(seed)
  prompts = [list(rng.randint(3, CFG.vocab_size, rng.randint(3, width + 1))) for _ in range(groups)]
  return left_pad([prompts[r // G] for r in range(groups * G)], groups * G, width, 0)


@pytest.mark.parametrize("speculative", [False, True])
def test_grouped_prefill_equals_plain(params, speculative):
  spec = SpeculativeConfig(draft_tokens=3) if speculative else None
  sampler = Sampler(CFG, max_new_tokens=8, pad_id=0, speculative=spec)
  tokens, mask = group_prompts(2, 12)
  keys = jax.random.split(jax.random.key(1), 2 * G)
  for temperature in (0.0, 1.0):
    sp = sampling_params(2 * G, 8, temperature=temperature, stop=[[5]])
    plain = sampler(params, tokens, mask, keys, sp)
    grouped = sampler(params, tokens, mask, keys, sp, group=G)
    np.testing.assert_array_equal(grouped.tokens, plain.tokens)
    np.testing.assert_array_equal(grouped.lengths, plain.lengths)
    np.testing.assert_allclose(grouped.logps, plain.logps, rtol=RTOL, atol=ATOL)
    if temperature > 0:  # each row keeps its own key: the group's rows differ
      assert len({tuple(r) for r in np.asarray(plain.tokens)}) > 2
  assert sampler.compilations() == 2  # one plain, one grouped variant for the shape
  assert sampler.group_for(2 * G, 3) == 1 and sampler.group_for(2 * G, 1) == 1


def test_grouped_prefill_on_the_mesh(params):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  sampler = Sampler(CFG, max_new_tokens=6, pad_id=0, mesh=mesh)
  # 16 rows in groups of 4 is 4 prefill rows, split over data x fsdp = 4 as the 16 are: grouped.
  tokens, mask = group_prompts(4, 10, seed=2)
  keys = jax.random.split(jax.random.key(3), 4 * G)
  sp = sampling_params(4 * G, 6, temperature=1.0)
  sharded = jax.device_put(params, sampler.param_shardings())
  assert sampler.group_for(4 * G, G) == G
  plain, grouped = (sampler(sharded, tokens, mask, keys, sp, group=g) for g in (1, G))
  np.testing.assert_array_equal(grouped.tokens, plain.tokens)
  np.testing.assert_allclose(grouped.logps, plain.logps, rtol=RTOL, atol=ATOL)
  # 8 rows in groups of 4: 2 prefill rows do not split 4 ways as 8 rows do, so the plain prefill serves.
  assert sampler.group_for(8, G) == 1


# --- update: shared-prefix forward ----------------------------------------------------------------------------------


def turn_rows(seed: int = 0) -> TokenBatch:
  """Rows like a multi-turn rollout's: group A's G turn-0 rows (one prompt, different answers), group A's G turn-1
  rows (shared instruction, then different histories), group B's rows sharing only a 2-token prefix (below
  min_prefix: they go alone), two unrelated rows, three empty rows; GRPO-like advantages, old and reference log-probs."""
  rng = np.random.RandomState(seed)
  v = CFG.vocab_size
  rand = lambda n: list(rng.randint(3, v, n))  # noqa: E731
  prompt_a, instr = rand(30), rand(20)
  rows = [(prompt_a, rand(rng.randint(3, 9))) for _ in range(G)]
  rows += [(instr + rand(rng.randint(5, 15)), rand(rng.randint(3, 9))) for _ in range(G)]
  short = rand(2)
  rows += [(short + rand(rng.randint(10, 20)), rand(5)) for _ in range(3)]
  rows += [(rand(25), rand(4)), (rand(8), rand(6))]
  b, t = 16, 64
  d = _empty(b, t)
  d["allowed"] = np.full((b, t, 3), -1, np.int32)  # odd rows drew their answers among 3 tokens (constrain_actions)
  for r, (prompt, answer) in enumerate(rows):
    n = len(prompt) + len(answer)
    d["tokens"][r, :n] = prompt + answer
    d["valid"][r, :n] = True
    d["loss_mask"][r, len(prompt):n] = 1.0
    d["old_logp"][r, len(prompt):n] = -rng.uniform(0.5, 5.0, len(answer))
    d["ref_logp"][r, len(prompt):n] = -rng.uniform(0.5, 5.0, len(answer))
    d["advantages"][r, len(prompt):n] = rng.randn()
    d["returns"][r, len(prompt):n] = rng.randn()
    d["old_values"][r, len(prompt):n] = rng.randn(len(answer))
    if r % 2:
      others = rng.randint(3, v, (len(answer), 2))
      d["allowed"][r, len(prompt):n] = np.concatenate([np.asarray(answer)[:, None], others], -1)
  return _finish(d)


def sgd() -> optax.GradientTransformation:
  # Plain SGD whose zero-decay trace keeps the gradient itself in the optimizer state.
  return optax.chain(optax.trace(decay=0.0), optax.scale(-1.0))


@functools.cache
def step(cfg, name: str, k: int, shared: bool, mesh=None):
  objective = make_objective(name, kl_coef=0.05, entropy_coef=0.01) if name == "grpo" else make_objective(name)
  return make_train_step(cfg, objective, sgd(), micro_batches=k, mesh=mesh, shared_prefix=shared, pad_to=16)


def run_step(cfg, p, name, k, shared, batch, mesh=None):
  state = create_train_state(cfg, jax.tree.map(jnp.array, p), sgd(), mesh=mesh)
  state, metrics = step(cfg, name, k, shared, mesh)(state, batch, jax.random.key(0))
  return jax.device_get((state.opt_state[0].trace, metrics))


def assert_same_update(a, b):
  (grads_a, metrics_a), (grads_b, metrics_b) = a, b
  for name in ("loss", "pg_loss", "kl", "entropy", "vf_loss", "grad_norm", "num_loss_tokens"):
    if name in metrics_a:
      np.testing.assert_allclose(metrics_b[name], metrics_a[name], rtol=RTOL, atol=ATOL, err_msg=name)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(y, x, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


def test_shared_prefix_batch_layout():
  batch = turn_rows()
  shared = shared_prefix_batch(batch, micro_batches=2, row_multiple=2, pad_to=16)
  k = 2
  idx = np.asarray(shared.prefix_index) * k + np.arange(16) % k
  plen = shared.prefix_valid.sum(-1)[idx]
  whole = {tuple(batch.tokens[r][batch.valid[r]]) for r in range(16) if batch.valid[r].any()}
  rebuilt = set()
  for r in range(16):
    if shared.valid[r].any():
      p = plen[r]
      row = tuple(shared.prefix_tokens[idx[r], :p]) + tuple(shared.tokens[r][shared.valid[r]])
      rebuilt.add(row)
      np.testing.assert_array_equal(shared.positions[r][shared.valid[r]], p + np.arange(shared.valid[r].sum()))
      assert shared.loss_mask[r, 0] == 0  # the token that predicts the first loss token is in the suffix
  assert rebuilt == whole and shared.loss_mask.sum() == batch.loss_mask.sum()
  # The layout is chosen for the fewest padded token slots (here prefixes of 16 slots and suffixes of 32).
  stats = prefix_stats(shared, k)
  assert stats["rows"] == 13 and stats["slot_ratio"] < 1 and stats["shared_frac"] > 0.2
  # The turn-0 group alone: its 30-token prompt (less the token that predicts the answer) is computed once.
  turn0 = jax.tree.map(lambda x: np.asarray(x)[:G], batch)
  stats = prefix_stats(shared_prefix_batch(turn0, pad_to=16))
  assert stats["prefixes"] == 1 and stats["computed_tokens"] == stats["row_tokens"] - (G - 1) * 29


@pytest.mark.parametrize("k", [1, 2])
def test_grpo_update_equals_per_row(params, k):
  """GRPO with KL and an entropy bonus: loss, metrics and every gradient leaf as the per-row step's; with 2
  micro-batches too (the shared batch reorders rows and may split a cluster; the sum is the same)."""
  batch = turn_rows()
  assert_same_update(run_step(CFG, params, "grpo", k, False, batch), run_step(CFG, params, "grpo", k, True, batch))


def test_ppo_shared_head_update_equals_per_row():
  p = init_params(CFG_V, jax.random.key(1))
  p = {**p, "value_head": jax.random.normal(jax.random.key(2), p["value_head"].shape) * 0.1}
  batch = turn_rows(1)
  assert_same_update(run_step(CFG_V, p, "ppo", 1, False, batch), run_step(CFG_V, p, "ppo", 1, True, batch))


def test_update_on_the_mesh_equals_per_row(params):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  batch = turn_rows(2)
  plain = run_step(CFG, params, "grpo", 2, False, batch)
  assert_same_update(plain, run_step(CFG, params, "grpo", 2, True, batch, mesh))


def test_reference_scoring_equals_per_row(params):
  """LogpScorer through shared prefixes: the same log-probs on the masked tokens, back in the caller's rows (13 rows
  in batches of 8, so the second batch is part padding)."""
  batch = turn_rows(3)
  m = 13
  tokens, valid, mask = (np.asarray(x)[:m] for x in (batch.tokens, batch.valid, batch.loss_mask))
  plain = LogpScorer(CFG, 8, pad_to=16)(params, tokens, None, valid, mask=mask)[0]
  shared = LogpScorer(CFG, 8, pad_to=16, shared_prefix=True)(params, tokens, None, valid, mask=mask)[0]
  assert np.count_nonzero(plain) == np.count_nonzero(mask)
  np.testing.assert_allclose(shared, plain, rtol=RTOL, atol=ATOL)
  # With allowed sets (odd rows): renormalised log-probs, the same through shared prefixes.
  allowed = np.asarray(batch.allowed)[:m]
  plain_r = LogpScorer(CFG, 8, pad_to=16)(params, tokens, None, valid, mask=mask, allowed=allowed)[0]
  shared_r = LogpScorer(CFG, 8, pad_to=16, shared_prefix=True)(params, tokens, None, valid, mask=mask,
                                                               allowed=allowed)[0]
  np.testing.assert_allclose(shared_r, plain_r, rtol=RTOL, atol=ATOL)
  limited = (allowed >= 0).any(-1) & (mask != 0)
  assert (plain_r[limited] > plain[limited]).all() and (plain_r[~limited] == plain[~limited]).all()


def test_refusals(params):
  with pytest.raises(ValueError, match="per-row objective"):
    make_train_step(CFG, make_objective("dpo"), sgd(), shared_prefix=True)
  with pytest.raises(ValueError, match="scan_layers"):
    make_train_step(CFG.replace(scan_layers=True), make_objective("grpo"), sgd(), shared_prefix=True)
  with pytest.raises(ValueError, match="log-probs only"):
    LogpScorer(CFG_V, 8, with_values=True, shared_prefix=True)
  with pytest.raises(ValueError, match="already"):
    shared_prefix_batch(shared_prefix_batch(turn_rows()))
  assert score_len_for(turn_rows().loss_mask) == 64


# --- one learner iteration with both settings on --------------------------------------------------------------------


class ToyEnv:
  """A BatchEnv of one-room games: "take coin" wins; a random policy never parses, so a group's rows keep one prompt
  turn after turn (the grouped prefill serves every turn)."""

  def reset_batch(self, tasks):
    return [Observation(f"You are in room {t.task_id[-1]}. A coin lies here.", t.instruction, ("take coin", "wait"))
            for t in tasks]

  def step_batch(self, actions):
    obs = Observation("You are in the room.", "", ("take coin", "wait"))
    return [None if a is None else StepResult(obs, float(a == "take coin"), a == "take coin", a == "take coin")
            for a in actions]

  def close(self):
    pass


# Adam's first step is lr x m / (sqrt(v) + eps): with the default eps about lr x sign(gradient), which turns float32
# rounding of a gradient entry near 0 into up to 2 x lr; eps 1 keeps the step linear in the gradient, so the weights
# compare like the gradients.
OPTIM = OptimConfig(lr=1e-3, eps=1.0)


def test_learner_iteration_with_shared_prefix_and_grouped_prefill(tmp_path):
  source = ModelSource(tiny=tiny("qwen2", vocab_size=400, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=512))
  tasks = [Task.make("toy", f"toy/{i}", instruction=f"Find the coin {i}.") for i in range(2)]
  texts = tokenizer_texts(RLConfig().agent, ToyEnv(), tasks, 8) * 4
  _, model_cfg, params, tok = prepare_model(source, tmp_path / "init", lambda: texts, seed=0)
  rollout = RolloutConfig(group_size=4, max_turns=2, max_action_tokens=6, max_episode_tokens=12,
                          prompt_buckets=(256,))
  results = []
  for on in (False, True):
    cfg = RLConfig(model=source, objective=PolicyGradientConfig(kl_coef=0.05),
                   rollout=dataclasses.replace(rollout, group_prefill=on), shared_prefix=on, tasks_per_iteration=2,
                   optim=OPTIM, rows_per_step=16, pad_to=64, score_batch=16)
    learner = PolicyLearner(cfg, model_cfg, jax.tree.map(jnp.array, params), tok)
    metrics, traj = learner.iteration(ToyEnv(), tasks, 0)
    results.append((metrics, traj, jax.device_get(learner.params)))
  (off, traj_off, params_off), (on, traj_on, params_on) = results
  assert traj_on.stats["grouped_turns"] == traj_on.stats["turns"] == 2 and traj_off.stats["grouped_turns"] == 0
  np.testing.assert_array_equal(traj_on.tokens, traj_off.tokens)  # same samples from the same keys
  np.testing.assert_allclose(traj_on.rollout_logp, traj_off.rollout_logp, rtol=RTOL, atol=ATOL)
  assert on["update_steps"] == off["update_steps"] == 1
  for name in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(on[name], off[name], rtol=RTOL, atol=ATOL, err_msg=name)
  for x, y in zip(jax.tree.leaves(params_on), jax.tree.leaves(params_off)):
    np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)
