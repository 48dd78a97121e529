"""Rotary position embeddings, bit-for-bit the rotate-half convention and frequency schedules of HF transformers."""

import math

import jax.numpy as jnp
import numpy as np

from dreamjax.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """[head_dim // 2] float32, computed in float32 as transformers does so angles agree to the last bit."""
  dim = cfg.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
  s = cfg.rope_scaling
  if s.rope_type == "linear":
    inv = inv / np.float32(s.factor)
  elif s.rope_type == "llama3":
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
  """x: [B, T, H, D]; positions: [B, T] int. Angles in float32 whatever the compute dtype."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
