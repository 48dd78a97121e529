"""KV reuse across turns is exact: over a multi-turn conversation whose prompts extend, partly repeat or abandon what
each row's cache holds, the reusing sampler gives the tokens, lengths and stops of a sampler that prefills every prompt
whole, and log-probs equal to float32 rounding; for plain and copy-speculative decoding, greedy and sampled, alone,
with grouped prefill, and on a mesh. Also: it prefills only what the cache does not hold."""

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.models import init_params, tiny
from dreamjax.parallel import SAMPLE_RULES, MeshConfig, make_mesh
from dreamjax.sampling import KVReuse, Sampler, SpeculativeConfig, left_pad, sampling_params
from dreamjax.sampling.sampler import common_prefix

CFG = tiny("qwen2", vocab_size=300)
N = 12  # new tokens per turn
WIDTH = 64  # the prompt bucket
ROWS = 6


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0))


def next_prompts(rng, prompts, answers, turn):
  """Each row's next prompt, from its last prompt and answer, one kind of change per row:
  0, 1: the last prompt and answer, then new tokens (an append-only history: everything held is reused);
  2: the prompt's first half, then new tokens (a history that dropped a turn: a partial prefix);
  3: a fresh prompt (a new episode: nothing reused);
  4: exactly the last prompt (a retry of the same prompt: all but its last token reused);
  5: the last prompt, the answer, new tokens, alternating with a fresh short prompt."""
  out = []
  for r, (p, a) in enumerate(zip(prompts, answers)):
    new = list(rng.randint(3, 300, 4 + r))
    if r in (0, 1) or (r == 5 and turn % 2):
      q = list(p) + list(a) + new
    elif r == 2:
      q = list(p[:len(p) // 2]) + new
    elif r == 3:
      q = list(rng.randint(3, 300, 10 + turn))
    elif r == 4:
      q = list(p)
    else:
      q = new
    out.append(q[-WIDTH:] if len(q) > WIDTH else q)  # rows 0 and 1 would outgrow the bucket: their start drops
  return out


def conversation(params, sampler, reuse, temperature, turns=4, group=1, key=0, grouped_prefill=False):
  """Outputs of `turns` calls; prompts after the first come from `next_prompts` of the answers (two runs see the same
  prompts as long as their answers agree, which the caller checks). With `group` G > 1 the first prompts come in
  groups of G equal rows, prefilled once per group with `grouped_prefill`."""
  rng = np.random.RandomState(key)
  if group > 1:
    base = [list(rng.randint(3, 300, 8 + r)) for r in range(ROWS // group)]
    prompts = [base[r // group] for r in range(ROWS)]
  else:
    prompts = [list(rng.randint(3, 300, 8 + 3 * r)) for r in range(ROWS)]
  outs = []
  for turn in range(turns):
    tokens, mask = left_pad(prompts, ROWS, WIDTH, 0)
    budget = [N, N, 5, N, N, 0 if turn == 1 else N]  # row 5 skips a turn: its cache stays as it was
    sp = sampling_params(ROWS, budget, temperature=temperature, top_k=50, stop=[[7]])
    kw = {"reuse": reuse} if reuse is not None else {}
    out = jax.tree.map(np.asarray, sampler(params, tokens, mask, jax.random.key(100 * key + turn), sp,
                                           group=group if turn == 0 and grouped_prefill else 1, **kw))
    outs.append(out)
    answers = [out.tokens[r, :out.lengths[r]] for r in range(ROWS)]
    prompts = next_prompts(rng, prompts, answers, turn)
  return outs


def assert_same(got, want):
  for t, (a, b) in enumerate(zip(got, want)):
    for name in ("tokens", "lengths", "stopped"):
      np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"turn {t} {name}")
    np.testing.assert_allclose(a.logps, b.logps, rtol=1e-5, atol=1e-5, err_msg=f"turn {t}")


@pytest.mark.parametrize("draft_tokens", [0, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reuse_equals_full_prefill(params, draft_tokens, temperature):
  spec = SpeculativeConfig(draft_tokens=draft_tokens)
  full = Sampler(CFG, N, speculative=spec)
  reusing = Sampler(CFG, N, speculative=spec)
  reuse = KVReuse()
  got = conversation(params, reusing, reuse, temperature)
  assert_same(got, conversation(params, full, None, temperature))
  # Rows 0, 1 and 4 reuse nearly everything from turn 1 on, row 3 nothing: well under the whole prompts.
  assert 0 < reuse.prefilled < 0.6 * reuse.prompt_tokens
  assert reusing.compilations() <= 3  # prefill widths 16, 32, 64 at most for the one prompt bucket


def test_prefilled_tokens_are_what_the_cache_did_not_hold(params):
  sampler, reuse = Sampler(CFG, N), KVReuse()
  first = [list(range(3, 13)), list(range(20, 50))]
  tokens, mask = left_pad(first, 2, WIDTH, 0)
  sp = sampling_params(2, N, temperature=0.0)
  out = sampler(params, tokens, mask, jax.random.key(0), sp, reuse=reuse)
  assert (reuse.prompt_tokens, reuse.prefilled) == (40, 40)
  for r in range(2):  # the cache holds the prompt and the answer but its last token
    np.testing.assert_array_equal(reuse.held[r], np.concatenate([first[r], out.tokens[r, :out.lengths[r] - 1]]))
  # Row 0 continues its prompt and answer; row 1 repeats its first 5 tokens, then differs.
  second = [first[0] + list(out.tokens[0, :out.lengths[0]]) + [5, 6], first[1][:5] + [60, 61]]
  tokens, mask = left_pad(second, 2, WIDTH, 0)
  sampler(params, tokens, mask, jax.random.key(0), sp, reuse=reuse)
  assert reuse.prefilled - 40 == (1 + 2) + (len(second[1]) - 5)
  assert common_prefix(np.arange(5), np.arange(3)) == 3 and common_prefix(np.arange(3), np.asarray([0, 9])) == 1


def test_a_wider_bucket_or_another_batch_starts_an_empty_cache(params):
  sampler, reuse = Sampler(CFG, N), KVReuse()
  prompts = [list(range(3, 40)), list(range(50, 60))]
  sp = sampling_params(2, N, temperature=0.0)
  outs = []
  for width in (WIDTH, 2 * WIDTH, WIDTH):  # 64 -> 128 outgrows the cache; back to 64 keeps the larger cache
    tokens, mask = left_pad(prompts, 2, width, 0)
    outs.append(sampler(params, tokens, mask, jax.random.key(0), sp, reuse=reuse))
    assert reuse.cache.slots == (2 * WIDTH + N if width > WIDTH or len(outs) == 3 else WIDTH + N)
  ref = Sampler(CFG, N)(params, *left_pad(prompts, 2, WIDTH, 0), jax.random.key(0), sp)
  for out in outs:
    np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert reuse.prefilled == 47 + 47 + 2  # a full prefill, another after the growth, then only the last tokens
  tokens, mask = left_pad(prompts + prompts, 4, WIDTH, 0)
  sampler(params, tokens, mask, jax.random.key(0), sampling_params(4, N, temperature=0.0), reuse=reuse)
  assert len(reuse.held) == 4 and reuse.prefilled == 96 + 94


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_grouped_prefill_with_reuse(params, draft_tokens):
  spec = SpeculativeConfig(draft_tokens=draft_tokens)
  reusing, reuse = Sampler(CFG, N, speculative=spec), KVReuse()
  got = conversation(params, reusing, reuse, 1.0, turns=3, group=2, key=3, grouped_prefill=True)
  assert_same(got, conversation(params, Sampler(CFG, N, speculative=spec), None, 1.0, turns=3, group=2, key=3))
  assert reusing._reuse_fn._cache_size() >= 2  # the grouped prefill was compiled (turn 0), then the plain one


def test_on_a_mesh_equals_one_device(params):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  spec = SpeculativeConfig(draft_tokens=4)
  on_mesh = Sampler(CFG, N, mesh=mesh, rules=SAMPLE_RULES, speculative=spec)
  sharded = jax.device_put(params, on_mesh.param_shardings())
  got = conversation(sharded, on_mesh, KVReuse(), 1.0, turns=3, key=5)
  assert_same(got, conversation(params, Sampler(CFG, N, speculative=spec), KVReuse(), 1.0, turns=3, key=5))


def test_a_failed_call_leaves_no_deleted_cache(params):
  sampler, reuse = Sampler(CFG, N), KVReuse()
  tokens, mask = left_pad([[3, 4, 5]], 1, WIDTH, 0)
  sampler(params, tokens, mask, jax.random.key(0), sampling_params(1, N), reuse=reuse)
  with pytest.raises(flax.errors.ScopeParamNotFoundError):
    sampler({"wrong": jnp.zeros(1)}, tokens, mask, jax.random.key(0), sampling_params(1, N), reuse=reuse)
  assert reuse.cache is None  # the next call starts an empty cache instead of reading a donated buffer
  out = sampler(params, tokens, mask, jax.random.key(0), sampling_params(1, N, temperature=0.0), reuse=reuse)
  assert out.lengths[0] == N
