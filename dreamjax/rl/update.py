"""The jitted update step: `(state, batch, rng) -> (state, metrics)` with micro-batch gradient accumulation.

Accumulation. The batch's B rows are split by stride into k micro-batches (`dreamjax.rl.batch.split_micro_batches`)
and a `lax.scan` sums their gradients, so activation memory is that of B / k rows. Micro-batch i's loss is an average
over its own count n_i (`Objective.normalizer`: loss tokens for `token_mean`, rows with a loss token for the
seq-mean modes, complete pairs for DPO) and is weighted by n_i / sum_j n_j. Since a row never straddles micro-batches
(nor a DPO pair, by construction of `dpo_batch`), the weighted sum is exactly the loss of the whole batch under the
same aggregation, and so is its gradient: k micro-batches and one big batch give the same update up to float32
rounding (tested).
Metrics describe the whole batch too: loss parts combine with the loss's weights, per-token (DPO: per-pair) means
with token (pair) counts, maxima with a max; only `explained_variance`, not a mean, is approximated.
Gradients accumulate in float32 whatever the parameter dtype.

Sharding. With a mesh, the state keeps the shardings of `train_state_shardings` (in = out, donated, so parameters and
moments are updated in place), batch rows are split over the rules' `batch` axes (data, fsdp), and the model's logical
activation constraints apply under the rules. Rematerialisation inside the model follows `ModelConfig.remat`.

Non-finite updates. A step whose loss or gradient norm is not finite (one NaN advantage, an overflow) is skipped inside
the jitted step: parameters, optimizer state and `step` come back unchanged, and the metric `skipped` is 1 (else 0).
The optimizer update runs inside a `lax.cond` on that one flag, the other branch returning the state as it came: a
finite step is exactly the unguarded one, bit for bit, and a skipped step costs nothing but the gradient already
computed. A `jnp.where` per leaf would also be exact, but XLA keeps the new and the old state alive together for the
select: measured on a small model, it adds a third of the parameters' size to the step's temporary memory, the cond
nothing. `optax.apply_if_finite` would look at the gradient only, change the optimizer state's structure (and so
every saved checkpoint's tree), and apply the update anyway after `max_consecutive_errors`. The gradient norm is the
test because a NaN or infinity in any gradient leaf makes it non-finite (and clipping by an infinite norm would zero
or NaN the step anyway). Loops count skips with `SkipCounter`, which raises `NonFiniteUpdateError` after a configured
number in a row.

Loss tokens. The loss reads log-probs on the batch's loss tokens only, so only they are projected onto the vocabulary
(`token_logps(score_mask=...)`); their count per row, rounded up to a power of two (`score_len_for`), is a static
argument: by default the batch's, so a batch with more loss tokens per row than any before compiles once more; SFT and
DPO trainers pass their whole data's.

Shared prefixes. `TrainStep(shared_prefix=True)` rebuilds each batch on the host with `shared_prefix_batch` (rows whole
in, clusters of rows sharing a prefix out, each cluster inside one micro-batch where it fits) so that the loss runs a
shared prefix's layers once per cluster (`token_logps(prefix=...)`): the same loss and gradients as the per-row step
on the same rows, to float32 rounding (tests/test_shared_prefix.py). Each new (prefix rows, prefix length, suffix
length) shape compiles once; the prefix rows per micro-batch are rounded up to a power of two to keep them few.
Policy-gradient and SFT objectives only (DPO pairs and the critic's value loss take rows whole).

Length buckets. The scanned step runs every micro-batch at the batch's length, its longest row's. Multi-turn rows vary
in length by turn (twc: 260-700 tokens, 450 on average), so most of that is padding. `TrainStep(length_buckets=True)`
sorts a step's rows by length into its micro-batches, cuts each to its own longest row (rounded up to `pad_to`) and
runs them as separate jitted calls on the same accumulator (`_add_grads`, the scan's body), then applies the sum
(`_apply_grads`, the scan's tail): the same update to float32 rounding (tests/test_rl_update.py), one compilation
per micro-batch length. Objectives whose rows are independent only (not DPO's pairs), and not with shared prefixes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dreamjax.models.config import ModelConfig
from dreamjax.parallel.distributed import to_devices
from dreamjax.parallel.sharding import TRAIN_RULES, Rules, logical_to_spec
from dreamjax.rl.batch import SharedPrefixBatch, TokenBatch, shared_prefix_batch, split_micro_batches
from dreamjax.rl.logprobs import most_scored, row_ends, score_len_for
from dreamjax.rl.losses import safe_div
from dreamjax.rl.objectives import LOSS_METRICS, DpoLossConfig, Objective, ValueLossConfig
from dreamjax.rl.optim import current_learning_rate
from dreamjax.rl.train_state import TrainState, train_state_shardings


def _combine(metrics: dict[str, jax.Array], loss_weights: jax.Array, metric_weights: jax.Array) -> dict[str, jax.Array]:
  """[k]-stacked micro-batch metrics -> whole-batch metrics: loss parts weighted like the loss, means over tokens
  (or pairs) by their counts, maxima by max."""

  def one(name, v):
    if name.endswith("_max"):
      return jnp.max(v)
    return jnp.sum(v * (loss_weights if name in LOSS_METRICS else metric_weights))

  return {k: one(k, v) for k, v in metrics.items()}


def _constrain(grads, grad_shardings):
  return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)


def _zero_grads(params, grad_shardings=None):
  return _constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_shardings)


def _add_grads(params, acc, mb: TokenBatch, rng: jax.Array, weight: jax.Array, score_len: int, *,
               model_cfg: ModelConfig, objective: Objective, grad_shardings=None):
  """One micro-batch: `acc` + `weight` x its loss's gradient (float32), and (loss, metrics)."""
  grad_fn = jax.value_and_grad(functools.partial(objective.loss, model_cfg, score_len=score_len), has_aux=True)
  (loss, metrics), grads = grad_fn(params, mb, rng)
  acc = jax.tree.map(lambda a, g: a + weight * g.astype(jnp.float32), acc, grads)
  return _constrain(acc, grad_shardings), (loss, metrics)


