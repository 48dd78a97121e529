"""Memory arithmetic (dreamjax/plan/memory.py) against what JAX itself reports: parameter trees from
`abstract_params`, shard shapes from the rule tables on a real 8-device mesh, optimizer state from `optax` under
`jax.eval_shape`, KV caches, XLA's compiled temp memory for the update step and the sampler; and the memory tables in
configs/scale/*.py docstrings, recomputed from the command written above each."""

import importlib.util
import json
import math
import re
import shlex
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamjax.config import load_config
from dreamjax.models import abstract_params, param_shardings, tiny
from dreamjax.models.config import to_hf_config
from dreamjax.models.transformer import KVCache
from dreamjax.parallel import SAMPLE_RULES, TRAIN_RULES, MeshConfig, make_mesh, named_sharding
from dreamjax.plan import memory
from dreamjax.rl.batch import TokenBatch
from dreamjax.rl.objectives import Objective, PolicyGradientConfig
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import TrainState, train_state_shardings
from dreamjax.rl.update import _train_step
from dreamjax.sampling import Sampler
from dreamjax.sampling.sampler import sampling_params

ROOT = Path(__file__).parent.parent
SCALE = sorted((ROOT / "configs" / "scale").glob("*.py"))
ONE = {"data": 1, "fsdp": 1, "tensor": 1}


