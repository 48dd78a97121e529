"""Forward pass, sampler and checkpoint loading on an 8-device fake CPU mesh agree with one device."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dreamjax.models import Transformer, init_params, load_hf_checkpoint, param_shardings, tiny
from dreamjax.parallel import SAMPLE_RULES, TRAIN_RULES, MeshConfig, logical_to_spec, make_mesh, named_sharding
from dreamjax.sampling import Sampler, sampling_params

CFG = tiny("qwen2")


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 8, "tests/conftest.py sets up 8 fake CPU devices"
  return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


def test_mesh_config_fills_the_remaining_axis():
  assert dict(make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1)).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  with pytest.raises(ValueError, match="needs 12 devices"):
    make_mesh(MeshConfig(data=3, fsdp=2, tensor=2))


def test_rules_drop_mesh_axes_that_do_not_divide():
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh, TRAIN_RULES) == P(None, None, None)
  assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh, TRAIN_RULES) == P(None, "tensor", None)
  mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  assert logical_to_spec(("batch", "seq"), (4, 9), mesh, TRAIN_RULES) == P("data", None)
  assert logical_to_spec(("batch", "seq"), (16, 9), mesh, TRAIN_RULES) == P(("data", "fsdp"), None)


def test_parameters_are_really_sharded(mesh):
  params = init_params(CFG, jax.random.key(0), mesh, TRAIN_RULES)
  gate = params["layers_1"]["mlp"]["gate"]  # [embed, mlp]
  assert gate.sharding.spec == P("fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (CFG.hidden_size // 2, CFG.intermediate_size // 2)
  assert params["layers_0"]["attn"]["k"].sharding.spec == P("fsdp", "tensor", None)


def test_forward_on_mesh_equals_single_device(mesh):
  single = init_params(CFG, jax.random.key(0))
  sharded = init_params(CFG, jax.random.key(0), mesh, TRAIN_RULES)
  for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
    np.testing.assert_array_equal(a, b)
  tokens = np.random.RandomState(0).randint(0, CFG.vocab_size, (4, 24)).astype(np.int32)
  pos = np.broadcast_to(np.arange(24), (4, 24))
  valid = np.ones((4, 24), bool)
  apply = jax.jit(Transformer(CFG).apply)
  ref = apply({"params": single}, tokens, pos, valid).logits
  rows = named_sharding(("batch", "seq"), tokens.shape, mesh, TRAIN_RULES)
  with jax.set_mesh(mesh), nn.logical_axis_rules(TRAIN_RULES):
    out = apply({"params": sharded}, *jax.device_put((tokens, pos, valid), rows)).logits
  assert out.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_sampler_on_mesh_equals_single_device(mesh):
  params = init_params(CFG, jax.random.key(1))
  rng = np.random.RandomState(1)
  tokens = rng.randint(3, CFG.vocab_size, (8, 12)).astype(np.int32)
  mask = np.ones((8, 12), bool)
  mask[::2, :5] = False  # mixed prompt lengths
  sp = sampling_params(8, 16, temperature=[0.0] * 4 + [1.0] * 4, top_p=0.9, stop=[[7]])
  ref = Sampler(CFG, 16)(params, tokens, mask, jax.random.key(2), sp)
  on_mesh = Sampler(CFG, 16, mesh=mesh, rules=SAMPLE_RULES)
  out = on_mesh(params=jax.device_put(params, on_mesh.param_shardings()), prompt_tokens=tokens, prompt_mask=mask,
                key=jax.random.key(2), sp=sp)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  np.testing.assert_allclose(out.logps, ref.logps, rtol=1e-5, atol=1e-5)


def test_checkpoint_loads_straight_into_shards(mesh, hf_tiny):
  _, folder = hf_tiny
  cfg, single = load_hf_checkpoint(folder)
  _, sharded = load_hf_checkpoint(folder, mesh=mesh, rules=TRAIN_RULES)
  expected = param_shardings(cfg, mesh, TRAIN_RULES)
  for a, b, s in zip(jax.tree.leaves(single), jax.tree.leaves(sharded), jax.tree.leaves(expected)):
    assert b.sharding.is_equivalent_to(s, b.ndim)
    np.testing.assert_array_equal(a, b)
  q = sharded["layers_1"]["attn"]["q"]
  assert q.addressable_shards[0].data.shape == (cfg.hidden_size // 2, cfg.num_heads // 2, cfg.head_dim)


def test_a_dropped_axis_warns_with_its_memory_cost(tmp_path):
  """2 KV heads on tensor=4: k and v of each layer stay whole over tensor. The warning counts them and the bytes
  per device beyond a layout that split them; the memory plan prints the same line."""
  from jax.sharding import AbstractMesh

  from dreamjax.models import abstract_params
  from dreamjax.parallel.sharding import ShardingWarning, dropped_axes
  from dreamjax.plan import memory

  cfg = tiny("llama")  # 4 heads, 2 KV heads, 2 layers
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
  with pytest.warns(ShardingWarning, match=r"mesh axis tensor=4 does not divide kv_heads=2: 4 parameter arrays"):
    param_shardings(cfg, mesh, TRAIN_RULES)
  (d,) = dropped_axes(abstract_params(cfg), mesh, TRAIN_RULES)
  kv = cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim  # elements of one k (or v) kernel
  assert (d.axis, d.size, d.dims, d.leaves) == ("tensor", 4, ("kv_heads=2",), 2 * cfg.num_layers)
  # Each is split over fsdp only: a quarter of it would stay per device if tensor divided.
  assert d.extra_bytes == 2 * cfg.num_layers * (kv // 2) * 4 * 3 // 4
  assert not dropped_axes(abstract_params(cfg), make_mesh(MeshConfig(data=4, fsdp=1, tensor=2)), TRAIN_RULES)
  qwen = memory.published_config("qwen2.5-7b")
  sizes = {"data": 1, "fsdp": 4, "tensor": 8}
  (d,) = dropped_axes(abstract_params(qwen), AbstractMesh((1, 4, 8), ("data", "fsdp", "tensor")), TRAIN_RULES)
  assert d.dims == ("heads=28", "kv_heads=4") and d.extra_bytes > 0.5 * 2**30
  note = memory._dropped("policy", qwen, sizes, memory.POLICY_LAYOUTS)[0]
  assert note == f"policy (train layout): {d}"
