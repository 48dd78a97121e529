"""The jitted sampler: exactness of greedy and log-probs, padding, stop sequences, budgets, keys, recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.models import Transformer, init_params, tiny
from dreamjax.sampling import Sampler, left_pad, sampling_params, truncation_mask
from dreamjax.sampling.logits import _inverse_cdf

CFG = tiny("qwen2", vocab_size=300)
N = 10


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CFG, max_new_tokens=N, pad_id=0)


def prompts(pad_side):
  """Four prompts of lengths 9, 5, 7, 1 in a [4, 9] array, padded on one side."""
  rng = np.random.RandomState(0)
  lengths = [9, 5, 7, 1]
  tokens = np.zeros((4, 9), np.int32)
  mask = np.zeros((4, 9), bool)
  for i, n in enumerate(lengths):
    row = rng.randint(3, CFG.vocab_size, n)
    cols = slice(0, n) if pad_side == "right" else slice(9 - n, 9)
    tokens[i, cols], mask[i, cols] = row, True
  return tokens, mask, [tokens[i][mask[i]] for i in range(4)]


@jax.jit
def _last_logits(params, seq, length):
  """Logits after the first `length` tokens of a fixed-shape buffer (one compilation for every length)."""
  valid = jnp.arange(seq.shape[1])[None] < length
  logits = Transformer(CFG).apply({"params": params}, seq, jnp.arange(seq.shape[1])[None], valid).logits
  return logits[0, length - 1]


def reference_continuation(params, prompt, n, temperature=1.0):
  """Greedy tokens by repeated full forwards, and the log-probs of those tokens at `temperature`."""
  seq = np.zeros((1, len(prompt) + n), np.int32)
  seq[0, :len(prompt)] = prompt
  logps = []
  for i in range(len(prompt), len(prompt) + n):
    logits = _last_logits(params, seq, i)
    seq[0, i] = int(jnp.argmax(logits))
    logps.append(float(jax.nn.log_softmax(logits / temperature)[seq[0, i]]))
  return list(seq[0, len(prompt):]), logps


@pytest.fixture(scope="module")
def greedy_reference(params):
  return [reference_continuation(params, row, N) for row in prompts("right")[2]]


def test_greedy_equals_argmax_of_full_forward(params, sampler, greedy_reference):
  tokens, mask, _ = prompts("right")
  out = sampler(params, tokens, mask, jax.random.key(0), sampling_params(4, N, temperature=0.0))
  for i, (ref, ref_logps) in enumerate(greedy_reference):
    assert list(np.asarray(out.tokens[i])) == ref
    np.testing.assert_allclose(out.logps[i], ref_logps, rtol=1e-5, atol=1e-5)
  assert list(np.asarray(out.lengths)) == [N] * 4 and not np.any(out.stopped)


def test_left_and_right_padding_give_identical_samples(params, sampler):
  sp = sampling_params(4, N, temperature=1.0, top_p=0.9)
  a = sampler(params, *prompts("left")[:2], jax.random.key(3), sp)
  b = sampler(params, *prompts("right")[:2], jax.random.key(3), sp)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logps, b.logps, rtol=1e-6)


def test_same_key_same_output_and_keys_matter(params, sampler):
  tokens, mask, _ = prompts("left")
  sp = sampling_params(4, N, temperature=1.0)
  a = sampler(params, tokens, mask, jax.random.key(7), sp)
  b = sampler(params, tokens, mask, jax.random.key(7), sp)
  c = sampler(params, tokens, mask, jax.random.key(8), sp)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


def test_a_row_does_not_depend_on_its_neighbours(params, sampler):
  tokens, mask, _ = prompts("left")
  keys = jax.random.split(jax.random.key(5), 4)
  sp = sampling_params(4, N, temperature=1.0, top_k=20)
  a = sampler(params, tokens, mask, keys, sp)
  other = tokens.copy()
  other[1:] = np.roll(other[1:], 1, axis=1)
  b = sampler(params, other, mask, keys, sp)
  np.testing.assert_array_equal(a.tokens[0], b.tokens[0])


def test_per_row_stop_sequences_and_budgets(params, sampler, greedy_reference):
  tokens, mask, _ = prompts("left")
  greedy = [tokens for tokens, _ in greedy_reference]
  # Row 0 stops on the pair it emits at steps 3-4, row 1 on a token it never emits, row 2 on its first token;
  # row 3 has no stop but a budget of 4 tokens.
  stop = [[greedy[0][3:5]], [[CFG.vocab_size - 1]], [greedy[2][:1]], []]
  sp = sampling_params(4, [N, N, N, 4], temperature=0.0, stop=stop)
  out = sampler(params, tokens, mask, jax.random.key(0), sp)
  assert list(np.asarray(out.lengths)) == [5, N, 1, 4]
  assert list(np.asarray(out.stopped)) == [True, False, True, False]
  for i, n in enumerate([5, N, 1, 4]):
    assert list(np.asarray(out.tokens[i, :n])) == greedy[i][:n]
    assert np.all(out.tokens[i, n:] == 0) and np.all(out.logps[i, n:] == 0)


def test_sampled_logps_match_the_model_at_the_temperature(params, sampler):
  tokens, mask, rows = prompts("right")
  out = sampler(params, tokens, mask, jax.random.key(1), sampling_params(4, N, temperature=0.7, top_p=0.8))
  apply = jax.jit(Transformer(CFG).apply)
  for i, row in enumerate(rows):
    seq = np.concatenate([row, np.asarray(out.tokens[i])])[None]
    logits = apply({"params": params}, seq, np.arange(seq.shape[1])[None], np.ones_like(seq, bool)).logits[0]
    logp = jax.nn.log_softmax(logits[len(row) - 1:-1] / 0.7)
    expected = np.take_along_axis(np.asarray(logp), np.asarray(out.tokens[i])[:, None], -1)[:, 0]
    np.testing.assert_allclose(out.logps[i], expected, rtol=1e-5, atol=1e-5)


def test_no_recompilation_across_settings_prompts_and_keys(params):
  sampler = Sampler(CFG, max_new_tokens=N, pad_id=0)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *_, **__: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
  tokens, mask, _ = prompts("left")
  settings = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.5), dict(temperature=0.3, top_k=5),
              dict(temperature=[0.0, 1.0, 2.0, 0.5], max_new_tokens=[1, 2, 3, 4])]
  for i, kw in enumerate(settings):
    budget = kw.pop("max_new_tokens", N)
    sampler(params, tokens + i, mask, jax.random.key(i), sampling_params(4, budget, stop=[[5, 6]], **kw))
  sampler(params, *prompts("right")[:2], jax.random.key(9), sampling_params(4, N, stop=[[5, 6]]))
  numpy_leaves = sampling_params(4, N, stop=[[5, 6]]).replace(stop=np.full((4, 1, 2), -1, np.int32))
  sampler(params, tokens, mask, jax.random.key(10), numpy_leaves)
  assert sampler.compilations() == 1
  first = len(compiles)
  sampler(params, tokens, mask, jax.random.key(11), sampling_params(4, N, top_p=0.1, stop=[[7, 8]]))
  assert len(compiles) == first  # no backend compilation at all on a further call


def sorted_reference_mask(logp, top_p, top_k):
  """Top-p and top-k the textbook way: sort, cumulative sum, cut."""
  order = np.argsort(-logp, kind="stable")
  probs = np.exp(logp[order])
  keep_sorted = np.ones_like(probs, bool)
  if top_p < 1:
    before = np.cumsum(probs) - probs  # mass of strictly more likely tokens
    keep_sorted &= before < top_p
  if top_k > 0:
    keep_sorted[top_k:] = False
  mask = np.zeros_like(keep_sorted)
  mask[order] = keep_sorted
  return mask


def test_truncation_matches_a_sorted_reference():
  rng = np.random.RandomState(0)
  logits = rng.randn(6, 1000).astype(np.float32) * np.array([[0.1], [1], [3], [8], [1], [2]], np.float32)
  logp = np.asarray(jax.nn.log_softmax(logits))
  top_p = np.array([0.9, 0.5, 0.99, 0.3, 1.0, 0.7], np.float32)
  top_k = np.array([0, 0, 17, 0, 40, 3], np.int32)
  got = np.asarray(jax.jit(truncation_mask)(logp, top_p, top_k))
  for i in range(6):
    np.testing.assert_array_equal(got[i], sorted_reference_mask(logp[i], top_p[i], top_k[i]), err_msg=f"row {i}")


def test_inverse_cdf_draws_follow_the_weights():
  weights = np.zeros((1, 300), np.float32)
  weights[0, [0, 127, 128, 299]] = [0.1, 0.2, 0.3, 0.4]
  u = jax.random.uniform(jax.random.key(0), (20000,))
  draws = np.asarray(jax.jit(jax.vmap(lambda x: _inverse_cdf(jnp.asarray(weights), x[None])[0]))(u))
  assert set(np.unique(draws)) == {0, 127, 128, 299}
  freq = np.array([np.mean(draws == i) for i in (0, 127, 128, 299)])
  np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.015)
  edge = np.asarray(_inverse_cdf(jnp.asarray(weights), jnp.asarray([0.0, 0.9999999])))
  assert list(edge) == [0, 299]


def test_left_pad_aligns_prompts_right_and_gives_missing_rows_a_dummy():
  tokens, mask = left_pad({0: [5, 6, 7], 2: [9]}, rows=3, width=4, pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 0], [0, 0, 0, 9]])
  np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])
  assert tokens.dtype == np.int32 and mask.dtype == bool
  same, _ = left_pad([[5, 6, 7], [1, 2]], rows=2, width=3, pad_id=0)
  np.testing.assert_array_equal(same, [[5, 6, 7], [0, 1, 2]])