def _tool():
  spec = importlib.util.spec_from_file_location("memory_plan_tool", ROOT / "tools" / "memory_plan.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _abstract(cfg):
  leaves = jax.tree_util.tree_leaves_with_path(abstract_params(cfg), is_leaf=lambda x: isinstance(x, nn.Partitioned))
  return {"/".join(k.key for k in path): (tuple(box.value.shape), tuple(box.names)) for path, box in leaves}


@pytest.mark.parametrize("name", sorted(memory.PUBLISHED))
def test_published_param_counts_are_exact_and_match_the_model_cards(name):
  cfg = memory.published_config(name, value_head=True)
  tree = _abstract(cfg)
  assert {s.path: (s.shape, s.axes) for s in memory.param_specs(cfg)} == tree
  counts = memory.param_count(cfg.replace(value_head=False))
  assert counts["total"] == sum(math.prod(shape) for path, (shape, _) in tree.items() if path != "value_head")
  assert memory.param_count(cfg)["value_head"] == cfg.hidden_size
  assert abs(counts["total"] / memory.PUBLISHED_SIZES[name] - 1) < 0.005
  assert counts["lm_head"] == (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def test_published_configs_read_as_transformers_would():
  llama3b, llama8b, qwen = (memory.published_config(n) for n in ("llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b"))
  assert llama3b.tie_word_embeddings and not llama8b.tie_word_embeddings
  assert (llama8b.rope_scaling.rope_type, llama8b.rope_scaling.factor, llama8b.rope_theta) == ("llama3", 8.0, 5e5)
  assert qwen.qkv_bias and not llama8b.qkv_bias and (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (28, 4, 128)
  with pytest.raises(ValueError, match="unknown published model 'gpt-2'"):
    memory.published_config("gpt-2")


@pytest.mark.parametrize("kw", [dict(family="qwen2"), dict(family="llama", tie_word_embeddings=True, value_head=True),
                                dict(family="llama", qkv_bias=True, o_bias=True, mlp_bias=True)])
def test_param_specs_match_the_model_for_every_option(kw):
  cfg = tiny(**kw)
  assert {s.path: (s.shape, s.axes) for s in memory.param_specs(cfg)} == _abstract(cfg)


def _shard_bytes(tree, shardings, width=None) -> int:
  return sum(math.prod(s.shard_shape(x.shape)) * (width or np.dtype(x.dtype).itemsize)
             for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)) if x.ndim)


# Tensor 4 does not divide the 2 KV heads nor the 6 query heads of the second config: the rules drop the axis there.
@pytest.mark.parametrize("axes", [(1, 8, 1), (1, 4, 2), (2, 2, 2), (1, 2, 4)])
@pytest.mark.parametrize("kw", [dict(family="qwen2"), dict(family="llama", num_heads=6, head_dim=8, vocab_size=250)])
def test_param_and_optimizer_bytes_per_device_match_the_mesh(axes, kw):
  mesh = make_mesh(MeshConfig(*axes))
  sizes = dict(mesh.shape)
  cfg = tiny(**kw, param_dtype="bfloat16")
  shapes = nn.unbox(abstract_params(cfg))
  for rules in (TRAIN_RULES, SAMPLE_RULES):
    shardings = param_shardings(cfg, mesh, rules)
    assert memory.param_bytes(cfg, sizes, rules) == _shard_bytes(shapes, shardings)
    assert memory.param_bytes(cfg, sizes, rules, "float32") == _shard_bytes(shapes, shardings, 4)
  optimizer = make_optimizer(OptimConfig(weight_decay=0.1, warmup_steps=2))
  opt = jax.eval_shape(optimizer.init, shapes)
  # AdamW keeps exactly two parameter-shaped moments in the parameters' dtype, sharded like them (scalars aside).
  assert _shard_bytes(opt, train_state_shardings(cfg, optimizer, mesh).opt_state) == \
      2 * memory.param_bytes(cfg, sizes, TRAIN_RULES)
  assert memory.same_layout(cfg, sizes, TRAIN_RULES, SAMPLE_RULES) == (sizes["fsdp"] == 1)


@pytest.mark.parametrize("axes", [(1, 8, 1), (1, 4, 2), (2, 1, 4)])
def test_kv_cache_bytes_match_the_cache_and_its_sharding(axes):
  mesh = make_mesh(MeshConfig(*axes))
  cfg = tiny("llama", dtype="bfloat16")
  rows, slots = 12, 40  # 12 rows do not split 8 ways: the rules keep the leading axes that divide
  cache = jax.eval_shape(lambda: KVCache.zeros(cfg, rows, slots))
  total = 0
  for k, v in zip(cache.k, cache.v):
    total += math.prod(named_sharding(("batch", "act_kv_heads", "head_dim", "cache_seq"), k.shape, mesh,
                                      SAMPLE_RULES).shard_shape(k.shape)) * 2
    total += math.prod(named_sharding(("batch", "act_kv_heads", "cache_seq", "head_dim"), v.shape, mesh,
                                      SAMPLE_RULES).shard_shape(v.shape)) * 2
  assert memory.kv_cache_bytes(cfg, rows, slots, dict(mesh.shape)) == total


def test_mesh_sizes_resolve_and_refuse():
  assert memory.mesh_sizes(MeshConfig(1, -1, 4), 32) == {"data": 1, "fsdp": 8, "tensor": 4}
  assert memory.mesh_sizes(MeshConfig(2, 2, 4)) == {"data": 2, "fsdp": 2, "tensor": 4}
  with pytest.raises(ValueError, match="has a -1 axis: give the device count"):
    memory.mesh_sizes(MeshConfig(1, -1, 4))
  with pytest.raises(ValueError, match="needs 16 devices, not 8"):
    memory.mesh_sizes(MeshConfig(2, 2, 4), 8)


# A model big enough that activations dominate XLA's temporaries, small enough to compile in seconds.
_CALIBRATION = dict(family="qwen2", vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048)


# Each compiles a train step (about 10-20 s on 2 cores); one micro-batch count in the default run, both with -m slow.
# Blocks of 64 queries over 256 tokens is the blocked-attention path; one block is the path of shorter inputs.
@pytest.mark.parametrize("micro,chunk", [(1, 64), pytest.param(1, 0, marks=pytest.mark.slow),
                                         pytest.param(2, 64, marks=pytest.mark.slow)])
def test_update_step_estimate_tracks_xla(micro, chunk):
  """Activations + gradients against the compiled update step's temp memory (CPU, remat off): 1.02-1.09x measured
  over lengths 256 and 512, vocabularies 512 and 2048, 4 and 8 heads, with and without query blocks."""
  cfg = tiny(**_CALIBRATION, attention_chunk=chunk)
  rows, length = 4, 256
  objective = Objective("grpo", PolicyGradientConfig(kl_coef=0.02, kl_kind="low_var_kl"))
  optimizer = make_optimizer(OptimConfig())
  params = nn.unbox(abstract_params(cfg))
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                     opt_state=jax.eval_shape(optimizer.init, params))
  row = lambda dt: jax.ShapeDtypeStruct((rows, length), dt)  # noqa: E731
  batch = TokenBatch(tokens=row(jnp.int32), positions=row(jnp.int32), valid=row(bool), loss_mask=row(jnp.float32),
                     old_logp=row(jnp.float32), ref_logp=row(jnp.float32), advantages=row(jnp.float32),
                     returns=row(jnp.float32), old_values=row(jnp.float32),
                     pair=jax.ShapeDtypeStruct((rows,), jnp.int32), chosen=jax.ShapeDtypeStruct((rows,), bool))
  # score_len None: every position projected, the estimate's case (a loss over whole rows; fewer loss tokens need less).
  step = jax.jit(lambda s, b, r: _train_step(s, b, r, None, model_cfg=cfg, objective=objective, optimizer=optimizer,
                                             micro_batches=micro), donate_argnums=0)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  measured = step.lower(state, batch, key).compile().memory_analysis().temp_size_in_bytes
  grads = memory.param_bytes(cfg, ONE, TRAIN_RULES, "float32") + memory.param_bytes(cfg, ONE, TRAIN_RULES)
  estimate = memory.activation_bytes(cfg, rows // micro, length, ONE) + grads
  assert 0.95 * measured <= estimate <= 1.2 * measured, (estimate / 2**20, measured / 2**20)


@pytest.mark.parametrize("chunk", [0, 128])
def test_sampler_estimate_tracks_xla(chunk):
  """KV cache + prefill against the compiled sampler's temp memory (CPU): 1.18x measured in one block, 1.35x in
  blocks of 128 (XLA overlaps the attention and MLP temporaries more than the estimate, which adds them)."""
  cfg = tiny(**_CALIBRATION, attention_chunk=chunk)
  rows, prompt, new = 8, 512, 32
  sampler = Sampler(cfg, new)
  sp = jax.tree.map(jnp.asarray, sampling_params(rows, new, 1.0, 1.0, 0, stop=[[1]]))
  keys = jax.random.split(jax.random.key(0), rows)
  tokens = jax.ShapeDtypeStruct((rows, prompt), jnp.int32)
  compiled = sampler._fn.lower(nn.unbox(abstract_params(cfg)), tokens, jax.ShapeDtypeStruct((rows, prompt), bool),
                               keys, sp).compile()
  measured = compiled.memory_analysis().temp_size_in_bytes
  estimate = memory.kv_cache_bytes(cfg, rows, prompt + new, ONE) + \
      memory.forward_bytes(cfg, rows, prompt, ONE, SAMPLE_RULES, logits_positions=1)
  assert 0.9 * measured <= estimate <= 1.4 * measured, (estimate / 2**20, measured / 2**20)


def test_remat_and_sharding_lower_the_estimate():
  cfg = memory.published_config("llama-3.1-8b")
  sizes = {"data": 1, "fsdp": 2, "tensor": 8}
  none, full, dots = (memory.activation_bytes(cfg.replace(remat=r), 2, 2048, sizes) for r in ("none", "full", "dots"))
  assert full < dots < none
  assert memory.activation_bytes(cfg, 2, 2048, {"data": 1, "fsdp": 2, "tensor": 1}) > none
  half = memory.activation_bytes(cfg.replace(dtype="bfloat16", param_dtype="bfloat16"), 2, 2048, sizes)
  assert half < none


def _docstring_plan(path: Path) -> tuple[list[str], str]:
  """(the tool's arguments, the table) written in a config's docstring."""
  text = path.read_text()
  found = re.search(r"\n  python tools/memory_plan\.py (.*?)\n\n(.*?)\n\"\"\"", text, re.S)
  assert found, f"{path.name}: no memory_plan command and table in the docstring"
  args = shlex.split(found.group(1).replace("\\\n", " "))
  return args, "\n".join(line.removeprefix("  ") for line in found.group(2).splitlines())


def test_scale_configs_found():
  assert {p.name for p in SCALE} >= {"dreamgym_llama3b_tpu.py", "dreamgym_llama8b_gpu.py", "dreamgym_qwen7b_tpu.py"}


@pytest.mark.parametrize("path", SCALE, ids=lambda p: p.name)
def test_scale_config_tables_are_current_and_fit(path, monkeypatch):
  args, written = _docstring_plan(path)
  assert args[:2] == ["--config", f"configs/scale/{path.name}"]
  monkeypatch.chdir(ROOT)  # the command as the docstring gives it, from the repository root
  plan, hbm = _tool().build_plan(args)
  fresh = plan.table(hbm)
  assert fresh == written, f"{path.name}: the memory table is stale; the tool now prints:\n{fresh}"
  assert hbm and max(plan.peaks().values()) <= 0.9 * hbm * memory.GIB, f"{path.name}: under 10% headroom"
  cfg = load_config(path)
  rl = getattr(cfg, "rl", cfg)
  assert math.prod(plan.sizes.values()) == math.prod([rl.mesh.data, rl.mesh.fsdp, rl.mesh.tensor])


def test_tool_errors_name_the_field(capsys):
  tool = _tool()
  assert tool.main(["--config", str(ROOT / "configs/grpo_real_twx.py"), "--devices", "8"]) == 2
  err = capsys.readouterr().err
  assert "model.checkpoint is 'runs/policy_sft/twx/checkpoint', which has no config.json here; give --arch " \
      "policy=" in err
  assert tool.main(["--config", str(ROOT / "configs/collect_twx.py")]) == 2
  assert "gives a CollectConfig; memory_plan handles RLConfig and DreamGymConfig" in capsys.readouterr().err
  assert tool.main(["--config", str(ROOT / "configs/dreamgym_twx.py"), "--devices", "8", "--arch", "policy=qwen2.5-7b",
                    "--arch", "exp=llama-3.2-3b"]) == 2
  assert "needs exp_prompt_buckets and exp_max_new_tokens set" in capsys.readouterr().err
  assert tool.main(["--config", str(ROOT / "configs/grpo_real_twx.py"), "--devices", "8", "--arch", "policy=qwen2.5-7b",
                    "--set", "mesh.fsdp=8", "--set", "micro_batches=1", "--set", "rows_per_step=12",
                    "--set", "micro_batches=3"]) == 2
  assert "rows_per_step (12) must be a multiple of micro_batches (3) x data x fsdp (8)" in capsys.readouterr().err


def test_tool_reads_a_checkpoint_folder_and_the_tiny_model(tmp_path, capsys):
  """A policy shape from a folder's config.json; --dtype and --remat reach the plan; PPO adds the value head."""
  folder = tmp_path / "ckpt"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(to_hf_config(memory.published_config("qwen2.5-7b"))))
  tool = _tool()
  base = ["--config", str(ROOT / "configs/grpo_real_twx.py"), "--devices", "8", "--set", f"model.checkpoint={folder}"]
  plan, _ = tool.build_plan(base + ["--set", "mesh.fsdp=8"])
  assert plan.models[0][1] == memory.published_config("qwen2.5-7b")
  plan16, _ = tool.build_plan(base + ["--set", "mesh.fsdp=8", "--dtype", "bfloat16", "--remat", "full"])
  policy = plan16.models[0][1]
  assert (policy.dtype, policy.param_dtype, policy.remat) == ("bfloat16", "bfloat16", "full")
  assert plan16.peak("update") < plan.peak("update")
  ppo, _ = tool.build_plan(["--config", str(ROOT / "configs/ppo_real_twx.py"), "--devices", "8", "--set",
                            f"model.checkpoint={folder}", "--set", "mesh.fsdp=8"])
  assert ppo.models[0][1].value_head
  tiny_plan, _ = tool.build_plan(["--config", str(ROOT / "configs/grpo_real_twx.py"), "--devices", "1",
                                  "--set", "model.checkpoint="])
  assert tiny_plan.models[0][1].hidden_size == 128 and tiny_plan.sizes == ONE