def _train_step(state: TrainState, batch: TokenBatch, rng: jax.Array, score_len: int, *, model_cfg: ModelConfig,
                objective: Objective, optimizer: optax.GradientTransformation, micro_batches: int,
                grad_shardings=None) -> tuple[TrainState, dict[str, jax.Array]]:
  micro = split_micro_batches(batch, micro_batches)
  counts = jax.vmap(objective.normalizer)(micro)  # [k]
  weights = safe_div(counts, jnp.sum(counts))
  metric_counts = jax.vmap(objective.metric_normalizer)(micro)
  add = functools.partial(_add_grads, score_len=score_len, model_cfg=model_cfg, objective=objective,
                          grad_shardings=grad_shardings)

  def body(acc, xs):
    mb, weight, i = xs
    return add(state.params, acc, mb, jax.random.fold_in(rng, i), weight)

  zeros = _zero_grads(state.params, grad_shardings)
  if micro_batches == 1:
    grads, (losses, metrics) = body(zeros, (jax.tree.map(lambda x: x[0], micro), weights[0], 0))
    losses, metrics = losses[None], jax.tree.map(lambda x: x[None], metrics)
  else:
    grads, (losses, metrics) = jax.lax.scan(body, zeros, (micro, weights, jnp.arange(micro_batches)))
  return _apply_grads(state, grads, losses, metrics, weights, safe_div(metric_counts, jnp.sum(metric_counts)),
                      jnp.sum(batch.loss_mask), optimizer=optimizer)


