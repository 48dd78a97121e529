"""Nearest-neighbour indexes (exact JAX, ScaNN two-tier, auto) against NumPy brute force, and the Retriever on top."""

import numpy as np
import pytest

from dreamjax.data.records import Transition
from dreamjax.envs.base import Task
from dreamjax.replay import index as index_mod
from dreamjax.replay.encoder import MiniLMEncoder
from dreamjax.replay.index import AutoIndex, ExactIndex, ScannIndex, make_index
from dreamjax.replay.retriever import Retriever
from experiments.bench.retrieval import clustered_vectors


def unit(n: int, dim: int = 384, seed: int = 0) -> np.ndarray:
  x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force(data: np.ndarray, queries: np.ndarray, k: int, banned=None):
  """Reference top-k in float64; `banned` [Q, N] bool removes candidates per row."""
  scores = queries.astype(np.float64) @ data.astype(np.float64).T
  if banned is not None:
    scores = np.where(banned, -np.inf, scores)
  ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(scores, ids, axis=1), ids


def recall(ids: np.ndarray, expected: np.ndarray) -> float:
  return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids, expected)]))


def test_exact_index_equals_brute_force_across_growth():
  data, queries = unit(3000), unit(37, seed=1)
  index = ExactIndex(384, capacity=16, block=256)  # small blocks: the running top-k merge runs over many blocks
  for part in np.array_split(data, [1, 5, 700, 701, 2048]):  # uneven adds, across capacity doublings
    assert np.array_equal(index.add(part), np.arange(len(index) - len(part), len(index)))
  assert len(index) == 3000 and index.capacity == 4096
  scores, ids = index.search(queries, 7)
  ref_scores, ref_ids = brute_force(data, queries, 7)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(scores, ref_scores, atol=2e-6)
  searches = index_mod._search._cache_size()
  index.add(unit(500, seed=2))  # same capacity, new size: the compiled search is reused
  index.search(queries[:33], 7)  # 33 and 37 queries share the padded batch 64
  assert index_mod._search._cache_size() == searches
  np.testing.assert_array_equal(index.vectors()[:3000], data)


def test_exact_index_edge_cases():
  index = ExactIndex(384)
  scores, ids = index.search(unit(3), 4)
  assert (ids == -1).all() and np.isneginf(scores).all()
  data = unit(2, seed=3)
  index.add(data)
  scores, ids = index.search(data, 4)  # k larger than the index: padded with -1 / -inf
  np.testing.assert_array_equal(ids[:, 2:], -1)
  np.testing.assert_array_equal(ids[:, 0], [0, 1])
  np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-6)
  assert np.isneginf(scores[:, 2:]).all()
  assert index.search(np.zeros((0, 384), np.float32), 3)[1].shape == (0, 3)
  with pytest.raises(ValueError, match=r"expected shape \[N, 384\], got \[2, 10\]"):
    index.add(np.ones((2, 10)))
  bad = data.copy()
  bad[1, 0] = np.nan
  with pytest.raises(ValueError, match="row 1 is not finite"):
    index.add(bad)
  with pytest.raises(ValueError, match="k must be >= 1"):
    index.search(data, 0)
  with pytest.raises(ValueError, match="power of two"):
    ExactIndex(8, block=1000)
  with pytest.raises(ValueError, match="unknown index kind 'faiss'"):
    make_index("faiss", 8)


def test_scann_recall_on_clustered_vectors():
  vectors = clustered_vectors(20_000 + 200, 384, 200, seed=7)
  data, queries = vectors[:20_000], vectors[20_000:]
  index = ScannIndex(384)
  index.add(data)
  assert index.built == 20_000 and index.rebuilds == 1
  scores, ids = index.search(queries, 10)
  ref_scores, ref_ids = brute_force(data, queries, 10)
  r = recall(ids, ref_ids)
  print(f"ScaNN recall@10 on 20k x 384 clustered vectors: {r:.4f}")
  assert r >= 0.9
  hit = ids == ref_ids
  np.testing.assert_allclose(scores[hit], ref_scores[hit], atol=1e-5)  # reordering scores exactly in float32
  assert (np.diff(scores, axis=1) <= 0).all()


