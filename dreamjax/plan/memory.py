"""Memory arithmetic: parameter counts and bytes per device of an RL or DreamGym run, from configs alone.

Nothing here allocates: the parameter list is the model's own, `dreamjax.models.abstract_params` (its init traced by
`jax.eval_shape`, once per config) read leaf by leaf as `dreamjax.parallel.sharding.tree_shardings` reads it (path,
shape, dtype, logical axes), and each array's shard on one device comes from `logical_to_spec` over an
`AbstractMesh`, so neither the parameter tree nor the sharding arithmetic is a copy that could drift from the model.

The run's settings are taken duck-typed (`Any`): the planner sits above models, parallel and rl and below the training
loops, so it reads the fields `RL_FIELDS` and `DREAMGYM_FIELDS` list from whatever config classes the loops define,
without importing them.

What the loops keep on a device, and in which layout (read from dreamjax/rl and the training loops):
- policy parameters in the TRAIN_RULES layout (`embed` over fsdp, heads / kv heads / mlp / vocab over tensor);
- AdamW state: `optax.scale_by_adam` keeps two moments in the parameters' dtype (no float32 master copy: the update
  is applied to the parameters themselves), sharded like them; the rest of the chain is stateless or scalars;
- gradients: the update step accumulates micro-batch gradients in a float32 tree (constrained to the parameters'
  shardings) and holds one micro-batch's gradient in the parameter dtype beside it;
- the frozen reference (GRPO's KL term): a copy of the warm start in the compute dtype (`in_compute_dtype`: exact,
  as the model casts every weight to it at use), in the TRAIN_RULES layout the policy was loaded in;
- during rollouts, the policy's parameters in the compute dtype, laid out for the sampler (SAMPLE_RULES keep `embed`
  whole, so under fsdp this is a second copy; with fsdp = 1 and float32 compute no copy is made);
- M_exp (DreamGym): loaded once in the SAMPLE_RULES layout, resident for the whole run;
- KV caches, allocated inside each sampler call: layers x 2 x kv_heads x head_dim x slots per row in the compute
  dtype, rows over (data, fsdp) and kv heads over tensor where they divide;
- the final HF export (`save_model`), after training with the training state still resident: one block of one
  leaf's rows at a time gathered whole on every device, in the export dtype (`export_bytes`).

The supervised commands that precede an RL run (`plan_policy_sft`, `plan_exp_sft`, `plan_dpo`; `plan_supervised`
picks by the config's fields) hold the same training state and update step, with phases of their own: "load" (the
weights as loaded, before AdamW exists), DPO's "reference" (its reference log-probs are scored once with the loaded
weights, so no second copy is kept), "step", their evaluations and "export". Their evaluations sample from the same
copy as the RL learner's rollouts (`sampling_copy`: compute dtype, sampling layout), made for each evaluation and
dropped after it.

Activations are an estimate, documented here so it can be checked: per token and layer the backward pass needs the
inputs and outputs of both RMSNorms (4 E), post-RoPE q and k and v ((H + 2 K) D), the attention output (H D), gate,
up and their product (3 M), all in the compute dtype, plus the attention scores, which this model materialises (no
fused attention kernel): H x T each for the scores and the probabilities in float32, and the probabilities again in
the compute dtype when that is narrower. Inputs longer than
`attention_chunk` attend in query blocks that the backward pass recomputes: no layer keeps scores then, and one
block's set (block x T per head) is live while it is recomputed. Head- and
MLP-sized terms divide by the tensor axis when it divides their dimension. With `remat="none"` all L layers keep
that; with "full" only each layer's input (E) is kept; with "dots" the outputs of the weight matmuls
((H + 2 K) D + 2 M + 2 E) and the input are kept. Either remat mode adds one layer's full set (recomputed in the
backward pass). One more layer's worth covers the backward temporaries, and the vocabulary projection, chunked by
`dreamjax.rl.logprobs` to at most MAX_LOGITS float32 logits per step, counts four times (logits, log-probabilities
and their gradients). These copy counts are what XLA kept on CPU: varying the vocabulary, the heads and the length
separately, the first estimate (three copies of the scores, two of the logits) was off by one copy of each.
Forward-only passes (reference scoring, sampler prefill) hold one layer's temporaries at a time: two float32 copies
of one query block's scores (scores and probabilities; a prefill attends over the prompt alone, not the cache's
empty slots), the residual stream and gate and up (3 E + 2 M), or the logits after the last layer, whichever is
larger.

Checked against XLA's own accounting (`compiled.memory_analysis().temp_size_in_bytes`, CPU, one device; see
tests/test_memory.py): the update step's activations and gradients came to 1.02-1.09x of it with remat off (lengths
256 and 512, vocabularies 512 and 2048, 4 and 8 heads, one query block or blocks of 64), the sampler's forward to
1.15-1.35x (the estimate errs on the safe side: it adds the attention and MLP temporaries, which XLA overlaps). On
CPU, XLA's temp memory did not shrink with remat="full" (the recomputing matmuls are there, 142 dots against 110, but
its scheduler keeps the memory), so the remat rows are the textbook figures, to be checked on an accelerator with the
same call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from dreamjax.models.config import ModelConfig, from_hf_config
from dreamjax.models.params import FLOAT32_LEAVES, abstract_params
from dreamjax.parallel.distributed import export_blocks
from dreamjax.parallel.mesh import AXES, MeshConfig
from dreamjax.parallel.sharding import SAMPLE_RULES, TRAIN_RULES, Rules, dropped_axes, logical_to_spec
from dreamjax.rl.logprobs import MAX_LOGITS

GIB = 1 << 30
POLICY_LAYOUTS = {"train": TRAIN_RULES, "sampling": SAMPLE_RULES}  # the layouts a policy's weights live in
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Published HF config.json values (the fields our ModelConfig reads), written in so nothing is downloaded; the sizes
# are the totals their model cards state.
PUBLISHED: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16"),
    "llama-3.2-3b": dict(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16"),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
}
PUBLISHED_SIZES = {"llama-3.2-1b": 1.24e9, "llama-3.2-3b": 3.21e9, "llama-3.1-8b": 8.03e9, "qwen2.5-7b": 7.62e9}

# The fields the planner reads of the loops' configs (dotted: nested configs), so a config class can be checked
# without importing it. An RL config (`plan_rl`, and `rl` of a DreamGym config): `rows` the rollout rows per
# iteration, `rows_per_step` / `micro_batches` the update's rows and gradient accumulation, `pad_to` the row-length
# rounding, `score_batch` the scoring pass's rows, `rollout.prompt_buckets` (the last one is the widest prompt) and
# `rollout.max_action_tokens` the sampler's shape, `objective.kl_coef` whether a reference model is kept,
# `export_dtype` the dtype of the final HF export ("": the parameters' own).
RL_FIELDS = ("rows", "rows_per_step", "micro_batches", "pad_to", "score_batch", "rollout.prompt_buckets",
             "rollout.max_action_tokens", "objective.kl_coef", "export_dtype")
# A DreamGym config (`plan_dreamgym`): `rl` as above, M_exp's widest prompt and answer budget, and the curriculum's
# task-generation settings (whether and how many seeds M_task writes variants of, its prompt buckets and budget).
DREAMGYM_FIELDS = ("rl", "exp_prompt_buckets", "exp_max_new_tokens", "curriculum.enabled", "curriculum.generate_every",
                   "curriculum.seeds_per_round", "curriculum.max_new_tokens", "curriculum.generation.prompt_buckets")
# The supervised commands' configs, each recognised by all of its fields (`supervised_kind`). Policy SFT
# (`plan_policy_sft`, dreamjax/commands/train_policy.py): `batch_size` rows per update in `micro_batches`, rows as long
# as `pad_to` or the largest prompt bucket plus `rollout.max_action_tokens`, evaluation sampling `eval.num_envs`
# episodes at a time. M_exp SFT (`plan_exp_sft`, train_exp.py): rows up to `max_len`, held-out scoring and decoding in
# batches of `eval_batch_size` with a `max_new_tokens` budget. DPO (`plan_dpo`, dpo.py): `pairs_per_step` pairs of
# episodes (up to `rollout.max_turns` rows each side), reference scoring in `score_batch` rows, evaluation as policy
# SFT.
POLICY_SFT_FIELDS = ("batch_size", "micro_batches", "pad_to", "rows", "rollout.prompt_buckets",
                     "rollout.max_action_tokens", "eval.num_envs", "export_dtype")
EXP_SFT_FIELDS = ("batch_size", "micro_batches", "max_len", "max_new_tokens", "eval_batch_size", "held_out_fraction",
                  "export_dtype")
DPO_FIELDS = ("pairs_per_step", "micro_batches", "pad_to", "score_batch", "beta", "rollout.max_turns",
              "rollout.prompt_buckets", "rollout.max_action_tokens", "eval.num_envs", "export_dtype")
SUPERVISED_FIELDS = {"policy_sft": POLICY_SFT_FIELDS, "exp_sft": EXP_SFT_FIELDS, "dpo": DPO_FIELDS}

# Memory one process may use per device (GiB), what a plan is compared against: a TPU chip's HBM; on GPUs 90% of it,
# the XLA_PYTHON_CLIENT_MEM_FRACTION that tpu/gpu_*.sh set (JAX's own default, 0.75, would leave less).
ACCELERATORS = {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0, "h100": 72.0, "h200": 126.9, "a100-40gb": 36.0,
                "a100-80gb": 72.0}


def published_config(name: str, **overrides) -> ModelConfig:
  """The ModelConfig of a published model (`PUBLISHED`), e.g. `published_config("llama-3.1-8b", value_head=True)`."""
  if name not in PUBLISHED:
    raise ValueError(f"unknown published model {name!r} (known: {', '.join(PUBLISHED)})")
  return from_hf_config(PUBLISHED[name], source=f"PUBLISHED[{name!r}]", **overrides)


def missing_fields(cfg: Any, fields: Sequence[str]) -> tuple[str, ...]:
  """The dotted `fields` (`RL_FIELDS`, `DREAMGYM_FIELDS`) that `cfg` lacks."""

  def has(obj: Any, dotted: str) -> bool:
    for name in dotted.split("."):
      if not hasattr(obj, name):
        return False
      obj = getattr(obj, name)
    return True

  return tuple(f for f in fields if not has(cfg, f))


def _require(cfg: Any, fields: Sequence[str], what: str) -> None:
  # Configs are duck-typed: a missing field is named here rather than surfacing as an AttributeError mid-plan.
  if missing := missing_fields(cfg, fields):
    raise ValueError(f"{what}: a {type(cfg).__name__} has no {', '.join(missing)} (the planner reads "
                     f"{', '.join(fields)})")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  path: str  # "layers_3/attn/q", as in the parameter tree
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]  # logical axis names
  dtype: str  # numpy name of the parameter's dtype ("bfloat16", "float32")

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize  # jnp's, which knows bfloat16 by name


def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


# Keyed by the (frozen, hashable) config: a plan asks for the same model's list many times, and tracing an 8B model's
# init is the one non-trivial cost here.
@functools.lru_cache(maxsize=64)
def param_specs(cfg: ModelConfig) -> tuple[ParamSpec, ...]:
  """Every parameter of the model, in the tree's (sorted) order: `abstract_params`' leaves, unboxed as
  `tree_shardings` unboxes them (an `nn.Partitioned` box's names are the logical axes; a bare leaf is replicated).
  Always the unrolled layout ("layers_3/attn/q"): stacked layers (`scan_layers`) hold the same bytes with the layer
  axis never sharded, and are exported and gathered layer by layer all the same."""
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params(cfg.replace(scan_layers=False)),
                                                        is_leaf=_is_box):
    value = leaf.value if _is_box(leaf) else leaf
    axes = tuple(leaf.names) if _is_box(leaf) else (None,) * len(value.shape)
    out.append(ParamSpec(jax.tree_util.keystr(path, simple=True, separator="/"), tuple(value.shape), axes,
                         jnp.dtype(value.dtype).name))
  return tuple(out)


def _group(path: str) -> str:
  if path in ("embed", "lm_head", "value_head"):
    return path
  if path.endswith("norm/scale"):
    return "norms"
  return "attention" if "/attn/" in path else "mlp"


def param_count(cfg: ModelConfig) -> dict[str, int]:
  """Parameters by part (embed, attention, mlp, norms, lm_head, value_head) and their `total`."""
  counts = dict.fromkeys(("embed", "attention", "mlp", "norms", "lm_head", "value_head"), 0)
  for spec in param_specs(cfg):
    counts[_group(spec.path)] += spec.size
  counts["total"] = sum(counts.values())
  return counts


def mesh_sizes(mesh: MeshConfig, devices: int | None = None) -> dict[str, int]:
  """Axis sizes of the mesh `make_mesh` would build on `devices` devices (needed only when an axis is -1)."""
  sizes = [mesh.data, mesh.fsdp, mesh.tensor]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"MeshConfig {mesh}: axis sizes must be >= 1, with at most one -1")
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if not devices or devices % known:
      raise ValueError(f"MeshConfig {mesh} has a -1 axis: give the device count (a multiple of {known}), got "
                       f"{devices}")
    sizes[sizes.index(-1)] = devices // known
  if devices and math.prod(sizes) != devices:
    raise ValueError(f"MeshConfig {mesh} needs {math.prod(sizes)} devices, not {devices}")
  return dict(zip(AXES, sizes))


def _mesh(sizes: Mapping[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(sizes[a] for a in AXES), AXES)


def shard_elements(axes: Sequence[str | None], shape: Sequence[int], sizes: Mapping[str, int], rules: Rules) -> int:
  """Elements of one device's shard of an array with these logical axes, placed by `rules`."""
  spec = logical_to_spec(axes, shape, _mesh(sizes), rules)
  n = 1
  for dim, entry in zip(shape, spec):
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    n *= dim // math.prod(sizes[a] for a in names)
  return n


def _divisor(axis: str, dim: int, sizes: Mapping[str, int], rules: Rules) -> int:
  return dim // shard_elements((axis,), (dim,), sizes, rules)


def param_bytes(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules, dtype: str | None = None) -> int:
  """Bytes of one device's parameter shards (in `dtype`, default each parameter's own, the config's param_dtype)."""
  return sum(shard_elements(s.axes, s.shape, sizes, rules) * (DTYPE_BYTES[dtype] if dtype else s.itemsize)
             for s in param_specs(cfg))


def export_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
  """Per-device bytes of the HF export beyond the resident state (`save_model`, leaf by leaf): in a multi-process run
  each leaf comes over in blocks of rows replicated on every device (`dreamjax.parallel.distributed.export_blocks`),
  counted as three copies of the largest block in the wider of the parameters' and the export's dtype (XLA on CPU
  kept up to two beside the output; tests/test_memory.py compiles every block of an 8B model). In one process the
  host assembles the shards and this is an upper bound."""
  def block(s: ParamSpec) -> int:
    start, stop = export_blocks(s.shape, dtype or s.dtype)[0]
    width = max(s.itemsize, DTYPE_BYTES[dtype] if dtype else 0)
    return 3 * (stop - start if s.shape else 1) * math.prod(s.shape[1:]) * width

  return max(block(s) for s in param_specs(cfg))


def compute_copy_bytes(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules) -> int:
  """Bytes of one device's shards of `in_compute_dtype(params)`: the compute dtype but for `FLOAT32_LEAVES`."""
  width = jnp.dtype(cfg.dtype).itemsize
  return sum(shard_elements(s.axes, s.shape, sizes, rules) * (s.itemsize if s.path in FLOAT32_LEAVES else width)
             for s in param_specs(cfg))


def same_layout(cfg: ModelConfig, sizes: Mapping[str, int], a: Rules, b: Rules) -> bool:
  """Whether every parameter is placed identically under both rule tables (then re-laying out is a no-op)."""
  m = _mesh(sizes)
  return all(logical_to_spec(s.axes, s.shape, m, a) == logical_to_spec(s.axes, s.shape, m, b) for s in param_specs(cfg))


def local_rows(rows: int, sizes: Mapping[str, int], rules: Rules) -> int:
  """Rows of a [rows, ...] batch on one device: the `batch` axis over (data, fsdp) where that divides."""
  return shard_elements(("batch",), (rows,), sizes, rules)


def kv_cache_bytes(cfg: ModelConfig, rows: int, slots: int, sizes: Mapping[str, int], rules: Rules = SAMPLE_RULES
                   ) -> int:
  """One device's part of a sampler's KV cache: keys and values of every layer for `rows` x `slots`."""
  per_layer = shard_elements(("batch", "act_kv_heads", "cache_seq", "head_dim"),
                             (rows, cfg.num_kv_heads, slots, cfg.head_dim), sizes, rules)
  return 2 * cfg.num_layers * per_layer * DTYPE_BYTES[cfg.dtype]


def _local_dims(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules) -> tuple[int, int, int]:
  """Query heads, KV heads and MLP width of one device's activations (split over tensor where it divides)."""
  return tuple(dim // _divisor(axis, dim, sizes, rules) for axis, dim in (
      ("act_heads", cfg.num_heads), ("act_kv_heads", cfg.num_kv_heads), ("act_mlp", cfg.intermediate_size)))


