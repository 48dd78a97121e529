"""Model configuration for the Llama 3 / Qwen2 family, read from and written to HF `config.json`.

One frozen, hashable dataclass: it is a static argument of jitted functions, so every field must be hashable.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# The rope types we implement exactly as transformers does; anything else is refused rather than silently mis-rotated.
_ROPE_TYPES = ("default", "linear", "llama3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # "llama" or "qwen2": decides attention biases and the HF architecture name.
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  qkv_bias: bool = False  # Qwen2 has q/k/v biases; Llama only with attention_bias.
  o_bias: bool = False
  mlp_bias: bool = False
  tie_word_embeddings: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  dtype: str = "float32"  # compute dtype of activations and matmuls
  param_dtype: str = "float32"
  value_head: bool = False  # scalar value head on the final hidden state (PPO critic)
  remat: str = "none"  # "none", "full" or "dots": rematerialisation of each layer in the backward pass
  # Queries per attention block: longer inputs attend block by block, each block's scores recomputed in the backward
  # pass, so float32 scores never exceed [block, keys] per head (0: one block, whatever the length).
  attention_chunk: int = 512
  # Layers stored stacked (one `layers` entry, a leading layer axis) and run by `nn.scan`: one layer's program to trace
  # and compile instead of num_layers. Cache-free forwards only (training, scoring); decoding keeps unrolled layers
  # (`dreamjax.models.params.unstack_layers`). A layout, not an architecture: never written to config.json.
  scan_layers: bool = False

  def __post_init__(self):
    if self.family not in _ARCHITECTURES:
      raise ValueError(f"ModelConfig.family must be one of {sorted(_ARCHITECTURES)}, got {self.family!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.rope_scaling.rope_type not in _ROPE_TYPES:
      raise ValueError(f"rope type {self.rope_scaling.rope_type!r} is not supported (supported: {_ROPE_TYPES})")
    if self.remat not in ("none", "full", "dots"):
      raise ValueError(f"ModelConfig.remat must be 'none', 'full' or 'dots', got {self.remat!r}")
    if self.attention_chunk < 0:
      raise ValueError(f"ModelConfig.attention_chunk must be >= 0 (0: no chunking), got {self.attention_chunk}")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"ModelConfig.scan_layers must be True or False, got {self.scan_layers!r}")

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, RopeScaling]:
  # transformers 5 keeps theta and scaling under `rope_parameters`; older files use `rope_theta` + `rope_scaling`.
  params = dict(d.get("rope_parameters") or {})
  scaling = dict(d.get("rope_scaling") or {})
  theta = params.pop("rope_theta", None) or d.get("rope_theta") or scaling.pop("rope_theta", None) or 10000.0
  merged = {**scaling, **params}
  rope_type = merged.pop("rope_type", merged.pop("type", "default"))
  known = {f.name for f in dataclasses.fields(RopeScaling)}
  kwargs = {k: v for k, v in merged.items() if k in known}
  return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def from_hf_config(d: dict[str, Any], source: str = "config.json", **overrides) -> ModelConfig:
  """Builds a ModelConfig from an HF config dict; `source` names the file in error messages."""
  model_type = d.get("model_type")
  if model_type not in _ARCHITECTURES:
    raise ValueError(f"{source}: model_type {model_type!r} is not supported (supported: {sorted(_ARCHITECTURES)})")
  if d.get("use_sliding_window"):
    raise ValueError(f"{source}: use_sliding_window=true is not supported")
  try:
    num_heads = d["num_attention_heads"]
    theta, scaling = _rope_from_hf(d)
    eos = d.get("eos_token_id")
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        family=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=attention_bias if model_type == "llama" else False,
        mlp_bias=bool(d.get("mlp_bias", False)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        **overrides,
    )
  except KeyError as e:
    raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
  except TypeError as e:
    raise ValueError(f"{source}: {e}") from None


def load_hf_config(folder: str | Path, **overrides) -> ModelConfig:
  path = Path(folder) / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no config.json in the checkpoint folder")
  try:
    d = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
  return from_hf_config(d, source=str(path), **overrides)


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The HF config dict that transformers loads into the same architecture."""
  rope = {"rope_type": cfg.rope_scaling.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling.rope_type == "linear":
    rope["factor"] = cfg.rope_scaling.factor
  elif cfg.rope_scaling.rope_type == "llama3":
    rope.update({k: v for k, v in dataclasses.asdict(cfg.rope_scaling).items() if k != "rope_type"})
  d = {
      "architectures": [_ARCHITECTURES[cfg.family]],
      "model_type": cfg.family,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_parameters": rope,
      "hidden_act": "silu",
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
      "torch_dtype": cfg.param_dtype,
  }
  if cfg.family == "llama":
    d.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
  else:
    d.update(use_sliding_window=False)
  return d


def tiny(family: str = "qwen2", **kw) -> ModelConfig:
  """A model small enough for unit tests on a 2-core CPU."""
  base = dict(
      family=family, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0, qkv_bias=(family == "qwen2"),
  )
  base.update(kw)
  return ModelConfig(**base)
