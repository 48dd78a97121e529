"""Stacked, scanned layers (`ModelConfig.scan_layers`) against the unrolled model on the same weights: forward and
gradients, a GRPO step, the conversions, HF export and load, the KV-cache refusal, the sampler's copy and sharding.

Float32 throughout. The scanned forward is bit for bit the unrolled one (the same ops per layer); gradients differ
by summation order only (~1e-12 absolute here), so they are compared to 1e-6 of each leaf's largest entry.
"""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from dreamjax.models import KVCache, Transformer, init_params, load_hf_checkpoint, save_hf_checkpoint, tiny
from dreamjax.models.config import to_hf_config
from dreamjax.models.params import (abstract_params, in_compute_dtype, param_shardings, sampling_copy, stack_layers,
                                    unstack_layers)
from dreamjax.plan.memory import param_specs
from dreamjax.parallel import SAMPLE_RULES, TRAIN_RULES, MeshConfig, make_mesh
from dreamjax.rl.batch import TokenBatch
from dreamjax.rl.logprobs import row_positions
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step

CFG = tiny("qwen2", vocab_size=97, num_layers=3, value_head=True)
SCAN = CFG.replace(scan_layers=True)
B, T = 4, 12


@pytest.fixture(scope="module")
def params():
  p = init_params(CFG, jax.random.key(0))
  p["value_head"] = jax.random.normal(jax.random.key(1), p["value_head"].shape) * 0.1  # zero at init: make it count
  return p


