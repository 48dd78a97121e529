"""phi(s, a): the text encoder behind replay retrieval, and the one place its input text is formatted.

The paper leaves phi open ("an arbitrary semantic encoder"); dreamjax offers two behind one protocol:
- `MiniLMEncoder` (default): all-MiniLM-L6-v2 in Flax (`minilm.py`), a sentence encoder trained for semantic
  similarity; 384-d, small enough to embed every transition of a rollout batch each turn.
- `BackbonePooledEncoder`: mean-pooled final hidden states of a dreamjax `Transformer` (the policy's or M_exp's
  weights), for users who want phi to share the backbone's notion of state; no extra model to ship.
Both return float32 [N, dim] rows of unit L2 norm, so cosine similarity is an inner product (what the index searches).

Encoding is jitted over a few fixed shapes: texts are sorted by token count, cut into chunks of `batch_size`, and each
chunk is padded to a power-of-two batch and a power-of-two length (capped at the model's maximum), so encoding any
number of texts reuses at most log2(batch_size) * log2(max_len) compiled programs and never compiles per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dreamjax.models import ModelConfig, Transformer, load_hf_checkpoint
from dreamjax.replay import minilm
from dreamjax.text import Tokenizer, load_tokenizer

MIN_BATCH = 8
MIN_LENGTH = 16


@runtime_checkable
class Encoder(Protocol):
  dim: int

  def encode(self, texts: Sequence[str]) -> np.ndarray:
    """float32 [len(texts), dim], each row of unit L2 norm."""
    ...


def transition_text(state: str, action: str) -> str:
  """phi's input for one (state, action). The action comes first: encoders truncate long inputs at the end, and a
  long state must not push the action (the part that distinguishes transitions from one state) out of view."""
  return f"action: {action.strip()}\nstate: {state.strip()}"


def buckets(limit: int, smallest: int) -> tuple[int, ...]:
  """Powers of two from `smallest` (capped at `limit`) up to `limit`, which is always the last bucket."""
  out, b = [], min(smallest, limit)
  while b < limit:
    out.append(b)
    b *= 2
  return (*out, limit)


def fit(n: int, sizes: Sequence[int]) -> int:
  return next(s for s in sizes if s >= n)


def encode_bucketed(ids: Sequence[Sequence[int]], embed: Callable[[np.ndarray, np.ndarray], Any], dim: int,
                    batch_size: int, max_len: int, pad_id: int) -> np.ndarray:
  """Runs `embed(tokens [B, T] int32, mask [B, T] bool) -> [B, dim]` over length-sorted, bucket-padded chunks and
  returns the rows in input order. Ids longer than `max_len` are cut at the end."""
  out = np.zeros((len(ids), dim), np.float32)
  batches, lengths = buckets(batch_size, MIN_BATCH), buckets(max_len, MIN_LENGTH)
  order = np.argsort([-len(x) for x in ids], kind="stable")  # similar lengths share a chunk: less padding
  for start in range(0, len(ids), batch_size):
    rows = order[start:start + batch_size]
    width = fit(max(1, min(max_len, max(len(ids[r]) for r in rows))), lengths)
    tokens = np.full((fit(len(rows), batches), width), pad_id, np.int32)
    mask = np.zeros(tokens.shape, bool)
    for j, r in enumerate(rows):
      x = list(ids[r])[:width]
      tokens[j, :len(x)], mask[j, :len(x)] = x, True
    out[rows] = np.asarray(embed(tokens, mask))[:len(rows)]
  return out


def _l2(x: Float[Array, "B E"]) -> Float[Array, "B E"]:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class MiniLMEncoder:
  """all-MiniLM-L6-v2 (or any sentence-transformers BERT folder with mean pooling)."""

  def __init__(self, folder: str | Path | None = None, batch_size: int = 64, dtype: str = "float32"):
    cfg, params, self.tokenizer = minilm.load(folder, dtype)
    self.cfg = dataclasses.replace(cfg, normalize=True)  # the Encoder contract: unit rows
    self.params = jax.device_put(params)
    self.dim = self.cfg.hidden_size
    self.batch_size = batch_size
    model = minilm.MiniLM(self.cfg)
    self._embed = jax.jit(lambda p, t, m: model.apply({"params": p}, t, m))

  def encode(self, texts: Sequence[str]) -> np.ndarray:
    ids = minilm.tokenize(self.tokenizer, self.cfg, list(texts))
    return encode_bucketed(ids, lambda t, m: self._embed(self.params, t, m), self.dim, self.batch_size,
                           self.cfg.max_seq_length, self.cfg.pad_id)

  def compilations(self) -> int:
    """Programs compiled so far (bounded by the bucket grid)."""
    return self._embed._cache_size()


class BackbonePooledEncoder:
  """Mean of a dreamjax `Transformer`'s final-norm hidden states over the text's tokens, L2-normalised.

  The text is tokenised without the chat template, after the tokenizer's BOS when it has one. The model is causal, so
  right padding leaves every valid position's hidden state unchanged. `params` may be sharded (e.g. the policy's
  training parameters); the jitted embed follows their sharding.
  """

  def __init__(self, cfg: ModelConfig, params: Any, tokenizer: Tokenizer, batch_size: int = 32, max_len: int = 256):
    self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
    self.dim = cfg.hidden_size
    self.batch_size, self.max_len = batch_size, max_len
    model = Transformer(cfg)

    def embed(p, tokens: Int[Array, "B T"], mask: Bool[Array, "B T"]) -> Float[Array, "B E"]:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
      hidden = model.apply({"params": p}, tokens, positions, mask, return_hidden=True).hidden
      m = mask.astype(jnp.float32)[..., None]
      return _l2((hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1.0))

    self._embed = jax.jit(embed)

  @classmethod
  def from_folder(cls, folder: str | Path, **kw) -> BackbonePooledEncoder:
    """From an HF checkpoint folder (config.json, model.safetensors, tokenizer files)."""
    cfg, params = load_hf_checkpoint(folder)
    return cls(cfg, params, load_tokenizer(folder), **kw)

  def encode(self, texts: Sequence[str]) -> np.ndarray:
    bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
    ids = [bos + self.tokenizer.encode(t) for t in texts]
    return encode_bucketed(ids, lambda t, m: self._embed(self.params, t, m), self.dim, self.batch_size,
                           self.max_len, self.tokenizer.pad_id)

  def compilations(self) -> int:
    return self._embed._cache_size()


ENCODERS = {"minilm": MiniLMEncoder, "backbone": BackbonePooledEncoder}


def make_encoder(name: str = "minilm", **kw) -> Encoder:
  """"minilm" (kw: folder, batch_size, dtype) or "backbone" (kw: folder, or cfg + params + tokenizer; batch_size,
  max_len)."""
  if name not in ENCODERS:
    raise ValueError(f"unknown encoder {name!r}; choose one of {sorted(ENCODERS)}")
  if name == "backbone" and "folder" in kw:
    return BackbonePooledEncoder.from_folder(**kw)
  return ENCODERS[name](**kw)