def _scores(cfg: ModelConfig, heads: int, keys: int, copies: int) -> int:
  """Bytes per query token of `copies` float32 [heads, keys] score arrays, plus the probabilities in a narrower
  compute dtype."""
  a = DTYPE_BYTES[cfg.dtype]
  return heads * keys * (copies * 4 + (a if a != 4 else 0))


def _query_block(cfg: ModelConfig, length: int) -> int:
  """Queries whose scores are live at once: the model attends `attention_chunk` queries at a time."""
  return length if cfg.attention_chunk <= 0 else min(length, cfg.attention_chunk)


def _per_token(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules, length: int) -> int:
  """Bytes one layer keeps per token for its backward pass (see the module docstring); blocked attention keeps no
  scores (each block is recomputed)."""
  h, k, m = _local_dims(cfg, sizes, rules)
  a = DTYPE_BYTES[cfg.dtype]
  scores = _scores(cfg, h, length, copies=2) if _query_block(cfg, length) == length else 0
  return a * (4 * cfg.hidden_size + (2 * h + 2 * k) * cfg.head_dim + 3 * m) + scores


def _dots_per_token(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules) -> int:
  h, k, m = _local_dims(cfg, sizes, rules)
  a = DTYPE_BYTES[cfg.dtype]
  return a * (2 * cfg.hidden_size + (h + 2 * k) * cfg.head_dim + 2 * m)


