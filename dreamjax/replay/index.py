"""Nearest-neighbour search over unit vectors by inner product (= cosine), for replay retrieval.

Every index assigns ids 0, 1, 2, ... in the order vectors are added and answers `search(queries, k)` with
(scores float32 [Q, k], ids int64 [Q, k]), best first; where fewer than k vectors exist a row ends in ids -1 with
scores -inf.

- `ExactIndex`: on the accelerator. Vectors sit in one device array whose capacity doubles when full, so the jitted
  search compiles once per capacity (log2 of the final size times), not per add; rows past `size` are masked out.
  Search is a jitted matmul + `lax.top_k`, streamed over fixed-size blocks of rows with a running top-k merge, so
  memory stays [Q, block] however large the index grows. Adds are written in place (donated) through power-of-two
  chunks. Exact, and on a GPU/TPU fast well past a million rows.
- `ScannIndex`: ScaNN (tree + asymmetric hashing + exact float32 reordering) on the host, for large buffers on CPU.
  ScaNN builds are batch jobs, so the index keeps two tiers: a ScaNN tier over ids [0, built) and an exact "delta"
  tier (a NumPy matmul) over ids [built, size) that new vectors land in. Every search queries both and merges by
  score. Rebuild policy: when the delta exceeds `rebuild_fraction` (default 25%) of the ScaNN tier (and the index holds
  at least `min_build_size` vectors), the ScaNN tier is rebuilt over everything. Adds are therefore O(1) apart from
  rebuilds, whose cost grows geometrically with the size (amortised O(1) per vector), and the delta never holds more
  than a quarter of the data, so the exact tier keeps recall up and its cost bounded.
- `make_index("auto")`: exact until `scann_threshold` vectors, then moves everything into a ScannIndex. The default
  threshold follows the backend: on CPU the exact matmul falls behind ScaNN early (2 shared cores, batch 64: exact
  600-1200 vs ScaNN 2400-3250 queries/s at 10k vectors, 85-120 vs 1500-2300 at 100k; experiments/bench/retrieval.py),
  so 20k; on a GPU/TPU exact search over a few million 384-d rows is milliseconds and needs no build, so 4M.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

MAX_QUERY_BATCH = 1024


@runtime_checkable
class Index(Protocol):
  dim: int

  def __len__(self) -> int: ...

  def add(self, vectors: np.ndarray) -> np.ndarray:
    """Adds [N, dim] unit vectors; returns their ids [N] (consecutive, from len(self))."""
    ...

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores float32 [Q, k], ids int64 [Q, k]), best first; -1 / -inf where fewer than k exist."""
    ...


def _check(x, dim: int, what: str) -> np.ndarray:
  x = np.asarray(x, np.float32)
  if x.ndim != 2 or x.shape[1] != dim:
    raise ValueError(f"{what}: expected shape [N, {dim}], got {list(x.shape)}")
  if not np.isfinite(x).all():
    raise ValueError(f"{what}: row {int(np.argwhere(~np.isfinite(x))[0, 0])} is not finite")
  return x


def _pow2(n: int, smallest: int = 8) -> int:
  return max(smallest, 1 << max(0, n - 1).bit_length())


