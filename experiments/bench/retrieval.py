"""Retrieval benchmark: the replay Retriever's queries/s at batch 64, exact (JAX) vs ScaNN index, by buffer size.

Run: `python experiments/bench/retrieval.py` (10k, 100k, 1M; 1M takes several minutes on 2 cores, mostly the ScaNN
build and the exact index's 1M x 384 matmuls) or `... --small` (smoke test, seconds).

The index part uses synthetic vectors, not encoded text: encoding a million transitions with MiniLM on a CPU would take
hours and measure the encoder, not the index. They are clustered unit vectors in 384-d (n/100 clusters, as near-duplicate
states cluster in a real buffer), the queries held out from the same distribution; the Retriever is filled through
`add(transitions, vectors=...)` with lightweight transitions, so `query_vectors` times the index search, the id to
transition mapping and the row assembly. MiniLM's cost is measured apart: the time to encode one batch of 64 realistic
phi(s, a) texts (ALFWorld-like states), which `Retriever.query` adds to every call. Recall@k of ScaNN is against the
exact index. Prints a markdown table; writes table.md and results.json to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# CPU is the setup this benchmark reports; without this JAX would pick an accelerator if one happened to be present.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dreamjax.data.records import Transition  # noqa: E402
from dreamjax.envs.base import Task  # noqa: E402
from dreamjax.replay.encoder import MiniLMEncoder, transition_text  # noqa: E402
from dreamjax.replay.index import ExactIndex, ScannIndex  # noqa: E402
from dreamjax.replay.retriever import Retriever  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def clustered_vectors(n: int, dim: int, clusters: int, spread: float = 1.0, seed: int = 0) -> np.ndarray:
  """Unit vectors around `clusters` random unit centres; `spread` 1.0 puts a point at cosine ~0.7 to its centre."""
  rng = np.random.default_rng(seed)
  centres = rng.standard_normal((clusters, dim)).astype(np.float32)
  centres /= np.linalg.norm(centres, axis=1, keepdims=True)
  x = np.empty((n, dim), np.float32)
  for i in range(0, n, 1 << 16):  # in slices: a 1M x 384 float64 temporary would need 3 GB
    m = min(n, i + (1 << 16)) - i
    part = centres[rng.integers(0, clusters, m)] + spread / np.sqrt(dim) * rng.standard_normal((m, dim), np.float32)
    x[i:i + m] = part / np.linalg.norm(part, axis=1, keepdims=True)
  return x


def transitions(n: int, episode_len: int = 20) -> list[Transition]:
  task = Task.make("alfworld", "bench/0", "put a clean mug on the desk")
  return [Transition(f"ep{i // episode_len}", i % episode_len, task, task.instruction, "state", "action",
                     "next state", 0.0, False, False, False) for i in range(n)]


def texts(batch: int) -> list[tuple[str, str]]:
  rng = np.random.default_rng(1)
  objects = ["mug", "desk", "drawer", "cabinet", "shelf", "bed", "laptop", "pencil", "keychain", "lamp"]
  rows = []
  for i in range(batch):
    seen = ", ".join(f"a {objects[j]} {rng.integers(1, 4)}" for j in rng.permutation(10)[:6])
    state = f"You are in the middle of a room. Looking quickly around you, you see {seen}. You arrive at desk {i}."
    rows.append((state, f"take {objects[i % 10]} {rng.integers(1, 4)} from desk 1"))
  return rows


def sentence_transformers_encode_s(batch: list[str], runs: int) -> float | None:
  """The same batch through sentence-transformers (torch), the peer; None where it is not installed."""
  try:
    from sentence_transformers import SentenceTransformer
  except ImportError:
    return None
  from dreamjax.replay.minilm import default_folder

  model = SentenceTransformer(str(default_folder()), device="cpu")
  log("sentence-transformers: encoding the same batch")
  return statistics.median(timed(lambda: model.encode(batch, batch_size=len(batch)), runs))


def timed(fn, runs: int) -> list[float]:
  fn()  # warm-up: compilation, ScaNN thread pools
  out = []
  for _ in range(runs):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def bench_size(n: int, args, encoder: MiniLMEncoder) -> list[dict]:
  log(f"[{n}] generating {n} clustered vectors")
  # Queries come from the same clusters as the buffer: the held-out tail of one draw.
  data = clustered_vectors(n + args.batch, encoder.dim, max(8, n // 100), seed=n)
  data, queries = data[:n], data[n:]
  items = transitions(n)
  rows, exact_ids = [], None
  for kind in ("exact", "scann"):
    t0 = time.perf_counter()
    # min_build_size=1: ScaNN is built whatever the size, so every row measures it (not its exact delta tier).
    index = ExactIndex(encoder.dim) if kind == "exact" else ScannIndex(encoder.dim, min_build_size=1)
    retriever = Retriever(encoder, index)
    retriever.add(items, vectors=data)
    if kind == "exact":
      index.block_until_ready()
    build = time.perf_counter() - t0
    log(f"[{n}] {kind}: added (and built) in {build:.1f}s; searching")
    times = timed(lambda r=retriever: r.query_vectors(queries, args.k), args.runs)
    _, ids = index.search(queries, args.k)
    if kind == "exact":
      exact_ids, recall = ids, 1.0
    else:
      recall = float(np.mean([len(set(a) & set(b)) / args.k for a, b in zip(ids, exact_ids)]))
    med = statistics.median(times)
    rows.append(dict(size=n, index=kind, build_s=build, search_s=med, queries_per_s=len(queries) / med,
                     recall_at_k=recall, times_s=times,
                     end_to_end_queries_per_s=len(queries) / (med + args.encode_s)))
    log(f"[{n}] {kind}: {len(queries) / med:.0f} queries/s, recall@{args.k} {recall:.3f}")
    del retriever, index
    gc.collect()
  return rows


def table(rows: list[dict], args) -> str:
  lines = [f"| buffer size | index | add + build s | queries/s (batch {args.batch}, k={args.k}) | recall@{args.k} "
           f"vs exact | queries/s incl. MiniLM encode |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['size']:,} | {r['index']} | {r['build_s']:.1f} | {r['queries_per_s']:.0f} | "
                 f"{r['recall_at_k']:.3f} | {r['end_to_end_queries_per_s']:.0f} |")
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default=None, help="comma-separated buffer sizes (default 10000,100000,1000000)")
  p.add_argument("--batch", type=int, default=64, help="query rows per call")
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--runs", type=int, default=5, help="timed calls after the warm-up; the median is reported")
  p.add_argument("--small", action="store_true", help="sizes 2000 and 6000 (unless --sizes), 2 runs: a smoke test")
  p.add_argument("--no-peer", action="store_true", help="skip the sentence-transformers (torch) encoding peer")
  p.add_argument("--out", type=Path, default=ROOT / "runs/bench/retrieval")
  args = p.parse_args(argv)
  if args.small:
    args.sizes, args.runs = args.sizes or "2000,6000", min(args.runs, 2)
  args.sizes = [int(s) for s in (args.sizes or "10000,100000,1000000").split(",")]
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  log("MiniLM: encoding one batch of phi(s, a) texts")
  encoder = MiniLMEncoder(batch_size=args.batch)
  batch = [transition_text(s, a) for s, a in texts(args.batch)]
  encode_times = timed(lambda: encoder.encode(batch), args.runs)
  args.encode_s = statistics.median(encode_times)
  log(f"MiniLM: {args.batch} texts in {args.encode_s * 1e3:.0f} ms (median of {args.runs})")
  peer_s = None if args.no_peer else sentence_transformers_encode_s(batch, args.runs)
  rows = []
  for n in args.sizes:
    rows += bench_size(n, args, encoder)
  md = table(rows, args) + (f"\n\nMiniLM (Flax, CPU): {args.batch} phi(s, a) texts encoded in "
                            f"{args.encode_s * 1e3:.0f} ms ({args.batch / args.encode_s:.0f} texts/s)")
  if peer_s is not None:
    md += (f"; sentence-transformers (torch, CPU, same texts): {peer_s * 1e3:.0f} ms, ratio "
           f"{peer_s / args.encode_s:.2f}x")
  md += "."
  print(md, flush=True)
  result = dict(setup=dict(batch=args.batch, k=args.k, dim=encoder.dim, runs=args.runs, jax=jax.__version__,
                           devices=[str(d) for d in jax.devices()], cpus=len(os.sched_getaffinity(0)),
                           load_average=os.getloadavg()),
                minilm_encode_s=args.encode_s, minilm_encode_times_s=encode_times,
                sentence_transformers_encode_s=peer_s, rows=rows, table_md=md)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "table.md").write_text(md + "\n")
  (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
  log(f"wrote {args.out / 'results.json'}")
  return result


if __name__ == "__main__":
  main()