def rows(seed: int):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, CFG.vocab_size, (B, T)).astype(np.int32)
  valid = np.arange(T)[None] < rng.randint(T // 2, T + 1, B)[:, None]
  return tokens, row_positions(valid), valid


def max_rel_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_config_field():
  assert SCAN != CFG and hash(SCAN) != hash(CFG)  # a static jit argument: the layouts never share a compilation
  assert to_hf_config(SCAN) == to_hf_config(CFG) and "scan_layers" not in json.dumps(to_hf_config(SCAN))
  with pytest.raises(ValueError, match="scan_layers must be True or False"):
    CFG.replace(scan_layers="yes")
  assert param_specs(SCAN) == param_specs(CFG)  # the memory planner's list: same bytes, per-layer paths


def test_stack_unstack_round_trip_is_exact(params):
  stacked = stack_layers(params, CFG)
  assert set(stacked) == {"embed", "layers", "final_norm", "lm_head", "value_head"}
  assert stacked["layers"]["mlp"]["gate"].shape == (3, CFG.hidden_size, CFG.intermediate_size)
  assert jax.tree.structure(stacked) == jax.tree.structure(nn.unbox(abstract_params(SCAN)))
  np.testing.assert_array_equal(stacked["layers"]["attn"]["q"][2], params["layers_2"]["attn"]["q"])
  assert_trees_equal(unstack_layers(stacked, CFG), params)
  assert_trees_equal(jax.jit(lambda p: stack_layers(p, CFG))(params), stacked)  # pure: traceable as well
  # Boxed abstract trees: the scanned init's boxes are the unrolled ones stacked, "layers" first.
  boxes = lambda t: jax.tree.map(lambda b: (b.value.shape, b.value.dtype, b.names), t,  # noqa: E731
                                 is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert boxes(stack_layers(abstract_params(CFG), CFG)) == boxes(abstract_params(SCAN))
  assert boxes(unstack_layers(abstract_params(SCAN), CFG)) == boxes(abstract_params(CFG))
  with pytest.raises(ValueError, match="not unrolled"):
    stack_layers(stacked, CFG)
  with pytest.raises(ValueError, match="not stacked"):
    unstack_layers(params, CFG)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_forward_and_gradients_equal_unrolled(params, remat):
  tokens, positions, valid = rows(0)

  def loss(cfg, p):
    out = Transformer(cfg).apply({"params": p}, tokens, positions, valid)
    logp = jax.nn.log_softmax(out.logits)
    return -(logp[:, :-1, 0] * valid[:, 1:]).mean() + (out.values ** 2).mean(), (out.logits, out.values)

  run = lambda cfg, p: jax.jit(jax.value_and_grad(lambda p: loss(cfg, p), has_aux=True))(p)  # noqa: E731
  (l1, (logits1, values1)), g1 = run(CFG.replace(remat=remat), params)
  (l2, (logits2, values2)), g2 = run(SCAN.replace(remat=remat), stack_layers(params, CFG))
  np.testing.assert_array_equal(logits2, logits1)  # bit for bit
  np.testing.assert_array_equal(values2, values1)
  np.testing.assert_array_equal(l2, l1)
  assert max_rel_diff(unstack_layers(g2, CFG), g1) < 1e-6


def test_grpo_step_scanned_equals_unrolled(params):
  """One AdamW GRPO step of the learner's jitted update (2 micro-batches) gives the same parameters either way."""
  tokens, positions, valid = rows(1)
  rng = np.random.RandomState(2)
  mask = (valid & (np.arange(T)[None] >= 3)).astype(np.float32)
  noise = lambda s: (rng.randn(B, T) * s * mask).astype(np.float32)  # noqa: E731
  batch = TokenBatch(tokens=tokens, positions=positions, valid=valid, loss_mask=mask, old_logp=noise(0.1) - 4.6,
                     ref_logp=noise(0.1) - 4.6, advantages=noise(1.0), returns=noise(1.0), old_values=noise(0.1),
                     pair=np.zeros(B, np.int32), chosen=np.zeros(B, bool))
  objective = make_objective("grpo", entropy_coef=0.01)
  optimizer = optax.adamw(1e-2)
  out = {}
  for cfg, p in ((CFG, params), (SCAN, stack_layers(params, CFG))):
    step = make_train_step(cfg, objective, optimizer, micro_batches=2)
    state, metrics = step(create_train_state(cfg, jax.tree.map(jnp.copy, p), optimizer), batch, jax.random.key(0))
    out[cfg.scan_layers] = (state.params, metrics)
  (unrolled, m1), (scanned, m2) = out[False], out[True]
  for key in m1:
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert max_rel_diff(unrolled, params) > 1e-3  # the step moved the weights
  # Adam normalises each gradient entry, so the ~1e-12 gradient differences stay at float32 rounding of the weights.
  assert max_rel_diff(unstack_layers(scanned, CFG), unrolled) < 1e-6


def test_hf_export_of_stacked_is_the_unrolled_export_and_loads_back(params, tmp_path):
  save_hf_checkpoint(params, CFG, tmp_path / "unrolled", max_shard_bytes=40_000)
  save_hf_checkpoint(stack_layers(params, CFG), SCAN, tmp_path / "stacked", max_shard_bytes=40_000)
  files = sorted(f.name for f in (tmp_path / "unrolled").iterdir())
  assert files == sorted(f.name for f in (tmp_path / "stacked").iterdir()) and len(files) > 3  # several shards
  for name in files:
    a, b = (tmp_path / "unrolled" / name), (tmp_path / "stacked" / name)
    if name.endswith(".safetensors"):
      x, y = load_file(a), load_file(b)
      assert x.keys() == y.keys()
      for k in x:
        np.testing.assert_array_equal(y[k], x[k], err_msg=k)
    else:
      assert a.read_text() == b.read_text(), name  # config.json (no scan_layers), the index
  cfg, loaded = load_hf_checkpoint(tmp_path / "unrolled", scan_layers=True, value_head=True)
  assert cfg == SCAN
  assert_trees_equal(loaded, stack_layers(params, CFG))


def test_kv_cache_forward_on_stacked_params_refuses(params):
  tokens, positions, valid = rows(0)
  cache = KVCache.zeros(SCAN, B, T + 4)
  with pytest.raises(ValueError, match="unstack first"):
    Transformer(SCAN).apply({"params": stack_layers(params, CFG)}, tokens, positions,
                            np.pad(valid, ((0, 0), (0, 4))), cache=cache, cache_index=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_samplers_get_an_unrolled_copy_in_the_compute_dtype(params, dtype):
  """Every sampler (the learner's, the SFT evaluators', M_exp's Predictor: `sampling_copy`) gets stacked training
  weights unrolled, cast to the compute dtype; unrolled float32 weights pass through uncopied."""
  copy = sampling_copy(stack_layers(params, CFG), SCAN.replace(dtype=dtype))
  assert copy["layers_1"]["mlp"]["up"].dtype == jnp.dtype(dtype) and copy["value_head"].dtype == jnp.float32
  assert_trees_equal(copy, in_compute_dtype(params, CFG.replace(dtype=dtype)))
  assert sampling_copy(params, CFG) is params


def test_policy_sft_with_scanned_layers_equals_unrolled(coin_expert_data, tmp_path):
  """A policy SFT run (its update, its evaluation's sampler and its export) with `model.scan_layers`: the same
  evaluation and, to float32 rounding, the same exported weights as the unrolled run."""
  from dreamjax.commands import train_policy
  from dreamjax.loop.model import load_model
  from tests import preemption_child as child

  base = dataclasses.replace(child.policy_sft(), data=(str(coin_expert_data),), max_steps=4,
                             eval=dataclasses.replace(child.EVAL, every_steps=0, num_tasks=2))
  runs = {}
  for scan in (False, True):
    cfg = dataclasses.replace(base, out_dir=str(tmp_path / f"scan{scan}"),
                              model=dataclasses.replace(base.model, scan_layers=scan))
    summary = train_policy.run(cfg)
    runs[scan] = summary, load_model(summary["checkpoint"])[1]
  a, b = runs[True][0]["eval"]["held_out"], runs[False][0]["eval"]["held_out"]
  assert {k for k in a if a[k] != b[k]} <= {"eval_s"}, {k: (a[k], b[k]) for k in a if a[k] != b[k]}
  assert runs[True][0]["final_loss"] == pytest.approx(runs[False][0]["final_loss"], rel=1e-5)
  assert max_rel_diff(runs[True][1], runs[False][1]) < 1e-5


def test_stacked_leaves_on_the_mesh(tmp_path):
  """On the 8-device mesh the layer axis is never split: stacked leaves are the unrolled ones' specs with a leading
  None, from init, from `stack_layers` of a sharded tree and from a sharded load; unstacking to the sampler's rules
  gives its layout; the scanned forward on the mesh equals one device's."""
  cfg = tiny("qwen2", num_layers=2)
  scan = cfg.replace(scan_layers=True)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  unrolled = init_params(cfg, jax.random.key(0), mesh, TRAIN_RULES)
  stacked = stack_layers(unrolled, cfg, param_shardings(scan, mesh, TRAIN_RULES))
  fresh = init_params(scan, jax.random.key(0), mesh, TRAIN_RULES)
  save_hf_checkpoint(unrolled, cfg, tmp_path)
  _, loaded = load_hf_checkpoint(tmp_path, mesh, TRAIN_RULES, scan_layers=True)
  assert_trees_equal(loaded, stacked)
  for tree in (stacked, fresh, loaded):
    assert tree["layers"]["mlp"]["gate"].sharding.spec == P(None, "fsdp", "tensor")
    assert tree["layers"]["attn"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert tree["layers"]["attn_norm"]["scale"].sharding.spec == P(None, None)
  assert unrolled["layers_0"]["mlp"]["gate"].sharding.spec == P("fsdp", "tensor")
  shard = stacked["layers"]["mlp"]["gate"].addressable_shards[0].data
  assert shard.shape == (2, cfg.hidden_size // 2, cfg.intermediate_size // 2)
  assert_trees_equal(unstack_layers(stacked, cfg), unrolled)
  sample = unstack_layers(stacked, cfg, param_shardings(cfg, mesh, SAMPLE_RULES))
  assert sample["layers_1"]["mlp"]["gate"].sharding.spec == P(None, "tensor")

  tokens, positions, valid = rows(3)
  fwd = lambda c: jax.jit(lambda p: Transformer(c).apply({"params": p}, tokens, positions, valid).logits)  # noqa: E731
  single = fwd(scan)(jax.device_get(stacked))
  with jax.set_mesh(mesh), nn.logical_axis_rules(TRAIN_RULES):
    sharded = fwd(scan)(stacked)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)
