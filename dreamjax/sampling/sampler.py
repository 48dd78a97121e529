"""Batched, jitted sampling: one prefill, then one `lax.while_loop` of single-token decode steps over a frozen state.

Prompts may be left- or right-padded and of different lengths: they are re-aligned on device so every row ends at the
same cache slot, which lets all rows write each new token at one shared slot (a scalar dynamic update, no scatter).
RoPE positions are per row, so the padding never shows in the model's output.

With `SpeculativeConfig(draft_tokens=K)` the loop instead runs copy-speculative (prompt-lookup) decoding: an experience
model's next state mostly repeats the state in its prompt, and a policy's action copies an admissible action listed
there, so each step drafts up to K tokens per row by looking the row's last tokens up in its own prompt and output (no
draft model), checks them all in one forward over the KV cache, and keeps each row's longest accepted prefix plus one
token from the model. Rows then advance at different rates, so each row writes the cache at its own slot (the slot
after its last accepted token: rejected drafts' keys and values lie past it, hidden by the causal mask until the
row's next step overwrites them). Greedy output equals plain decoding's, sampled output has exactly its distribution
(`logits.verify_draft`), and the log-probs are the model's, as with plain decoding.

Grouped prefill (`Sampler.__call__(..., group=G)`, both decoding modes): when the caller knows that rows come in
groups of G consecutive rows with identical prompts (a GRPO group's G samples of one prompt), the prefill runs on one
row of each group and its cache and first logits are repeated G times; decoding then goes on per row, each row with
its own key, so the output is the ungrouped call's (the prefill's rows are computed alike whatever the batch, up to
float32 rounding of the matmuls). G is a static argument: one more compilation per shape. Under a mesh, a G whose N / G
rows would be split differently over the data axes than the N rows falls back to the plain prefill.

Choices (`Sampler.__call__(..., choices=...)`, plain decoding with or without `KVReuse`): each row may be limited to a
set of whole token sequences, [B, C, L] int32, -1 padded (a policy that must answer with one of the admissible
actions). At each step only tokens that continue a choice the row still matches can be drawn: the logits of every
other token are -inf before temperature, top-k and top-p, so the answer is always one of the choices, drawn with
probability proportional to the product of the model's probabilities of its tokens, each renormalised over the
tokens the choices allow at that step. A row whose choices are all -1 is not limited. The recorded log-probs are
those renormalised ones, of the distribution each token was drawn from: the trainer recomputes them from the same
allowed sets (`dreamjax.rl.logprobs`, `allowed`; docs/paper_map.md, "Admissible-action decoding").
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from dreamjax.parallel.distributed import to_devices, to_host
from dreamjax.parallel.sharding import SAMPLE_RULES, Rules, logical_to_spec, named_sharding, tree_shardings
from dreamjax.sampling.logits import choose_tokens, verify_draft


@flax.struct.dataclass
class SamplingParams:
  """Per-row settings, all arrays (changing them never recompiles). Build with `sampling_params`."""

  temperature: Float[Array, " B"]  # <= 0 means greedy
  top_p: Float[Array, " B"]  # >= 1 disables
  top_k: Int[Array, " B"]  # <= 0 disables
  max_new_tokens: Int[Array, " B"]  # per-row budget, at most the sampler's static buffer
  stop: Int[Array, "B N S"]  # stop token sequences, right-aligned, -1 padded on the left


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """Copy-speculative (prompt-lookup) decoding, fixed when a `Sampler` is built (it sets the loop's shapes).

  Each step, a row's last n tokens (n from `max_ngram` down to `min_ngram`: the longest that occurs earlier wins) are
  looked up in the row's prompt and the tokens it has generated so far, and the latest occurrence wins: the tokens that
  followed it are the draft. Searching the output too catches a model repeating itself, and the latest occurrence is
  the most local context (the current state in an experience model's prompt comes after the retrieved examples).
  A match ending k tokens before the row's end continues with period k past the known tokens, so a repeating pattern
  drafts all K tokens. `draft_tokens` 0 is plain decoding (the default).
  """

  draft_tokens: int = 0  # K: draft tokens checked per forward
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if self.draft_tokens < 0 or not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"SpeculativeConfig: need draft_tokens >= 0 and 1 <= min_ngram <= max_ngram, got {self}")


@flax.struct.dataclass
class SampleOutput:
  tokens: Int[Array, "B N"]  # generated ids; pad_id after each row's end
  logps: Float[Array, "B N"]  # log-prob of each generated token at the row's temperature; 0 after the end
  lengths: Int[Array, " B"]  # generated tokens per row, stop sequence included
  stopped: Bool[Array, " B"]  # ended by a stop sequence (False: ran out of budget)
  # Forward passes that chose this row's tokens (the prefill included): `lengths` without speculation.
  forwards: Int[Array, " B"] | None = None
  # Draft tokens accepted and emitted. lengths = forwards + draft_accepted, less one where a row's last step ended
  # on an accepted draft (a stop sequence or the budget cut the step short).
  draft_accepted: Int[Array, " B"] | None = None

  def speculation_stats(self) -> dict[str, float]:
    """The batch's `speculation_rates`: draft tokens accepted per verify step, tokens per forward pass."""
    if self.forwards is None or self.draft_accepted is None:
      return {}
    stats: dict[str, int] = {}
    count_speculation(stats, self, range(np.shape(self.lengths)[0]))
    return speculation_rates(stats)


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
  matching: Bool[Array, "B C"]  # the choices each row's tokens still match (see the module docstring)
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


def _prefill(model: Transformer, params, tokens, positions, key_valid, cache: KVCache, group: int,
             cache_index: Int[Array, " B"] | int = 0, logits_at: Int[Array, " B"] | None = None
             ) -> tuple[Float[Array, "B V"], KVCache]:
  """The prompts' forward into `cache` at `cache_index`: (next-token logits at the last column, or per row at
  `logits_at`; the cache). With `group` G > 1 rows come in G identical copies (see the module docstring) and `cache`
  has one row per group: one row of each group is run and the results repeated, so the prompt's layer work is done
  N / G times instead of N."""
  if group > 1:
    tokens, positions, key_valid = (x[::group] for x in (tokens, positions, key_valid))
    if logits_at is not None:  # the per-row path: cache_index and logits_at are per row too
      cache_index, logits_at = cache_index[::group], logits_at[::group]
  out = model.apply({"params": params}, tokens, positions, key_valid, cache=cache, cache_index=cache_index,
                    last_only=logits_at is None, logits_at=logits_at)
  logits, cache = out.logits[:, 0], out.cache
  if group > 1:
    logits = jnp.repeat(logits, group, axis=0)
    cache = jax.tree.map(lambda x: jnp.repeat(x, group, axis=0), cache)
  return logits, cache.constrain()


def _restricted(logits, choices, matching, emitted):
  """Logits where a row with choices keeps only the tokens that continue one of its still-`matching` choices at
  position `emitted` (per row), and each choice's token there ([B, C], -1 past its end)."""
  b, c, width = choices.shape
  at = jnp.broadcast_to(jnp.minimum(emitted, width - 1)[:, None, None], (b, c, 1))
  nxt = jnp.where((emitted < width)[:, None], jnp.take_along_axis(choices, at, 2)[..., 0], -1)
  open_ = matching & (nxt >= 0)
  allowed = jnp.zeros(logits.shape, jnp.int32).at[jnp.arange(b)[:, None], jnp.maximum(nxt, 0)].add(open_) > 0
  limit = jnp.any(open_, -1)[:, None]
  return jnp.where(limit & ~allowed, -jnp.inf, logits), nxt


def _choose(logits, u, sp: SamplingParams, choices, matching, emitted):
  """`choose_tokens`, within each row's choices when `choices` is given: (token, its log-prob under the distribution
  it was drawn from, renormalised over the allowed tokens, the choices the row still matches after it)."""
  if choices is None:
    token, logp = choose_tokens(logits, u, sp.temperature, sp.top_p, sp.top_k)
    return token, logp, matching
  restricted, nxt = _restricted(logits, choices, matching, emitted)
  token, logp = choose_tokens(restricted, u, sp.temperature, sp.top_p, sp.top_k)
  return token, logp, matching & (nxt == token[:, None])


def _first_matching(choices, batch: int):
  """Every row matches all of its choices before its first token; [B, 1] of False without choices."""
  return jnp.zeros((batch, 1), bool) if choices is None else choices[:, :, 0] >= 0


def _sample(params, prompt_tokens, prompt_mask, keys, sp: SamplingParams, group: int = 1, choices=None, *,
            cfg: ModelConfig, max_new_tokens: int, pad_id: int) -> SampleOutput:
  model = Transformer(cfg)
  batch, prompt_len = prompt_tokens.shape
  tokens, mask, lengths = _left_align(prompt_tokens, prompt_mask)
  positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
  key_valid = jnp.concatenate([mask, jnp.zeros((batch, max_new_tokens), bool)], -1)
  cache = KVCache.zeros(cfg, batch // group, prompt_len + max_new_tokens).constrain()
  first_logits, cache = _prefill(model, params, tokens, positions, key_valid, cache, group)
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
      logits=first_logits,
      matching=_first_matching(choices, batch),
      cache=cache,
  )

  def emit(s: _State) -> _State:
    """Chooses token `step` for every live row from the current logits and records it."""
    # Each row draws from its own key folded with the step: a row's sample never depends on its batch neighbours.
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, s.step)))(keys)
    token, logp, matching = _choose(s.logits, u, sp, choices, s.matching, s.lengths)
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
        matching=matching,
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
  return SampleOutput(tokens=s.tokens, logps=s.logps, lengths=s.lengths, stopped=s.stopped, forwards=s.lengths,
                      draft_accepted=jnp.zeros_like(s.lengths))


