"""One Flax transformer for the Llama 3 and Qwen2 families (RMSNorm, RoPE, GQA, SwiGLU, optional q/k/v biases).

Layers are stacked with `nn.scan` (parameters carry a leading `layers` axis) so compile time does not grow with depth.
Every parameter carries logical axis names; `dreamjax.parallel` maps them to mesh axes.

Attention masking is expressed in cache *slots*: a query in slot q sees key slot k iff k <= q and the key is valid.
Positions (for RoPE) are passed separately, so left padding, right padding and cached decoding all use one code path.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from dreamjax.models.config import ModelConfig
from dreamjax.models.rope import apply_rope, inverse_frequencies
from dreamjax.parallel.sharding import constrain

_INIT = nn.initializers.normal(stddev=0.02)


@flax.struct.dataclass
class KVCache:
  """Preallocated keys and values for every layer: [layers, batch, slots, kv_heads, head_dim]."""

  k: Float[Array, "L B S K D"]
  v: Float[Array, "L B S K D"]

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, slots: int) -> KVCache:
    shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
    return cls(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))

  @property
  def slots(self) -> int:
    return self.k.shape[2]


CACHE_AXES = ("layers", "batch", "cache_seq", "act_kv_heads", "head_dim")


@flax.struct.dataclass
class ModelOutput:
  logits: Float[Array, "B T V"]  # float32; T is 1 when `last_only`
  values: Float[Array, "B T"] | None  # value head output, float32, or None without a value head
  cache: KVCache | None


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], init=_INIT):
  cfg = module.config
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(cfg.param_dtype))


class RMSNorm(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones)
    # Normalise in float32 and cast back before the scale, as transformers does, for parity in bf16 too.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.config.rms_norm_eps)
    return scale.astype(self.config.dtype) * xf.astype(self.config.dtype)


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, positions, q_slots, key_valid, layer_cache, cache_index):
    cfg = self.config
    dt = jnp.dtype(cfg.dtype)
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(name, heads, head_axis):
      w = _param(self, name, (e, heads, d), ("embed", head_axis, "head_dim"))
      y = jnp.einsum("bte,ehd->bthd", x, w.astype(dt))
      if cfg.qkv_bias:
        y = y + _param(self, name + "_bias", (heads, d), (head_axis, "head_dim"), nn.initializers.zeros).astype(dt)
      return y

    inv_freq = inverse_frequencies(cfg)
    q = apply_rope(proj("q", h, "heads"), positions, inv_freq)
    key = apply_rope(proj("k", k, "kv_heads"), positions, inv_freq)
    val = proj("v", k, "kv_heads")
    q = constrain(q, ("batch", "seq", "act_heads", "head_dim"))

    if layer_cache is not None:
      ck, cv = layer_cache
      ck = jax.lax.dynamic_update_slice_in_dim(ck, key.astype(ck.dtype), cache_index, axis=1)
      cv = jax.lax.dynamic_update_slice_in_dim(cv, val.astype(cv.dtype), cache_index, axis=1)
      key, val, new_cache = ck.astype(dt), cv.astype(dt), (ck, cv)
    else:
      new_cache = None

    # Grouped-query attention without repeating K/V: query heads are viewed as [kv_heads, group].
    b, t = q.shape[:2]
    q = q.reshape(b, t, k, h // k, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, key, preferred_element_type=jnp.float32) * (d**-0.5)
    k_slots = jnp.arange(key.shape[1])
    mask = (k_slots[None, :] <= q_slots[:, None])[None] & key_valid[:, None, :]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, val).reshape(b, t, h, d)
    wo = _param(self, "o", (h, d, e), ("heads", "head_dim", "embed"))
    y = jnp.einsum("bthd,hde->bte", out, wo.astype(dt))
    if cfg.o_bias:
      y = y + _param(self, "o_bias", (e,), ("embed",), nn.initializers.zeros).astype(dt)
    return y, new_cache


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dt = jnp.dtype(cfg.dtype)
    e, m = cfg.hidden_size, cfg.intermediate_size

    def dense(name, shape, axes, bias_axis, inp):
      y = inp @ _param(self, name, shape, axes).astype(dt)
      if cfg.mlp_bias:
        y = y + _param(self, name + "_bias", shape[-1:], (bias_axis,), nn.initializers.zeros).astype(dt)
      return y

    gate = dense("gate", (e, m), ("embed", "mlp"), "mlp", x)
    up = dense("up", (e, m), ("embed", "mlp"), "mlp", x)
    hidden = constrain(nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
    return dense("down", (m, e), ("mlp", "embed"), "embed", hidden)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, layer_cache, positions, q_slots, key_valid, cache_index):
    attn_out, new_cache = Attention(self.config, name="attn")(
        RMSNorm(self.config, name="attn_norm")(x), positions, q_slots, key_valid, layer_cache, cache_index
    )
    x = x + attn_out
    x = x + MLP(self.config, name="mlp")(RMSNorm(self.config, name="mlp_norm")(x))
    return constrain(x, ("batch", "seq", "act_embed")), new_cache


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nn.Module):
  """Causal LM. `__call__` runs a full forward (cache None) or writes T new tokens into the cache at `cache_index`."""

  config: ModelConfig

  @nn.compact
  def __call__(
      self,
      tokens: Int[Array, "B T"],
      positions: Int[Array, "B T"],
      key_valid: Bool[Array, "B S"],
      cache: KVCache | None = None,
      cache_index: Int[Array, ""] | int = 0,
      last_only: bool = False,
  ) -> ModelOutput:
    """`key_valid` marks valid key slots: [B, T] without a cache, [B, cache.slots] with one (new tokens included)."""
    cfg = self.config
    dt = jnp.dtype(cfg.dtype)
    embedding = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
    x = constrain(jnp.take(embedding, tokens, axis=0).astype(dt), ("batch", "seq", "act_embed"))
    q_slots = cache_index + jnp.arange(tokens.shape[1])

    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    layers = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, name="layers")
    layer_caches = None if cache is None else (cache.k, cache.v)
    x, new_caches = layers(x, layer_caches, positions, q_slots, key_valid, cache_index)
    new_cache = None if cache is None else KVCache(*new_caches)

    if last_only:
      x = x[:, -1:]
    x = RMSNorm(cfg, name="final_norm")(x)
    if cfg.tie_word_embeddings:
      head = embedding.T
    else:
      head = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    logits = jnp.einsum("bte,ev->btv", x, head.astype(dt), preferred_element_type=jnp.float32)
    logits = constrain(logits, ("batch", "seq", "act_vocab"))
    values = None
    if cfg.value_head:
      w = _param(self, "value_head", (cfg.hidden_size,), ("embed",), nn.initializers.zeros)
      values = jnp.einsum("bte,e->bt", x.astype(jnp.float32), w.astype(jnp.float32))
    return ModelOutput(logits=logits, values=values, cache=new_cache)