def test_scann_growth_rebuilds_and_keeps_recall():
  vectors = clustered_vectors(6_000 + 100, 384, 60, seed=11)
  data, queries = vectors[:6_000], vectors[6_000:]
  index = ScannIndex(384, min_build_size=2_000, rebuild_fraction=0.25)
  index.add(data[:1_000])
  assert index.built == 0  # below min_build_size everything is in the exact tier
  np.testing.assert_array_equal(index.search(queries, 5)[1], brute_force(data[:1_000], queries, 5)[1])
  index.add(data[1_000:2_400])
  assert (index.built, index.rebuilds) == (2_400, 1)
  history = []
  for stop in range(2_900, 6_001, 500):
    index.add(data[len(index):stop])
    # The policy: the delta tier never exceeds rebuild_fraction of the ScaNN tier.
    assert len(index) - index.built <= 0.25 * index.built
    history.append((len(index), index.built, recall(index.search(queries, 10)[1],
                                                    brute_force(data[:stop], queries, 10)[1])))
  print("size, ScaNN tier, recall@10:", history)
  assert index.rebuilds >= 3 and any(size > built for size, built, _ in history)  # searched with a non-empty delta
  assert min(r for *_, r in history) >= 0.9


def test_scann_pads_missing_neighbours_with_minus_one():
  # 1000 points in 20 leaves, 8 searched: about 400 candidates, far fewer than k. Leaf sizes vary with ScaNN's
  # k-means training from run to run (one fresh-clone run found 600), so k leaves room for unbalanced leaves. ScaNN
  # pads with id 0 and NaN distances, which must come back as -1 / -inf, never as a repeated id 0.
  data = unit(1_000, dim=16, seed=4)
  index = ScannIndex(16, min_build_size=1_000)
  index.add(data)
  k = 990
  scores, ids = index.search(data[:3], k)
  for query, row_scores, row_ids in zip(data[:3], scores, ids):
    found = row_ids[row_ids >= 0]
    assert 0 < len(found) < k and len(set(found.tolist())) == len(found)
    assert (row_ids[len(found):] == -1).all() and np.isneginf(row_scores[len(found):]).all()
    np.testing.assert_allclose(row_scores[:len(found)], data[found] @ query, atol=1e-5)


def test_auto_index_switches_to_scann_at_the_threshold():
  vectors = clustered_vectors(5_000 + 50, 384, 50, seed=5)
  data, queries = vectors[:5_000], vectors[5_000:]
  index = make_index("auto", 384, scann_threshold=4_000, scann_kw=dict(min_build_size=1_000))
  assert isinstance(index, AutoIndex)
  index.add(data[:3_999])
  assert index.kind == "exact"
  np.testing.assert_array_equal(index.search(queries, 5)[1], brute_force(data[:3_999], queries, 5)[1])
  assert np.array_equal(index.add(data[3_999:]), np.arange(3_999, 5_000))
  assert index.kind == "scann" and len(index) == 5_000
  assert recall(index.search(queries, 10)[1], brute_force(data, queries, 10)[1]) >= 0.9


def _transition(episode: str, step: int, state: str, action: str) -> Transition:
  task = Task.make("textworld_express", f"{episode}-task", "make a meal")
  return Transition(episode, step, task, task.instruction, state, action, f"after {action}", 0.0, False, False, False)


@pytest.fixture(scope="module")
def encoder():
  return MiniLMEncoder(batch_size=16)