def test_export_holds_a_block_per_device_not_the_model():
  """The HF export gathers leaf by leaf in blocks of rows (`export_program`, what `save_model` runs on arrays that
  span processes): compiled on the fake mesh for every block of every leaf of an 8B model (two layers: every kind of
  leaf), no program holds more per device than the planner's export line, which is a fraction of the largest leaf
  (the whole-tree `to_host` replicated every leaf at once: the whole model)."""
  from dreamjax.parallel.distributed import export_blocks, export_program

  cfg = memory.published_config("llama-3.1-8b").replace(num_layers=2)
  sizes = {"data": 1, "fsdp": 4, "tensor": 2}
  mesh = make_mesh(MeshConfig(**sizes), jax.devices()[:8])
  largest = max(spec.size for spec in memory.param_specs(cfg)) * 4
  for dtype in ("float32", "bfloat16"):
    planned = memory.export_bytes(cfg, None if dtype == "float32" else dtype)
    assert planned < largest / 2, (dtype, planned, largest)
    for spec in memory.param_specs(cfg):
      sharding = named_sharding(spec.axes, spec.shape, mesh, TRAIN_RULES)
      shard = memory.shard_elements(spec.axes, spec.shape, sizes, TRAIN_RULES)
      leaf = jax.ShapeDtypeStruct(spec.shape, jnp.float32, sharding=sharding)
      blocks = export_blocks(spec.shape, jnp.dtype(dtype))
      assert blocks[0][0] == 0 and blocks[-1][1] == spec.shape[0]
      assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
      for start, stop in {blocks[0], blocks[-1]}:  # the others compile like the first
        analysis = export_program(sharding, jnp.dtype(dtype), start, stop).lower(leaf).compile().memory_analysis()
        assert analysis.argument_size_in_bytes == shard * 4, spec.path  # it reads the resident shard, nothing more
        held = analysis.output_size_in_bytes + analysis.temp_size_in_bytes
        assert analysis.output_size_in_bytes == (stop - start) * math.prod(spec.shape[1:]) * jnp.dtype(dtype).itemsize
        assert held <= planned, (spec.path, dtype, start, stop, held, planned)


