"""One Flax transformer for the Llama 3 and Qwen2 families (RMSNorm, RoPE, GQA, SwiGLU, optional q/k/v biases).

Layers are unrolled, each with its own parameters (`layers_0`, ...) and its own KV-cache arrays: a scanned stack made
XLA slice every layer's weights and copy its cache on every decode step (measured 2.7x slower decode on CPU), and the
per-layer layout is also HF's, so checkpoints map one tensor to one parameter.
`ModelConfig.scan_layers` is the training layout: the same `Block` under `nn.scan` over parameters stored stacked (one
`layers` entry, leading axis "layers"), so tracing and compiling cost one layer rather than `num_layers` (the update
step of 32 small layers on CPU: trace 6-10x and XLA compile 2.5-4x faster; steps ~1.2x slower without remat, as fast
with remat "full"; experiments/bench/scan_layers.py). It serves cache-free forwards only, and
`dreamjax.models.params.stack_layers` / `unstack_layers` convert between the two layouts.
Every parameter carries logical axis names; `dreamjax.parallel` maps them to mesh axes.

Attention masking is expressed in cache *slots*: a query in slot q sees key slot k iff k <= q and the key is valid.
Positions (for RoPE) are passed separately, so left padding, right padding and cached decoding all use one code path.
The cache write slot is one scalar for the batch, or one per row (speculative decoding: rows accept different numbers
of draft tokens, so each row writes its next tokens where its own sequence ends).
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
  """Preallocated keys and values, one array per layer. Keys are stored transposed, [batch, kv_heads, head_dim, slots],
  and values as [batch, kv_heads, slots, head_dim], so both attention matmuls read the cache in the layout XLA's dot
  wants: any other layout makes XLA transpose (copy) the whole cache of every layer on every decode step."""

  k: tuple[Float[Array, "B K D S"], ...]
  v: tuple[Float[Array, "B K S D"], ...]

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, slots: int) -> KVCache:
    kv = (batch, cfg.num_kv_heads)
    return cls(tuple(jnp.zeros(kv + (cfg.head_dim, slots), cfg.dtype) for _ in range(cfg.num_layers)),
               tuple(jnp.zeros(kv + (slots, cfg.head_dim), cfg.dtype) for _ in range(cfg.num_layers)))

  @property
  def slots(self) -> int:
    return self.v[0].shape[2]

  def constrain(self) -> KVCache:
    """Applies the cache's logical sharding under the active rules and mesh."""
    return KVCache(tuple(constrain(k, ("batch", "act_kv_heads", "head_dim", "cache_seq")) for k in self.k),
                   tuple(constrain(v, ("batch", "act_kv_heads", "cache_seq", "head_dim")) for v in self.v))


@flax.struct.dataclass
class ModelOutput:
  logits: Float[Array, "B T V"] | None  # float32; T is 1 when `last_only`; None with `values_only`
  values: Float[Array, "B T"] | None  # value head output, float32, or None without a value head
  cache: KVCache | None
  hidden: Float[Array, "B T E"] | None = None  # final hidden states after the final norm, with `return_hidden`


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


