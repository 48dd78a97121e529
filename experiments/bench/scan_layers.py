"""Compile time and step time of the learner's update step with unrolled layers against stacked, scanned ones
(`ModelConfig.scan_layers`), on CPU.

Run: `python experiments/bench/scan_layers.py` (32 layers of hidden 256, ~5 min on 2 cores) or `... --layers 4` (a
smoke run). Prints a markdown table; nothing is written.

The step is the one `PolicyLearner` runs (`dreamjax.rl.update.make_train_step`: GRPO with the low-variance KL term,
AdamW with clipping, `dreamjax rl`'s defaults) on one device, over `--rows` rows of `--length` tokens, every token a
loss token. Both layouts start from the same weights (the unrolled ones are `unstack_layers` of the stacked init).
Columns per (remat, layout): trace+lower (Python tracing of the model and lowering to StableHLO), XLA compile (of
that lowering, with JAX's persistent cache off so nothing is read from disk), the median step over `--runs` steps
after one warm-up step, and XLA's temporary buffer size for the step. The ratio rows are scanned / unrolled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dreamjax.models import ModelConfig, init_params, tiny  # noqa: E402
from dreamjax.models.params import unstack_layers  # noqa: E402
from dreamjax.rl.batch import TokenBatch  # noqa: E402
from dreamjax.rl.logprobs import score_len_for  # noqa: E402
from dreamjax.rl.objectives import Objective, PolicyGradientConfig  # noqa: E402
from dreamjax.rl.optim import OptimConfig, make_optimizer  # noqa: E402
from dreamjax.rl.train_state import create_train_state  # noqa: E402
from dreamjax.rl.update import make_train_step  # noqa: E402

OPTIM = OptimConfig(lr=1e-6, clip_norm=1.0)  # `dreamjax rl`'s defaults (RLConfig)
OBJECTIVE = PolicyGradientConfig(kl_coef=0.02, kl_kind="low_var_kl")


def model(args: argparse.Namespace) -> ModelConfig:
  return tiny("qwen2", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
              num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
              head_dim=args.hidden // args.heads, max_position_embeddings=max(512, args.length))


def batch(cfg: ModelConfig, rows: int, length: int) -> TokenBatch:
  rng = np.random.RandomState(0)
  f = lambda scale: (rng.randn(rows, length) * scale).astype(np.float32)  # noqa: E731
  valid = np.ones((rows, length), bool)
  return TokenBatch(tokens=rng.randint(0, cfg.vocab_size, (rows, length)).astype(np.int32),
                    positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(), valid=valid,
                    loss_mask=valid.astype(np.float32), old_logp=f(0.1) - 7.0, ref_logp=f(0.1) - 7.0,
                    advantages=f(1.0), returns=f(1.0), old_values=f(0.1), pair=np.zeros(rows, np.int32),
                    chosen=np.zeros(rows, bool))


def measure(cfg: ModelConfig, params, data: TokenBatch, runs: int) -> dict[str, float]:
  """Times one layout's step: AOT trace+lower, compile, then warm-up and timed calls of the compiled step."""
  optimizer = make_optimizer(OPTIM)
  step = make_train_step(cfg, Objective("grpo", OBJECTIVE), optimizer)
  state = create_train_state(cfg, jax.tree.map(lambda x: x.copy(), params), optimizer)
  data = jax.device_put(data)
  rng = jax.random.key(0)
  t0 = time.perf_counter()
  lowered = step._fn.trace(state, data, rng, score_len_for(data.loss_mask)).lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  times = []
  for i in range(runs + 1):  # the first is the warm-up
    t = time.perf_counter()
    state, metrics = compiled(state, data, rng)
    jax.block_until_ready((state, metrics))
    if i:
      times.append(time.perf_counter() - t)
  memory = compiled.memory_analysis()
  return dict(lower_s=t1 - t0, compile_s=t2 - t1, step_s=statistics.median(times),
              temp_mib=getattr(memory, "temp_size_in_bytes", float("nan")) / 2**20)


def table(results: dict[tuple[str, bool], dict[str, float]], cfg: ModelConfig, args: argparse.Namespace) -> str:
  head = [f"Update step, {cfg.num_layers} layers (hidden {cfg.hidden_size}, {cfg.num_heads} heads, MLP "
          f"{cfg.intermediate_size}, vocab {cfg.vocab_size}), {args.rows} rows x {args.length} tokens, float32, one "
          f"CPU device ({len(os.sched_getaffinity(0))} cores), jax {jax.__version__}; step = median of {args.runs}",
          "",
          "| remat | layers | trace+lower s | XLA compile s | total s | step s | temp MiB |",
          "|---|---|---:|---:|---:|---:|---:|"]
  for remat in args.remat:
    u, s = results[remat, False], results[remat, True]
    for name, r in (("unrolled", u), ("scanned", s)):
      head.append(f"| {remat} | {name} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | "
                  f"{r['lower_s'] + r['compile_s']:.2f} | {r['step_s']:.3f} | {r['temp_mib']:.1f} |")
    head.append(f"| {remat} | scanned / unrolled | {s['lower_s'] / u['lower_s']:.2f}x | "
                f"{s['compile_s'] / u['compile_s']:.2f}x | "
                f"{(s['lower_s'] + s['compile_s']) / (u['lower_s'] + u['compile_s']):.2f}x | "
                f"{s['step_s'] / u['step_s']:.2f}x | {s['temp_mib'] / u['temp_mib']:.2f}x |")
  return "\n".join(head)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--mlp", type=int, default=512)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--rows", type=int, default=4)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--runs", type=int, default=5, help="timed steps after one warm-up step; the median is reported")
  p.add_argument("--remat", nargs="+", default=["none", "full"], choices=["none", "full", "dots"])
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
  args = parse_args(argv)
  jax.config.update("jax_enable_compilation_cache", False)  # compile times are XLA's, not a cache read
  base = model(args)
  stacked = init_params(base.replace(scan_layers=True), jax.random.key(0))
  layouts = {True: stacked, False: unstack_layers(stacked, base)}
  data = batch(base, args.rows, args.length)
  results = {}
  for remat in args.remat:
    for scan in (False, True):
      cfg = base.replace(remat=remat, scan_layers=scan)
      results[remat, scan] = r = measure(cfg, layouts[scan], data, args.runs)
      print(f"remat {remat}, {'scanned' if scan else 'unrolled'}: {r}", file=sys.stderr, flush=True)
  md = table(results, base, args)
  print(md, flush=True)
  return md


if __name__ == "__main__":
  main()
