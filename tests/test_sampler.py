"""The jitted sampler: exactness of greedy and log-probs, padding, stop sequences, budgets, keys, recompilation, and
sampling within choices (the distribution, the log-probs, KV reuse, a mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.models import Transformer, init_params, tiny
from dreamjax.parallel import SAMPLE_RULES, MeshConfig, make_mesh
from dreamjax.sampling import KVReuse, Sampler, SpeculativeConfig, left_pad, sampling_params, truncation_mask
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


# Choices: each row may only produce one of a few whole token sequences (the engine's admissible actions).
STOP = 2
CHOICES = [[[11, 12, STOP], [11, 13, STOP], [14, STOP, -1]],  # two share a first token
           [[20, STOP, -1], [-1, -1, -1], [-1, -1, -1]],  # one choice only
           [[-1, -1, -1]] * 3,  # not limited
           [[30, 31, 32], [30, 33, STOP], [-1, -1, -1]]]  # one choice runs past the budget of 3


def _choices(rows=CHOICES, width=N):
  out = np.full((len(rows), 4, width), -1, np.int32)
  for r, row in enumerate(rows):
    for i, choice in enumerate(row):
      out[r, i, :len(choice)] = choice
  return out


def test_choices_limit_each_row_and_leave_the_others_alone(params, sampler):
  tokens, mask, _ = prompts("left")
  free = sampler(params, tokens, mask, jax.random.key(4), sampling_params(4, [N, N, N, 3], stop=[[STOP]]))
  seen = [set() for _ in range(4)]
  for seed in range(12):
    key = jax.random.key(seed)
    out = sampler(params, tokens, mask, key, sampling_params(4, [N, N, N, 3], stop=[[STOP]]), choices=_choices())
    for r in (0, 1, 3):
      got = list(np.asarray(out.tokens[r, :out.lengths[r]]))
      assert got in [[t for t in c if t >= 0] for c in CHOICES[r] if c[0] >= 0], (r, got)
      seen[r].add(tuple(got))
    assert out.stopped[0] and out.stopped[1]
    if seed == 4:  # the unlimited row is the plain call's, token for token
      np.testing.assert_array_equal(out.tokens[2], free.tokens[2])
      np.testing.assert_allclose(out.logps[2], free.logps[2], rtol=1e-6)
  assert len(seen[0]) == 3 and len(seen[3]) == 2  # every choice is reachable


def test_choices_log_probs_are_renormalised_and_greedy_takes_the_best_allowed_token(params, sampler):
  """A token's recorded log-prob is the model's (at the row's temperature) renormalised over the tokens the choices
  the row still matched allowed there: the distribution it was drawn from; 0 where only one token was allowed."""
  tokens, mask, rows = prompts("right")
  out = sampler(params, tokens, mask, jax.random.key(0), sampling_params(4, N, temperature=0.7, stop=[[STOP]]),
                choices=_choices())
  greedy = sampler(params, tokens, mask, jax.random.key(0), sampling_params(4, N, temperature=0.0, stop=[[STOP]]),
                   choices=_choices())
  apply = jax.jit(Transformer(CFG).apply)
  for i in (0, 1, 3):
    n = int(out.lengths[i])
    drawn = list(np.asarray(out.tokens[i, :n]))
    seq = np.concatenate([rows[i], drawn])[None]
    logits = apply({"params": params}, seq, np.arange(seq.shape[1])[None], np.ones_like(seq, bool)).logits[0]
    logp = np.asarray(jax.nn.log_softmax(logits[len(rows[i]) - 1:-1] / 0.7))
    for j, token in enumerate(drawn):
      allowed = sorted({c[j] for c in CHOICES[i] if len(c) > j and c[j] >= 0 and list(c[:j]) == drawn[:j]})
      want = logp[j, token] - np.log(np.exp(logp[j, allowed]).sum())
      np.testing.assert_allclose(out.logps[i, j], want, rtol=1e-5, atol=1e-5, err_msg=f"row {i} token {j}")
  assert abs(float(out.logps[1, 0])) < 1e-6  # row 1 has one choice: every token of it is certain
  # Greedy row 0: the first token is whichever of 11 and 14 the model prefers; after 11, the better of 12 and 13.
  first = _last_logits(params, np.pad(rows[0], (0, N))[None], len(rows[0]))
  want = [11 if first[11] > first[14] else 14]
  if want[0] == 11:
    seq = np.pad(np.append(rows[0], 11), (0, N))[None]
    second = _last_logits(params, seq, len(rows[0]) + 1)
    want.append(12 if second[12] > second[13] else 13)
  assert list(np.asarray(greedy.tokens[0, :greedy.lengths[0]])) == want + [STOP]


def test_choices_are_drawn_with_the_renormalised_model_probabilities(params):
  """Row 0's three choices, sampled 4000 times: each one's frequency is the product, over its tokens, of the model's
  probability renormalised over the tokens the still-matching choices allow."""
  rows, n = 4000, 3
  prompt = prompts("right")[2][0]
  sampler = Sampler(CFG, max_new_tokens=n, pad_id=0)
  tokens = np.tile(prompt, (rows, 1)).astype(np.int32)
  choices = np.tile(_choices(CHOICES[:1], n), (rows, 1, 1))
  out = sampler(params, tokens, np.ones_like(tokens, bool), jax.random.key(1), sampling_params(rows, n, stop=[[STOP]]),
                choices=choices)
  got = [tuple(np.asarray(out.tokens[r, :out.lengths[r]])) for r in range(rows)]
  p0 = np.exp(np.asarray(jax.nn.log_softmax(_last_logits(params, np.pad(prompt, (0, n))[None], len(prompt)))))
  after = _last_logits(params, np.pad(np.append(prompt, 11), (0, n))[None], len(prompt) + 1)
  p1 = np.exp(np.asarray(jax.nn.log_softmax(after)))
  first = p0[11] / (p0[11] + p0[14])
  want = {(11, 12, STOP): first * p1[12] / (p1[12] + p1[13]), (11, 13, STOP): first * p1[13] / (p1[12] + p1[13]),
          (14, STOP): 1 - first}
  for choice, p in want.items():
    freq = got.count(choice) / rows
    assert abs(freq - p) < 4 * np.sqrt(p * (1 - p) / rows) + 1e-3, (choice, freq, p)


def test_choices_with_kv_reuse_equal_the_plain_call_and_speculation_refuses_them(params, sampler):
  tokens, mask, _ = prompts("left")
  sp = sampling_params(4, [N, N, N, 3], stop=[[STOP]])
  plain = sampler(params, tokens, mask, jax.random.key(2), sp, choices=_choices())
  reused = sampler(params, tokens, mask, jax.random.key(2), sp, choices=_choices(), reuse=KVReuse())
  np.testing.assert_array_equal(np.asarray(reused.tokens), np.asarray(plain.tokens))
  np.testing.assert_allclose(reused.logps, plain.logps, rtol=1e-5, atol=1e-5)
  spec = Sampler(CFG, max_new_tokens=N, pad_id=0, speculative=SpeculativeConfig(draft_tokens=2))
  with pytest.raises(ValueError, match="choices need plain decoding"):
    spec(params, tokens, mask, jax.random.key(2), sp, choices=_choices())
  with pytest.raises(ValueError, match="choices must be"):
    sampler(params, tokens, mask, jax.random.key(2), sp, choices=_choices()[:2])


def test_choices_on_a_mesh_equal_one_device(params, sampler):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  on_mesh = Sampler(CFG, max_new_tokens=N, pad_id=0, mesh=mesh, rules=SAMPLE_RULES)
  sharded = jax.device_put(params, on_mesh.param_shardings())
  tokens, mask, _ = prompts("left")
  sp = sampling_params(4, [N, N, N, 3], stop=[[STOP]])
  want = sampler(params, tokens, mask, jax.random.key(6), sp, choices=_choices())
  for reuse in (None, KVReuse()):
    got = on_mesh(sharded, tokens, mask, jax.random.key(6), sp, choices=_choices(), reuse=reuse)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logps), np.asarray(want.logps), rtol=1e-5, atol=1e-5)