def _logits_bytes(cfg: ModelConfig, rows: int, length: int, sizes: Mapping[str, int], rules: Rules) -> int:
  """One device's float32 logits of the (chunked) vocabulary projection over a [rows, length] batch."""
  total = min(rows * length * cfg.vocab_size, max(MAX_LOGITS // (rows * cfg.vocab_size), 1) * rows * cfg.vocab_size)
  share = rows // local_rows(rows, sizes, rules) * _divisor("act_vocab", cfg.vocab_size, sizes, rules)
  return 4 * total // share


def _gathered_layer_bytes(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules) -> int:
  """Two layers' weights all-gathered over fsdp (the one in use and the next, prefetched); 0 without fsdp sharding."""
  layer = [s for s in param_specs(cfg) if s.path.startswith("layers_0/")]
  whole = sum(shard_elements(s.axes, s.shape, sizes, SAMPLE_RULES) for s in layer)
  sharded = sum(shard_elements(s.axes, s.shape, sizes, rules) for s in layer)
  return 0 if whole == sharded else 2 * whole * DTYPE_BYTES[cfg.param_dtype]


def activation_bytes(cfg: ModelConfig, rows: int, length: int, sizes: Mapping[str, int], rules: Rules = TRAIN_RULES
                     ) -> int:
  """Estimated activation memory of one forward + backward over a [rows, length] micro-batch (see the docstring)."""
  tokens = local_rows(rows, sizes, rules) * length
  layer = _per_token(cfg, sizes, rules, length)
  block = _query_block(cfg, length)
  # Blocked attention: the backward pass recomputes one block's scores at a time.
  recomputed = 0 if block == length else \
      local_rows(rows, sizes, rules) * block * _scores(cfg, _local_dims(cfg, sizes, rules)[0], length, copies=2)
  embed = DTYPE_BYTES[cfg.dtype] * cfg.hidden_size
  if cfg.remat == "none":
    kept = (cfg.num_layers + 1) * layer
  elif cfg.remat == "full":
    kept = cfg.num_layers * embed + 2 * layer
  else:
    kept = cfg.num_layers * (embed + _dots_per_token(cfg, sizes, rules)) + 2 * layer
  # Logits of every position: the bound for a loss over whole rows; the update projects only the loss tokens
  # (token_logps' score_mask), so RL rows with long prompts need less than this.
  return tokens * (kept + 3 * embed) + recomputed + 4 * _logits_bytes(cfg, rows, length, sizes, rules) + \
      _gathered_layer_bytes(cfg, sizes, rules)


def forward_bytes(cfg: ModelConfig, rows: int, length: int, sizes: Mapping[str, int], rules: Rules,
                  logits_positions: int | None = None) -> int:
  """Peak temporaries of a forward pass without gradients over `length` tokens (a scoring pass, or a prefill, which
  attends over the prompt alone): one layer at a time, the residual stream, and the logits of `logits_positions`
  positions per row (None: all, chunked as the scorer does)."""
  local = local_rows(rows, sizes, rules)
  tokens = local * length
  h, _, m = _local_dims(cfg, sizes, rules)
  # Without a backward pass only one layer's temporaries are live (one query block's scores, the stream around the
  # layer, gate and up), and the logits come after the last layer: the peak is the larger of the two, over the
  # residual stream.
  a = DTYPE_BYTES[cfg.dtype]
  layer = local * _query_block(cfg, length) * _scores(cfg, h, length, copies=2) + \
      tokens * a * (2 * cfg.hidden_size + 2 * m)
  logits = _logits_bytes(cfg, rows, length if logits_positions is None else logits_positions, sizes, rules)
  return tokens * a * cfg.hidden_size + max(layer, logits) + _gathered_layer_bytes(cfg, sizes, rules)


@dataclasses.dataclass(frozen=True)
class Line:
  name: str
  bytes: int
  phases: tuple[str, ...]  # where it is live; () means always (resident)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes of each component and the phase peaks; `table()` renders it."""

  title: str
  sizes: dict[str, int]
  models: tuple[tuple[str, ModelConfig], ...]  # (role, config)
  lines: tuple[Line, ...]
  phases: tuple[str, ...]
  # Mesh axes some parameters could not be split over, and what that costs (`dropped_axes`), per model and layout.
  notes: tuple[str, ...] = ()

  def peak(self, phase: str) -> int:
    return sum(line.bytes for line in self.lines if not line.phases or phase in line.phases)

  def peaks(self) -> dict[str, int]:
    return {p: self.peak(p) for p in self.phases}

  def table(self, hbm_gib: float | None = None) -> str:
    devices = math.prod(self.sizes.values())
    rows = [self.title, f"mesh data={self.sizes['data']} fsdp={self.sizes['fsdp']} tensor={self.sizes['tensor']} "
                        f"({devices} devices)"]
    for role, cfg in self.models:
      rows.append(f"{role}: {param_count(cfg)['total'] / 1e9:.3f}B params, {cfg.param_dtype} weights, "
                  f"{cfg.dtype} compute, remat {cfg.remat}")
    rows.append(f"{'component':<52}{'GiB/device':>10}  live in")
    for line in self.lines:
      where = ",".join(line.phases) or "all"
      rows.append(f"{line.name:<52}{line.bytes / GIB:>10.2f}  {where}")
    for phase, value in self.peaks().items():
      rows.append(f"{'peak ' + phase:<52}{value / GIB:>10.2f}")
    rows += [f"warning: {note}" for note in self.notes]
    if hbm_gib:
      worst = max(self.peaks().values()) / GIB
      verdict = "fits" if worst <= hbm_gib else "DOES NOT FIT"
      rows.append(f"{verdict} in {hbm_gib:g} GiB per device ({100 * worst / hbm_gib:.0f}% at the peak)")
    return "\n".join(rows)


def _state_lines(role: str, model: ModelConfig, sizes: Mapping[str, int], phases: tuple[str, ...] = ()
                 ) -> list[Line]:
  """The training state: parameters in the TRAIN_RULES layout and AdamW's two moments in their dtype."""
  p_train = param_bytes(model, sizes, TRAIN_RULES)
  return [Line(f"{role} params (train layout)", p_train, phases),
          Line("AdamW moments (2 x params dtype)", 2 * p_train, phases)]


def _update_lines(model: ModelConfig, micro_rows: int, length: int, sizes: Mapping[str, int],
                  phases: tuple[str, ...]) -> list[Line]:
  """The update step's transients (`TrainStep`): the float32 gradient accumulator beside one micro-batch's gradient
  in the parameters' dtype, and the activations of one micro-batch of `micro_rows` rows x `length`."""
  elements = param_bytes(model, sizes, TRAIN_RULES, dtype="float32") // 4
  return [Line("gradients (f32 accumulator + one in dtype)", elements * 4 + param_bytes(model, sizes, TRAIN_RULES),
               phases),
          Line(f"activations ({local_rows(micro_rows, sizes, TRAIN_RULES)} rows/device x {length}, per micro-batch)",
               activation_bytes(model, micro_rows, length, sizes, TRAIN_RULES), phases)]


def _sampler_lines(who: str, model: ModelConfig, rows: int, prompt: int, new_tokens: int, sizes: Mapping[str, int],
                   phases: tuple[str, ...]) -> list[Line]:
  """One sampler call's transients: its KV cache (prompt + answer slots) and its prefill over the prompt."""
  slots = prompt + new_tokens
  return [Line(f"{who} KV cache ({rows} rows x {slots} slots)", kv_cache_bytes(model, rows, slots, sizes), phases),
          Line(f"{who} prefill ({rows} rows x {prompt})",
               forward_bytes(model, rows, prompt, sizes, SAMPLE_RULES, logits_positions=1), phases)]


def _export_line(model: ModelConfig, dtype: str) -> Line:
  return Line("export: one block of a leaf gathered whole", export_bytes(model, dtype or None), ("export",))


def _learner_lines(rl: Any, policy: ModelConfig, sizes: Mapping[str, int],
                   sampling: tuple[str, ...]) -> tuple[list[Line], list[Line]]:
  """The RL learner's (resident, transient) lines: training state and reference; rollout sampling (live in the
  `sampling` phases), reference scoring and the update step."""
  ro = rl.rollout
  rows, prompt = rl.rows, ro.prompt_buckets[-1]
  slots = prompt + ro.max_action_tokens
  length = -(-slots // rl.pad_to) * rl.pad_to  # turn rows: a prompt and its answer, rounded up as take_rows does
  micro_rows = rl.rows_per_step // rl.micro_batches
  resident = _state_lines("policy", policy, sizes)
  if rl.objective.kl_coef:  # frozen, so kept in the compute dtype (`in_compute_dtype`), as is the sampling copy
    resident.append(Line(f"reference params (train layout, {policy.dtype})",
                         compute_copy_bytes(policy, sizes, TRAIN_RULES), ()))
  # With kv_reuse the policy's cache lives for the whole rollout, M_exp's steps between its turns included.
  cache_phases = sampling if getattr(ro, "kv_reuse", False) else ("rollout",)
  cache, prefill = _sampler_lines("policy", policy, rows, prompt, ro.max_action_tokens, sizes, ("rollout",))
  transient = [
      Line(f"policy params for sampling ({policy.dtype})", sampling_copy_bytes(policy, sizes), sampling),
      dataclasses.replace(cache, phases=cache_phases), prefill,
      Line(f"scoring forward ({rl.score_batch} rows x {length})",
           forward_bytes(policy, rl.score_batch, length, sizes, TRAIN_RULES), ("score",)),
      *_update_lines(policy, micro_rows, length, sizes, ("update",)),
      _export_line(policy, rl.export_dtype),
  ]
  return resident, transient


def plan_rl(rl: Any, policy: ModelConfig, sizes: Mapping[str, int], title: str = "dreamjax rl") -> MemoryPlan:
  """The real-env loop (`dreamjax rl`): policy, AdamW, reference, rollouts, scoring, update. `rl` is the loop's RL
  config, read duck-typed (`RL_FIELDS`)."""
  _require(rl, RL_FIELDS, "plan_rl")
  _check_rows(rl, sizes)
  resident, transient = _learner_lines(rl, policy, sizes, ("rollout",))
  return MemoryPlan(title, dict(sizes), (("policy", policy),), tuple(resident + transient),
                    ("rollout", "score", "update", "export"),
                    _dropped("policy", policy, sizes, POLICY_LAYOUTS) + _unplanned(rl))


def plan_dreamgym(cfg: Any, policy: ModelConfig, exp: ModelConfig, sizes: Mapping[str, int],
                  title: str = "dreamjax dreamgym") -> MemoryPlan:
  """The DreamGym loop: the RL learner plus M_exp (sampling layout, resident), its KV cache when it answers the
  policy's turns, and M_task's generation calls (M_exp's weights, the curriculum's budget). `cfg` is the DreamGym
  config, read duck-typed (`DREAMGYM_FIELDS`, and `RL_FIELDS` of its `rl`)."""
  _require(cfg, DREAMGYM_FIELDS, "plan_dreamgym")
  _require(cfg.rl, RL_FIELDS, "plan_dreamgym")
  rl, c = cfg.rl, cfg.curriculum
  _check_rows(rl, sizes)
  if not cfg.exp_prompt_buckets or not cfg.exp_max_new_tokens:
    raise ValueError("DreamGymConfig: the memory plan needs exp_prompt_buckets and exp_max_new_tokens set (otherwise "
                     "they come from the M_exp checkpoint's exp_model.json at run time)")
  # The policy's sampling copy is made once per rollout, so it stays live while M_exp answers (the turns alternate).
  resident, transient = _learner_lines(rl, policy, sizes, ("rollout", "exp_step"))
  resident.append(Line("M_exp params (sampling layout)", param_bytes(exp, sizes, SAMPLE_RULES), ()))
  prompt, rows = cfg.exp_prompt_buckets[-1], rl.rows
  slots = prompt + cfg.exp_max_new_tokens
  # With exp_kv_reuse M_exp's cache lives through the episode batch, the policy's turns included.
  exp_cache_phases = ("rollout", "exp_step") if getattr(cfg, "exp_kv_reuse", False) else ("exp_step",)
  transient += [
      Line(f"M_exp KV cache ({rows} rows x {slots} slots)", kv_cache_bytes(exp, rows, slots, sizes), exp_cache_phases),
      Line(f"M_exp prefill ({rows} rows x {prompt})",
           forward_bytes(exp, rows, prompt, sizes, SAMPLE_RULES, logits_positions=1), ("exp_step",)),
  ]
  phases = ("rollout", "exp_step", "score", "update")
  if c.enabled and c.generate_every:
    task_rows = 1 << max(0, (c.seeds_per_round - 1).bit_length())  # padded to a power of two, as generate_variants
    task_prompt = c.generation.prompt_buckets[-1]  # an upper bound: prompts are padded to the smallest bucket
    slots = task_prompt + c.max_new_tokens
    transient += [
        Line(f"M_task KV cache ({task_rows} rows x {slots} slots)", kv_cache_bytes(exp, task_rows, slots, sizes),
             ("task_gen",)),
        Line(f"M_task prefill ({task_rows} rows x {task_prompt})",
             forward_bytes(exp, task_rows, task_prompt, sizes, SAMPLE_RULES, logits_positions=1),
             ("task_gen",)),
    ]
    phases += ("task_gen",)
  notes = (_dropped("policy", policy, sizes, POLICY_LAYOUTS) + _dropped("M_exp", exp, sizes, {"sampling": SAMPLE_RULES})
           + _unplanned(cfg.rl))
  return MemoryPlan(title, dict(sizes), (("policy", policy), ("M_exp", exp)), tuple(resident + transient),
                    phases + ("export",), notes)


def supervised_kind(cfg: Any) -> str | None:
  """Which supervised command's config `cfg` is ("policy_sft", "exp_sft", "dpo"; `SUPERVISED_FIELDS`), or None."""
  kinds = [k for k, fields in SUPERVISED_FIELDS.items() if not missing_fields(cfg, fields)]
  return kinds[0] if len(kinds) == 1 else None


def _check_batch(cfg: Any, field: str, rows: int, sizes: Mapping[str, int]) -> None:
  dp = sizes["data"] * sizes["fsdp"]  # TrainStep splits rows over the batch axes (data, fsdp)
  if rows % (cfg.micro_batches * dp):
    raise ValueError(f"{type(cfg).__name__}.{field} ({rows}) must be a multiple of micro_batches "
                     f"({cfg.micro_batches}) x data x fsdp ({dp})")


def _turn_row_length(cfg: Any) -> int:
  """Policy SFT and DPO rows: one turn in the rollout layout (a prompt fitted to the largest bucket, an answer within
  `max_action_tokens`), padded to `pad_to`, else the longest row rounded up to 64: at most this."""
  ro = cfg.rollout
  return cfg.pad_to if cfg.pad_to > 0 else -(-(ro.prompt_buckets[-1] + ro.max_action_tokens) // 64) * 64


def sampling_copy_bytes(model: ModelConfig, sizes: Mapping[str, int]) -> int:
  """Bytes per device of `sampling_copy` (the learner's rollouts, the SFT evaluators, M_exp's Predictor): the
  weights in the compute dtype and the sampling layout, or nothing when they are already both, and unrolled."""
  needed = (model.dtype != model.param_dtype or model.scan_layers
            or not same_layout(model, sizes, TRAIN_RULES, SAMPLE_RULES))
  return compute_copy_bytes(model, sizes, SAMPLE_RULES) if needed else 0


def _unplanned(rl: Any) -> tuple[str, ...]:
  """Warnings for RL settings whose memory the plan does not count."""
  if getattr(rl, "shared_prefix", False):
    return ("shared_prefix: the update's per-row copies of the shared prefix's KV cache (rows x layers x prefix) are "
            "not counted in the update phase",)
  return ()


def _supervised_plan(title: str, role: str, model: ModelConfig, sizes: Mapping[str, int], cfg: Any, micro_rows: int,
                     length: int, phases: tuple[str, ...], extra: Sequence[Line]) -> MemoryPlan:
  """A supervised command's plan: the weights as loaded (live throughout), AdamW's moments from the train state's
  creation on (every phase but "load" and "reference"), one update step ("step"), `extra` (evaluation, reference
  scoring) and the final export."""
  params, moments = _state_lines(role, model, sizes)
  trained = tuple(p for p in phases if p not in ("load", "reference"))
  lines = [params, dataclasses.replace(moments, phases=trained), *_update_lines(model, micro_rows, length, sizes,
                                                                                ("step",)),
           *extra, _export_line(model, cfg.export_dtype)]
  return MemoryPlan(title, dict(sizes), ((role, model),), tuple(lines), phases,
                    _dropped(role, model, sizes, POLICY_LAYOUTS))


def _policy_eval_lines(cfg: Any, policy: ModelConfig, sizes: Mapping[str, int]) -> list[Line]:
  """Evaluation in the real env (`dreamjax.loop.evaluate.Evaluator`): the policy resharded for the sampler, greedy
  episodes `eval.num_envs` at a time through the rollout engine (the RL rollout's KV cache and prefill)."""
  ro = cfg.rollout
  return [Line(f"policy params for sampling ({policy.dtype})", sampling_copy_bytes(policy, sizes), ("eval",)),
          *_sampler_lines("policy", policy, cfg.eval.num_envs, ro.prompt_buckets[-1], ro.max_action_tokens, sizes,
                          ("eval",))]


def plan_policy_sft(cfg: Any, policy: ModelConfig, sizes: Mapping[str, int], title: str = "dreamjax train-policy"
                    ) -> MemoryPlan:
  """Policy SFT (`dreamjax train-policy`): the loaded policy, its AdamW state and one update step of `batch_size /
  micro_batches` rows, evaluation in the real env (at the end and every `eval.every_steps`), the export. `cfg` is a
  PolicySftConfig, read duck-typed (`POLICY_SFT_FIELDS`). The row length is its bound (`_turn_row_length`): a run
  whose longest row is shorter pads to less."""
  _require(cfg, POLICY_SFT_FIELDS, "plan_policy_sft")
  _check_batch(cfg, "batch_size", cfg.batch_size, sizes)
  return _supervised_plan(title, "policy", policy, sizes, cfg, cfg.batch_size // cfg.micro_batches,
                          _turn_row_length(cfg), ("load", "step", "eval", "export"),
                          _policy_eval_lines(cfg, policy, sizes))


def plan_exp_sft(cfg: Any, exp: ModelConfig, sizes: Mapping[str, int], title: str = "dreamjax train-exp"
                 ) -> MemoryPlan:
  """M_exp SFT (`dreamjax train-exp`): the loaded M_exp, its AdamW state and one update step of `batch_size /
  micro_batches` rows of up to `max_len` tokens (rounded up to 64, the largest length bucket), and the held-out
  evaluation, for which `Predictor` holds a sampling copy of M_exp's weights (`sampling_copy`, dropped after each
  evaluation): teacher-forced scoring of `eval_batch_size` rows ("eval_score") and greedy decoding of as many with the
  `max_new_tokens` budget ("eval_decode"; 0: the run sets it from the data, at most `max_len`, which is what is
  counted). `cfg` is an
  ExpSftConfig, read duck-typed (`EXP_SFT_FIELDS`)."""
  _require(cfg, EXP_SFT_FIELDS, "plan_exp_sft")
  _check_batch(cfg, "batch_size", cfg.batch_size, sizes)
  length = -(-cfg.max_len // 64) * 64  # fidelity.prompt_buckets' top, which train_exp's length buckets are
  rows, new = cfg.eval_batch_size, cfg.max_new_tokens or cfg.max_len
  copy = sampling_copy_bytes(exp, sizes)
  phases = ("load", "step", "eval_score", "eval_decode", "export")
  extra = [
      Line(f"M_exp params for decoding ({exp.dtype}, Predictor's)", copy, ("eval_score", "eval_decode")),
      # The scorer reads the Predictor's copy (sampling layout, so no layer is gathered over fsdp).
      Line(f"held-out scoring forward ({rows} rows x {length})", forward_bytes(exp, rows, length, sizes, SAMPLE_RULES),
           ("eval_score",)),
      *_sampler_lines("M_exp", exp, rows, length, new, sizes, ("eval_decode",)),
  ]
  return _supervised_plan(title, "M_exp", exp, sizes, cfg, cfg.batch_size // cfg.micro_batches, length, phases, extra)


def dpo_batch_rows(cfg: Any, sizes: Mapping[str, int]) -> int:
  """Rows of a DPO update batch, bounded from the config alone as `dpo._rows_per_micro` bounds them from the data,
  with every episode at `rollout.max_turns` turns (a pair: one row per turn of each side); the run's summary.json
  gives the real `batch_rows`."""
  pair = 2 * cfg.rollout.max_turns
  total = cfg.pairs_per_step * pair
  per_micro = total if cfg.micro_batches == 1 else -(-total // cfg.micro_batches) + pair
  dp = sizes["data"] * sizes["fsdp"]
  return -(-per_micro // dp) * dp * cfg.micro_batches


def plan_dpo(cfg: Any, policy: ModelConfig, sizes: Mapping[str, int], title: str = "dreamjax dpo",
             batch_rows: int | None = None) -> MemoryPlan:
  """DPO (`dreamjax dpo`): the SFT checkpoint loaded once, as the policy and as the reference. The reference's
  log-probs are scored once, before the train state exists ("reference": the loaded weights and a forward of
  `score_batch` rows), so no second copy of the weights is kept; then AdamW, one update step of `batch_rows /
  micro_batches` rows (`batch_rows` default: `dpo_batch_rows`' bound), evaluation as policy SFT, the export. `cfg` is
  a DpoConfig, read duck-typed (`DPO_FIELDS`)."""
  _require(cfg, DPO_FIELDS, "plan_dpo")
  batch_rows = batch_rows or dpo_batch_rows(cfg, sizes)
  _check_batch(cfg, "batch_rows", batch_rows, sizes)
  length = _turn_row_length(cfg)
  extra = [Line(f"reference scoring forward ({cfg.score_batch} rows x {length})",
                forward_bytes(policy, cfg.score_batch, length, sizes, TRAIN_RULES), ("reference",)),
           *_policy_eval_lines(cfg, policy, sizes)]
  return _supervised_plan(title, "policy", policy, sizes, cfg, batch_rows // cfg.micro_batches, length,
                          ("load", "reference", "step", "eval", "export"), extra)


def plan_supervised(cfg: Any, model: ModelConfig, sizes: Mapping[str, int], title: str | None = None,
                    **kw) -> MemoryPlan:
  """The plan of whichever supervised command `cfg` configures (`supervised_kind`); `kw` goes to `plan_dpo`."""
  kind = supervised_kind(cfg)
  if kind is None:
    raise ValueError(f"plan_supervised: a {type(cfg).__name__} is none of PolicySftConfig, ExpSftConfig, DpoConfig "
                     f"(by their fields, SUPERVISED_FIELDS)")
  plan = {"policy_sft": plan_policy_sft, "exp_sft": plan_exp_sft, "dpo": plan_dpo}[kind]
  return plan(cfg, model, sizes, **({"title": title} if title else {}), **kw)


def _dropped(role: str, cfg: ModelConfig, sizes: Mapping[str, int], layouts: Mapping[str, Rules]) -> tuple[str, ...]:
  return tuple(f"{role} ({name} layout): {d}" for name, rules in layouts.items()
               for d in dropped_axes(abstract_params(cfg), _mesh(sizes), rules))


def _check_rows(rl: Any, sizes: Mapping[str, int]) -> None:
  dp = sizes["data"] * sizes["fsdp"]  # TrainStep splits rows over the batch axes (data, fsdp)
  if rl.rows_per_step % (rl.micro_batches * dp):
    raise ValueError(f"RLConfig.rows_per_step ({rl.rows_per_step}) must be a multiple of micro_batches "
                     f"({rl.micro_batches}) x data x fsdp ({dp})")
