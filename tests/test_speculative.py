"""Copy-speculative (prompt-lookup) decoding is exact: greedy tokens equal plain decoding's, log-probs equal a full
forward's, and sampled tokens follow the model's distribution (chi-square against the enumerated distribution, with
deliberately wrong acceptance rules shown to fail the same test). Also: the drafting rule, statistics, compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dreamjax.models import Transformer, init_params, tiny
from dreamjax.parallel import SAMPLE_RULES, MeshConfig, make_mesh
from dreamjax.sampling import Sampler, SpeculativeConfig, prompt_lookup, sampling_params, verify_draft
from dreamjax.sampling import sampler as sampler_module

CFG = tiny("qwen2", vocab_size=300)
N = 24
K = 4


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def plain():
  return Sampler(CFG, max_new_tokens=N, pad_id=0)


@pytest.fixture(scope="module")
def spec():
  return Sampler(CFG, max_new_tokens=N, pad_id=0, speculative=SpeculativeConfig(draft_tokens=K))


def prompts():
  """Six rows of width 24, mixed padding sides: repeated text (drafts hit from the prompt), random text (they miss
  until the random model starts repeating itself), a 1-token prompt."""
  rng = np.random.RandomState(0)
  rows = [np.tile(rng.randint(3, 300, 8), 3), rng.randint(3, 300, 20), np.tile(rng.randint(3, 300, 3), 6),
          rng.randint(3, 300, 5), rng.randint(3, 300, 1), np.tile(rng.randint(3, 300, 5), 4)]
  tokens, mask = np.zeros((6, 24), np.int32), np.zeros((6, 24), bool)
  for i, r in enumerate(rows):
    cols = slice(0, len(r)) if i % 2 else slice(24 - len(r), 24)
    tokens[i, cols], mask[i, cols] = r, True
  return tokens, mask, rows


def params6(max_new_tokens, **kw):
  """`sampling_params` for the six rows, stop sequences widened to one shape ([6, 2, 10], -1 is a wildcard and an
  all -1 sequence none), so each sampler here compiles once for all its calls."""
  sp = sampling_params(6, max_new_tokens, **kw)
  _, n, width = sp.stop.shape
  return sp.replace(stop=jnp.pad(sp.stop, ((0, 0), (0, 2 - n), (10 - width, 0)), constant_values=-1))


def test_prompt_lookup_longest_then_latest_match_with_periodic_continuation():
  seq = jnp.asarray([
      [9, 1, 2, 7, 8, 5, 2, 6, 6, 1, 2],  # [1 2] after slot 1 (2-gram) beats the later [2] at slot 6 (1-gram)
      [9, 3, 4, 3, 4, 0, 3, 4, 0, 0, 0],  # [3 4] ends at slots 2 and 4: the latest, 3 before the end, period 3
      [5, 6, 7, 8, 9, 1, 0, 0, 0, 0, 0],  # no earlier 1 (or 9 1): no draft
      [4, 2, 4, 2, 3, 9, 4, 2, 0, 0, 0],  # slot 0 is padding: the 4 there must not match
  ], jnp.int32)
  valid = np.ones(seq.shape, bool)
  valid[1, 8:] = valid[2, 6:] = valid[3, :1] = valid[3, 8:] = False
  end = jnp.asarray([10, 7, 5, 7])
  draft, found = prompt_lookup(seq, jnp.asarray(valid), end, 5, max_ngram=3)
  np.testing.assert_array_equal(found, [True, True, False, True])
  np.testing.assert_array_equal(draft[0], [7, 8, 5, 2, 6])
  np.testing.assert_array_equal(draft[1], [0, 3, 4, 0, 3])  # seq[5:8] repeated
  np.testing.assert_array_equal(draft[3], [3, 9, 4, 2, 3])  # [4 2] at slots 2-3 (longest, latest): 3 9 4 2, period 4
  _, found = prompt_lookup(seq, jnp.asarray(valid), end, 5, max_ngram=3, min_ngram=3)
  np.testing.assert_array_equal(found, [False, False, False, False])  # no 3-gram occurs twice


def test_greedy_equals_plain_decoding_token_for_token(params, plain, spec):
  tokens, mask, _ = prompts()
  ref = plain(params, tokens, mask, jax.random.key(0), params6(N, temperature=0.0))
  ref_tokens = np.asarray(ref.tokens)
  # Rows 0 and 2 stop on sequences first completed inside their repeating stretch, and row 3 runs out of budget
  # there: each lands inside a verify step whose later tokens were accepted too, which must not be emitted.
  stop = [[list(ref_tokens[0, 3:13])], [[CFG.vocab_size - 1]], [list(ref_tokens[2, 11:14])], [], [[3]], []]
  budgets = [N, 10, N, 17, N, 15]
  sp = params6(budgets, temperature=0.0, stop=stop)
  a, b = plain(params, tokens, mask, jax.random.key(0), sp), spec(params, tokens, mask, jax.random.key(0), sp)
  np.testing.assert_array_equal(b.tokens, a.tokens)
  np.testing.assert_array_equal(b.lengths, a.lengths)
  np.testing.assert_array_equal(b.stopped, a.stopped)
  np.testing.assert_allclose(b.logps, a.logps, rtol=1e-5, atol=1e-5)
  lengths, forwards, accepted = (np.asarray(x) for x in (b.lengths, b.forwards, b.draft_accepted))
  assert list(lengths) == [13, 10, 14, 17, N, 15] and list(np.asarray(b.stopped)) == [1, 0, 1, 0, 0, 0]
  assert accepted.sum() >= 20 and accepted[[0, 4, 5]].min() >= 5  # drafts hit
  assert forwards[1] >= 8  # and miss: the random prompt's row decodes nearly token by token
  # Each forward yields at most K + 1 tokens, and at least one (a step cut short ends on an accepted draft).
  assert np.all(lengths <= forwards + accepted) and np.all(lengths >= forwards + accepted - 1)
  assert np.all(lengths <= forwards * (K + 1))
  cut = lengths == forwards + accepted - 1
  assert cut[0] and cut[2] and cut[3]  # stops and a budget cut accepted drafts short
  assert 1 < b.speculation_stats()["tokens_per_forward"] <= K + 1


def test_logps_equal_a_full_forward_at_the_temperature(params, spec):
  tokens, mask, rows = prompts()
  out = spec(params, tokens, mask, jax.random.key(1), params6(N, temperature=0.7, top_k=20, top_p=0.95))
  assert int(np.sum(out.draft_accepted)) > 0
  # One full forward (no cache) over each prompt and its output, right-padded to one shape.
  width = 24 + N
  seq, valid = np.zeros((6, width), np.int32), np.zeros((6, width), bool)
  for i, row in enumerate(rows):
    seq[i, :len(row) + N] = np.concatenate([row, np.asarray(out.tokens[i])])
    valid[i, :len(row) + int(out.lengths[i])] = True
  logits = Transformer(CFG).apply({"params": params}, seq, np.broadcast_to(np.arange(width), seq.shape), valid).logits
  logp = np.asarray(jax.nn.log_softmax(logits / 0.7))
  for i, row in enumerate(rows):
    n = int(out.lengths[i])
    expected = np.take_along_axis(logp[i, len(row) - 1:len(row) - 1 + n], seq[i, len(row):len(row) + n, None], -1)
    np.testing.assert_allclose(out.logps[i, :n], expected[:, 0], rtol=1e-5, atol=1e-5)


def test_k0_is_plain_decoding_and_settings_never_recompile(params, plain, spec):
  tokens, mask, _ = prompts()
  off = Sampler(CFG, max_new_tokens=N, pad_id=0, speculative=SpeculativeConfig(draft_tokens=0))
  sp = params6([N, 3, N, 7, N, 0], temperature=[0.0, 1.0, 0.7, 1.3, 1.0, 1.0], top_p=0.9, stop=[[5]])
  a, b = plain(params, tokens, mask, jax.random.key(4), sp), off(params, tokens, mask, jax.random.key(4), sp)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(b.forwards, b.lengths)
  assert not np.any(b.draft_accepted) and b.speculation_stats()["tokens_per_forward"] == 1.0

  settings = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.5), dict(temperature=0.3, top_k=5),
              dict(temperature=[0.0, 1.0, 2.0, 0.5, 0.0, 1.0], max_new_tokens=[1, 2, 3, 4, 0, N])]
  for i, kw in enumerate(settings):
    budget = kw.pop("max_new_tokens", N)
    spec(params, tokens + i, mask, jax.random.key(i), params6(budget, stop=[[5, 6], [7]], **kw))
  assert spec.compilations() == 1 and plain.compilations() == 1  # every test here shares the one shape


def test_a_row_does_not_depend_on_its_neighbours_and_starts_like_plain(params, plain, spec):
  tokens, mask, _ = prompts()
  keys = jax.random.split(jax.random.key(5), 6)
  sp = params6(N, temperature=1.0, top_k=20)
  a = spec(params, tokens, mask, keys, sp)
  other = tokens.copy()
  other[1:] = np.roll(other[1:], 1, axis=0)
  b = spec(params, other, mask[[0, 5, 1, 2, 3, 4]], keys, sp)
  np.testing.assert_array_equal(a.tokens[0], b.tokens[0])
  # The first token comes from the prefill with plain decoding's uniform: the same token for the same key.
  np.testing.assert_array_equal(a.tokens[:, 0], plain(params, tokens, mask, keys, sp).tokens[:, 0])


def test_on_a_mesh_equals_one_device(params, spec):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  tokens, mask, _ = prompts()
  sp = params6(N, temperature=[0.0, 0.0, 0.0, 1.0, 1.0, 0.7], top_p=0.9, stop=[[7]])
  ref = spec(params, tokens, mask, jax.random.key(2), sp)
  on_mesh = Sampler(CFG, N, mesh=mesh, rules=SAMPLE_RULES, speculative=spec.speculative)
  out = on_mesh(jax.device_put(params, on_mesh.param_shardings()), tokens, mask, jax.random.key(2), sp)
  for name in ("tokens", "lengths", "forwards", "draft_accepted"):
    np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
  np.testing.assert_allclose(out.logps, ref.logps, rtol=1e-5, atol=1e-5)


# --- The sampled distribution, on a 16-token vocabulary where every continuation can be enumerated. ---

SMALL = tiny("llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
ROWS, STEPS, TEMPERATURE, TOP_K = 4096, 3, 0.05, 6
# Every id occurs in the prompt, so every step has a draft; its 2-grams repeat, so some drafts are likely tokens.
PROMPT = [3, 9, 1, 12, 7, 0, 15, 4, 3, 9, 11, 2, 14, 6, 10, 5, 8, 13, 1, 12]


def _wrong_rules(logits, draft, has_draft, u_accept, u_sample, *rest):
  """Two wrong acceptance rules in one sampler (one compilation), each on half of the batch. First half: every draft
  token accepted. Second half: accepted with probability p(d), but a rejection draws from p itself, not from p with
  the draft removed (a subtle bug that over-weights the draft)."""
  tokens, logps, accepted = verify_draft(logits, draft, has_draft, u_accept, u_sample, *rest)
  fresh, _, _ = verify_draft(logits, draft, jnp.zeros_like(has_draft), u_accept, u_sample, *rest)
  first = (jnp.arange(logits.shape[0]) < logits.shape[0] // 2)[:, None]
  tokens = jnp.where(first, jnp.where(has_draft, draft, tokens), jnp.where(accepted, draft, fresh))
  return tokens, logps, jnp.where(first, has_draft, accepted)


def exact_distribution(params) -> np.ndarray:
  """P(x1, x2, x3) under temperature and top-k, from full forwards over all 256 two-token continuations."""
  v = SMALL.vocab_size
  x1, x2 = np.divmod(np.arange(v * v), v)
  seq = np.concatenate([np.tile(PROMPT, (v * v, 1)), x1[:, None], x2[:, None]], 1).astype(np.int32)
  apply = jax.jit(Transformer(SMALL).apply)
  logits = apply({"params": params}, seq, np.broadcast_to(np.arange(seq.shape[1]), seq.shape),
                 np.ones(seq.shape, bool)).logits[:, len(PROMPT) - 1:]
  logits = np.asarray(logits, np.float64) / TEMPERATURE
  kth = -np.sort(-logits, -1)[..., TOP_K - 1:TOP_K]
  p = np.where(logits >= kth, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
  p /= p.sum(-1, keepdims=True)  # [v*v, 3, v]: position j's distribution given PROMPT + (x1, x2)[:j]
  p1, p2, p3 = p[0, 0], p[::v, 1], p[:, 2].reshape(v, v, v)
  return p1[:, None, None] * p2[:, :, None] * p3


def chi_square(samples: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
  """Pearson's statistic and p-value for samples [R, 3] against the joint, cells expected < 5 times pooled."""
  v = SMALL.vocab_size
  observed = np.bincount((samples[:, 0] * v + samples[:, 1]) * v + samples[:, 2], minlength=v**3).astype(float)
  expected = probs.reshape(-1) * len(samples)
  small = expected < 5
  obs = np.append(observed[~small], observed[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  stat = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
  return stat, float(stats.chi2.sf(stat, len(obs) - 1))


@pytest.fixture(scope="module")
def small_params():
  return init_params(SMALL, jax.random.key(3))


def draw(params, sampler, rows=ROWS) -> tuple[np.ndarray, dict]:
  tokens = np.tile(np.asarray(PROMPT, np.int32), (rows, 1))
  sp = sampling_params(rows, STEPS, temperature=TEMPERATURE, top_k=TOP_K)
  out = sampler(params, tokens, np.ones_like(tokens, bool), jax.random.key(11), sp)
  assert np.all(np.asarray(out.lengths) == STEPS)
  return np.asarray(out.tokens), out.speculation_stats()


def test_sampled_distribution_is_exact_and_the_test_detects_wrong_rules(small_params, monkeypatch):
  probs = exact_distribution(small_params)
  # A spread-out distribution: the test means something only if several continuations are likely.
  assert (probs > 5 / ROWS).sum() > 50
  spec = SpeculativeConfig(draft_tokens=2)
  results = {"plain": draw(small_params, Sampler(SMALL, STEPS)),
             "speculative": draw(small_params, Sampler(SMALL, STEPS, speculative=spec))}
  monkeypatch.setattr(sampler_module, "verify_draft", _wrong_rules)  # traced into the new sampler's jit
  wrong, _ = draw(small_params, Sampler(SMALL, STEPS, speculative=spec), rows=2 * ROWS)
  results["always accept"], results["resample from p"] = (wrong[:ROWS], None), (wrong[ROWS:], None)
  chi2 = {name: chi_square(samples, probs) for name, (samples, _) in results.items()}
  assert chi2["plain"][1] > 1e-3 and chi2["speculative"][1] > 1e-3, chi2
  assert chi2["always accept"][1] < 1e-9 and chi2["resample from p"][1] < 1e-9, chi2
  # Drafts were checked and accepted often enough for the rule to matter.
  assert results["speculative"][1]["accepted_per_step"] > 0.1