# The supervised commands (policy SFT, M_exp SFT, DPO): `plan_policy_sft`, `plan_exp_sft`, `plan_dpo`.


@pytest.mark.parametrize("micro", [1, 2])
def test_sft_step_plan_tracks_xla_on_the_mesh(micro):
  """The step phase of M_exp SFT's plan (configs/train_exp_twx.py at a small shape on the fake 8-device mesh, fsdp 4 x
  tensor 2: parameters, AdamW, gradients, one micro-batch's activations) against the compiled SFT train step
  (`make_train_step` with the "sft" objective, as train_exp runs it): XLA's arguments (the donated state and the
  batch) plus its temporaries, per device: 1.10x measured with one micro-batch (2 rows per device), 1.01x with
  two (1 row)."""
  from dreamjax.rl.objectives import make_objective
  from dreamjax.rl.update import make_train_step

  sizes = {"data": 1, "fsdp": 4, "tensor": 2}
  mesh = make_mesh(MeshConfig(**sizes), jax.devices()[:8])
  cfg = load_config(ROOT / "configs/train_exp_twx.py", ["batch_size=8", f"micro_batches={micro}", "max_len=256",
                                                        "mesh.fsdp=4", "mesh.tensor=2"])
  model = tiny(**_CALIBRATION, attention_chunk=64)
  plan = memory.plan_exp_sft(cfg, model, sizes)
  optimizer = make_optimizer(cfg.optim)
  step = make_train_step(model, make_objective("sft"), optimizer, micro_batches=cfg.micro_batches, mesh=mesh)
  shardings = train_state_shardings(model, optimizer, mesh)
  params = nn.unbox(abstract_params(model))
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                        opt_state=jax.eval_shape(optimizer.init, params))
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
  rows, length = cfg.batch_size, cfg.max_len
  dtypes = dict(tokens=jnp.int32, positions=jnp.int32, valid=bool, pair=jnp.int32, chosen=bool, allowed=jnp.int32)
  shapes = dict(pair=(rows,), chosen=(rows,), allowed=(rows, length, 0))  # SFT: no allowed sets
  batch = jax.tree.map(lambda s, name: jax.ShapeDtypeStruct(shapes.get(name, (rows, length)),
                                                            dtypes.get(name, jnp.float32), sharding=s),
                       step._batch_shardings, TokenBatch(**{f: f for f in TokenBatch.__dataclass_fields__}))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  # score_len = length: every position projected, the plan's case (SFT rows with fewer answer tokens need less).
  with jax.set_mesh(mesh), nn.logical_axis_rules(TRAIN_RULES):
    analysis = step._fn.lower(state, batch, key, length).compile().memory_analysis()
  measured = analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
  estimate = plan.peak("step")  # the Predictor's copy lives only while evaluating
  assert 0.95 * measured <= estimate <= 1.2 * measured, (estimate / 2**20, measured / 2**20)


