"""Our Flax port against transformers (torch, CPU) on tiny random Llama 3 and Qwen2 checkpoints, float32, 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.models import KVCache, Transformer, load_hf_checkpoint, save_hf_checkpoint
from tests import hf_fixtures

RTOL = 1e-5


def rel_err(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(0).randint(0, 256, (2, 40)).astype(np.int32)


def full_forward(cfg, params, tokens, mask=None):
  b, t = tokens.shape
  mask = np.ones((b, t), bool) if mask is None else mask
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  return Transformer(cfg).apply({"params": params}, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))


def test_full_forward_matches_transformers(hf_tiny, tokens):
  family, folder = hf_tiny
  cfg, params = load_hf_checkpoint(folder)
  assert cfg.family == family
  assert rel_err(full_forward(cfg, params, tokens).logits, hf_fixtures.hf_logits(folder, tokens)) < RTOL


def test_left_padded_forward_matches_transformers(hf_tiny, tokens):
  _, folder = hf_tiny
  cfg, params = load_hf_checkpoint(folder)
  mask = np.ones(tokens.shape, bool)
  mask[1, :7] = False
  ours = np.asarray(full_forward(cfg, params, tokens, mask).logits)
  ref = hf_fixtures.hf_logits(folder, tokens, mask.astype(np.int64))
  assert rel_err(ours[mask], ref[mask]) < RTOL


def test_prefill_then_cached_decode_matches_transformers(hf_tiny, tokens):
  _, folder = hf_tiny
  cfg, params = load_hf_checkpoint(folder)
  ref = hf_fixtures.hf_logits(folder, tokens)
  apply = jax.jit(Transformer(cfg).apply)  # cache_index is traced, so every decode step reuses one compilation
  b, t = tokens.shape
  prefill = 16
  key_valid = np.zeros((b, 64), bool)
  key_valid[:, :prefill] = True
  pos = np.broadcast_to(np.arange(t), (b, t))
  out = apply({"params": params}, tokens[:, :prefill], pos[:, :prefill], key_valid,
                    cache=KVCache.zeros(cfg, b, 64), cache_index=0)
  steps = [out.logits]
  cache = out.cache
  for i in range(prefill, t):
    key_valid[:, i] = True
    out = apply({"params": params}, tokens[:, i:i + 1], pos[:, i:i + 1], key_valid, cache=cache, cache_index=i)
    cache = out.cache
    steps.append(out.logits)
  assert rel_err(np.concatenate(steps, 1), ref) < RTOL


def test_export_round_trip_reloads_in_transformers(hf_tiny, tokens, tmp_path):
  _, folder = hf_tiny
  cfg, params = load_hf_checkpoint(folder)
  # A tiny shard limit forces several files plus the index, as real checkpoints have.
  save_hf_checkpoint(params, cfg, tmp_path, max_shard_bytes=40_000)
  assert (tmp_path / "model.safetensors.index.json").is_file()
  np.testing.assert_array_equal(hf_fixtures.hf_logits(tmp_path, tokens), hf_fixtures.hf_logits(folder, tokens))
  cfg2, params2 = load_hf_checkpoint(tmp_path)
  assert cfg2 == cfg
  np.testing.assert_array_equal(full_forward(cfg2, params2, tokens).logits, full_forward(cfg, params, tokens).logits)