@pytest.mark.parametrize("kind", ["exact", "scann"])
def test_retriever_excludes_own_episode_exactly(encoder, kind):
  # Precomputed vectors exercise the id -> transition mapping and the exclusion against a brute-force reference.
  n, episode_len = 6_000, 40
  data = clustered_vectors(n, 384, 30, seed=3)
  items = [_transition(f"ep{i // episode_len}", i % episode_len, "s", "a") for i in range(n)]
  index = make_index(kind, 384, **({"min_build_size": 2_000} if kind == "scann" else {}))
  retriever = Retriever(encoder, index)
  retriever.add(items[:2_500], vectors=data[:2_500])
  retriever.add(items[2_500:], vectors=data[2_500:])
  rows = np.arange(0, n, 97)
  excluded = [items[r].episode_id for r in rows]
  got = retriever.query_vectors(data[rows], 8, exclude_episodes=excluded)
  episode = np.arange(n) // episode_len
  _, ref = brute_force(data, data[rows], 8, banned=episode[None, :] == episode[rows][:, None])
  assert all(len(row) == 8 for row in got)
  assert all(t.episode_id != e for row, e in zip(got, excluded) for _, t in row)
  got_ids = np.array([[int(t.episode_id[2:]) * episode_len + t.step for _, t in row] for row in got])
  if kind == "exact":
    np.testing.assert_array_equal(got_ids, ref)
  else:
    assert recall(got_ids, ref) >= 0.9
  plain = retriever.query_vectors(data[rows[:3]], 1)  # without exclusion a stored vector finds itself
  assert [row[0][1] for row in plain] == [items[r] for r in rows[:3]]


def test_retriever_with_minilm_finds_the_matching_transition(encoder):
  kitchen = ["You are in the kitchen. You see a fridge and a counter.", "The fridge is open. It holds an apple."]
  bedroom = ["You are in the bedroom. A bed and a desk are here.", "On the desk you see a laptop and a pencil."]
  garden = ["You are in the garden. There is a shovel near the shed.", "The shed door is locked."]
  items = []
  for name, states, actions in (("kitchen", kitchen, ["open fridge", "take apple"]),
                                ("bedroom", bedroom, ["go to desk", "take laptop"]),
                                ("garden", garden, ["take shovel", "unlock shed"])):
    items += [_transition(name, j, s, a) for j, (s, a) in enumerate(zip(states, actions))]
  retriever = Retriever(encoder, ExactIndex(encoder.dim))
  assert retriever.query(["anything"], ["go"], 3) == [[]]
  retriever.add(items)
  assert len(retriever) == 6 and retriever[2] is items[2]
  scored = retriever.query_scored([kitchen[1], garden[0]], ["take apple", "take shovel"], 2)
  assert [row[0][1] for row in scored] == [items[1], items[4]]
  assert scored[0][0][0] == pytest.approx(1.0, abs=1e-5) and scored[0][1][0] < scored[0][0][0]
  # Excluding the row's own episode: its transitions never come back, and k others do.
  rows = retriever.query([kitchen[1], "You stand in a kitchen next to the fridge."], ["take apple", "open fridge"], 4,
                         exclude_episodes=["kitchen", None])
  assert len(rows[0]) == 4 and all(t.episode_id != "kitchen" for t in rows[0])
  assert rows[1][0] is items[0]  # paraphrased state: still the nearest by meaning
  assert retriever.query([], [], 3) == []
  with pytest.raises(ValueError, match="2 states but 1 actions"):
    retriever.query(["a", "b"], ["c"], 1)
  with pytest.raises(ValueError, match=r"vectors have shape \[1, 3\], expected \[1, 384\]"):
    retriever.add(items[:1], vectors=np.ones((1, 3)))


def test_bench_retrieval_small(tmp_path):
  from experiments.bench import retrieval as bench

  result = bench.main(["--small", "--sizes", "3000", "--runs", "1", "--batch", "8", "--no-peer", "--out", str(tmp_path)])
  assert {(r["size"], r["index"]) for r in result["rows"]} == {(3000, "exact"), (3000, "scann")}
  assert all(r["queries_per_s"] > 0 and r["recall_at_k"] >= 0.8 for r in result["rows"])  # 8 queries: coarse
  assert "| 3,000 | scann |" in (tmp_path / "table.md").read_text()