# What a documented command sets that leaves memory as it is (paths, the learning rate, the annotation check).
_MEMORY_NEUTRAL = ("model.checkpoint", "out_dir", "annotations", "require_teacher_annotations", "optim.lr")


def _docstring_step_plans(path: Path) -> list[tuple[list[str], list[str], str]]:
  """(the documented `dreamjax train-exp|train-policy|dpo` command's words, the memory_plan arguments indented under
  it, the table) for each supervised step of a config's docstring that carries its memory table."""
  text = path.read_text()
  found = re.findall(r"^       (dreamjax (?:train-exp|train-policy|dpo) (?:.*\\\n)*.*)\n"
                     r"(?:(?!       dreamjax).*\n){0,3}?( +)python tools/memory_plan\.py ((?:.*\\\n)*.*)\n\n"
                     r"((?:.+\n)+)\n", text, re.M)
  return [(shlex.split(command.replace("\\\n", " ")), shlex.split(args.replace("\\\n", " ")),
           "\n".join(line.removeprefix(indent) for line in table.splitlines()))
          for command, indent, args, table in found]


def _sets(words: list[str]) -> set[str]:
  return {words[i + 1] for i, w in enumerate(words) if w == "--set"}


@pytest.mark.parametrize("path", SCALE, ids=lambda p: p.name)
def test_scale_config_sft_tables_are_current_and_fit(path, monkeypatch):
  """Every documented SFT step of a scale config carries the table of the memory_plan command under it, and that
  command plans the documented one: the same config and every --set that changes memory."""
  steps = _docstring_step_plans(path)
  documented = re.findall(r"^       dreamjax (train-exp|train-policy|dpo) ", path.read_text(), re.M)
  assert len(steps) == len(documented) >= 1, f"{path.name}: an SFT step without its memory table"
  monkeypatch.chdir(ROOT)
  for command, args, written in steps:
    assert args[args.index("--config") + 1] == command[command.index("--config") + 1]
    wanted = {s for s in _sets(command) if s.split("=", 1)[0] not in _MEMORY_NEUTRAL}
    assert wanted <= _sets(args), f"{path.name}: {command[1]}'s plan lacks {wanted - _sets(args)}"
    plan, hbm = _tool().build_plan(args)
    fresh = plan.table(hbm)
    assert fresh == written, f"{path.name}: the {command[1]} memory table is stale; the tool now prints:\n{fresh}"
    assert hbm and max(plan.peaks().values()) <= 0.9 * hbm * memory.GIB, f"{path.name} {command[1]}: over 90%"


