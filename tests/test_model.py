"""Model features beyond HF parity: bf16 compute, value head, rematerialisation, config round trips and errors."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.models import (Transformer, from_hf_config, init_params, load_hf_checkpoint, load_hf_config,
                             save_hf_checkpoint, tiny, to_hf_config)
from dreamjax.models.config import RopeScaling
from dreamjax.models.transformer import KVCache

TOKENS = np.random.RandomState(0).randint(0, 256, (2, 16)).astype(np.int32)
POS = np.broadcast_to(np.arange(16), (2, 16))
VALID = np.ones((2, 16), bool)


def forward(cfg, params):
  return jax.jit(Transformer(cfg).apply)({"params": params}, TOKENS, POS, VALID)


def test_bfloat16_compute_stays_close_to_float32():
  cfg = tiny("llama")
  params = init_params(cfg, jax.random.key(0))
  ref = forward(cfg, params).logits
  out = forward(cfg.replace(dtype="bfloat16"), params).logits
  assert out.dtype == jnp.float32  # logits are always float32
  assert float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))) < 3e-2


def test_value_head_outputs_and_survives_export(tmp_path):
  cfg = tiny("qwen2", value_head=True)
  params = init_params(cfg, jax.random.key(0))
  params["value_head"] = jax.random.normal(jax.random.key(1), params["value_head"].shape)
  values = forward(cfg, params).values
  assert values.shape == (2, 16) and values.dtype == jnp.float32 and float(jnp.std(values)) > 0
  save_hf_checkpoint(params, cfg, tmp_path)
  _, reloaded = load_hf_checkpoint(tmp_path, value_head=True)
  np.testing.assert_array_equal(reloaded["value_head"], params["value_head"])
  (tmp_path / "value_head.safetensors").unlink()
  _, plain = load_hf_checkpoint(tmp_path, value_head=True)  # an LM-only checkpoint gets a zero critic head
  assert not np.any(np.asarray(plain["value_head"]))


def test_remat_gives_the_same_gradients():
  cfg = tiny("llama")
  params = init_params(cfg, jax.random.key(0))

  def grads(c):
    loss = lambda p: jnp.mean(Transformer(c).apply({"params": p}, TOKENS, POS, VALID).logits ** 2)
    return jax.jit(jax.grad(loss))(params)

  ref = grads(cfg)
  for policy in ("full", "dots"):
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(grads(cfg.replace(remat=policy)))):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_attention_in_query_blocks_gives_the_same_outputs_gradients_and_cache():
  """16 tokens in blocks of 5 (the last block padded), against one block: logits and gradients, and a cached forward
  of 7 new tokens after 9 (blocks read keys up to their own slots, past the cache index)."""
  cfg = tiny("qwen2")
  params = init_params(cfg, jax.random.key(0))
  left_padded = VALID.copy()
  left_padded[1, :4] = False
  whole, blocks = cfg.replace(attention_chunk=0), cfg.replace(attention_chunk=5)

  def loss(c, p):
    return jnp.mean(Transformer(c).apply({"params": p}, TOKENS, POS, left_padded).logits ** 2)

  for c in (whole, blocks):
    np.testing.assert_allclose(forward(c, params).logits, forward(whole, params).logits, rtol=1e-5, atol=1e-5)
  grads = [jax.jit(jax.grad(functools.partial(loss, c)))(params) for c in (whole, blocks)]
  for a, b in zip(*map(jax.tree.leaves, grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

  @functools.partial(jax.jit, static_argnums=0)
  def cached(c):
    model = Transformer(c)
    first = model.apply({"params": params}, TOKENS[:, :9], POS[:, :9], VALID, cache=KVCache.zeros(c, 2, 16),
                        cache_index=0)
    return model.apply({"params": params}, TOKENS[:, 9:], POS[:, 9:], VALID, cache=first.cache,
                       cache_index=jnp.int32(9)).logits

  np.testing.assert_allclose(cached(blocks), forward(whole, params).logits[:, 9:], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cached(whole), forward(whole, params).logits[:, 9:], rtol=1e-5, atol=1e-5)


def test_attention_blocks_bound_the_scores_memory():
  """XLA's own temp-memory count of a 512-token forward and backward: blocks of 64 queries keep far less than one
  block of 512 (the [heads, 512, 512] float32 scores per layer are what goes)."""
  cfg = tiny("qwen2", num_layers=2)
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((2, 512), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(512), (2, 512))

  def temp_bytes(c):
    loss = lambda p: jnp.mean(Transformer(c).apply({"params": p}, tokens, pos, jnp.ones((2, 512), bool)).logits)
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  whole, blocks = temp_bytes(cfg.replace(attention_chunk=0)), temp_bytes(cfg.replace(attention_chunk=64))
  scores = 2 * cfg.num_layers * cfg.num_heads * 512 * 512 * 4  # one float32 copy of every layer's scores
  assert whole - blocks > scores, (whole, blocks, scores)


@pytest.mark.parametrize("cfg", [
    tiny("qwen2"),
    tiny("llama", tie_word_embeddings=True, eos_token_id=(2, 3),
         rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    tiny("llama", rope_scaling=RopeScaling("linear", 2.0)),
])
def test_hf_config_round_trip(cfg):
  assert from_hf_config(to_hf_config(cfg)) == cfg


def test_legacy_rope_fields_are_read():
  d = to_hf_config(tiny("llama"))
  d.pop("rope_parameters")
  d.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 4.0})
  cfg = from_hf_config(d)
  assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == RopeScaling("linear", 4.0)


def test_config_errors_name_file_and_field(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_hf_config(tmp_path)
  (tmp_path / "config.json").write_text("{\n  \"model_type\": \"llama\",\n")
  with pytest.raises(ValueError, match="config.json: invalid JSON at line 3"):
    load_hf_config(tmp_path)
  d = to_hf_config(tiny("llama"))
  del d["hidden_size"]
  (tmp_path / "config.json").write_text(json.dumps(d))
  with pytest.raises(ValueError, match="config.json: missing field 'hidden_size'"):
    load_hf_config(tmp_path)
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    from_hf_config({"model_type": "gpt2"})
  d = to_hf_config(tiny("llama"))
  d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
  with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
    from_hf_config(d)


def test_checkpoint_errors_name_the_tensor(tmp_path):
  cfg = tiny("qwen2")
  save_hf_checkpoint(init_params(cfg, jax.random.key(0)), cfg, tmp_path)
  d = json.loads((tmp_path / "config.json").read_text())
  d["intermediate_size"] = 96
  (tmp_path / "config.json").write_text(json.dumps(d))
  with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.(gate|up|down)_proj.weight' has shape"):
    load_hf_checkpoint(tmp_path)
  d["tie_word_embeddings"] = True
  d["intermediate_size"] = 128
  d["model_type"] = "llama"
  d["attention_bias"] = True  # llama with biases on o_proj too: the checkpoint lacks o_proj.bias
  (tmp_path / "config.json").write_text(json.dumps(d))
  with pytest.raises(ValueError, match="no tensor 'model.layers.0.self_attn.o_proj.bias'"):
    load_hf_checkpoint(tmp_path)
  (tmp_path / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
    load_hf_checkpoint(tmp_path)


def test_export_gathers_sharded_leaves_in_blocks_and_casts(tmp_path, monkeypatch):
  """The export's multi-process path (`gather_blocks`: rows in replicated blocks) on the 8-device mesh, with blocks
  small enough that every leaf spans several: equal to the arrays; and a bfloat16 export of a sharded model saves
  the bfloat16-rounded weights, says so in config.json, and loads back."""
  from dreamjax.parallel import MeshConfig, make_mesh
  from dreamjax.parallel import distributed

  monkeypatch.setattr(distributed, "EXPORT_BLOCK_BYTES", 4096)
  mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
  cfg = tiny("llama", value_head=True)
  params = init_params(cfg, jax.random.key(3), mesh=mesh)
  flat = {"/".join(k.key for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
  for x in (flat["embed"], flat["layers_0/mlp/down"], flat["final_norm/scale"]):
    assert x.ndim < 2 or len(distributed.export_blocks(x.shape, jnp.bfloat16)) > 1
    np.testing.assert_array_equal(distributed.gather_blocks(x, jnp.float32), np.asarray(x))
    np.testing.assert_array_equal(distributed.gather_blocks(x, jnp.bfloat16), np.asarray(x.astype(jnp.bfloat16)))
  save_hf_checkpoint(params, cfg, tmp_path, dtype="bfloat16", max_shard_bytes=20_000)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  assert (tmp_path / "model.safetensors.index.json").is_file()
  _, reloaded = load_hf_checkpoint(tmp_path, value_head=True)
  for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)).astype(np.float32))


def test_compute_dtype_copy_gives_the_same_outputs_bit_for_bit():
  """The frozen reference and the sampler's copy are `in_compute_dtype` casts: with bfloat16 compute the model's
  logits and values from them equal those from the float32 weights bit for bit (the model casts each weight where it
  reads it), the value head stays float32, and the copy is new buffers (the train step donates the originals)."""
  from dreamjax.models.params import in_compute_dtype

  cfg = tiny("qwen2", value_head=True, dtype="bfloat16")
  params = init_params(cfg, jax.random.key(0))
  params["value_head"] = jax.random.normal(jax.random.key(1), params["value_head"].shape)
  copy = in_compute_dtype(params, cfg)
  dtypes = {jax.tree_util.keystr(p, simple=True, separator="/"): x.dtype
            for p, x in jax.tree_util.tree_leaves_with_path(copy)}
  assert dtypes.pop("value_head") == jnp.float32 and set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}
  full, cast = forward(cfg, params), forward(cfg, copy)
  np.testing.assert_array_equal(np.asarray(cast.logits), np.asarray(full.logits))
  np.testing.assert_array_equal(np.asarray(cast.values), np.asarray(full.values))
  same = in_compute_dtype(params, cfg.replace(dtype="float32"))  # float32 compute: a plain copy
  assert all(a.dtype == b.dtype and a is not b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)))
