"""HF safetensors checkpoints <-> our Flax parameters.

Loading reads each tensor lazily from the (possibly multi-file) safetensors checkpoint and builds every parameter with
`jax.make_array_from_callback`, so each device receives only its own shard, read straight from the memory-mapped file:
the whole model is never assembled on one host.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as save_tensors
from safetensors.numpy import save_file

from dreamjax.models.config import ModelConfig, load_hf_config, to_hf_config
from dreamjax.models.params import abstract_params
from dreamjax.parallel.distributed import leaf_to_host
from dreamjax.parallel.sharding import TRAIN_RULES, Rules, tree_shardings
from dreamjax.storage import is_uri, storage_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_VALUE_HEAD_FILE = "value_head.safetensors"  # not an HF tensor: kept beside the checkpoint so round trips keep it


@dataclasses.dataclass(frozen=True)
class _Map:
  """How one HF tensor becomes one of our parameters: reshape to `view`, then transpose by `perm`."""

  hf_name: str
  view: tuple[int, ...]
  perm: tuple[int, ...]
  hf_shape: tuple[int, ...]


def _maps(cfg: ModelConfig) -> dict[str, _Map]:
  """Our parameter path ("layers_3/attn/q") -> its HF tensor."""
  e, m, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = {
      "embed": _Map("model.embed_tokens.weight", (v, e), (0, 1), (v, e)),
      "final_norm/scale": _Map("model.norm.weight", (e,), (0,), (e,)),
  }
  if not cfg.tie_word_embeddings:
    out["lm_head"] = _Map("lm_head.weight", (v, e), (1, 0), (v, e))
  for i in range(cfg.num_layers):
    ours, hf = f"layers_{i}/", f"model.layers.{i}."
    layer = {
        "attn_norm/scale": _Map(hf + "input_layernorm.weight", (e,), (0,), (e,)),
        "mlp_norm/scale": _Map(hf + "post_attention_layernorm.weight", (e,), (0,), (e,)),
        "attn/q": _Map(hf + "self_attn.q_proj.weight", (h, d, e), (2, 0, 1), (h * d, e)),
        "attn/k": _Map(hf + "self_attn.k_proj.weight", (k, d, e), (2, 0, 1), (k * d, e)),
        "attn/v": _Map(hf + "self_attn.v_proj.weight", (k, d, e), (2, 0, 1), (k * d, e)),
        "attn/o": _Map(hf + "self_attn.o_proj.weight", (e, h, d), (1, 2, 0), (e, h * d)),
        "mlp/gate": _Map(hf + "mlp.gate_proj.weight", (m, e), (1, 0), (m, e)),
        "mlp/up": _Map(hf + "mlp.up_proj.weight", (m, e), (1, 0), (m, e)),
        "mlp/down": _Map(hf + "mlp.down_proj.weight", (e, m), (1, 0), (e, m)),
    }
    if cfg.qkv_bias:
      for name, heads in (("q", h), ("k", k), ("v", k)):
        layer[f"attn/{name}_bias"] = _Map(hf + f"self_attn.{name}_proj.bias", (heads, d), (0, 1), (heads * d,))
    if cfg.o_bias:
      layer["attn/o_bias"] = _Map(hf + "self_attn.o_proj.bias", (e,), (0,), (e,))
    if cfg.mlp_bias:
      for name, size in (("gate", m), ("up", m), ("down", e)):
        layer[f"mlp/{name}_bias"] = _Map(hf + f"mlp.{name}_proj.bias", (size,), (0,), (size,))
    out.update({ours + key: mp for key, mp in layer.items()})
  return out


def _groups(hf_shape, view) -> list[list[int]]:
  """Which view dims make up each HF dim (view only splits HF dims, never merges across them)."""
  groups, i = [], 0
  for size in hf_shape:
    group, prod = [], 1
    while prod < size or not group:
      group.append(i)
      prod *= view[i]
      i += 1
    groups.append(group)
  return groups


def _is_full(s: slice, size: int) -> bool:
  return s.indices(size) == (0, size, 1)


def _read(tensor_slice, mp: _Map, index: tuple[slice, ...]) -> np.ndarray:
  """Our-layout block `index` of one HF tensor, reading from the file only the rows/columns it covers."""
  view_index = [slice(None)] * len(mp.view)
  for ours, theirs in enumerate(mp.perm):
    view_index[theirs] = index[ours]
  hf_index, view_shape, rest = [], [], list(view_index)
  for dims in _groups(mp.hf_shape, mp.view):
    inner = math.prod(mp.view[j] for j in dims[1:])
    start, stop, _ = view_index[dims[0]].indices(mp.view[dims[0]])
    if all(_is_full(view_index[j], mp.view[j]) for j in dims[1:]):  # a contiguous range of the HF dim
      hf_index.append(slice(start * inner, stop * inner))
      rest[dims[0]] = slice(None)
      lead = stop - start
    else:
      hf_index.append(slice(None))
      lead = mp.view[dims[0]]
    view_shape += [lead] + [mp.view[j] for j in dims[1:]]
  block = np.asarray(tensor_slice[tuple(hf_index)]).reshape(view_shape)
  return block[tuple(rest)].transpose(mp.perm)


def _tensor_files(folder: Path) -> dict[str, Path]:
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: folder / file for name, file in weight_map.items()}
  files = sorted(folder.glob("*.safetensors"))
  files = [f for f in files if f.name != _VALUE_HEAD_FILE]
  if not files:
    raise FileNotFoundError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
  out = {}
  for f in files:
    with safe_open(f, "np") as handle:
      out.update({name: f for name in handle.keys()})
  return out


def load_hf_checkpoint(
    folder: str | Path, mesh: jax.sharding.Mesh | None = None, rules: Rules = TRAIN_RULES, **config_overrides
) -> tuple[ModelConfig, dict]:
  """Reads config.json and the safetensors weights; returns (config, params) placed with the mesh's shardings."""
  folder = Path(folder)
  cfg = load_hf_config(folder, **config_overrides)
  files = _tensor_files(folder)
  boxed = abstract_params(cfg)
  shapes = nn.unbox(boxed)
  if mesh is None:
    # One device, placed as a jitted step returns arrays it made there: a mesh-less NamedSharding would differ from
    # the update's output, and every jitted function would compile once more in a run's second iteration.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: one, shapes)
  else:
    shardings = tree_shardings(boxed, mesh, rules)
  maps = _maps(cfg)
  handles: dict[Path, object] = {}

  def tensor(name):
    if name not in files:
      raise ValueError(f"{folder}: checkpoint has no tensor {name!r} (needed for a {cfg.family} model)")
    path = files[name]
    if path not in handles:
      handles[path] = safe_open(path, "np")
    return handles[path].get_slice(name)

  def build(path, shape_dtype, sharding):
    key = "/".join(p.key for p in path)
    if key == "value_head":
      return _load_value_head(folder, shape_dtype, sharding)
    # A stacked leaf ("layers/attn/q", `ModelConfig.scan_layers`) holds every layer's tensor on a leading axis: each
    # device's block is read layer by layer from the files, so no unrolled copy is ever built.
    stacked = key.startswith("layers/")
    layer_maps = [maps[f"layers_{i}/{key[7:]}"] for i in range(cfg.num_layers)] if stacked else [maps[key]]
    for mp in layer_maps:
      if tuple(tensor(mp.hf_name).get_shape()) != mp.hf_shape:
        raise ValueError(f"{folder}: tensor {mp.hf_name!r} has shape {tensor(mp.hf_name).get_shape()}, "
                         f"config.json implies {mp.hf_shape}")
    read = lambda mp, index: _read(tensor(mp.hf_name), mp, index).astype(shape_dtype.dtype)  # noqa: E731
    if stacked:
      callback = lambda index: np.stack([read(mp, index[1:]) for mp in layer_maps[index[0]]])  # noqa: E731
    else:
      callback = lambda index: read(layer_maps[0], index)  # noqa: E731
    return jax.make_array_from_callback(shape_dtype.shape, sharding, callback)

  params = jax.tree_util.tree_map_with_path(build, shapes, shardings)
  return cfg, params