def _empty(q: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  return np.full((q, k), -np.inf, np.float32), np.full((q, k), -1, np.int64)


@functools.partial(jax.jit, donate_argnums=0)
def _write(store: Float[Array, "C D"], rows: Float[Array, "P D"], start: Int[Array, ""], n: Int[Array, ""]):
  # Padding rows target index C (out of bounds) and are dropped; a slice update would clamp and overwrite.
  j = jnp.arange(rows.shape[0])
  return store.at[jnp.where(j < n, start + j, store.shape[0])].set(rows.astype(store.dtype), mode="drop")


@functools.partial(jax.jit, static_argnums=1)
def _grow(store: Float[Array, "C D"], capacity: int) -> Float[Array, "C2 D"]:
  return jnp.zeros((capacity, store.shape[1]), store.dtype).at[:store.shape[0]].set(store)


@functools.partial(jax.jit, static_argnames=("k", "block", "precision"))
def _search(store: Float[Array, "C D"], size: Int[Array, ""], queries: Float[Array, "Q D"], k: int, block: int,
            precision: str) -> tuple[Float[Array, "Q k"], Int[Array, "Q k"]]:
  capacity, dim = store.shape
  kb = min(k, block)
  q = queries.astype(store.dtype)

  def step(best, xs):
    rows, base = xs
    s = jnp.einsum("qd,bd->qb", q, rows, precision=precision, preferred_element_type=jnp.float32)
    ids = base + jnp.arange(block)
    s, top = jax.lax.top_k(jnp.where(ids < size, s, -jnp.inf), kb)
    scores = jnp.concatenate([best[0], s], axis=1)
    cand = jnp.concatenate([best[1], base + top], axis=1)
    scores, pick = jax.lax.top_k(scores, k)
    return (scores, jnp.take_along_axis(cand, pick, axis=1)), None

  init = (jnp.full((q.shape[0], k), -jnp.inf, jnp.float32), jnp.full((q.shape[0], k), -1, jnp.int32))
  blocks = store.reshape(capacity // block, block, dim)
  (scores, ids), _ = jax.lax.scan(step, init, (blocks, jnp.arange(0, capacity, block)))
  return scores, jnp.where(jnp.isneginf(scores), -1, ids)


class ExactIndex:
  """Exact top-k on device; see the module docstring. `dtype="bfloat16"` halves memory at ~3 digits of score."""

  def __init__(self, dim: int, capacity: int = 1024, block: int = 65536, dtype: str = "float32",
               precision: str = "highest", device: jax.Device | None = None):
    if block < 1 or block & (block - 1):
      raise ValueError(f"ExactIndex: block must be a power of two (capacities are), got {block}")
    self.dim, self.block, self.precision = dim, block, precision
    self._device = device or jax.local_devices()[0]
    self._store = jax.device_put(jnp.zeros((_pow2(capacity), dim), dtype), self._device)
    self._size = 0

  def __len__(self) -> int:
    return self._size

  @property
  def capacity(self) -> int:
    return self._store.shape[0]

  def add(self, vectors: np.ndarray) -> np.ndarray:
    vectors = _check(vectors, self.dim, "ExactIndex.add vectors")
    n = len(vectors)
    start = self._size
    if start + n > self.capacity:
      self._store = _grow(self._store, _pow2(start + n))
    chunk = min(self.capacity, 1 << 16)  # bounds the padded upload; power-of-two chunks compile a few programs
    for i in range(0, n, chunk):
      part = vectors[i:i + chunk]
      rows = np.zeros((_pow2(len(part)), self.dim), np.float32)
      rows[:len(part)] = part
      self._store = _write(self._store, jax.device_put(rows, self._device), jnp.int32(start + i), jnp.int32(len(part)))
    self._size += n
    return np.arange(start, start + n, dtype=np.int64)

  def block_until_ready(self) -> None:
    """Waits for pending (asynchronous) writes; for timing adds."""
    self._store.block_until_ready()

  def vectors(self) -> np.ndarray:
    """Host copy of the stored vectors [size, dim] (float32)."""
    return np.asarray(self._store[:self._size], np.float32)

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    queries = _check(queries, self.dim, "ExactIndex.search queries")
    if k < 1:
      raise ValueError(f"ExactIndex.search: k must be >= 1, got {k}")
    if self._size == 0 or len(queries) == 0:
      return _empty(len(queries), k)
    block = min(self.block, self.capacity)
    scores, ids = [], []
    for i in range(0, len(queries), MAX_QUERY_BATCH):
      part = queries[i:i + MAX_QUERY_BATCH]
      padded = np.zeros((_pow2(len(part)), self.dim), np.float32)
      padded[:len(part)] = part
      s, j = _search(self._store, jnp.int32(self._size), jax.device_put(padded, self._device), k=k, block=block,
                     precision=self.precision)
      scores.append(np.asarray(s)[:len(part)])
      ids.append(np.asarray(j)[:len(part)].astype(np.int64))
    return np.concatenate(scores), np.concatenate(ids)


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int):
  scores, ids = np.concatenate([a[0], b[0]], axis=1), np.concatenate([a[1], b[1]], axis=1)
  order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _exact_numpy(vectors: np.ndarray, base: int, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Top-k of queries @ vectors.T on the host; ids offset by `base`; padded to k with -1 / -inf."""
  out = _empty(len(queries), k)
  if len(vectors) == 0:
    return out
  s = queries @ vectors.T
  kk = min(k, len(vectors))
  top = np.argpartition(-s, kk - 1, axis=1)[:, :kk] if kk < len(vectors) else np.tile(np.arange(kk), (len(s), 1))
  return _merge(out, (np.take_along_axis(s, top, axis=1), top.astype(np.int64) + base), k)


class ScannIndex:
  """ScaNN tier + exact delta tier with the rebuild policy of the module docstring.

  ScaNN settings scale with the tier size n: sqrt(n) leaves from spherical k-means (the data are unit vectors; on
  clustered 384-d vectors it lifted recall@10 from 0.965 to 0.993 at 6k and 0.988 to 1.0 at 100k over plain k-means,
  at no extra build time), `leaves_fraction` of them searched (at least `min_leaves`), anisotropic hashing with 2
  dims per block, and exact float32 reordering of the best max(`reorder`, 4k) candidates. Reordering more did not
  raise recall; searching more leaves does, at proportional cost.
  """

  def __init__(self, dim: int, rebuild_fraction: float = 0.25, min_build_size: int = 4096,
               leaves_fraction: float = 0.1, min_leaves: int = 8, reorder: int = 100,
               training_sample_size: int = 100_000, threads: int = 0):
    if rebuild_fraction <= 0:
      raise ValueError(f"ScannIndex: rebuild_fraction must be > 0, got {rebuild_fraction}")
    self.dim, self.rebuild_fraction, self.min_build_size = dim, rebuild_fraction, min_build_size
    self.leaves_fraction, self.min_leaves, self.reorder = leaves_fraction, min_leaves, reorder
    self.training_sample_size, self.threads = training_sample_size, threads
    self._vectors = np.zeros((1024, dim), np.float32)
    self._size = 0
    self._built = 0  # ids [0, built) are in the ScaNN tier, [built, size) in the delta tier
    self._searcher = None
    self._leaves = 0
    self.rebuilds = 0

  def __len__(self) -> int:
    return self._size

  @property
  def built(self) -> int:
    return self._built

  def add(self, vectors: np.ndarray) -> np.ndarray:
    vectors = _check(vectors, self.dim, "ScannIndex.add vectors")
    n, start = len(vectors), self._size
    if start + n > len(self._vectors):
      grown = np.zeros((_pow2(start + n), self.dim), np.float32)
      grown[:start] = self._vectors[:start]
      self._vectors = grown
    self._vectors[start:start + n] = vectors
    self._size += n
    if self._size >= self.min_build_size and self._size - self._built > self.rebuild_fraction * self._built:
      self.rebuild()
    return np.arange(start, start + n, dtype=np.int64)

  def vectors(self) -> np.ndarray:
    return self._vectors[:self._size]

  def rebuild(self) -> None:
    """Rebuilds the ScaNN tier over every vector added so far (the delta tier becomes empty)."""
    import scann  # imported lazily: only ScaNN users pay for it

    n = self._size
    if n == 0:
      return
    db = self._vectors[:n]
    self._leaves = max(1, min(int(math.sqrt(n)), n // 50))  # ScaNN wants >= 50 points per leaf
    sample = min(n, self.training_sample_size)
    # ScaNN copies the database, so later growth of self._vectors cannot invalidate the searcher.
    self._searcher = (
        scann.scann_ops_pybind.builder(db, 10, "dot_product")
        .tree(num_leaves=self._leaves, num_leaves_to_search=self._leaves_to_search(), training_sample_size=sample,
              spherical=True)
        .score_ah(2, anisotropic_quantization_threshold=0.2, training_sample_size=sample)
        .reorder(self.reorder)
        .build()
    )
    if self.threads:
      self._searcher.set_num_threads(self.threads)
    self._built = n
    self.rebuilds += 1

  def _leaves_to_search(self) -> int:
    # Read at every search, so `leaves_fraction` can be changed (recall against speed) without a rebuild.
    return min(self._leaves, max(self.min_leaves, math.ceil(self.leaves_fraction * self._leaves)))

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    queries = _check(queries, self.dim, "ScannIndex.search queries")
    if k < 1:
      raise ValueError(f"ScannIndex.search: k must be >= 1, got {k}")
    out = _exact_numpy(self._vectors[self._built:self._size], self._built, queries, k)
    if self._searcher is None or len(queries) == 0:
      return out
    kk = min(k, self._built)
    ids, scores = self._searcher.search_batched_parallel(
        queries, final_num_neighbors=kk, pre_reorder_num_neighbors=max(self.reorder, 4 * kk),
        leaves_to_search=self._leaves_to_search())
    ids, scores = np.asarray(ids, np.int64).reshape(len(queries), -1), np.asarray(scores, np.float32)
    scores = scores.reshape(ids.shape)
    # Where the searched leaves hold fewer than kk points ScaNN pads with id 0 and a NaN distance.
    missing = np.isnan(scores)
    return _merge(out, (np.where(missing, -np.inf, scores), np.where(missing, -1, ids)), k)


def default_scann_threshold() -> int:
  return 20_000 if jax.default_backend() == "cpu" else 4_000_000


class AutoIndex:
  """Exact while small, ScaNN from `scann_threshold` vectors on (the move happens inside the add that crosses it)."""

  def __init__(self, dim: int, scann_threshold: int | None = None, exact_kw: dict | None = None,
               scann_kw: dict | None = None):
    self.dim = dim
    self.scann_threshold = default_scann_threshold() if scann_threshold is None else scann_threshold
    self._scann_kw = scann_kw or {}
    self._index: ExactIndex | ScannIndex = ExactIndex(dim, **(exact_kw or {}))

  @property
  def kind(self) -> str:
    return "exact" if isinstance(self._index, ExactIndex) else "scann"

  def __len__(self) -> int:
    return len(self._index)

  def add(self, vectors: np.ndarray) -> np.ndarray:
    ids = self._index.add(vectors)
    if isinstance(self._index, ExactIndex) and len(self._index) >= self.scann_threshold:
      scann_index = ScannIndex(self.dim, **self._scann_kw)
      scann_index.add(self._index.vectors())
      self._index = scann_index
    return ids

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    return self._index.search(queries, k)


def make_index(kind: str = "auto", dim: int = 384, scann_threshold: int | None = None, **kw) -> Index:
  """"exact" (kw: ExactIndex's), "scann" (kw: ScannIndex's) or "auto" (kw: exact_kw, scann_kw)."""
  if kind == "exact":
    return ExactIndex(dim, **kw)
  if kind == "scann":
    return ScannIndex(dim, **kw)
  if kind == "auto":
    return AutoIndex(dim, scann_threshold, **kw)
  raise ValueError(f"unknown index kind {kind!r}; choose 'auto', 'exact' or 'scann'")