def prompt_lookup(seq: Int[Array, "B L"], valid: Bool[Array, "B L"], end: Int[Array, " B"], draft_tokens: int,
                  max_ngram: int, min_ngram: int = 1) -> tuple[Int[Array, "B K"], Bool[Array, " B"]]:
  """Per row, the `draft_tokens` tokens that followed the latest earlier occurrence of the row's last n tokens
  `seq[end - n + 1 : end + 1]`, the longest n in [min_ngram, max_ngram] winning, among its `valid` slots (one
  contiguous run ending at `end`). A match ending at i repeats seq[i + 1 : end + 1] periodically, so the draft never
  reads past `end`. `found` is False where no n-gram matches (the draft is then arbitrary). Fixed shapes, no sort:
  O(L * max_ngram) comparisons per row."""
  b, length = seq.shape
  col = jnp.arange(length)
  run = jnp.zeros((b, length), jnp.int32)  # how many of the row's last tokens match the tokens ending at each slot
  matching = jnp.ones((b, length), bool)
  for t in range(max_ngram):
    target = jnp.take_along_axis(seq, jnp.maximum(end - t, 0)[:, None], 1)
    earlier = jnp.pad(seq, ((0, 0), (t, 0)))[:, :length]  # earlier[:, i] = seq[:, i - t]
    earlier_valid = jnp.pad(valid, ((0, 0), (t, 0)))[:, :length]
    matching &= earlier_valid & (earlier == target)
    run += matching
  score = jnp.where((col[None] < end[:, None]) & (run >= min_ngram), run * length + col, -1)
  best = jnp.argmax(score, -1)
  period = jnp.maximum(end - best, 1)
  src = best[:, None] + 1 + jnp.arange(draft_tokens)[None] % period[:, None]
  return jnp.take_along_axis(seq, jnp.minimum(src, length - 1), 1), jnp.max(score, -1) >= 0


