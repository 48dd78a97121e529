"""Batched, jitted sampling: one prefill, then one `lax.while_loop` of single-token decode steps over a frozen state.

Prompts may be left- or right-padded and of different lengths: they are re-aligned on device so every row ends at the
same cache slot, which lets all rows write each new token at one shared slot (a scalar dynamic update, no scatter).
RoPE positions are per row, so the padding never shows in the model's output.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dreamjax.models.config import ModelConfig
from dreamjax.models.transformer import KVCache, Transformer
from dreamjax.parallel.distributed import to_devices
from dreamjax.parallel.sharding import SAMPLE_RULES, Rules, named_sharding, tree_shardings
from dreamjax.sampling.logits import choose_tokens


@flax.struct.dataclass
class SamplingParams:
  """Per-row settings, all arrays (changing them never recompiles). Build with `sampling_params`."""

  temperature: Float[Array, " B"]  # <= 0 means greedy
  top_p: Float[Array, " B"]  # >= 1 disables
  top_k: Int[Array, " B"]  # <= 0 disables
  max_new_tokens: Int[Array, " B"]  # per-row budget, at most the sampler's static buffer
  stop: Int[Array, "B N S"]  # stop token sequences, right-aligned, -1 padded on the left


@flax.struct.dataclass
class SampleOutput:
  tokens: Int[Array, "B N"]  # generated ids; pad_id after each row's end
  logps: Float[Array, "B N"]  # log-prob of each generated token at the row's temperature; 0 after the end
  lengths: Int[Array, " B"]  # generated tokens per row, stop sequence included
  stopped: Bool[Array, " B"]  # ended by a stop sequence (False: ran out of budget)


@flax.struct.dataclass
class _State:
  step: Int[Array, ""]  # tokens emitted so far
  tokens: Int[Array, "B N"]
  logps: Float[Array, "B N"]
  lengths: Int[Array, " B"]
  done: Bool[Array, " B"]
  stopped: Bool[Array, " B"]
  tail: Int[Array, "B S"]  # the last S generated tokens, for stop-sequence matching
  positions: Int[Array, " B"]  # RoPE position of the next token
  key_valid: Bool[Array, "B C"]
  logits: Float[Array, "B V"]  # logits for the next token
  cache: KVCache


def sampling_params(
    batch: int,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 1.0,
    top_p: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    stop: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]] = (),
) -> SamplingParams:
  """Host-side builder. `stop` is one list of token sequences for all rows, or one list per row (end-of-sequence ids
  are stop sequences of length one)."""
  per_row = [list(stop)] * batch if not stop or isinstance(stop[0][0], int) else [list(s) for s in stop]
  if len(per_row) != batch:
    raise ValueError(f"sampling_params: {len(per_row)} rows of stop sequences for a batch of {batch}")
  n = max([len(s) for s in per_row] + [1])
  width = max([len(seq) for s in per_row for seq in s] + [1])
  arr = np.full((batch, n, width), -1, np.int32)
  for b, seqs in enumerate(per_row):
    for i, seq in enumerate(seqs):
      if len(seq):
        arr[b, i, width - len(seq):] = seq

  def col(x, dtype):
    return jnp.asarray(np.broadcast_to(np.asarray(x, dtype), (batch,)))

  return SamplingParams(col(temperature, np.float32), col(top_p, np.float32), col(top_k, np.int32),
                        col(max_new_tokens, np.int32), jnp.asarray(arr))


def left_pad(prompts: Mapping[int, Sequence[int]] | Sequence[Sequence[int]], rows: int, width: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """The sampler's prompt layout: (tokens int32, mask bool) [rows, width] with row r's ids (`prompts` maps rows to
  ids, or lists rows 0..) right-aligned. Rows without a prompt get a one-token dummy, so no row attends to nothing;
  give them a budget of 0 new tokens. Callers pick `width` from a few buckets, so the sampler compiles once per
  bucket."""
  prompts = prompts if isinstance(prompts, Mapping) else dict(enumerate(prompts))
  tokens = np.full((rows, width), pad_id, np.int32)
  mask = np.zeros((rows, width), bool)
  mask[:, -1] = True
  for r, p in prompts.items():
    tokens[r, width - len(p):], mask[r, width - len(p):] = p, True
  return tokens, mask


def _left_align(tokens, mask):
  """Moves each row's valid tokens (one contiguous run, left- or right-padded) to the end of the row."""
  p = tokens.shape[1]
  lengths = jnp.sum(mask, -1)
  first = jnp.argmax(mask, -1)
  col = jnp.arange(p)[None, :]
  pad = (p - lengths)[:, None]
  src = jnp.clip(first[:, None] + col - pad, 0, p - 1)
  aligned_mask = col >= pad
  return jnp.where(aligned_mask, jnp.take_along_axis(tokens, src, 1), 0), aligned_mask, lengths


