"""Task groups for PPO: k-means over L2-normalised instruction embeddings.

docs/paper_map.md, "Curriculum": with PPO there is no rollout group per task, so tasks are clustered by an embedder and a cluster
is the group whose reward variance ranks its tasks (`state.update(..., groups=...)`). Any `encode(texts) -> [N, D]`
works (e.g. `dreamjax.replay.encoder.MiniLMEncoder().encode`); rows are L2-normalised here, so Euclidean k-means on
them ranks points as cosine similarity does.

k-means runs in JAX on fixed shapes: rows are padded to a power-of-two count with a `valid` mask, initialisation is
k-means++ drawn from a key (deterministic), and a fixed number of Lloyd iterations follows; an empty cluster keeps its
previous centroid. So clustering a growing pool reuses one compiled program per (row bucket, k, iters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dreamjax.curriculum.pool import TaskPool


@flax.struct.dataclass
class KMeansResult:
  centroids: Float[Array, "K D"]
  assign: Int[Array, " N"]  # cluster of each row; -1 for invalid rows
  inertia: Float[Array, ""]  # sum over valid rows of the squared distance to their centroid
  init: Float[Array, "K D"]  # the k-means++ centroids the iterations started from


def l2_normalize(x: Float[Array, "N D"], eps: float = 1e-12) -> Float[Array, "N D"]:
  x = jnp.asarray(x, jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def _sq_dist(x: Float[Array, "N D"], c: Float[Array, "K D"]) -> Float[Array, "N K"]:
  return jnp.sum(jnp.square(x[:, None, :] - c[None, :, :]), -1)


def kmeans_init(x: Float[Array, "N D"], valid: Bool[Array, " N"], key: jax.Array, k: int) -> Float[Array, "K D"]:
  """k-means++: the first centroid uniform over valid rows, each next one with probability proportional to the squared
  distance to the nearest centroid so far (uniform again when every valid row sits on a centroid)."""
  keys = jax.random.split(key, k)
  first = jax.random.categorical(keys[0], jnp.where(valid, 0.0, -jnp.inf))
  cents = jnp.zeros((k, x.shape[1]), x.dtype).at[0].set(x[first])
  nearest = jnp.where(valid, jnp.sum(jnp.square(x - x[first]), -1), 0.0)

  def body(i, carry):
    cents, nearest = carry
    w = jnp.where(jnp.sum(nearest) > 0, nearest, valid.astype(x.dtype))
    j = jax.random.categorical(keys[i], jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf))
    nearest = jnp.where(valid, jnp.minimum(nearest, jnp.sum(jnp.square(x - x[j]), -1)), 0.0)
    return cents.at[i].set(x[j]), nearest

  cents, _ = jax.lax.fori_loop(1, k, body, (cents, nearest))
  return cents


def lloyd(x: Float[Array, "N D"], valid: Bool[Array, " N"], centroids: Float[Array, "K D"], iters: int
          ) -> KMeansResult:
  """`iters` Lloyd steps (assign to the nearest centroid, move centroids to their rows' means) from `centroids`."""
  k = centroids.shape[0]
  w = valid.astype(x.dtype)

  def assign(c):
    return jnp.argmin(_sq_dist(x, c), -1)

  def step(_, c):
    a = assign(c)
    sums = jax.ops.segment_sum(x * w[:, None], a, num_segments=k)
    counts = jax.ops.segment_sum(w, a, num_segments=k)
    return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], c)

  c = jax.lax.fori_loop(0, iters, step, centroids)
  a = assign(c)
  inertia = jnp.sum(w * jnp.min(_sq_dist(x, c), -1))
  return KMeansResult(centroids=c, assign=jnp.where(valid, a, -1).astype(jnp.int32), inertia=inertia, init=centroids)


@functools.partial(jax.jit, static_argnames=("k", "iters"))
def kmeans(x: Float[Array, "N D"], key: jax.Array, *, k: int, iters: int = 20,
           valid: Bool[Array, " N"] | None = None) -> KMeansResult:
  """k-means of the L2-normalised rows of `x` (invalid rows ignored), k-means++ init from `key`."""
  x = l2_normalize(x)
  valid = jnp.ones(x.shape[:1], bool) if valid is None else jnp.asarray(valid, bool)
  return lloyd(x, valid, kmeans_init(x, valid, key, k), iters)


def cluster_texts(encode: Callable[[Sequence[str]], np.ndarray], texts: Sequence[str], key: jax.Array, *, k: int,
                  iters: int = 20) -> np.ndarray:
  """int32 [len(texts)] cluster ids in [0, min(k, len(texts))). Rows are padded to a power of two for the jit."""
  n = len(texts)
  if n == 0:
    return np.zeros((0,), np.int32)
  emb = np.asarray(encode(list(texts)), np.float32)
  if emb.ndim != 2 or emb.shape[0] != n:
    raise ValueError(f"cluster_texts: encode returned shape {emb.shape} for {n} texts; expected [{n}, D]")
  k = min(k, n)  # more clusters than texts would leave clusters without a row to seed them
  rows = int(2 ** np.ceil(np.log2(max(n, 2))))
  x = np.zeros((rows, emb.shape[1]), np.float32)
  x[:n] = emb
  return np.asarray(kmeans(x, key, k=k, iters=iters, valid=np.arange(rows) < n).assign[:n])


def pool_groups(pool: TaskPool, encode: Callable[[Sequence[str]], np.ndarray], key: jax.Array, *, k: int,
                iters: int = 20) -> np.ndarray:
  """int32 [capacity]: the cluster of each occupied slot's instruction, -1 for free slots. Index it with the
  episodes' task slots to get the `groups` argument of `state.update`."""
  slots = [i for i, t in enumerate(pool.tasks) if t is not None]
  out = np.full((pool.capacity,), -1, np.int32)
  out[slots] = cluster_texts(encode, [pool.tasks[i].instruction for i in slots], key, k=k, iters=iters)
  return out
