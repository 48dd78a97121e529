"""Top-k retrieval of past transitions by cosine similarity of phi(s, a), for grounding M_exp (DreamGym Sec. 4).

`Retriever` pairs an `Encoder` with an `Index`: `add` embeds each transition's `transition_text(state, action)` and
keeps the transition under the id the index assigned, `query` embeds a whole batch of (state, action) rows at once and
returns each row's k nearest stored transitions, best first. It knows nothing of the replay buffer's storage: callers
feed it transitions (the offline seed, then each iteration's new ones), and may pass precomputed embeddings (e.g. cached
next to a persisted buffer) to skip encoding.

Own-episode exclusion: a row may name an episode whose transitions must not come back (a held-out evaluation must not
retrieve its own ground truth). The index is asked for k + (that episode's transition count) neighbours, rounded up to
a power of two so the exact index compiles few programs, which provably leaves k others after filtering when the
index holds that many.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dreamjax.data.records import Transition
from dreamjax.replay.encoder import Encoder, make_encoder, transition_text
from dreamjax.replay.index import Index, make_index


class Retriever:
  def __init__(self, encoder: Encoder, index: Index | None = None):
    self.encoder = encoder
    self.index = make_index("auto", encoder.dim) if index is None else index
    if self.index.dim != encoder.dim:
      raise ValueError(f"Retriever: index dim {self.index.dim} differs from encoder dim {encoder.dim}")
    if len(self.index):
      raise ValueError("Retriever: the index must start empty (its ids are positions in the retriever's store)")
    self._items: list[Transition] = []
    self._episode_ids: dict[str, int] = {}  # episode id -> dense index, for vectorised exclusion
    self._episode_of = np.zeros(1024, np.int64)  # per stored item, its dense episode index
    self._episode_count: list[int] = []

  def __len__(self) -> int:
    return len(self._items)

  def __getitem__(self, i: int) -> Transition:
    return self._items[i]

  def add(self, transitions: Sequence[Transition], vectors: np.ndarray | None = None) -> None:
    """Stores transitions; `vectors` ([N, dim], unit rows), when given, are used instead of encoding them."""
    transitions = list(transitions)
    if not transitions:
      return
    if vectors is None:
      vectors = self.encoder.encode([transition_text(t.state, t.action) for t in transitions])
    elif np.shape(vectors) != (len(transitions), self.encoder.dim):
      raise ValueError(f"Retriever.add: vectors have shape {list(np.shape(vectors))}, expected "
                       f"[{len(transitions)}, {self.encoder.dim}]")
    ids = self.index.add(vectors)
    start = len(self._items)
    if not np.array_equal(ids, np.arange(start, start + len(transitions))):
      raise RuntimeError("Retriever.add: the index assigned non-consecutive ids; it was modified outside the retriever")
    if start + len(transitions) > len(self._episode_of):
      self._episode_of = np.resize(self._episode_of, max(2 * len(self._episode_of), start + len(transitions)))
    for j, t in enumerate(transitions):
      e = self._episode_ids.setdefault(t.episode_id, len(self._episode_ids))
      if e == len(self._episode_count):
        self._episode_count.append(0)
      self._episode_count[e] += 1
      self._episode_of[start + j] = e
    self._items.extend(transitions)

  def query(self, states: Sequence[str], actions: Sequence[str], k: int,
            exclude_episodes: Sequence[str | None] | None = None) -> list[list[Transition]]:
    """Per row, up to k stored transitions nearest to phi(states[i], actions[i]), best first; fewer only when the
    retriever holds fewer (after excluding the row's `exclude_episodes[i]`, when given and not None)."""
    return [[t for _, t in row] for row in self.query_scored(states, actions, k, exclude_episodes)]

  def query_scored(self, states: Sequence[str], actions: Sequence[str], k: int,
                   exclude_episodes: Sequence[str | None] | None = None) -> list[list[tuple[float, Transition]]]:
    """As `query`, with each transition's cosine similarity."""
    if len(states) != len(actions):
      raise ValueError(f"Retriever.query: {len(states)} states but {len(actions)} actions")
    if not len(states):
      return []
    vectors = self.encoder.encode([transition_text(s, a) for s, a in zip(states, actions)])
    return self.query_vectors(vectors, k, exclude_episodes)

  def query_vectors(self, vectors: np.ndarray, k: int,
                    exclude_episodes: Sequence[str | None] | None = None) -> list[list[tuple[float, Transition]]]:
    """As `query_scored`, from already encoded query rows [Q, dim]."""
    if k < 1:
      raise ValueError(f"Retriever.query: k must be >= 1, got {k}")
    q = len(vectors)
    if exclude_episodes is not None and len(exclude_episodes) != q:
      raise ValueError(f"Retriever.query: {len(exclude_episodes)} exclude_episodes for {q} rows")
    if not self._items or q == 0:
      return [[] for _ in range(q)]
    excluded = np.full(q, -1, np.int64)
    if exclude_episodes is not None:
      excluded[:] = [self._episode_ids.get(e, -1) if e is not None else -1 for e in exclude_episodes]
    extra = max((self._episode_count[e] for e in excluded if e >= 0), default=0)
    fetch = k if extra == 0 else 1 << (k + extra - 1).bit_length()
    scores, ids = self.index.search(vectors, fetch)
    keep = (ids >= 0) & (self._episode_of[np.maximum(ids, 0)] != excluded[:, None])
    out = []
    for row_scores, row_ids, row_keep in zip(scores, ids, keep):
      out.append([(float(s), self._items[i]) for s, i in zip(row_scores[row_keep][:k], row_ids[row_keep][:k])])
    return out


def make_retriever(encoder: str | Encoder = "minilm", index: str | Index = "auto", encoder_kw: dict | None = None,
                   **index_kw) -> Retriever:
  """A retriever from names: `encoder` for `make_encoder`, `index` for `make_index` (with the encoder's dim)."""
  enc = make_encoder(encoder, **(encoder_kw or {})) if isinstance(encoder, str) else encoder
  idx = make_index(index, enc.dim, **index_kw) if isinstance(index, str) else index
  return Retriever(enc, idx)
