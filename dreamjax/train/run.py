"""What every training loop shares: the run folder, its metrics log, and where its model comes from.

A run folder holds `config.json` (the resolved config), `metrics.jsonl` (one JSON object per logged step, appended
and flushed so a killed run keeps what it logged), the checkpoints the loop writes, and its result files; the loops
write the first two through `dreamjax.track.Tracker`, which uses `MetricsLog` below. Models
always pass through an HF folder: a real checkpoint given in the config, or a tiny one built for the run (a BPE
trained on the run's own text and a random model), so tiny CPU runs take the code path a Llama/Qwen checkpoint takes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.models import ModelConfig, init_params, load_hf_checkpoint, save_hf_checkpoint, tiny
from dreamjax.parallel import TRAIN_RULES, Rules
from dreamjax.text import Tokenizer, load_tokenizer, train_bpe_tokenizer


def to_json(value: Any) -> Any:
  """Config trees (frozen dataclasses, tuples, enums) as plain JSON values."""
  if dataclasses.is_dataclass(value):
    return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): to_json(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [to_json(v) for v in value]
  if isinstance(value, set | frozenset):
    return sorted(to_json(v) for v in value)
  if isinstance(value, np.generic | jax.Array | np.ndarray):
    return np.asarray(value).tolist()
  return value


class MetricsLog:
  """Appends one JSON object per call to `metrics.jsonl`; values are converted to Python floats/ints."""

  def __init__(self, path: Path):
    self.path = path
    self._file = open(path, "a", encoding="utf-8")
    self._start = time.time()

  def log(self, step: int, metrics: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    row = {"step": int(step), "time_s": round(time.time() - self._start, 3), **extra, **plain_values(metrics)}
    self._file.write(json.dumps(row, sort_keys=True) + "\n")
    self._file.flush()
    return row

  def close(self) -> None:
    self._file.close()


def plain_values(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Metrics (arrays, NumPy or Python scalars) as Python numbers and lists, as a JSON row holds them."""
  out = {}
  for k, v in metrics.items():
    v = np.asarray(v)
    out[k] = v.item() if v.ndim == 0 else v.tolist()
  return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where a run's model comes from: an HF checkpoint folder, or (empty `checkpoint`) a tiny model built for the run."""

  checkpoint: str = ""
  tiny: ModelConfig = tiny("qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32)  # vocab_size is the tokenizer's size
  value_head: bool = False  # PPO's critic; added (zero-initialised) when the checkpoint has none
  # How the loaded model computes (they override the checkpoint's config; the weights stay float32: with bfloat16
  # weights AdamW's steps of lr ~1e-6 on weights ~1e-2 fall below bfloat16's resolution and round away).
  dtype: str = "float32"  # activations and matmuls: "bfloat16" for mixed precision
  remat: str = "none"  # rematerialisation of each layer in the backward pass: "none", "full" or "dots"
  attention_chunk: int = 512  # queries per attention block (ModelConfig.attention_chunk)

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"ModelSource.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  def overrides(self) -> dict[str, Any]:
    """What `load_model` applies over the checkpoint's own config."""
    return {"dtype": self.dtype, "remat": self.remat, "attention_chunk": self.attention_chunk}


def build_tiny_checkpoint(source: ModelSource, texts: Iterable[str], folder: Path, seed: int) -> Path:
  """A BPE trained on `texts` plus a random model of `source.tiny`'s shape, saved as an HF folder."""
  tok_dir = folder / "tokenizer"
  tokenizer = train_bpe_tokenizer(texts, tok_dir, vocab_size=source.tiny.vocab_size)
  cfg = source.tiny.replace(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_ids[0],
                            value_head=source.value_head)
  save_hf_checkpoint(init_params(cfg, jax.random.key(seed)), cfg, folder, tokenizer_folder=tok_dir)
  return folder


def load_model(folder: str | Path, *, value_head: bool = False, mesh=None, rules: Rules = TRAIN_RULES,
               seed: int = 0, overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Any, Tokenizer]:
  """(config, params, tokenizer) from an HF folder; a value head is added zero-initialised when asked and absent.
  `overrides` (ModelConfig fields, e.g. `ModelSource.overrides()`) replace the checkpoint config's."""
  cfg, params = load_hf_checkpoint(folder, mesh=mesh, rules=rules, **(overrides or {}))
  if value_head and not cfg.value_head:
    cfg = cfg.replace(value_head=True)
    fresh = init_params(cfg, jax.random.key(seed), mesh=mesh, rules=rules)  # the value head initialises to zeros
    params = {**params, "value_head": fresh["value_head"]}
  return cfg, params, load_tokenizer(folder)


def save_model(params: Any, cfg: ModelConfig, tokenizer_folder: str | Path, folder: str | Path) -> Path:
  folder = Path(folder)
  save_hf_checkpoint(jax.device_get(params), cfg, folder, tokenizer_folder=tokenizer_folder)
  return folder


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """95% Wilson score interval of a success rate: sensible at small n and at rates of 0 or 1, unlike mean +- 2 SE."""
  if n == 0:
    return 0.0, 1.0
  p = successes / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return max(0.0, centre - half), min(1.0, centre + half)