def test_llama3b_tpu_sft_steps_fit_a_v4_chip(monkeypatch):
  """The M_exp SFT of Llama-3.1-8B and the policy SFT of Llama-3.2-3B documented before
  configs/scale/dreamgym_llama3b_tpu.py (fsdp 4 x tensor 8 on a v4-64, micro_batches 8) stay under a v4 chip's 32 GiB
  in every phase (an issue measured the M_exp step at about 32.7 GiB when the export still gathered whole leaves)."""
  monkeypatch.chdir(ROOT)
  steps = {command[1]: (command, args) for command, args, _ in
           _docstring_step_plans(ROOT / "configs/scale/dreamgym_llama3b_tpu.py")}
  assert set(steps) == {"train-exp", "train-policy"}
  for name, arch, role in (("train-exp", "llama-3.1-8b", "M_exp"), ("train-policy", "llama-3.2-3b", "policy")):
    command, args = steps[name]
    assert {"mesh.fsdp=4", "mesh.tensor=8", "micro_batches=8"} <= _sets(command)
    plan, hbm = _tool().build_plan(args)
    assert hbm == 32.0 and plan.sizes == {"data": 1, "fsdp": 4, "tensor": 8}
    assert plan.models == ((role, memory.published_config(arch).replace(
        **load_config(ROOT / command[command.index("--config") + 1]).model.overrides())),)
    assert {"load", "step", "export"} <= set(plan.phases)
    for phase, peak in plan.peaks().items():
      assert peak < 32 * memory.GIB, (name, phase, peak / memory.GIB)