def _attend(
    q: Float[Array, "B K G T D"], keys: Float[Array, "B K D S"], values: Float[Array, "B K S D"],
    q_slots: Int[Array, " T"] | Int[Array, "B T"], key_valid: Bool[Array, "B S"], chunk: int,
) -> Float[Array, "B K G T D"]:
  """Causal softmax attention in cache slots (query slot q sees valid key slots <= q), `chunk` queries at a time.
  `q_slots` is shared by the batch [T] or per row [B, T].

  The float32 scores of all queries at once are the largest temporary of a long forward (prompts x slots x heads
  per row), so longer inputs go block by block through `lax.map`; each block is rematerialised in the backward pass,
  which then keeps q, k and v instead of every block's scores. Rows are independent, so blocks change no result."""
  dt = q.dtype
  d = q.shape[-1]

  def block(q, q_slots):
    scores = jnp.einsum("bkgtd,bkds->bkgts", q, keys, preferred_element_type=jnp.float32) * (d**-0.5)
    if q_slots.ndim == 1:
      mask = (jnp.arange(keys.shape[-1])[None, :] <= q_slots[:, None])[None] & key_valid[:, None, :]  # [B, T, S]
    else:
      mask = (jnp.arange(keys.shape[-1])[None, None, :] <= q_slots[:, :, None]) & key_valid[:, None, :]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(scores, axis=-1).astype(dt), values)

  b, k, g, t, _ = q.shape
  if chunk <= 0 or t <= chunk:
    return block(q, q_slots)
  n = -(-t // chunk)
  # Padded queries take slots past the last one; their rows are computed and dropped.
  q_slots = q_slots[..., :1] + jnp.arange(n * chunk)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, n * chunk - t), (0, 0)))
  blocks = q.reshape(b, k, g, n, chunk, d).transpose(3, 0, 1, 2, 4, 5)
  slot_blocks = q_slots.reshape(n, chunk) if q_slots.ndim == 1 else q_slots.reshape(b, n, chunk).transpose(1, 0, 2)
  out = jax.lax.map(jax.checkpoint(lambda a: block(*a)), (blocks, slot_blocks))
  return out.transpose(1, 2, 3, 0, 4, 5).reshape(b, k, g, n * chunk, d)[:, :, :, :t]


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, positions, q_slots, key_valid, layer_cache, cache_index):
    cfg = self.config
    dt = jnp.dtype(cfg.dtype)
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(name, heads, head_axis):
      w = _param(self, name, (e, heads, d), ("embed", head_axis, "head_dim"))
      y = (x @ w.reshape(e, heads * d).astype(dt)).reshape(*x.shape[:2], heads, d)  # a plain GEMM, no transposes
      if cfg.qkv_bias:
        y = y + _param(self, name + "_bias", (heads, d), (head_axis, "head_dim"), nn.initializers.zeros).astype(dt)
      return y

    inv_freq = inverse_frequencies(cfg)
    b, t = x.shape[:2]
    q = apply_rope(proj("q", h, "heads"), positions, inv_freq)
    q = constrain(q, ("batch", "seq", "act_heads", "head_dim"))
    # Grouped-query attention without repeating K/V: query head k * group + g reads KV head k, as in transformers.
    q = q.reshape(b, t, k, h // k, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    new_k = apply_rope(proj("k", k, "kv_heads"), positions, inv_freq).transpose(0, 2, 3, 1)  # [B, K, D, T]
    new_v = proj("v", k, "kv_heads").transpose(0, 2, 1, 3)  # [B, K, T, D]
    keys, values, new_cache = new_k, new_v, None
    if layer_cache is not None:
      ck, cv = layer_cache
      if jnp.ndim(cache_index) == 1:
        # Per-row slots: a batched dynamic update (a scatter of T slots per row), never a pass over the whole cache.
        def write(c, x, axis):
          return jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, axis))(c, x, cache_index)

        ck = write(ck, new_k.astype(ck.dtype), 2)  # per row: [K, D, S], slots on axis 2
        cv = write(cv, new_v.astype(cv.dtype), 1)  # per row: [K, S, D]
      else:
        ck = jax.lax.dynamic_update_slice_in_dim(ck, new_k.astype(ck.dtype), cache_index, axis=3)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, new_v.astype(cv.dtype), cache_index, axis=2)
      new_cache = (ck, cv)
      if isinstance(cache_index, int) and cache_index == 0:
        # A prefill into an empty cache: the new tokens are all the keys there are, so attending over the cache's
        # empty slots (the whole generation budget) would only add masked-out work.
        key_valid = key_valid[:, :t]
      else:
        keys, values = ck.astype(dt), cv.astype(dt)
    out = _attend(q, keys, values, q_slots, key_valid, cfg.attention_chunk).astype(dt)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)
    wo = _param(self, "o", (h, d, e), ("heads", "head_dim", "embed"))
    y = out @ wo.reshape(h * d, e).astype(dt)
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
      cache_index: Int[Array, ""] | Int[Array, " B"] | int = 0,
      last_only: bool = False,
      return_hidden: bool = False,
      values_only: bool = False,
      logits_at: Int[Array, " B"] | None = None,
  ) -> ModelOutput:
    """`key_valid` marks valid key slots: [B, T] without a cache, [B, cache.slots] with one (new tokens included).
    `cache_index`: the first cache slot the T new tokens take, shared [] or per row [B]; the caller keeps every row's
    T slots inside the cache (XLA clamps a write that would run past its end onto earlier slots).

    `return_hidden` also returns the final-norm hidden states (what the LM head reads), e.g. for pooled text
    embeddings; under jit, a caller that uses only them lets XLA drop the vocabulary projection.
    `values_only` skips the LM head (logits None) and never reads an `lm_head` parameter: a critic
    (`dreamjax.rl.critic`) is this model without one, which spares its weights and their optimizer moments.
    `logits_at` [B]: like `last_only`, but each row's output is its column `logits_at[b]` (T becomes 1): a per-row
    prefill whose rows end at different columns (the sampler's `KVReuse` path)."""
    cfg = self.config
    if values_only and not cfg.value_head:
      raise ValueError("Transformer(values_only=True) needs a model with a value head (ModelConfig.value_head=True)")
    dt = jnp.dtype(cfg.dtype)
    embedding = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
    x = constrain(jnp.take(embedding, tokens, axis=0).astype(dt), ("batch", "seq", "act_embed"))
    per_row = jnp.ndim(cache_index) == 1
    q_slots = (jnp.asarray(cache_index)[:, None] if per_row else cache_index) + jnp.arange(tokens.shape[1])

    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    if cfg.scan_layers:
      if cache is not None:
        raise ValueError("Transformer: stacked layers (ModelConfig.scan_layers=True) serve cache-free forwards only; "
                         "for a KV-cache forward unstack first: dreamjax.models.params.unstack_layers(params, cfg) "
                         "with cfg.replace(scan_layers=False)")
      # One Block's program for every layer: params get a leading layer axis ("layers", never sharded), the hidden
      # state is the carry, and everything else is the same for every layer.
      stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.num_layers,
                      in_axes=(nn.broadcast,) * 5, metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(cfg, name="layers")(x, None, positions, q_slots, key_valid, cache_index)
    new_k, new_v = [], []
    for i in range(0 if cfg.scan_layers else cfg.num_layers):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i])
      x, layer_cache = block(cfg, name=f"layers_{i}")(x, layer_cache, positions, q_slots, key_valid, cache_index)
      if cache is not None:
        new_k.append(layer_cache[0])
        new_v.append(layer_cache[1])
    new_cache = None if cache is None else KVCache(tuple(new_k), tuple(new_v))

    if last_only:
      x = x[:, -1:]
    elif logits_at is not None:
      x = jnp.take_along_axis(x, jnp.asarray(logits_at)[:, None, None], 1)
    x = RMSNorm(cfg, name="final_norm")(x)
    logits = None
    if not values_only:
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
    return ModelOutput(logits=logits, values=values, cache=new_cache, hidden=x if return_hidden else None)