def _apply_stacked(state: TrainState, grads, outs: tuple, weights: jax.Array, metric_weights: jax.Array,
                   num_loss_tokens: jax.Array, *, optimizer: optax.GradientTransformation
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
  """`_apply_grads` after per-call micro-batches (TrainStep._bucketed): their (loss, metrics) stacked here."""
  losses, metrics = jax.tree.map(lambda *x: jnp.stack(x), *outs)
  return _apply_grads(state, grads, losses, metrics, weights, metric_weights, num_loss_tokens, optimizer=optimizer)


def _apply_grads(state: TrainState, grads, losses: jax.Array, metrics: dict[str, jax.Array], weights: jax.Array,
                 metric_weights: jax.Array, num_loss_tokens: jax.Array, *, optimizer: optax.GradientTransformation
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
  """The step's end: the accumulated gradient applied unless it or the loss is not finite; whole-batch metrics from
  the [k]-stacked micro-batch ones."""
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  metrics = _combine(metrics, weights, metric_weights)
  metrics["loss"] = jnp.sum(losses * weights)
  metrics["grad_norm"] = optax.tree.norm(grads)  # before the optimizer's clipping
  metrics["num_loss_tokens"] = num_loss_tokens
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

  def apply(grads):
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  # A skipped step keeps the old state (see the module docstring): the update runs only in the finite branch.
  params, opt_state = jax.lax.cond(finite, apply, lambda _: (state.params, state.opt_state), grads)
  metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
  lr = current_learning_rate(opt_state)
  if lr is not None:
    metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
  return TrainState(step=state.step + finite.astype(state.step.dtype), params=params, opt_state=opt_state), metrics


def batch_shardings(mesh: jax.sharding.Mesh, rules: Rules = TRAIN_RULES, shared_prefix: bool = False) -> TokenBatch:
  """A TokenBatch of shardings: rows over the rules' `batch` axes, everything else whole; with `shared_prefix`, the
  prefix rows too (`shared_prefix_batch` makes their count a multiple of the data-parallel size)."""
  spec = logical_to_spec(("batch",), (int(np.prod(list(mesh.shape.values()))),), mesh, rules)
  rows = NamedSharding(mesh, PartitionSpec(spec[0], None))
  flat = NamedSharding(mesh, PartitionSpec(spec[0]))
  fields = {f: rows for f in ("tokens", "positions", "valid", "loss_mask", "old_logp", "ref_logp", "advantages",
                              "returns", "old_values")}
  if shared_prefix:
    return SharedPrefixBatch(**fields, pair=flat, chosen=flat, prefix_tokens=rows, prefix_valid=rows, prefix_index=flat,
                             allowed=rows)
  return TokenBatch(**fields, pair=flat, chosen=flat, allowed=rows)


def data_parallel_size(mesh: jax.sharding.Mesh | None, rules: Rules = TRAIN_RULES) -> int:
  """How many ways batch rows are split: batches must have a multiple of micro_batches x this many rows."""
  if mesh is None:
    return 1
  spec = logical_to_spec(("batch",), (int(np.prod(list(mesh.shape.values()))),), mesh, rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes]))