SPECULATION_KEYS = ("forwards", "draft_accepted", "answers", "answer_tokens")


def count_speculation(stats: dict, out: SampleOutput, rows: Sequence[int]) -> None:
  """Adds `rows`' forward passes, accepted draft tokens, answers (rows that produced a token) and their tokens to
  `stats` (`SPECULATION_KEYS`), the running totals a caller keeps over many sampler calls."""
  rows = list(rows)
  lengths = np.asarray(out.lengths)[rows]
  # An output without the counts (a stand-in sampler) decoded plainly: one forward per token, nothing drafted.
  forwards = lengths if out.forwards is None else np.asarray(out.forwards)[rows]
  accepted = 0 if out.draft_accepted is None else np.asarray(out.draft_accepted)[rows]
  for name, value in (("forwards", forwards), ("draft_accepted", accepted), ("answers", lengths > 0),
                      ("answer_tokens", lengths)):
    stats[name] = stats.get(name, 0) + int(np.sum(value))


def speculation_rates(stats: dict) -> dict[str, float]:
  """From `count_speculation`'s totals: draft tokens accepted per verify step (0 without speculation) and tokens per
  forward pass (1.0 without). Each answer's first token comes from its prefill, which verifies nothing: not a step."""
  forwards = stats.get("forwards", 0)
  return dict(accepted_per_step=stats.get("draft_accepted", 0) / max(forwards - stats.get("answers", 0), 1),
              tokens_per_forward=stats.get("answer_tokens", 0) / max(forwards, 1))