def _load_value_head(folder: Path, shape_dtype, sharding):
  path = folder / _VALUE_HEAD_FILE
  if not path.is_file():  # a plain LM checkpoint: the critic head starts at zero, as a fresh one would
    return jax.device_put(jnp.zeros(shape_dtype.shape, shape_dtype.dtype), sharding)
  with safe_open(path, "np") as f:
    return jax.device_put(f.get_tensor("value_head.weight").astype(shape_dtype.dtype), sharding)


def _to_hf(value: np.ndarray, mp: _Map) -> np.ndarray:
  inverse = np.argsort(mp.perm)
  return np.ascontiguousarray(value.transpose(inverse).reshape(mp.hf_shape))


@dataclasses.dataclass(frozen=True)
class _LayerSlice:
  """Layer `i` of a stacked leaf (`ModelConfig.scan_layers`), cut on its devices only when the export writes it, so a
  stacked model's export still moves one layer's tensor at a time, as an unrolled one's does."""

  stacked: jax.Array
  i: int

  @property
  def dtype(self):
    return self.stacked.dtype


def _per_layer(flat: dict, cfg: ModelConfig) -> dict:
  """Leaves by our unrolled paths ("layers_3/attn/q"), whichever layout `flat` holds (the tree's, whatever
  `cfg.scan_layers` says): the HF files have one tensor per layer either way."""
  if not any(k.startswith("layers/") for k in flat):
    return flat
  out = {k: v for k, v in flat.items() if not k.startswith("layers/")}
  out.update({f"layers_{i}/{k[7:]}": _LayerSlice(v, i) for k, v in flat.items() if k.startswith("layers/")
              for i in range(cfg.num_layers)})
  return out