def _sample(params, prompt_tokens, prompt_mask, keys, sp: SamplingParams, *, cfg: ModelConfig, max_new_tokens: int,
            pad_id: int) -> SampleOutput:
  model = Transformer(cfg)
  batch, prompt_len = prompt_tokens.shape
  tokens, mask, lengths = _left_align(prompt_tokens, prompt_mask)
  positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
  key_valid = jnp.concatenate([mask, jnp.zeros((batch, max_new_tokens), bool)], -1)
  cache = KVCache.zeros(cfg, batch, prompt_len + max_new_tokens)
  cache = cache.constrain()
  out = model.apply({"params": params}, tokens, positions, key_valid, cache=cache, cache_index=0, last_only=True)
  state = _State(
      step=jnp.zeros((), jnp.int32),
      tokens=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
      logps=jnp.zeros((batch, max_new_tokens), jnp.float32),
      lengths=jnp.zeros((batch,), jnp.int32),
      done=sp.max_new_tokens <= 0,
      stopped=jnp.zeros((batch,), bool),
      tail=jnp.full((batch, sp.stop.shape[-1]), -2, jnp.int32),
      positions=lengths,
      key_valid=key_valid,
      logits=out.logits[:, 0],
      cache=out.cache,
  )

  def emit(s: _State) -> _State:
    """Chooses token `step` for every live row from the current logits and records it."""
    # Each row draws from its own key folded with the step: a row's sample never depends on its batch neighbours.
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, s.step)))(keys)
    token, logp = choose_tokens(s.logits, u, sp.temperature, sp.top_p, sp.top_k)
    live = ~s.done
    token = jnp.where(live, token, pad_id)
    tail = jnp.concatenate([s.tail[:, 1:], token[:, None]], -1)
    hit = jnp.all((sp.stop == tail[:, None, :]) | (sp.stop < 0), -1) & jnp.any(sp.stop >= 0, -1)
    lengths = s.lengths + live
    stopped = s.stopped | (live & jnp.any(hit, -1))
    return s.replace(
        step=s.step + 1,
        tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, token[:, None], s.step, axis=1),
        logps=jax.lax.dynamic_update_slice_in_dim(s.logps, jnp.where(live, logp, 0.0)[:, None], s.step, axis=1),
        lengths=lengths, stopped=stopped, done=s.done | stopped | (lengths >= sp.max_new_tokens), tail=tail,
        key_valid=jax.lax.dynamic_update_slice_in_dim(s.key_valid, live[:, None], prompt_len + s.step, axis=1),
    )

  def advance(s: _State) -> _State:
    """Feeds the last emitted token through the model: logits for the next one, and its keys/values cached."""
    slot = prompt_len + s.step - 1
    token = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
    out = model.apply({"params": params}, token, s.positions[:, None], s.key_valid, cache=s.cache, cache_index=slot)
    live = jax.lax.dynamic_slice_in_dim(s.key_valid, slot, 1, axis=1)[:, 0]
    return s.replace(logits=out.logits[:, 0], cache=out.cache, positions=s.positions + live)

  # N tokens need N - 1 forwards after the prefill: the loop emits and advances, the last token is emitted after it.
  s = jax.lax.while_loop(lambda s: (s.step < max_new_tokens - 1) & ~jnp.all(s.done), lambda s: advance(emit(s)), state)
  s = emit(s)
  return SampleOutput(tokens=s.tokens, logps=s.logps, lengths=s.lengths, stopped=s.stopped)


class Sampler:
  """Binds a model config, output budget and (optionally) a mesh to one jitted sampling function.

  Calls with the same batch size and prompt length reuse one compilation whatever the settings, prompts or keys.
  """

  def __init__(self, cfg: ModelConfig, max_new_tokens: int, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None,
               rules: Rules = SAMPLE_RULES):
    self.cfg, self.max_new_tokens, self.pad_id, self.mesh, self.rules = cfg, max_new_tokens, pad_id, mesh, rules
    self._fn = jax.jit(functools.partial(_sample, cfg=cfg, max_new_tokens=max_new_tokens, pad_id=pad_id))

  def param_shardings(self):
    """Where parameters should live for sampling (differs from training when training shards over fsdp)."""
    from dreamjax.models.params import abstract_params

    return tree_shardings(abstract_params(self.cfg), self.mesh, self.rules)

  def compilations(self) -> int:
    return self._fn._cache_size()

  def __call__(self, params, prompt_tokens, prompt_mask, key: jax.Array, sp: SamplingParams) -> SampleOutput:
    """`key`: one PRNG key (split per row) or one key per row [B]."""
    batch = np.shape(prompt_tokens)[0]
    keys = key if key.ndim == 1 and key.shape[0] == batch else jax.random.split(key, batch)
    sp = jax.tree.map(jnp.asarray, sp)  # a numpy leaf would be a different jit cache entry than a jax.Array
    if self.mesh is None:
      return self._fn(params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool), keys, sp)
    # Host prompts stay NumPy until `to_devices` places them: with several processes each places only its share.
    host = [x.astype(t) if isinstance(x, jax.Array) else np.asarray(x, t)
            for x, t in ((prompt_tokens, np.int32), (prompt_mask, bool))]
    rows = named_sharding(("batch", None), host[0].shape, self.mesh, self.rules)
    prompt_tokens, prompt_mask = to_devices(tuple(host), (rows, rows))
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return self._fn(params, prompt_tokens, prompt_mask, keys, sp)