@flax.struct.dataclass
class _RowState:
  iters: Int[Array, ""]
  seq: Int[Array, "B S"]  # the prompt where `prompt_valid`, then the generated tokens: cache slot order
  logps: Float[Array, "B N"]
  lengths: Int[Array, " B"]
  done: Bool[Array, " B"]
  stopped: Bool[Array, " B"]
  tail: Int[Array, "B S"]
  forwards: Int[Array, " B"]
  draft_accepted: Int[Array, " B"]
  matching: Bool[Array, "B C"]
  cache: KVCache


def _decode_rows(model: Transformer, params, cache: KVCache, key_valid, seq, prompt_valid, start, pos0, first_logits,
                 keys, sp: SamplingParams, choices=None, *, n_max: int, spec: SpeculativeConfig
                 ) -> tuple[SampleOutput, KVCache]:
  """Decoding where every row writes the cache at its own slot: row b's j-th generated token takes slot
  `start[b] + j` of `seq` [B, S] and of the cache, with RoPE position `pos0[b] + j`. With K = `spec.draft_tokens` > 0
  each step drafts K tokens per row by prompt lookup, runs one forward over [last token, K drafts] and emits each
  row's accepted prefix plus one token (1 to K + 1 tokens); with K = 0 each step emits one token drawn with plain
  decoding's uniform, so the output is `_sample`'s (`choices` too, which need K = 0). Returns the output and the cache
  (the `KVReuse` path keeps it)."""
  k = spec.draft_tokens
  if k and choices is not None:
    raise ValueError("sampling within choices runs plain decoding: speculative decoding drafts tokens that the "
                     "choices may not allow")
  batch, width = seq.shape
  col = jnp.arange(width)
  out_col = jnp.arange(n_max)
  budget = jnp.minimum(sp.max_new_tokens, n_max)

  def record(s: _RowState, token, logp, live) -> _RowState:
    """Appends token to each `live` row, with plain decoding's stop-sequence and budget checks: a row that ends here
    takes no further tokens, even ones accepted in the same verify step."""
    tail = jnp.where(live[:, None], jnp.concatenate([s.tail[:, 1:], token[:, None]], -1), s.tail)
    hit = jnp.all((sp.stop == tail[:, None, :]) | (sp.stop < 0), -1) & jnp.any(sp.stop >= 0, -1)
    lengths = s.lengths + live
    stopped = s.stopped | (live & jnp.any(hit, -1))
    at = live[:, None] & (col[None] == (start + s.lengths)[:, None])
    out_at = live[:, None] & (out_col[None] == s.lengths[:, None])
    return s.replace(
        seq=jnp.where(at, token[:, None], s.seq), logps=jnp.where(out_at, logp[:, None], s.logps),
        lengths=lengths, stopped=stopped, done=s.done | stopped | (lengths >= budget), tail=tail,
    )

  # The first token comes from the prefill's logits with plain decoding's uniform, so it is plain decoding's token.
  u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0)))(keys)
  token, logp, matching = _choose(first_logits, u, sp, choices, _first_matching(choices, batch),
                                  jnp.zeros(batch, jnp.int32))
  live = budget > 0
  state = _RowState(
      iters=jnp.zeros((), jnp.int32),
      seq=seq,
      logps=jnp.zeros((batch, n_max), jnp.float32),
      lengths=jnp.zeros((batch,), jnp.int32),
      done=~live,
      stopped=jnp.zeros((batch,), bool),
      tail=jnp.full((batch, sp.stop.shape[-1]), -2, jnp.int32),
      forwards=live.astype(jnp.int32),
      draft_accepted=jnp.zeros((batch,), jnp.int32),
      matching=matching,
      cache=cache,
  )
  state = record(state, token, logp, live)

  def step(s: _RowState) -> _RowState:
    live = ~s.done
    end = start + s.lengths - 1  # slot of each row's last token, the one whose keys/values are not cached yet
    last = jnp.take_along_axis(s.seq, end[:, None], 1)
    pos = (pos0 + s.lengths - 1)[:, None] + jnp.arange(k + 1)

    def single(u_token):
      # One token per row, at the cost of plain decoding.
      o = model.apply({"params": params}, last, pos[:, :1], key_valid, cache=s.cache, cache_index=end)
      tok, lp, matching = _choose(o.logits[:, 0], u_token, sp, choices, s.matching, s.lengths)
      pad = jnp.zeros((batch, k), jnp.int32)
      return (jnp.concatenate([tok[:, None], pad], 1), jnp.concatenate([lp[:, None], pad.astype(lp.dtype)], 1),
              jnp.zeros((batch,), jnp.int32), o.cache, matching)

    if k == 0:
      # Plain decoding's draw for token j: the row's key folded with j (`_sample`'s step).
      u0 = jax.vmap(lambda key, n: jax.random.uniform(jax.random.fold_in(key, n)))(keys, s.lengths)
      toks, lps, n_acc, cache, matching = single(u0)
      # A row that emits nothing this step keeps its choices (its token is never recorded).
      s = s.replace(matching=jnp.where(live[:, None], matching, s.matching))
    else:
      valid = prompt_valid | ((col[None] >= start[:, None]) & (col[None] <= end[:, None]))
      draft, found = prompt_lookup(s.seq, valid, end, k, spec.max_ngram, spec.min_ngram)
      found &= live
      # Per row from its own key and length (which grows every step): a row's draws never depend on its neighbours.
      u = jax.vmap(lambda key, n: jax.random.uniform(jax.random.fold_in(key, n), (2, k + 1)))(keys, s.lengths)

      def verify():
        o = model.apply({"params": params}, jnp.concatenate([last, draft], 1), pos, key_valid, cache=s.cache,
                        cache_index=end)
        # Position K checks no draft: after K accepted drafts it yields the bonus token.
        has = found[:, None] & (jnp.arange(k + 1) < k)[None]
        padded = jnp.concatenate([draft, jnp.zeros((batch, 1), jnp.int32)], 1)
        toks, lps, acc = verify_draft(o.logits, padded, has, u[:, 0], u[:, 1], sp.temperature, sp.top_p, sp.top_k)
        return toks, lps, jnp.sum(jnp.cumprod(acc, -1), -1), o.cache

      # No row has a draft: the single step, with the uniform verify's position 0 would use.
      toks, lps, n_acc, cache = jax.lax.cond(jnp.any(found), verify, lambda: single(u[:, 1, 0])[:4])
    s = s.replace(iters=s.iters + 1, cache=cache, forwards=s.forwards + live)
    for j in range(k + 1):
      emit = ~s.done & (j <= n_acc)
      s = record(s, toks[:, j], lps[:, j], emit)
      s = s.replace(draft_accepted=s.draft_accepted + (emit & (j < n_acc)))
    return s

  # Every step emits at least one token per live row, so n_max steps always suffice; the bound is only a guard.
  s = jax.lax.while_loop(lambda s: (s.iters < n_max) & ~jnp.all(s.done), step, state)
  src = jnp.minimum(start[:, None] + out_col[None], width - 1)
  return SampleOutput(tokens=jnp.take_along_axis(s.seq, src, 1), logps=s.logps, lengths=s.lengths,
                      stopped=s.stopped, forwards=s.forwards, draft_accepted=s.draft_accepted), s.cache