def _array(leaf):
  return leaf.stacked[leaf.i] if isinstance(leaf, _LayerSlice) else leaf


def _write_tensors(tensors: dict[str, np.ndarray], path, metadata: dict[str, str] | None = None) -> None:
  """One safetensors file: written in place on a local disk; built in memory and written once to an object store,
  which cannot be written piecewise."""
  if is_uri(path):
    path.write_bytes(save_tensors(tensors, metadata=metadata))
  else:
    save_file(tensors, path, metadata=metadata)


def save_hf_checkpoint(
    params, cfg: ModelConfig, folder: str | Path, tokenizer_folder: str | Path | None = None,
    max_shard_bytes: int = 2**31, dtype: str | None = None, write: bool = True,
) -> Path:
  """Writes config.json, sharded safetensors with their index, and the tokenizer files, loadable by transformers.

  Leaf by leaf: each parameter comes to the host alone (`leaf_to_host`, cast to `dtype` on its devices first; None
  keeps the parameters' dtype) and at most one safetensors file's tensors are held at once, so neither a device nor
  the host ever holds the whole model (files are planned from the shapes before anything moves). With several
  processes every process calls this on the same tree (each leaf's fetch may be a collective) and only the one with
  `write` writes files. `folder` may be a URI (gs://...: `dreamjax.storage`)."""
  folder = storage_path(folder)
  flat = {"/".join(p.key for p in path): v for path, v in jax.tree_util.tree_leaves_with_path(params)}
  flat = _per_layer(flat, cfg)
  itemsize = {key: jnp.dtype(dtype or v.dtype).itemsize for key, v in flat.items()}
  files: list[list[tuple[str, str, _Map]]] = [[]]  # per file: (HF name, our key, map), in the maps' order
  size = 0
  for key, mp in _maps(cfg).items():
    nbytes = math.prod(mp.hf_shape) * itemsize[key]
    if size and size + nbytes > max_shard_bytes:
      files.append([])
      size = 0
    files[-1].append((mp.hf_name, key, mp))
    size += nbytes
  names = (["model.safetensors"] if len(files) == 1 else
           [f"model-{n + 1:05d}-of-{len(files):05d}.safetensors" for n in range(len(files))])
  if write:
    folder.mkdir(parents=True, exist_ok=True)
  total = 0
  for name, entries in zip(names, files):
    shard = {hf_name: _to_hf(leaf_to_host(_array(flat[key]), dtype), mp) for hf_name, key, mp in entries}
    total += sum(a.nbytes for a in shard.values())
    if write:
      _write_tensors(shard, folder / name, metadata={"format": "pt"})
    del shard  # one file's tensors at a time on the host
  if cfg.value_head:
    head = leaf_to_host(flat["value_head"], dtype)
    if write:
      _write_tensors({"value_head.weight": head}, folder / _VALUE_HEAD_FILE)
  if not write:
    return folder
  if len(files) > 1:
    weight_map = {hf_name: name for name, entries in zip(names, files) for hf_name, _, _ in entries}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  hf_config = to_hf_config(cfg)
  if dtype is not None:
    hf_config["torch_dtype"] = str(jnp.dtype(dtype))  # what the files hold, which a loader may cast from
  (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
  if tokenizer_folder is not None:
    for name in TOKENIZER_FILES:
      src = Path(tokenizer_folder) / name
      if src.is_file():
        (folder / name).write_bytes(src.read_bytes())
  return folder