class TrainStep:
  """The jitted step bound to a model, objective, optimizer and (optionally) mesh. Call as `step(state, batch, rng)`;
  the state argument is donated (do not reuse it after the call). `shared_prefix`: rebuild each batch (rows whole)
  with shared prefixes, their lengths rounded up to `pad_to` (see the module docstring). `length_buckets`: see
  `_bucketed`."""

  def __init__(self, model_cfg: ModelConfig, objective: Objective, optimizer: optax.GradientTransformation, *,
               micro_batches: int = 1, mesh: jax.sharding.Mesh | None = None, rules: Rules = TRAIN_RULES,
               abstract: Any = None, shared_prefix: bool = False, pad_to: int = 64, length_buckets: bool = False):
    if micro_batches < 1:
      raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    objective.check(model_cfg)
    if shared_prefix and (isinstance(objective.config, DpoLossConfig | ValueLossConfig) or model_cfg.scan_layers):
      raise ValueError(f"TrainStep: shared_prefix needs a per-row objective (policy gradient or SFT, not "
                       f"{objective.name!r}) and unrolled layers (ModelConfig.scan_layers={model_cfg.scan_layers}): "
                       "its prefix forward writes a KV cache")
    if length_buckets and (isinstance(objective.config, DpoLossConfig) or shared_prefix):
      raise ValueError(f"TrainStep: length_buckets reorders a step's rows, so it needs a per-row objective (not "
                       f"{objective.name!r}, whose pairs must share a micro-batch) and no shared_prefix (whose "
                       "clusters are laid out per micro-batch)")
    self.shared_prefix, self.pad_to, self.length_buckets = shared_prefix, pad_to, length_buckets
    self.model_cfg, self.objective, self.micro_batches, self.mesh, self.rules = (
        model_cfg, objective, micro_batches, mesh, rules)
    self.row_multiple = micro_batches * data_parallel_size(mesh, rules)
    fn = functools.partial(_train_step, model_cfg=model_cfg, objective=objective, optimizer=optimizer,
                           micro_batches=micro_batches)
    add = functools.partial(_add_grads, model_cfg=model_cfg, objective=objective)
    apply = functools.partial(_apply_stacked, optimizer=optimizer)
    if mesh is None:
      self._fn = jax.jit(fn, donate_argnums=0, static_argnums=3)
      self._zeros, self._add = jax.jit(_zero_grads), jax.jit(add, donate_argnums=1, static_argnums=5)
      self._apply = jax.jit(apply, donate_argnums=(0, 1))
      return
    state_sh = train_state_shardings(model_cfg, optimizer, mesh, rules, abstract)
    replicated = NamedSharding(mesh, PartitionSpec())
    grad_sh = state_sh.params
    fn = functools.partial(fn, grad_shardings=grad_sh)
    self._batch_shardings = batch_shardings(mesh, rules, shared_prefix)
    self._fn = jax.jit(fn, in_shardings=(state_sh, self._batch_shardings, replicated),
                       out_shardings=(state_sh, replicated), donate_argnums=0, static_argnums=3)
    self._zeros = jax.jit(functools.partial(_zero_grads, grad_shardings=grad_sh), in_shardings=(grad_sh,),
                          out_shardings=grad_sh)
    self._add = jax.jit(functools.partial(add, grad_shardings=grad_sh),
                        in_shardings=(grad_sh, grad_sh, self._batch_shardings, replicated, replicated),
                        out_shardings=(grad_sh, replicated), donate_argnums=1, static_argnums=5)
    self._apply = jax.jit(apply, in_shardings=(state_sh, grad_sh, replicated, replicated, replicated, replicated),
                          out_shardings=(state_sh, replicated), donate_argnums=(0, 1))

  def compilations(self) -> int:
    return (self._add if self.length_buckets else self._fn)._cache_size()

  def __call__(self, state: TrainState, batch: TokenBatch, rng: jax.Array, score_len: int | None = None
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """`score_len`: slots for each row's loss tokens (static; default `score_len_for(batch.loss_mask)`). Trainers that
    know their whole data pass `score_len_for` of all its rows, so that each row length compiles once."""
    if batch.num_rows % self.row_multiple:
      raise ValueError(f"TrainStep: the batch has {batch.num_rows} rows, not a multiple of {self.row_multiple} "
                       f"(micro_batches {self.micro_batches} x data-parallel size); build it with "
                       f"row_multiple={self.row_multiple}")
    # Only the loss tokens are projected onto the vocabulary (token_logps); their bucketed count is static.
    if score_len is None:
      score_len = score_len_for(batch.loss_mask)
    elif score_len < most_scored(batch.loss_mask):
      raise ValueError(f"TrainStep: score_len {score_len} is less than the {most_scored(batch.loss_mask)} loss tokens "
                       "of a row of this batch")
    if batch.allowed is None:  # one tree for the shardings: width 0 is drawn from the whole vocabulary too
      batch = batch.replace(allowed=np.full((*np.shape(batch.tokens), 0), -1, np.int32))
    if self.shared_prefix:  # a row keeps all its loss tokens in its suffix: score_len holds
      batch = shared_prefix_batch(batch, micro_batches=self.micro_batches, row_multiple=self.row_multiple,
                                  pad_to=self.pad_to)
    if self.length_buckets:
      return self._bucketed(state, batch, rng, score_len)
    if self.mesh is None:
      return self._fn(state, batch, rng, score_len)
    # Placed here rather than by jit: with several processes jit refuses host (NumPy) rows for sharded inputs; every
    # process holds the same rows and places its own devices' share.
    batch = to_devices(batch, self._batch_shardings)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return self._fn(state, batch, rng, score_len)

  def _bucketed(self, state: TrainState, batch: TokenBatch, rng: jax.Array, score_len: int
                ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The step with `length_buckets`: micro-batch i holds the i-th k-th of the rows in length order, cut to its own
    longest row rounded up to `pad_to`, and each runs as its own jitted call (one compilation per length); then one
    call applies the sum. The loss weighs micro-batches by their counts as the scanned step does, and a per-row
    loss does not depend on which micro-batch holds a row, so the update is the same to float32 rounding. On
    multi-turn rows, whose lengths vary by turn, this skips most of the padding to the step's longest row."""
    batch = jax.tree.map(np.asarray, batch)
    k, (b, t) = self.micro_batches, batch.tokens.shape
    ends = row_ends(batch.valid)
    order = np.argsort(ends, kind="stable")
    micro = []
    for i in range(k):
      rows = order[i * (b // k):(i + 1) * (b // k)]
      length = min(t, max(self.pad_to, -(-int(ends[rows].max()) // self.pad_to) * self.pad_to))
      micro.append(jax.tree.map(lambda x, rows=rows, length=length: x[rows, :length] if x.ndim >= 2 else x[rows],
                                batch))
    counts = np.array([self.objective.normalizer(mb) for mb in micro], np.float32)
    metric_counts = np.array([self.objective.metric_normalizer(mb) for mb in micro], np.float32)
    weights, metric_weights = (c / c.sum() if c.sum() > 0 else np.zeros_like(c) for c in (counts, metric_counts))
    num_loss_tokens = np.float32(batch.loss_mask.sum())
    with contextlib.ExitStack() as scope:
      if self.mesh is not None:
        scope.enter_context(jax.set_mesh(self.mesh))
        scope.enter_context(nn.logical_axis_rules(self.rules))
        micro = [to_devices(mb, self._batch_shardings) for mb in micro]
      acc, outs = self._zeros(state.params), []
      for i, mb in enumerate(micro):
        acc, out = self._add(state.params, acc, mb, jax.random.fold_in(rng, i), weights[i],
                             min(score_len, mb.tokens.shape[1]))
        outs.append(out)
      return self._apply(state, acc, tuple(outs), weights, metric_weights, num_loss_tokens)


class NonFiniteUpdateError(RuntimeError):
  """Raised by `SkipCounter` when too many updates in a row were skipped for a non-finite loss or gradient."""


class SkipCounter:
  """Counts the updates a `TrainStep` skipped (its `skipped` metric) and raises `NonFiniteUpdateError` once `limit`
  steps in a row were skipped. `add` keeps each step's flag on the device, so a loop that reads metrics only every few
  steps does not wait for each step; `check` reads the pending flags (in order) and raises. A skipped step leaves the
  parameters as they were, so a late check loses nothing."""

  def __init__(self, limit: int, what: str):
    if limit < 1:
      raise ValueError(f"{what}: max_nonfinite_updates must be >= 1, got {limit}")
    self.limit, self.what = limit, what
    self.total = self.streak = 0
    self._pending: list[tuple[Any, str]] = []

  def add(self, metrics: dict[str, Any], where: str) -> None:
    """Records one step's metrics; `where` names the step in the error (e.g. "iteration 3, update 2")."""
    self._pending.append((metrics["skipped"], where))

  def check(self) -> dict[str, int]:
    """Reads the pending flags; returns {"skipped_updates": total so far, "nonfinite_streak": skips in a row}."""
    pending, self._pending = self._pending, []
    for flag, where in pending:
      if float(flag) > 0:
        self.total, self.streak = self.total + 1, self.streak + 1
        if self.streak >= self.limit:
          raise NonFiniteUpdateError(
              f"{self.what}: {self.streak} updates in a row had a non-finite loss or gradient (the last at {where}); "
              f"each was skipped, so the parameters are those from before the first of them; stopping (limit "
              f"max_nonfinite_updates={self.limit}); look for NaN/inf in rewards, advantages or the learning rate")
      else:
        self.streak = 0
    return {"skipped_updates": self.total, "nonfinite_streak": self.streak}


def make_train_step(model_cfg: ModelConfig, objective: Objective, optimizer: optax.GradientTransformation, *,
                    micro_batches: int = 1, mesh: jax.sharding.Mesh | None = None, rules: Rules = TRAIN_RULES,
                    abstract: Any = None, shared_prefix: bool = False, pad_to: int = 64,
                    length_buckets: bool = False) -> TrainStep:
  """See `TrainStep`; `abstract` is the state's parameter tree when it is not the model's whole tree (PPO's separate
  critic, `dreamjax.rl.critic`), as in `train_state_shardings`."""
  return TrainStep(model_cfg, objective, optimizer, micro_batches=micro_batches, mesh=mesh, rules=rules,
                   abstract=abstract, shared_prefix=shared_prefix, pad_to=pad_to, length_buckets=length_buckets)
