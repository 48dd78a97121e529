"""Token log-probs (exact, and equal to the sampler's), objectives, and the jitted update step with accumulation.

Compilation dominates the run time on a shared 2-core CPU, so the model has one layer, every batch has the same shape,
and train steps are built once per (objective, optimizer, micro-batches) and shared between tests (`train_step`).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dreamjax.models import Transformer, init_params, load_hf_checkpoint, save_hf_checkpoint, tiny
from dreamjax.models.params import param_shardings
from dreamjax.parallel import MeshConfig, make_mesh
from dreamjax.parallel.sharding import TRAIN_RULES
from dreamjax.rl.batch import TokenBatch, dpo_batch, sft_batch
from dreamjax.rl.logprobs import LogpScorer, most_scored, row_positions, score_len_for, token_logps
from dreamjax.rl.objectives import PolicyGradientConfig, ValueLossConfig, make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer, make_schedule
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.sampling import Sampler, sampling_params

CFG = tiny("qwen2", vocab_size=97, num_layers=1)
CFG_V = CFG.replace(value_head=True)
B, T = 8, 16
ADAM = OptimConfig(lr=1e-2, warmup_steps=1, schedule="cosine", total_steps=10, eps=1e-3, weight_decay=0.1)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def sgd() -> optax.GradientTransformation:
  # Plain SGD (lr 1) whose zero-decay trace keeps the gradient itself in the optimizer state, bit for bit.
  return optax.chain(optax.trace(decay=0.0), optax.scale(-1.0))


def grads_of(state):
  return state.opt_state[0].trace


_OPTIMIZERS = {"sgd": sgd(), "adam": make_optimizer(ADAM), "adam_const": make_optimizer(OptimConfig(lr=1e-2)),
               "adam_vh": make_optimizer(OptimConfig(lr=1e-3, value_head_lr_multiplier=10.0, weight_decay=0.01)),
               "adam_tiny": make_optimizer(OptimConfig(lr=1e-6))}


@functools.cache
def train_step(cfg, objective, opt: str, k: int, mesh=None):
  return make_train_step(cfg, objective, _OPTIMIZERS[opt], micro_batches=k, mesh=mesh)


def fresh_state(cfg, p, opt: str, mesh=None):
  return create_train_state(cfg, jax.tree.map(jnp.array, p), _OPTIMIZERS[opt], mesh=mesh)


def rows(seed: int):
  """Random right-padded [B, T] rows: tokens, valid and a loss mask over a suffix of each row (the 'action')."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, CFG.vocab_size, (B, T)).astype(np.int32)
  lengths = rng.randint(T // 2, T + 1, B)
  valid = np.arange(T)[None] < lengths[:, None]
  starts = rng.randint(1, T // 2, B)
  mask = (np.arange(T)[None] >= starts[:, None]) & valid
  return tokens, valid, mask.astype(np.float32)


_logps = jax.jit(token_logps, static_argnums=0)


def pg_batch(seed: int, params, cfg=CFG) -> TokenBatch:
  """A policy-gradient batch of random rows with random advantages, returns and old values; old_logp is the current
  policy's (PPO's first epoch) plus noise, so ratios are near 1 and some get clipped."""
  tokens, valid, mask = rows(seed)
  rng = np.random.RandomState(seed + 1)
  f = lambda scale=1.0: (rng.randn(B, T) * scale * mask).astype(np.float32)  # noqa: E731
  old = np.asarray(_logps(cfg, params, tokens, row_positions(valid), valid).logp)
  return TokenBatch(tokens=tokens, positions=row_positions(valid), valid=valid, loss_mask=mask,
                    old_logp=(old + f(0.2)) * mask, ref_logp=(old + f(0.1)) * mask, advantages=f(), returns=f(),
                    old_values=f(0.1), pair=np.zeros(B, np.int32), chosen=np.zeros(B, bool))


def max_rel_diff(a, b) -> float:
  """Largest |a - b| per leaf relative to the leaf's largest |b|."""
  return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# Log-probs.

def test_token_logps_equal_float64_reference():
  p = init_params(CFG_V, jax.random.key(1))
  p["value_head"] = jax.random.normal(jax.random.key(2), p["value_head"].shape) * 0.1
  tokens, valid, _ = rows(0)
  valid[2, :4] = False  # a left-padded row: its first valid token has no context and no log-prob
  pos = row_positions(valid)

  @jax.jit
  def run(p):
    out = Transformer(CFG_V).apply({"params": p}, tokens, pos, valid)
    # One projection, and chunks of 6 that do not divide T (padded, mapped, rematerialised).
    return out, [token_logps(CFG_V, p, tokens, pos, valid, with_entropy=True, with_values=True, chunk_size=c)
                 for c in (None, 6)]

  out, results = run(p)
  logits = np.asarray(out.logits, np.float64)
  logits = logits - logits.max(-1, keepdims=True)
  logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  scored = np.zeros_like(valid)
  scored[:, 1:] = valid[:, 1:] & valid[:, :-1]
  ref = {k: np.zeros((B, T)) for k in ("logp", "entropy", "values")}
  ref["logp"][:, 1:] = np.take_along_axis(logsm[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  ref["entropy"][:, 1:] = -(np.exp(logsm) * logsm).sum(-1)[:, :-1]
  ref["values"][:, 1:] = np.asarray(out.values, np.float64)[:, :-1]
  for got in results:
    for k, r in ref.items():
      np.testing.assert_allclose(getattr(got, k), np.where(scored, r, 0), rtol=1e-5, atol=1e-6, err_msg=k)
  assert results[0].logp[2, 4] == 0 and results[0].logp[2, 5] != 0


@pytest.mark.slow
def test_chunked_projection_gradients_equal_direct(params):
  tokens, valid, _ = rows(1)
  pos = row_positions(valid)
  grads = jax.jit(lambda p: [jax.grad(lambda q, c=c: jnp.sum(token_logps(CFG, q, tokens, pos, valid, chunk_size=c)
                                                             .logp))(p) for c in (None, 6)])(params)
  assert max_rel_diff(grads[1], grads[0]) < 1e-5


def test_token_logps_equal_sampler_logps(params):
  """No drift between rollout and update: the update's log-probs of sampled tokens are the sampler's, at the rollout
  temperature, through the host-side scorer with its row batching and length padding."""
  n, prompt_len = 12, 9
  rng = np.random.RandomState(3)
  prompts = rng.randint(1, CFG.vocab_size, (4, prompt_len)).astype(np.int32)
  prompt_mask = np.arange(prompt_len)[None] < np.array([9, 4, 7, 2])[:, None]
  sampler = Sampler(CFG, n)
  for temperature in (1.0, 0.7):
    sp = sampling_params(4, n, temperature=temperature, top_p=1.0, stop=[[5]])
    out = sampler(params, prompts, prompt_mask, jax.random.key(4), sp)
    seq = np.zeros((4, prompt_len + n), np.int32)
    valid = np.zeros_like(seq, bool)
    spans = []
    for b in range(4):
      p, k = int(prompt_mask[b].sum()), int(out.lengths[b])
      seq[b, :p], seq[b, p:p + k] = prompts[b, :p], np.asarray(out.tokens)[b, :k]
      valid[b, :p + k] = True
      spans.append((p, k))
    got, _ = LogpScorer(CFG, batch_size=3, temperature=temperature, pad_to=16)(params, seq, None, valid)
    assert got.shape == seq.shape
    for b, (p, k) in enumerate(spans):
      np.testing.assert_allclose(got[b, p:p + k], np.asarray(out.logps)[b, :k], rtol=1e-5, atol=1e-5)
      assert not got[b, p + k:].any()
    assert sampler.compilations() == 1


def short_mask(valid: np.ndarray, seed: int) -> np.ndarray:
  """A loss mask of at most 5 tokens per row (some rows empty, one token at t = 0, which has no log-prob), so the
  scored tokens fit in fewer slots than the row is long."""
  rng = np.random.RandomState(seed)
  starts = rng.randint(0, T // 2, B)
  mask = (np.arange(T)[None] >= starts[:, None]) & (np.arange(T)[None] < starts[:, None] + rng.randint(0, 6, B)[:, None])
  mask[0, :2] = True
  return (mask & valid).astype(np.float32)


def test_the_scorer_batches_rows_by_length_and_scores_each_alone(params):
  """LogpScorer sorts rows by length and cuts each batch to its longest row (rounded up to pad_to): rows of mixed
  lengths get the log-probs and values each would get scored alone, in the caller's order, and 0 past their ends."""
  cfg = CFG_V
  p = init_params(cfg, jax.random.key(1))
  rng = np.random.RandomState(3)
  lengths = np.array([40, 5, 20, 3, 25, 44, 30])  # sorted: 3 5 | 20 25 | 30 40 | 44: batches of 16, 32, 48, 48 tokens
  m, t = len(lengths), 48
  tokens = rng.randint(3, cfg.vocab_size, (m, t)).astype(np.int32)
  valid = np.arange(t)[None] < lengths[:, None]
  mask = valid & (np.arange(t)[None] >= 2)
  scorer = LogpScorer(cfg, 2, with_values=True, pad_to=16)
  logp, values = scorer(p, tokens, None, valid, mask=mask)
  assert scorer._fn._cache_size() == 3  # in the caller's order the pairs would need widths 48 and 32 only
  for i in range(m):
    alone_logp, alone_values = LogpScorer(cfg, 1, with_values=True, pad_to=t)(p, tokens[i:i + 1], None, valid[i:i + 1],
                                                                              mask=mask[i:i + 1])
    np.testing.assert_allclose(logp[i], alone_logp[0], rtol=1e-5, atol=1e-6, err_msg=str(i))
    np.testing.assert_allclose(values[i, :lengths[i]], alone_values[0, :lengths[i]], rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(logp[i]) == mask[i].sum()
  assert not values[~valid].any()


def test_scoring_only_the_loss_tokens_equals_scoring_all(params):
  """Gathering the masked tokens' predicting states into score_len slots (and projecting only them, also in chunks)
  gives the full projection's log-probs, entropies and gradients there, and 0 elsewhere."""
  tokens, valid, _ = rows(2)
  mask = short_mask(valid, 2)
  pos = row_positions(valid)
  assert [score_len_for(m) for m in (np.zeros((2, 3)), mask, np.ones((1, 64)), np.ones((1, 65)))] == [0, 64, 64, 128]

  def logps(p, **kw):
    return token_logps(CFG, p, tokens, pos, valid, with_entropy=True, **kw)

  def weighted(p, **kw):  # a loss reading the masked log-probs and entropies with distinct weights
    out = logps(p, **kw)
    w = jnp.arange(1.0, T + 1.0)
    return jnp.sum((out.logp + 0.3 * out.entropy) * mask * w)

  full = jax.jit(logps)(params)
  full_grads = jax.jit(jax.grad(weighted))(params)
  scored = np.zeros_like(valid)
  scored[:, 1:] = valid[:, 1:] & valid[:, :-1]
  for k, chunk in ((5, None), (8, 3), (T, None)):  # T: at least the row length, so the full projection, masked
    got = jax.jit(functools.partial(logps, score_mask=mask, score_len=k, chunk_size=chunk))(params)
    for name in ("logp", "entropy"):
      want = np.where(mask != 0, getattr(full, name), 0)
      np.testing.assert_allclose(getattr(got, name), want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
    assert np.all(np.asarray(got.logp)[(mask != 0) & scored] != 0) and got.logp[0, 0] == 0
    grads = jax.jit(jax.grad(functools.partial(weighted, score_mask=mask, score_len=k, chunk_size=chunk)))(params)
    assert max_rel_diff(grads, full_grads) < 1e-5, k
  # On a data=2, fsdp=2, tensor=2 mesh (rows, weights and the vocabulary sharded), the gather gives the same.
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh), nn.logical_axis_rules(TRAIN_RULES):
    sharded = jax.device_put(params, param_shardings(CFG, mesh))
    got = jax.jit(functools.partial(logps, score_mask=mask, score_len=5))(sharded)
    grads = jax.jit(jax.grad(functools.partial(weighted, score_mask=mask, score_len=5)))(sharded)
  np.testing.assert_allclose(got.logp, np.where(mask != 0, full.logp, 0), rtol=1e-5, atol=1e-6)
  assert max_rel_diff(*jax.device_get((grads, full_grads))) < 1e-5
  zero = jax.jit(functools.partial(logps, score_mask=np.zeros_like(mask), score_len=0))(params)
  assert not np.asarray(zero.logp).any() and not np.asarray(zero.entropy).any()
  with pytest.raises(ValueError, match="score_mask and score_len go together"):
    logps(params, score_mask=mask)
  # The host scorer with a mask: the same log-probs on the masked tokens, 0 elsewhere.
  got, _ = LogpScorer(CFG, batch_size=3, pad_to=16)(params, tokens, None, valid, mask=mask)
  np.testing.assert_allclose(got, np.where(mask != 0, full.logp, 0), rtol=1e-5, atol=1e-6)


def allowed_sets(tokens: np.ndarray, mask: np.ndarray, seed: int, width: int = 4) -> np.ndarray:
  """[B, T, width] allowed sets for the masked tokens, as a restricted rollout records them: each holds its token and
  up to width - 1 others; some hold the token alone (forced), some are empty (drawn from the whole vocabulary)."""
  rng = np.random.RandomState(seed)
  out = np.full((*tokens.shape, width), -1, np.int32)
  for b, t in zip(*np.nonzero(mask)):
    n = rng.randint(0, width + 1)  # 0: no set
    if n:
      others = rng.choice(np.setdiff1d(np.arange(CFG.vocab_size), [tokens[b, t]]), n - 1, replace=False)
      out[b, t, :n] = rng.permutation(np.append(others, tokens[b, t]))
  return out


def test_allowed_sets_renormalise_log_probs_and_entropies(params):
  """With allowed sets, the log-prob and entropy at a token with a set are the model's renormalised over it (float64
  reference from the full logits), elsewhere unchanged: on the full projection, in score_len slots and chunks, on a
  mesh with the vocabulary sharded, and through the host scorer."""
  tokens, valid, mask = rows(4)
  pos = row_positions(valid)
  allowed = allowed_sets(tokens, mask, 4)
  logits = np.asarray(Transformer(CFG).apply({"params": params}, tokens, pos, valid).logits, np.float64)
  ref = {k: np.zeros((B, T)) for k in ("logp", "entropy")}
  for b, t in zip(*np.nonzero(valid[:, 1:] & valid[:, :-1])):
    z = logits[b, t]
    keep = allowed[b, t + 1][allowed[b, t + 1] >= 0]
    z = np.where(np.isin(np.arange(len(z)), keep) if len(keep) else True, z, -np.inf)
    logsm = z - z.max() - np.log(np.exp(z - z.max()).sum())
    ref["logp"][b, t + 1] = logsm[tokens[b, t + 1]]
    ref["entropy"][b, t + 1] = -np.sum(np.exp(logsm) * np.where(np.isfinite(logsm), logsm, 0.0))
  limited = (allowed >= 0).any(-1)
  forced = (allowed >= 0).sum(-1) == 1
  assert limited.sum() > 10 and forced.any() and (mask.astype(bool) & ~limited).any()
  assert np.all(ref["logp"][forced] == 0)  # a forced token was certain
  plain = jax.jit(functools.partial(token_logps, CFG, with_entropy=True))(params, tokens, pos, valid)
  assert np.abs(np.asarray(plain.logp) - ref["logp"])[limited & ~forced].min() > 1e-3  # the sets change something

  def logps(p, **kw):
    return token_logps(CFG, p, tokens, pos, valid, with_entropy=True, allowed=allowed, **kw)

  def check(got, where=None):
    for name in ("logp", "entropy"):
      want = ref[name] if where is None else np.where(where != 0, ref[name], 0)
      np.testing.assert_allclose(getattr(got, name), want, rtol=1e-5, atol=1e-5, err_msg=name)

  check(jax.jit(logps)(params))
  check(jax.jit(functools.partial(logps, chunk_size=6))(params))
  check(jax.jit(functools.partial(logps, score_mask=mask, score_len=most_scored(mask), chunk_size=3))(params), mask)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh), nn.logical_axis_rules(TRAIN_RULES):
    sharded = jax.device_put(params, param_shardings(CFG, mesh))
    got = jax.jit(functools.partial(logps, score_mask=mask, score_len=most_scored(mask)))(sharded)
    check(jax.device_get(got), mask)
  got, _ = LogpScorer(CFG, batch_size=3, pad_to=16)(params, tokens, None, valid, mask=mask, allowed=allowed)
  np.testing.assert_allclose(got, np.where(mask != 0, ref["logp"], 0), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="allowed"):
    LogpScorer(CFG, batch_size=3, pad_to=16)(params, tokens, None, valid, allowed=allowed[:2])


def test_objective_on_the_loss_tokens_equals_the_full_projection(params):
  """The update's objective with score_len (what TrainStep passes) has the full projection's loss, metrics and
  gradient."""
  batch = pg_batch(7, params)
  batch = batch.replace(loss_mask=short_mask(batch.valid, 7))
  objective = make_objective("grpo", entropy_coef=0.01)

  @jax.jit
  def both(p):
    return [jax.value_and_grad(lambda q, k=k: objective.loss(CFG, q, batch, jax.random.key(0), score_len=k),
                               has_aux=True)(p) for k in (None, 5)]

  ((l1, m1), g1), ((l2, m2), g2) = both(params)
  np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-6)
  for key in m1:
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert max_rel_diff(g2, g1) < 1e-5


def test_a_loaded_checkpoint_compiles_the_step_and_sampler_once(tmp_path):
  """Without a mesh, loaded parameters sit on one device as the step returns them, so neither the update nor the
  sampler compiles again on the updated parameters (each once cost a model-sized compilation per run)."""
  save_hf_checkpoint(init_params(CFG, jax.random.key(5)), CFG, tmp_path)
  cfg, loaded = load_hf_checkpoint(tmp_path)
  objective = make_objective("grpo")
  step, sampler = make_train_step(cfg, objective, make_optimizer(OptimConfig(lr=1e-2))), Sampler(cfg, 4)
  state = create_train_state(cfg, loaded, make_optimizer(OptimConfig(lr=1e-2)))
  batch = pg_batch(8, loaded, cfg)
  prompts = np.ones((2, 3), np.int32)
  for i in range(3):
    sampler(state.params, prompts, np.ones_like(prompts, bool), jax.random.key(i), sampling_params(2, 4))
    state, _ = step(state, batch, jax.random.key(i))
  assert int(state.step) == 3 and step.compilations() == 1 and sampler.compilations() == 1


# Update steps.

@pytest.mark.parametrize("agg", ["token_mean", pytest.param("seq_mean_token_mean", marks=pytest.mark.slow)])
def test_grad_accumulation_equals_one_big_batch(params, agg):
  """4 micro-batches give the gradient and metrics of one batch, for per-token and per-row averaging."""
  batch = pg_batch(5, params)
  batch = batch.replace(loss_mask=np.where(np.arange(B)[:, None] == 2, 0, batch.loss_mask))  # an empty row
  objective = make_objective("grpo", agg=agg, entropy_coef=0.01)
  (g1, m1), (g4, m4) = [(grads_of(s), m) for s, m in (
      train_step(CFG, objective, "sgd", k)(fresh_state(CFG, params, "sgd"), batch, jax.random.key(0))
      for k in (1, 4))]
  # Float32 rounding differs between matmul shapes (~1e-6); a wrong micro-batch weight is off by 10% or more.
  assert max_rel_diff(g4, g1) < 2e-5, agg
  for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl", "grad_norm", "num_loss_tokens",
              "ratio_max"):
    np.testing.assert_allclose(m4[key], m1[key], rtol=1e-5, err_msg=f"{agg} {key}")


def test_grpo_steps_on_the_mesh_equal_one_device(params):
  """A GRPO step (AdamW, warmup + cosine, 2 micro-batches) with sane metrics; sharded over data=2, fsdp=2, tensor=2
  it gives the single-device parameters within 1e-5."""
  objective = make_objective("grpo", entropy_coef=0.01)
  batch = pg_batch(6, params)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  single, sharded = fresh_state(CFG, params, "adam"), fresh_state(CFG, params, "adam", mesh)
  step, mesh_step = train_step(CFG, objective, "adam", 2), train_step(CFG, objective, "adam", 2, mesh)
  assert step.row_multiple == 2 and mesh_step.row_multiple == 8
  shardings = jax.tree.map(lambda x: x.sharding, sharded)
  for i in range(2):
    single, m = step(single, batch, jax.random.key(i))
    sharded, ms = mesh_step(sharded, batch, jax.random.key(i))
    assert all(np.isfinite(float(v)) for v in m.values())
    np.testing.assert_allclose(m["learning_rate"], make_schedule(ADAM)(i), rtol=1e-6)
    for key in m:
      np.testing.assert_allclose(ms[key], m[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert float(m["learning_rate"]) > 0 and int(single.step) == 2
  assert max_rel_diff(single.params, params) > 1e-3  # the second step moved the parameters
  assert 0 < float(m["clip_frac"]) < 1 and float(m["kl"]) > 0 and float(m["entropy"]) > 0
  assert 0.7 < float(m["ratio_mean"]) < 1.4 and float(m["grad_norm"]) > 0
  assert float(m["num_loss_tokens"]) == batch.loss_mask.sum()
  assert max_rel_diff(*jax.device_get((sharded.params, single.params))) < 1e-5  # one device vs the mesh: on host
  assert jax.tree.map(lambda x: x.sharding, sharded) == shardings  # donated and updated in place
  assert sharded.params["layers_0"]["mlp"]["gate"].sharding.spec == P("fsdp", "tensor")
  assert sharded.opt_state[1].mu["layers_0"]["mlp"]["gate"].sharding.spec == P("fsdp", "tensor")
  assert step.compilations() == 1 and mesh_step.compilations() == 1
  with pytest.raises(ValueError, match="not a multiple of 8"):
    mesh_step(sharded, jax.tree.map(lambda x: x[:4], batch), jax.random.key(0))


def test_length_buckets_give_the_scanned_update(params):
  """`length_buckets`: a step's rows sorted by length into micro-batches, each cut to its own longest row, give the
  scanned step's gradient and metrics, with one compilation per micro-batch length; on the mesh too (AdamW, two
  steps), where the state keeps its shardings."""
  lengths = np.array([3, 16, 5, 14, 4, 16, 6, 12])  # sorted in pairs: 3 4 | 5 6 | 12 14 | 16 16
  rng = np.random.RandomState(7)
  tokens = rng.randint(1, CFG.vocab_size, (B, T)).astype(np.int32)
  valid = np.arange(T)[None] < lengths[:, None]
  mask = (valid & (np.arange(T)[None] >= 1)).astype(np.float32)
  old = np.asarray(_logps(CFG, params, tokens, row_positions(valid), valid).logp)
  f = lambda scale=1.0: (rng.randn(B, T) * scale * mask).astype(np.float32)  # noqa: E731
  batch = TokenBatch(tokens=tokens, positions=row_positions(valid), valid=valid, loss_mask=mask,
                     old_logp=(old + f(0.2)) * mask, ref_logp=(old + f(0.1)) * mask, advantages=f(), returns=f(),
                     old_values=f(0.1), pair=np.zeros(B, np.int32), chosen=np.zeros(B, bool))
  objective = make_objective("grpo", entropy_coef=0.01)
  sgd_ = _OPTIMIZERS["sgd"]
  plain = make_train_step(CFG, objective, sgd_, micro_batches=4)
  bucketed = make_train_step(CFG, objective, sgd_, micro_batches=4, pad_to=4, length_buckets=True)
  (gp, mp), (gb, mb) = [(grads_of(s), m) for s, m in (
      step(fresh_state(CFG, params, "sgd"), batch, jax.random.key(0)) for step in (plain, bucketed))]
  assert max_rel_diff(gb, gp) < 2e-5
  for key in mp:
    np.testing.assert_allclose(mb[key], mp[key], rtol=1e-5, atol=1e-7, err_msg=key)
  # Lengths 4, 8, 16 and 16; in the caller's order the pairs would all need 12 or 16.
  assert bucketed.compilations() == 3 and float(mb["num_loss_tokens"]) == mask.sum()

  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  single, sharded = fresh_state(CFG, params, "adam"), fresh_state(CFG, params, "adam", mesh)
  shardings = jax.tree.map(lambda x: x.sharding, sharded)
  step = make_train_step(CFG, objective, _OPTIMIZERS["adam"], micro_batches=2)
  mesh_step = make_train_step(CFG, objective, _OPTIMIZERS["adam"], micro_batches=2, mesh=mesh, pad_to=4,
                              length_buckets=True)
  for i in range(2):
    single, m = step(single, batch, jax.random.key(i))
    sharded, ms = mesh_step(sharded, batch, jax.random.key(i))
    for key in m:
      np.testing.assert_allclose(ms[key], m[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert max_rel_diff(*jax.device_get((sharded.params, single.params))) < 1e-5
  assert max_rel_diff(single.params, params) > 1e-3 and jax.tree.map(lambda x: x.sharding, sharded) == shardings
  with pytest.raises(ValueError, match="length_buckets reorders a step's rows"):
    make_train_step(CFG, make_objective("dpo"), sgd_, micro_batches=2, length_buckets=True)


def test_ppo_step_trains_the_value_head():
  p = init_params(CFG_V, jax.random.key(7))
  batch = pg_batch(8, p, CFG_V)
  objective = make_objective("ppo")
  state, m = train_step(CFG_V, objective, "adam_vh", 1)(fresh_state(CFG_V, p, "adam_vh"), batch, jax.random.key(0))
  assert all(np.isfinite(float(v)) for v in m.values())
  assert {"vf_loss", "pg_loss", "explained_variance", "vf_clip_frac", "approx_kl", "entropy"} <= set(m)
  assert float(m["vf_loss"]) > 0 and "kl" not in m
  # The value head starts at zero; Adam's first step moves every entry by lr x multiplier.
  np.testing.assert_allclose(np.abs(state.params["value_head"]), 1e-2, rtol=1e-2)
  assert 0 < float(jnp.max(jnp.abs(state.params["lm_head"] - p["lm_head"]))) < 2e-3
  with pytest.raises(ValueError, match="no value head"):
    make_train_step(CFG, objective, _OPTIMIZERS["adam"])


def test_tokens_outside_the_mask_get_no_gradient(params):
  batch = pg_batch(9, params)
  lengths = batch.valid.sum(1)
  batch = batch.replace(loss_mask=batch.loss_mask * (np.arange(T)[None] < lengths[:, None] - 3))  # observations after
  objective = make_objective("ppo", vf_coef=0.0, kl_coef=0.05, entropy_coef=0.01)
  grad_fn = jax.jit(jax.grad(lambda p, b: objective.loss(CFG, p, b, jax.random.key(0))[0], (0, 1), allow_int=True))
  g_params, g_batch = grad_fn(params, batch)
  # The per-token inputs of the loss (advantages, old and reference log-probs) count only under the mask.
  mask = batch.loss_mask > 0
  for field in ("advantages", "old_logp", "ref_logp"):
    arr = np.asarray(getattr(g_batch, field))
    assert not arr[~mask].any(), field
    assert np.count_nonzero(arr[mask]) > mask.sum() // 2, field
  # Tokens after a row's last masked token are observations the loss never scores: changing them changes nothing.
  tokens = np.array(batch.tokens)
  last = T - 1 - np.argmax(mask[:, ::-1], 1)
  after = (np.arange(T)[None] > last[:, None]) & batch.valid
  assert after.sum() >= 12
  tokens[after] = (tokens[after] + 7) % CFG.vocab_size
  assert max_rel_diff(grad_fn(params, batch.replace(tokens=tokens))[0], g_params) == 0
  # ...whereas changing masked target tokens does.
  tokens[mask] = (tokens[mask] + 7) % CFG.vocab_size
  assert max_rel_diff(grad_fn(params, batch.replace(tokens=tokens))[0], g_params) > 1e-2


def test_sft_memorises():
  rng = np.random.RandomState(10)
  ids = [rng.randint(1, CFG.vocab_size, n) for n in (12, 16, 9, 14, 11, 16, 10, 13)]
  masks = [np.r_[np.zeros(4), np.ones(len(i) - 4)] for i in ids]
  batch = sft_batch(ids, masks, pad_to=T, row_multiple=2)
  step = train_step(CFG, make_objective("sft"), "adam_const", 2)
  state = fresh_state(CFG, init_params(CFG, jax.random.key(11)), "adam_const")
  losses = []
  for i in range(20):
    state, m = step(state, batch, jax.random.key(i))
    losses.append(float(m["loss"]))
  assert losses[0] > 0.9 * np.log(CFG.vocab_size) and losses[-1] < 0.3 * losses[0]
  assert float(m["num_loss_tokens"]) == sum(len(i) - 4 for i in ids)


def dpo_pairs_batch(params, k: int) -> TokenBatch:
  rng = np.random.RandomState(12)

  def traj(turns):  # a trajectory of 1-2 turn rows, each ending in its action
    return [(rng.randint(1, CFG.vocab_size, 10), np.r_[np.zeros(6), np.ones(4)]) for _ in range(turns)]

  pairs = [(traj(2), traj(1)), (traj(1), traj(1)), (traj(1), traj(2))]
  batch = dpo_batch(pairs, micro_batches=k, pad_to=T, row_multiple=B)
  assert batch.tokens.shape[1] == T and batch.tokens.shape[0] % B == 0
  ref_logp, _ = LogpScorer(CFG, batch_size=B, pad_to=T)(params, batch.tokens, batch.positions, batch.valid)
  return batch.replace(ref_logp=ref_logp)


DPO = make_objective("dpo", beta=0.5, sft_coef=0.1)


def test_dpo_margin_increases(params):
  batch = dpo_pairs_batch(params, 2)
  step = train_step(CFG, DPO, "sgd", 2)
  margins, state = [], fresh_state(CFG, params, "sgd")
  for i in range(4):
    state, m = step(state, batch, jax.random.key(i))
    margins.append(float(m["margin"]))
    if i == 0:  # the policy is the reference at the first step
      np.testing.assert_allclose(m["dpo_loss"], np.log(2), rtol=1e-6)
  assert margins[0] == pytest.approx(0, abs=1e-6) and np.all(np.diff(margins) > 0)
  assert float(m["reward_accuracy"]) == 1.0 and float(m["nll"]) > 0


@pytest.mark.slow
def test_dpo_accumulation_keeps_pairs_whole(params):
  """A pair's rows split over micro-batches would change the loss; dpo_batch keeps them together."""
  results = []
  for k in (1, 2):
    state, m = train_step(CFG, DPO, "sgd", k)(fresh_state(CFG, params, "sgd"), dpo_pairs_batch(params, k),
                                               jax.random.key(0))
    results.append((grads_of(state), m))
  assert max_rel_diff(results[1][0], results[0][0]) < 2e-5
  for key in ("loss", "nll", "margin", "reward_accuracy"):
    np.testing.assert_allclose(results[1][1][key], results[0][1][key], rtol=1e-5, atol=1e-7)


def test_objective_registry_and_config_errors(params):
  assert make_objective("grpo").config.kl_coef > 0 and make_objective("ppo").config.vf_coef > 0
  assert make_objective("critic").config == ValueLossConfig(clip=0.5, agg="token_mean")
  with pytest.raises(ValueError, match="trains a critic but the model has no value head"):
    make_train_step(CFG, make_objective("critic"), _OPTIMIZERS["adam"])
  with pytest.raises(ValueError, match="ValueLossConfig.clip must be > 0"):
    ValueLossConfig(clip=0.0)
  tokens = np.ones((1, 2), np.int32)
  with pytest.raises(ValueError, match=r"values_only=True\) needs a model with a value head"):
    Transformer(CFG).apply({"params": params}, tokens, tokens, tokens > 0, values_only=True)
  with pytest.raises(ValueError, match="unknown objective 'reinforce'"):
    make_objective("reinforce")
  with pytest.raises(ValueError, match="agg must be one of"):
    PolicyGradientConfig(agg="sum")
  with pytest.raises(ValueError, match="needs total_steps"):
    OptimConfig(schedule="cosine", total_steps=0)


def test_bfloat16_compute_steps_float32_weights(params):
  """Mixed precision (ModelSource.dtype): a bfloat16-compute GRPO step keeps float32 weights and moments, moves them
  by an lr-sized step (1e-6 on weights ~1e-2 is below bfloat16's resolution: only float32 weights keep it), and its
  loss and gradient norm stay near the float32 step's."""
  objective = make_objective("grpo")
  opt = "adam_tiny"
  batch = pg_batch(12, params)
  half = CFG.replace(dtype="bfloat16")
  full_state, full_m = train_step(CFG, objective, opt, 1)(fresh_state(CFG, params, opt), batch, jax.random.key(0))
  state, m = train_step(half, objective, opt, 1)(fresh_state(half, params, opt), batch, jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state[1].mu))} == {jnp.dtype("float32")}
  moved = np.abs(np.asarray(state.params["lm_head"]) - np.asarray(params["lm_head"]))
  assert 0.5e-6 < moved.max() < 2e-6 and np.count_nonzero(moved) > 0.9 * moved.size
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(m[key], full_m[key], rtol=5e-2, err_msg=key)
