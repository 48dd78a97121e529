"""Sampler benchmark: dreamjax's jitted `Sampler` against transformers `generate`, side by side (BENCHMARKS.md setup).

Run: `python experiments/bench/sampler.py` (standard model, ~5-10 min on 2 cores) or `... --small` (smoke test, seconds).
Prints a markdown table of decode tokens/s (batch * new tokens / median seconds, prefill included), the ratio, dreamjax's
compile time and the tunix numbers of BENCHMARKS.md; writes table.md and results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# CPU is the setup BENCHMARKS.md defines; without this JAX would pick an accelerator if one happened to be present.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dreamjax.models import load_hf_checkpoint  # noqa: E402
from dreamjax.sampling import Sampler, sampling_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STANDARD = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# Measured elsewhere (google-tunix 0.1.7 sampler, same model and CPU); copied from BENCHMARKS.md, never run here.
TUNIX_TOK_S = {("greedy", 1): 130, ("greedy", 32): 513, ("top_p", 1): 63, ("top_p", 32): 100}


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def ensure_model(folder: Path, small: bool) -> Path:
  """Saves the random Qwen2 once; reusing the folder keeps every run (and every contender) on identical weights."""
  if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
    return folder
  log(f"building the {'small' if small else 'standard'} benchmark model in {folder}")
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(**(SMALL if small else STANDARD), max_position_embeddings=2048,
                                 tie_word_embeddings=False, dtype="float32")
  transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(folder)
  return folder


def timed(fn: Callable[[int], object], runs: int) -> tuple[float, list[float], object]:
  """(first call seconds, timed-run seconds, last output); the first call is the warm-up (and compilation)."""
  t0 = time.perf_counter()
  out = fn(0)
  first = time.perf_counter() - t0
  times = []
  for i in range(runs):
    t0 = time.perf_counter()
    out = fn(i + 1)
    times.append(time.perf_counter() - t0)
  return first, times, out


def run_dreamjax(cfg, params, sampler: Sampler, prompts: np.ndarray, mode: str, new_tokens: int, runs: int):
  batch = prompts.shape[0]
  sp = sampling_params(batch, new_tokens, temperature=0.0) if mode == "greedy" else \
      sampling_params(batch, new_tokens, temperature=1.0, top_p=0.9)
  mask = np.ones_like(prompts, dtype=bool)

  def call(i: int):
    out = sampler(params, prompts, mask, jax.random.key(i), sp)
    out.tokens.block_until_ready()
    return np.asarray(out.tokens)

  before = sampler.compilations()
  first, times, tokens = timed(call, runs)
  return first, times, tokens, sampler.compilations() > before


def run_transformers(model, prompts: np.ndarray, mode: str, new_tokens: int, runs: int):
  ids = torch.from_numpy(prompts.astype(np.int64))
  mask = torch.ones_like(ids)
  # top_k=0 turns off generate's default top-k 50, so both sides sample from the same pure nucleus.
  sampling = dict(do_sample=True, temperature=1.0, top_p=0.9, top_k=0) if mode == "top_p" else dict(do_sample=False)

  def call(i: int):
    torch.manual_seed(i)
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=0, **sampling)
    return out[:, prompts.shape[1]:].numpy()

  return timed(call, runs)


def table(rows: list[dict]) -> str:
  lines = ["| case | dreamjax tok/s | transformers tok/s | ratio (dreamjax / transformers) | dreamjax compile s | "
           "tunix tok/s (BENCHMARKS.md, not run here) |", "|---|---|---|---|---|---|"]
  for r in rows:
    compile_s = f"{r['dreamjax_compile_s']:.1f}" if r["dreamjax_compiled"] else "0 (reuses the greedy compilation)"
    tunix = r["tunix_tok_s"] if r["tunix_tok_s"] is not None else "-"
    lines.append(f"| {r['case']} | {r['dreamjax_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | {r['ratio']:.2f}x | "
                 f"{compile_s} | {tunix} |")
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
  p.add_argument("--modes", default="greedy,top_p", help="comma-separated: greedy, top_p (temperature 1, top-p 0.9)")
  p.add_argument("--new-tokens", type=int, default=None, help="forced new tokens (default 128; 16 with --small)")
  p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 16 with --small)")
  p.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up; the median is reported")
  p.add_argument("--threads", type=int, default=2, help="CPU threads for both contenders; 0 leaves them alone")
  p.add_argument("--no-prefill", action="store_true", help="skip the prefill-only measurement")
  p.add_argument("--small", action="store_true", help="tiny model for a quick smoke test")
  p.add_argument("--model-dir", type=Path, default=None, help="HF folder of the benchmark model (made if missing)")
  p.add_argument("--out", type=Path, default=ROOT / "runs/bench/sampler")
  args = p.parse_args(argv)
  args.new_tokens = args.new_tokens or (16 if args.small else 128)
  args.prompt_len = args.prompt_len or (16 if args.small else 128)
  args.model_dir = args.model_dir or ROOT / ".cache/bench" / ("qwen2-small" if args.small else "qwen2-standard")
  args.batches = [int(b) for b in args.batches.split(",")]
  args.modes = args.modes.split(",")
  if not set(args.modes) <= {"greedy", "top_p"}:
    p.error(f"--modes: expected greedy and/or top_p, got {args.modes}")
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  if args.threads:
    torch.set_num_threads(args.threads)
    # XLA has no flag for its CPU thread count (intra_op_parallelism_threads is a TF option; XLA_FLAGS rejects it), but
    # its thread pool is sized from the CPU affinity when the backend starts, so pinning limits it on larger machines.
    if len(os.sched_getaffinity(0)) > args.threads:
      os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
  transformers.logging.set_verbosity_error()  # generate's per-call notices would drown the progress lines
  folder = ensure_model(args.model_dir, args.small)
  cfg, params = load_hf_checkpoint(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  sampler = Sampler(cfg, max_new_tokens=args.new_tokens, pad_id=0)
  prefill_sampler = Sampler(cfg, max_new_tokens=1, pad_id=0)
  rng = np.random.default_rng(0)
  rows, prefill = [], []
  for batch in args.batches:
    prompts = rng.integers(10, cfg.vocab_size, size=(batch, args.prompt_len)).astype(np.int32)
    for mode in args.modes:
      case = f"{mode}, batch {batch}"
      log(f"[{case}] dreamjax ...")
      first, dj_times, dj_tokens, compiled = run_dreamjax(cfg, params, sampler, prompts, mode, args.new_tokens,
                                                          args.runs)
      log(f"[{case}] dreamjax first call {first:.2f}s, runs {[round(t, 3) for t in dj_times]}; transformers ...")
      tf_first, tf_times, tf_tokens = run_transformers(model, prompts, mode, args.new_tokens, args.runs)
      log(f"[{case}] transformers first call {tf_first:.2f}s, runs {[round(t, 3) for t in tf_times]}")
      dj_med, tf_med = statistics.median(dj_times), statistics.median(tf_times)
      n = batch * args.new_tokens
      row = dict(case=case, mode=mode, batch=batch, dreamjax_tok_s=n / dj_med, transformers_tok_s=n / tf_med,
                 ratio=tf_med / dj_med, dreamjax_compile_s=max(first - dj_med, 0.0), dreamjax_compiled=compiled,
                 dreamjax_first_s=first, dreamjax_times_s=dj_times, transformers_first_s=tf_first,
                 transformers_times_s=tf_times, tunix_tok_s=None if args.small else TUNIX_TOK_S.get((mode, batch)))
      if mode == "greedy":
        # Same weights in float32: greedy paths should agree until a near-tie flips (random weights give flat logits).
        same = dj_tokens == tf_tokens
        row["greedy_token_agreement"] = float(same.mean())
        row["greedy_rows_identical"] = int(same.all(-1).sum())
        log(f"[{case}] greedy tokens equal to transformers': {same.mean():.1%} ({int(same.all(-1).sum())}/{batch} rows)")
      rows.append(row)
    if not args.no_prefill:
      # Prefill cost per contender: one new token. dreamjax's loop also runs one decode step for logits it never uses.
      log(f"[prefill, batch {batch}] ...")
      _, dj_pre, _, _ = run_dreamjax(cfg, params, prefill_sampler, prompts, "greedy", 1, args.runs)
      _, tf_pre, _ = run_transformers(model, prompts, "greedy", 1, args.runs)
      prefill.append(dict(batch=batch, prompt_len=args.prompt_len, dreamjax_s=statistics.median(dj_pre),
                          transformers_s=statistics.median(tf_pre)))
  md = table(rows)
  if prefill:
    md += "\n\n| prefill (1 new token) | dreamjax s | transformers s |\n|---|---|---|\n" + "\n".join(
        f"| batch {p['batch']}, {p['prompt_len']} tokens | {p['dreamjax_s']:.3f} | {p['transformers_s']:.3f} |"
        for p in prefill)
  print(md, flush=True)
  result = dict(
      setup=dict(model_dir=str(folder), small=args.small, new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                 runs=args.runs, threads=args.threads, cpus_available=len(os.sched_getaffinity(0)),
                 jax=jax.__version__, transformers=transformers.__version__, torch=torch.__version__,
                 jax_devices=[str(d) for d in jax.devices()]),
      rows=rows, prefill=prefill, table_md=md)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "table.md").write_text(md + "\n")
  (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
  log(f"wrote {args.out / 'results.json'}")
  return result


if __name__ == "__main__":
  main()