def test_supervised_plans_count_what_the_commands_hold():
  """Phases and lines of the three supervised plans: AdamW exists from the train state on; DPO scores its reference
  with the loaded weights before that and keeps no second copy; M_exp SFT's Predictor holds a decoding copy while it
  evaluates, not during the steps; with fsdp = 1 the layouts coincide and evaluation copies nothing."""
  llama = memory.published_config("llama-3.2-3b")
  sizes = {"data": 1, "fsdp": 8, "tensor": 1}
  dpo = load_config(ROOT / "configs/dpo_twx.py", ["mesh.fsdp=8"])
  plan = memory.plan_supervised(dpo, llama, sizes)
  assert plan.phases == ("load", "reference", "step", "eval", "export")
  assert not [line for line in plan.lines if "reference" in line.phases and line.bytes and
              not line.name.startswith(("policy params (train", "reference scoring"))]
  assert not any(line.name.startswith("reference params") for line in plan.lines)
  # One micro-batch: every pair with both episodes at the turn limit (800 rows, a multiple of fsdp 8).
  assert dpo.micro_batches == 1 and memory.dpo_batch_rows(dpo, sizes) == dpo.pairs_per_step * 2 * dpo.rollout.max_turns
  small = memory.plan_dpo(dpo, llama, sizes, batch_rows=64)
  assert small.peak("step") < plan.peak("step") and small.peak("eval") == plan.peak("eval")
  with pytest.raises(ValueError, match=r"DpoConfig.batch_rows \(12\) must be a multiple of micro_batches"):
    memory.plan_dpo(dpo, llama, sizes, batch_rows=12)

  exp = load_config(ROOT / "configs/train_exp_twx.py", ["mesh.fsdp=8", "micro_batches=4"])
  plan = memory.plan_supervised(exp, llama, sizes)
  assert memory.supervised_kind(exp) == "exp_sft" and plan.models[0][0] == "M_exp"
  copy = memory.param_bytes(llama, sizes, SAMPLE_RULES)  # float32 compute: the sampling layout's bytes
  assert plan.phases == ("load", "step", "eval_score", "eval_decode", "export")
  copies = [line for line in plan.lines if "decoding" in line.name]
  assert [(c.bytes, c.phases) for c in copies] == [(copy, ("eval_score", "eval_decode"))]
  whole = memory.plan_exp_sft(exp, llama, {"data": 1, "fsdp": 1, "tensor": 8})
  assert all(line.bytes == 0 for line in whole.lines if "decoding" in line.name)

  sft = load_config(ROOT / "configs/train_policy_twx.py", ["mesh.fsdp=8"])
  plan = memory.plan_supervised(sft, llama, sizes)
  assert memory.supervised_kind(sft) == "policy_sft" and plan.phases == ("load", "step", "eval", "export")
  assert plan.peak("load") == memory.param_bytes(llama, sizes, TRAIN_RULES)
  assert memory.supervised_kind(load_config(ROOT / "configs/grpo_real_twx.py")) is None
  with pytest.raises(ValueError, match=r"PolicySftConfig.batch_size \(32\) must be a multiple of micro_batches \(3\)"):
    memory.plan_policy_sft(load_config(ROOT / "configs/train_policy_twx.py", ["micro_batches=3"]), llama, ONE)


def test_tool_plans_the_supervised_commands(capsys):
  tool = _tool()
  exp = ["--config", str(ROOT / "configs/train_exp_twx.py"), "--devices", "8"]
  plan, _ = tool.build_plan(exp + ["--arch", "exp=llama-3.2-1b", "--remat", "full"])
  assert plan.models[0][0] == "M_exp" and plan.models[0][1].remat == "full" and plan.sizes["fsdp"] == 8
  assert tool.main(exp + ["--arch", "policy=llama-3.2-1b"]) == 2
  assert "a ExpSftConfig trains one model, given as --arch exp=NAME" in capsys.readouterr().err
  assert tool.main(exp) == 2
  assert "model.checkpoint is 'checkpoints/Llama-3.2-3B-Instruct', which has no config.json here; give --arch exp=" \
      in capsys.readouterr().err
  assert tool.main(exp + ["--arch", "exp=llama-3.2-1b", "--dpo-batch-rows", "8"]) == 2
  assert "--dpo-batch-rows: only for a DpoConfig" in capsys.readouterr().err
  dpo = ["--config", str(ROOT / "configs/dpo_twx.py"), "--devices", "8", "--arch", "policy=llama-3.2-1b"]
  assert tool.main(dpo + ["--set", "mesh.fsdp=8", "--dpo-batch-rows", "64"]) == 0
  out = capsys.readouterr().out
  assert "(DpoConfig)" in out and "peak reference" in out and "(8 rows/device x 2112, per micro-batch)" in out
  tiny_plan, _ = tool.build_plan(["--config", str(ROOT / "configs/train_policy_twx.py:tiny")])
  assert tiny_plan.models[0][1].hidden_size == 128 and tiny_plan.sizes == ONE


def test_settings_the_plan_does_not_count_are_named():
  rl = load_config(ROOT / "configs/grpo_real_twx.py", ["shared_prefix=true"])
  plan = memory.plan_rl(rl, memory.published_config("llama-3.2-1b"), ONE)
  assert any(note.startswith("shared_prefix:") for note in plan.notes)
  assert "warning: shared_prefix:" in plan.table(None)