def _sample_speculative(params, prompt_tokens, prompt_mask, keys, sp: SamplingParams, group: int = 1, *,
                        cfg: ModelConfig, max_new_tokens: int, pad_id: int, spec: SpeculativeConfig) -> SampleOutput:
  """`_sample` with copy-speculative decoding (`_decode_rows` with K > 0) after the same prefill."""
  model = Transformer(cfg)
  k, n_max = spec.draft_tokens, max_new_tokens
  batch, prompt_len = prompt_tokens.shape
  tokens, mask, plen = _left_align(prompt_tokens, prompt_mask)
  positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
  # K spare slots: a finished row still writes K + 1 slots from its last token, and XLA would clamp a write that ran
  # past the end of the cache back onto earlier slots. Generated slots are all valid: the causal mask hides a row's
  # slots past its query, which are the only ones holding rejected drafts.
  key_valid = jnp.concatenate([mask, jnp.ones((batch, n_max + k), bool)], -1)
  cache = KVCache.zeros(cfg, batch // group, prompt_len + n_max + k).constrain()
  first_logits, cache = _prefill(model, params, tokens, positions, key_valid, cache, group)
  seq = jnp.concatenate([jnp.where(mask, tokens, pad_id), jnp.full((batch, n_max), pad_id, jnp.int32)], -1)
  prompt_valid = jnp.concatenate([mask, jnp.zeros((batch, n_max), bool)], -1)
  start = jnp.full((batch,), prompt_len, jnp.int32)
  out, _ = _decode_rows(model, params, cache, key_valid, seq, prompt_valid, start, plen, first_logits, keys, sp,
                        n_max=n_max, spec=spec)
  return out


def _sample_reuse(params, cache: KVCache, tokens, lengths, reuse, keys, sp: SamplingParams, group: int = 1,
                  choices=None, *,
                  cfg: ModelConfig, max_new_tokens: int, pad_id: int, spec: SpeculativeConfig, width: int
                  ) -> tuple[SampleOutput, KVCache]:
  """The `KVReuse` path. `tokens` [B, P]: each row's whole prompt from column 0 (pad after it), `lengths` [B] its
  length, `reuse` [B] how many of its first tokens `cache` already holds at slots 0.. (always < lengths). Slot and
  RoPE position are equal in this layout. One `width`-column forward prefills columns reuse .. lengths - 1 of each
  row at its slots (columns past a row's prompt write slots that its decoding overwrites before any query can see
  them: the causal mask hides slots past the query), then `_decode_rows` decodes from slot `lengths`."""
  model = Transformer(cfg)
  n_max = max_new_tokens
  batch, p = tokens.shape
  col = reuse[:, None] + jnp.arange(width)
  suffix = jnp.take_along_axis(tokens, jnp.minimum(col, p - 1), 1)
  # Every slot is valid: slots past a row's last written one are never at or before a query's slot when read.
  key_valid = jnp.ones((batch, cache.slots), bool)
  if group > 1:
    cache = jax.tree.map(lambda x: x[::group], cache)
  first_logits, cache = _prefill(model, params, suffix, col, key_valid, cache, group, cache_index=reuse,
                                 logits_at=lengths - 1 - reuse)
  prompt_valid = jnp.arange(p + n_max)[None] < lengths[:, None]
  seq = jnp.where(prompt_valid, jnp.pad(tokens, ((0, 0), (0, n_max))), pad_id)
  return _decode_rows(model, params, cache, key_valid, seq, prompt_valid, lengths, lengths, first_logits, keys, sp,
                      choices, n_max=n_max, spec=spec)


@dataclasses.dataclass
class KVReuse:
  """Rows' KV caches kept on device between calls of one `Sampler` (`Sampler.__call__(..., reuse=...)`), for
  multi-turn callers whose next prompt repeats much of the last prompt and answer.

  Row r's cache holds the keys and values of `held[r]` (its last prompt and answer but the answer's last token, whose
  keys were never computed) at slots 0..; the next call prefills only the part of the row's new prompt after its
  longest common prefix with `held[r]`, and a prefix that breaks at once (a new episode, dropped history) is a full
  prefill. Tokens and log-probs equal the full-prefill path's to float32 rounding (the prefix's keys were computed in
  another forward); tests/test_kv_reuse.py checks it. `prompt_tokens` and `prefilled` count the prompt tokens of the
  calls' live rows (budget > 0) and how many of them the caches did not hold. The prefill forward itself runs a fixed
  number of columns per row: the smallest of a quarter, half or all of the prompt bucket that holds every row's new
  tokens.
  """

  cache: KVCache | None = None
  held: list[np.ndarray] = dataclasses.field(default_factory=list)
  prompt_tokens: int = 0
  prefilled: int = 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two id arrays."""
  n = min(len(a), len(b))
  differ = np.flatnonzero(a[:n] != b[:n])
  return int(differ[0]) if len(differ) else n


class Sampler:
  """Binds a model config, output budget and (optionally) a mesh to one jitted sampling function.

  Calls with the same batch size and prompt length reuse one compilation whatever the settings, prompts or keys.
  `speculative` (off by default) turns on copy-speculative decoding; its statistics are in `SampleOutput.forwards`,
  `.draft_accepted` and `.speculation_stats()`. A call with `group` G > 1 prefills each group of G identical prompts
  once (see the module docstring); each G used compiles once more. A call with `reuse` (a `KVReuse` the caller keeps
  across its calls) prefills only what each row's cache does not already hold; it compiles once per (prompt width,
  prefill width, cache slots, G), the prefill width being the smallest of a quarter, half or all of the prompt width
  that holds every row's new part.
  """

  def __init__(self, cfg: ModelConfig, max_new_tokens: int, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None,
               rules: Rules = SAMPLE_RULES, speculative: SpeculativeConfig | None = None):
    # Decoding writes per-layer KV caches: unrolled layers whatever the training layout (ModelConfig.scan_layers;
    # PolicyLearner.sampling_params unstacks the weights).
    cfg = cfg.replace(scan_layers=False)
    self.cfg, self.max_new_tokens, self.pad_id, self.mesh, self.rules = cfg, max_new_tokens, pad_id, mesh, rules
    self.speculative = speculative or SpeculativeConfig()
    if self.speculative.draft_tokens:
      fn = functools.partial(_sample_speculative, spec=self.speculative)
    else:
      fn = _sample  # plain decoding, untouched by speculation
    bound = dict(cfg=cfg, max_new_tokens=max_new_tokens, pad_id=pad_id)
    self._fn = jax.jit(functools.partial(fn, **bound), static_argnums=5)
    # The cache is donated: the caller's KVReuse gets the updated one back, so one copy lives at a time.
    self._reuse_fn = jax.jit(functools.partial(_sample_reuse, spec=self.speculative, **bound),
                             static_argnums=7, static_argnames="width", donate_argnums=1)
    self._zeros = jax.jit(lambda batch, slots: KVCache.zeros(cfg, batch, slots).constrain(), static_argnums=(0, 1))
    self._param_shardings = None

  def param_shardings(self):
    """Where parameters should live for sampling (differs from training when training shards over fsdp)."""
    if self._param_shardings is None:
      from dreamjax.models.params import abstract_params

      self._param_shardings = tree_shardings(abstract_params(self.cfg), self.mesh, self.rules)
    return self._param_shardings

  def compilations(self) -> int:
    return self._fn._cache_size() + self._reuse_fn._cache_size()

  def group_for(self, batch: int, group: int) -> int:
    """The prefill group a call of `batch` rows asking for `group` gets: `group`, or 1 (plain prefill) where it does
    not divide the batch or, under a mesh, where batch / group rows would not be split over the data axes as the
    batch's rows are (the repeated cache would have to move between devices)."""
    if group <= 1 or batch % group:
      return 1
    if self.mesh is not None:
      spec = lambda n: logical_to_spec(("batch",), (n,), self.mesh, self.rules)  # noqa: E731
      if spec(batch // group) != spec(batch):
        return 1
    return group

  def __call__(self, params, prompt_tokens, prompt_mask, key: jax.Array, sp: SamplingParams, group: int = 1,
               reuse: KVReuse | None = None, choices: np.ndarray | None = None) -> SampleOutput:
    """`key`: one PRNG key (split per row) or one key per row [B]. `group` G: the caller promises that rows
    G * i .. G * i + G - 1 have identical prompts (tokens and mask), so each group is prefilled once (`group_for`
    may turn it down); the output is that of `group` 1. `reuse`: the caller's `KVReuse`, updated in place; the
    output then comes back on the host (NumPy), since the held tokens are needed there. `choices` [B, C, L] int32,
    -1 padded: the token sequences each row may produce (see the module docstring); plain decoding only."""
    batch = np.shape(prompt_tokens)[0]
    if choices is not None:
      if self.speculative.draft_tokens:
        raise ValueError("Sampler: choices need plain decoding; this sampler was built with speculative decoding")
      choices = np.asarray(choices, np.int32)
      if choices.ndim != 3 or choices.shape[0] != batch or choices.shape[1] < 1:
        raise ValueError(f"Sampler: choices must be [rows={batch}, choices, length], got {choices.shape}")
    keys = key if key.ndim == 1 and key.shape[0] == batch else jax.random.split(key, batch)
    sp = jax.tree.map(jnp.asarray, sp)  # a numpy leaf would be a different jit cache entry than a jax.Array
    group = self.group_for(batch, group)
    if reuse is not None:
      return self._call_reuse(params, prompt_tokens, prompt_mask, keys, sp, group, reuse, choices)
    # Speculative decoding takes no choices argument at all (refused above).
    if self.mesh is None:
      extra = () if choices is None else (jnp.asarray(choices),)
      return self._fn(params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool), keys, sp, group,
                      *extra)
    prompt_tokens, prompt_mask = self._rows_to_devices(
        *(x.astype(t) if isinstance(x, jax.Array) else np.asarray(x, t)
          for x, t in ((prompt_tokens, np.int32), (prompt_mask, bool))))
    extra = () if choices is None else self._rows_to_devices(choices)
    with self._mesh_context():
      return self._fn(params, prompt_tokens, prompt_mask, keys, sp, group, *extra)

  def _rows_to_devices(self, *arrays):
    """Arrays with rows first, placed by rows over the mesh's data axes. Host arrays stay NumPy until `to_devices`
    places them: with several processes each places only its share."""
    host = [x if isinstance(x, jax.Array) else np.asarray(x) for x in arrays]
    shardings = tuple(named_sharding(("batch",) + (None,) * (x.ndim - 1), x.shape, self.mesh, self.rules)
                      for x in host)
    return to_devices(tuple(host), shardings)

  def _call_reuse(self, params, prompt_tokens, prompt_mask, keys, sp: SamplingParams, group: int,
                  reuse: KVReuse, choices: np.ndarray | None) -> SampleOutput:
    # The prompts are read on the host (common prefixes, lengths): callers pass host arrays, as the engines do.
    tokens, mask = np.asarray(jax.device_get(prompt_tokens), np.int32), np.asarray(jax.device_get(prompt_mask), bool)
    batch, width = tokens.shape
    prompts = [tokens[r][mask[r]] for r in range(batch)]
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    slots = width + self.max_new_tokens + self.speculative.draft_tokens
    if reuse.cache is None or len(reuse.held) != batch or reuse.cache.slots < slots:
      # A first call, another batch size, or a wider prompt bucket than the cache has room for: start empty.
      with self._mesh_context():
        reuse.cache = self._zeros(batch, slots)
      reuse.held = [np.zeros(0, np.int32)] * batch
    slots = reuse.cache.slots
    # At least the last prompt token is prefilled: its logits choose the first new token.
    held = np.minimum([common_prefix(p, h) for p, h in zip(prompts, reuse.held)], lengths - 1)
    need = int(np.max(lengths - held))
    prefill = next(w for w in (max(width // 4, 1), max(width // 2, 1), width) if w >= need)
    live = np.asarray(jax.device_get(sp.max_new_tokens)) > 0
    reuse.prompt_tokens += int(np.sum(lengths[live]))
    reuse.prefilled += int(np.sum((lengths - held)[live]))
    # The prefill's window of `prefill` columns starts at each row's first new token, or earlier where it would run
    # past the cache (XLA would clamp the write back onto earlier slots): the forward costs `prefill` columns either
    # way, and recomputing held tokens is exact.
    held = np.minimum(held, slots - prefill).astype(np.int32)
    if group > 1 and not (held.reshape(-1, group) == held[::group, None]).all():
      group = 1  # the group's rows must also hold the same prefix to share one prefill
    left = np.full((batch, width), self.pad_id, np.int32)
    for r, p in enumerate(prompts):
      left[r, :len(p)] = p
    cache, reuse.cache = reuse.cache, None  # donated: a failed call must not leave a deleted cache behind
    if self.mesh is None:
      args = (jnp.asarray(left), jnp.asarray(lengths), jnp.asarray(held))
      choices = None if choices is None else jnp.asarray(choices)
      out, cache = self._reuse_fn(params, cache, *args, keys, sp, group, choices, width=prefill)
    else:
      args = self._rows_to_devices(left, lengths, held)
      if choices is not None:
        (choices,) = self._rows_to_devices(choices)
      with self._mesh_context():
        out, cache = self._reuse_fn(params, cache, *args, keys, sp, group, choices, width=prefill)
    out = to_host(out)
    reuse.cache = cache
    reuse.held = [np.concatenate([p, out.tokens[r, :max(int(out.lengths[r]) - 1, 0)]]).astype(np.int32)
                  for r, p in enumerate(prompts)]
    return out

  def _mesh_context(self):
    if self.mesh is None:
      return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack
