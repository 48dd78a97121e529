"""Sampler benchmark: dreamjax's jitted `Sampler` against transformers `generate` and google-tunix's `Sampler`, side by
side on the same model, prompts and batch (BENCHMARKS.md setup).

Run: `python experiments/bench/sampler.py` (standard model, ~30 min on 2 cores) or `... --small` (smoke test, seconds).
Each case runs its contenders one after the other (never at once): dreamjax in this process, transformers in this
process, tunix in its own venv through `experiments/bench/peers.py` (a subprocess per case, given the same prompt ids;
`bash experiments/bench/tunix_venv.sh` makes the venv; without it, or with --no-tunix, its column says why). The first
tunix call also checks tunix's logits against transformers' on the same folder. Prints markdown tables of decode
tokens/s (batch * new tokens / median seconds, prefill included) with the ratios, compile times, and prefill seconds;
writes table.md and results.json to --out. Every case runs `--passes` passes (dreamjax, transformers, tunix, then
again), and each contender reports its fastest pass's median of `--runs` runs (BENCHMARKS.md's convention: the machine
is shared, and other work only ever slows a pass down).

A second table measures copy-speculative decoding (`--draft-tokens K`, 0 skips it; `--speculative-only` skips the
peers): dreamjax with and without it, per batch and mode, on a repetitive prompt (a 16-token segment repeated) and on
the random prompt above, with the acceptance statistics (`SampleOutput.speculation_stats`) and whether greedy tokens
equal plain decoding's. On a random model the drafts hit where its greedy output falls into a loop, and a copy of the
prompt is no likelier than any other text, so acceptance here says little about a trained model's (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

# CPU is the setup BENCHMARKS.md defines; without this JAX would pick an accelerator if one happened to be present.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from dreamjax.models import load_hf_checkpoint  # noqa: E402
from dreamjax.sampling import Sampler, SpeculativeConfig, sampling_params  # noqa: E402
from experiments.bench import peers  # noqa: E402
from experiments.bench.models import COMMON, SMALL, STANDARD  # noqa: E402



def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def ensure_model(folder: Path, small: bool) -> Path:
  """Saves the random Qwen2 once; reusing the folder keeps every run (and every contender) on identical weights."""
  if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
    return folder
  log(f"building the {'small' if small else 'standard'} benchmark model in {folder}")
  torch.manual_seed(0)
  shape = {k: v for k, v in COMMON.items() if k != "model_type"}
  cfg = transformers.Qwen2Config(**(SMALL if small else STANDARD), **shape, dtype="float32")
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


def run_dreamjax(cfg, params, sampler: Sampler, prompts: np.ndarray, mode: str, new_tokens: int, runs: int,
                 stats: dict | None = None):
  """Times the sampler; `stats`, when given, receives the last call's `speculation_stats()`."""
  batch = prompts.shape[0]
  sp = sampling_params(batch, new_tokens, temperature=0.0) if mode == "greedy" else \
      sampling_params(batch, new_tokens, temperature=1.0, top_p=0.9)
  mask = np.ones_like(prompts, dtype=bool)
  last = []

  def call(i: int):
    out = sampler(params, prompts, mask, jax.random.key(i), sp)
    out.tokens.block_until_ready()
    last[:] = [out]
    return np.asarray(out.tokens)

  before = sampler.compilations()
  first, times, tokens = timed(call, runs)
  if stats is not None:
    stats.update(last[0].speculation_stats())
  return first, times, tokens, sampler.compilations() > before


def repetitive_prompts(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
  """Per row, a random 16-token segment repeated to `length` tokens: prompt lookup always finds a match."""
  segment = rng.integers(10, vocab, size=(batch, 16))
  return np.tile(segment, -(-length // 16))[:, :length].astype(np.int32)


def run_speculative(cfg, params, plain: Sampler, spec: Sampler, prompts: np.ndarray, mode: str, new_tokens: int,
                    runs: int, passes: int) -> dict:
  """dreamjax with and without speculation on one batch of prompts, passes interleaved; fastest pass's medians."""
  plain_med, spec_med, stats = [], [], {}
  for _ in range(passes):
    plain_out = run_dreamjax(cfg, params, plain, prompts, mode, new_tokens, runs)
    spec_out = run_dreamjax(cfg, params, spec, prompts, mode, new_tokens, runs, stats)
    plain_med.append(statistics.median(plain_out[1]))
    spec_med.append(statistics.median(spec_out[1]))
  n = prompts.shape[0] * new_tokens
  row = dict(plain_tok_s=n / min(plain_med), speculative_tok_s=n / min(spec_med), speedup=min(plain_med) / min(spec_med),
             speculative_compile_s=max(spec_out[0] - statistics.median(spec_out[1]), 0.0), **stats)
  if mode == "greedy":  # the last runs' tokens: speculation must not change a greedy token
    row["greedy_tokens_identical"] = bool(np.array_equal(plain_out[2], spec_out[2]))
  return row


def speculative_table(rows: list[dict], spec: SpeculativeConfig) -> str:
  lines = [f"| speculative (K={spec.draft_tokens}, n-gram {spec.min_ngram}-{spec.max_ngram}) | plain tok/s | "
           "speculative tok/s | speedup | accepted / step | tokens / forward | greedy tokens identical |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    same = {True: "yes", False: "NO"}.get(r.get("greedy_tokens_identical"), "-")
    lines.append(f"| {r['case']} | {r['plain_tok_s']:.0f} | {r['speculative_tok_s']:.0f} | {r['speedup']:.2f}x | "
                 f"{r['accepted_per_step']:.2f} | {r['tokens_per_forward']:.2f} | {same} |")
  return "\n".join(lines)


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


def run_tunix(folder: Path, prompts: np.ndarray, mode: str, new_tokens: int, runs: int, threads: int,
              check_logits: bool) -> dict:
  """tunix's measurement of one case in its venv, on these exact prompt ids."""
  with tempfile.TemporaryDirectory(prefix="bench_tunix_") as tmp:
    path = Path(tmp) / "prompts.npy"
    np.save(path, prompts)
    args = ["--model-dir", folder, "--prompts", path, "--mode", mode, "--new-tokens", new_tokens, "--runs", runs]
    return peers.run_tunix(args + (["--check-logits"] if check_logits else []), threads=threads)


def _cell(value: float | None, fmt: str, missing: str) -> str:
  return missing if value is None else format(value, fmt)


def table(rows: list[dict], tunix_missing: str) -> str:
  lines = ["| case | dreamjax tok/s | transformers tok/s | tunix tok/s | dreamjax / transformers | dreamjax / tunix | "
           "dreamjax compile s | tunix compile s |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    compile_s = f"{r['dreamjax_compile_s']:.1f}" if r["dreamjax_compiled"] else "0 (reuses the greedy compilation)"
    lines.append(f"| {r['case']} | {r['dreamjax_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
                 f"{_cell(r['tunix_tok_s'], '.0f', tunix_missing)} | {r['ratio']:.2f}x | "
                 f"{_cell(r['tunix_ratio'], '.2f', '-')}{'x' if r['tunix_ratio'] is not None else ''} | {compile_s} | "
                 f"{_cell(r['tunix_compile_s'], '.1f', '-')} |")
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
  p.add_argument("--modes", default="greedy,top_p", help="comma-separated: greedy, top_p (temperature 1, top-p 0.9)")
  p.add_argument("--new-tokens", type=int, default=None, help="forced new tokens (default 128; 16 with --small)")
  p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 16 with --small)")
  p.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up; the median is reported")
  p.add_argument("--passes", type=int, default=None, help="passes of every contender per case, one after the other; "
                 "each reports its fastest pass's median (default 2; 1 with --small)")
  p.add_argument("--threads", type=int, default=2, help="CPU threads for both contenders; 0 leaves them alone")
  p.add_argument("--no-prefill", action="store_true", help="skip the prefill-only measurement")
  p.add_argument("--no-tunix", action="store_true", help="skip the tunix peer (also: DREAMJAX_SKIP_PEERS=1)")
  p.add_argument("--draft-tokens", type=int, default=4, help="K for the speculative table (0: no table)")
  p.add_argument("--speculative-only", action="store_true", help="only the speculative table (no peers, no prefill)")
  p.add_argument("--small", action="store_true", help="tiny model for a quick smoke test")
  p.add_argument("--model-dir", type=Path, default=None, help="HF folder of the benchmark model (made if missing)")
  p.add_argument("--out", type=Path, default=ROOT / "runs/bench/sampler")
  args = p.parse_args(argv)
  args.new_tokens = args.new_tokens or (16 if args.small else 128)
  args.prompt_len = args.prompt_len or (16 if args.small else 128)
  args.model_dir = args.model_dir or ROOT / ".cache/bench" / ("qwen2-small" if args.small else "qwen2-standard")
  args.passes = args.passes or (1 if args.small else 2)
  if args.passes < 1 or args.runs < 1:
    p.error(f"--passes and --runs must be >= 1, got {args.passes} and {args.runs}")
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
  spec_cfg = SpeculativeConfig(draft_tokens=args.draft_tokens)
  spec_sampler = Sampler(cfg, max_new_tokens=args.new_tokens, pad_id=0, speculative=spec_cfg)
  tunix_missing = peers.status(skip=args.no_tunix or args.speculative_only)
  logits_check = None
  rng = np.random.default_rng(0)
  spec_rng = np.random.default_rng(1)  # its own stream: the other cases keep their prompts
  rows, prefill, spec_rows = [], [], []
  for batch in args.batches:
    prompts = rng.integers(10, cfg.vocab_size, size=(batch, args.prompt_len)).astype(np.int32)
    for mode in args.modes if not args.speculative_only else ():
      case = f"{mode}, batch {batch}"
      dj, tf, txs = [], [], []  # per pass: (first call s, timed runs s, ...)
      for pass_ in range(args.passes):
        log(f"[{case}] pass {pass_ + 1}/{args.passes}: dreamjax ...")
        dj.append(run_dreamjax(cfg, params, sampler, prompts, mode, args.new_tokens, args.runs))
        log(f"[{case}] dreamjax first call {dj[-1][0]:.2f}s, runs {[round(t, 3) for t in dj[-1][1]]}; transformers ...")
        tf.append(run_transformers(model, prompts, mode, args.new_tokens, args.runs))
        log(f"[{case}] transformers first call {tf[-1][0]:.2f}s, runs {[round(t, 3) for t in tf[-1][1]]}")
        if tunix_missing is None:
          log(f"[{case}] tunix ...")
          res = run_tunix(folder, prompts, mode, args.new_tokens, args.runs, args.threads, logits_check is None)
          logits_check = logits_check or res.get("logits")
          txs.append(res["sampler"])
      first, dj_tokens, compiled = dj[0][0], dj[0][2], dj[0][3]
      tf_tokens, tx = tf[0][2], (txs[0] if txs else None)
      # Each contender's fastest pass: load from other work on a shared machine only ever slows a pass down.
      dj_med = min(statistics.median(d[1]) for d in dj)
      tf_med = min(statistics.median(t[1]) for t in tf)
      tx_med = min(t["median_s"] for t in txs) if txs else None
      n = batch * args.new_tokens
      row = dict(case=case, mode=mode, batch=batch, dreamjax_tok_s=n / dj_med, transformers_tok_s=n / tf_med,
                 ratio=tf_med / dj_med, dreamjax_compile_s=max(first - statistics.median(dj[0][1]), 0.0),
                 dreamjax_compiled=compiled, dreamjax_first_s=first, dreamjax_times_s=[d[1] for d in dj],
                 transformers_first_s=tf[0][0], transformers_times_s=[t[1] for t in tf],
                 tunix_tok_s=tx and n / tx_med, tunix_ratio=tx and tx_med / dj_med,
                 tunix_compile_s=tx and tx["compile_s"], tunix_first_s=tx and tx["first_s"],
                 tunix_times_s=[t["times_s"] for t in txs] or None)
      if mode == "greedy":
        # Same weights in float32: greedy paths should agree until a near-tie flips (random weights give flat logits).
        for peer, tokens in (("transformers", tf_tokens), ("tunix", tx and np.asarray(tx["tokens"]))):
          if tokens is None:
            continue
          same = dj_tokens == tokens
          key = "" if peer == "transformers" else "tunix_"
          row[f"{key}greedy_token_agreement"] = float(same.mean())
          row[f"{key}greedy_rows_identical"] = int(same.all(-1).sum())
          log(f"[{case}] greedy tokens equal to {peer}: {same.mean():.1%} ({int(same.all(-1).sum())}/{batch} rows)")
      rows.append(row)
    if not args.no_prefill and not args.speculative_only:
      # Prefill cost per contender: one new token. dreamjax's loop also runs one decode step for logits it never uses.
      log(f"[prefill, batch {batch}] ...")
      dj_pre, tf_pre, tx_pre = [], [], []
      for _ in range(args.passes):
        dj_pre.append(statistics.median(run_dreamjax(cfg, params, prefill_sampler, prompts, "greedy", 1, args.runs)[1]))
        tf_pre.append(statistics.median(run_transformers(model, prompts, "greedy", 1, args.runs)[1]))
        if tunix_missing is None:
          tx_pre.append(run_tunix(folder, prompts, "greedy", 1, args.runs, args.threads, False)["sampler"]["median_s"])
      prefill.append(dict(batch=batch, prompt_len=args.prompt_len, dreamjax_s=min(dj_pre),
                          transformers_s=min(tf_pre), tunix_s=min(tx_pre) if tx_pre else None))
    if args.draft_tokens:
      repetitive = repetitive_prompts(spec_rng, batch, args.prompt_len, cfg.vocab_size)
      for mode in args.modes:
        for kind, p in (("repetitive", repetitive), ("random", prompts)):
          case = f"{mode}, batch {batch}, {kind} prompt"
          log(f"[{case}] dreamjax with and without speculation ...")
          spec_rows.append(dict(case=case, mode=mode, batch=batch, prompt=kind, **run_speculative(
              cfg, params, sampler, spec_sampler, p, mode, args.new_tokens, args.runs, args.passes)))
          log(f"[{case}] {spec_rows[-1]}")
  md = table(rows, tunix_missing or "-") if rows else ""
  if spec_rows:
    md = (md + "\n\n" if md else "") + speculative_table(spec_rows, spec_cfg)
  if prefill:
    md += "\n\n| prefill (1 new token) | dreamjax s | transformers s | tunix s |\n|---|---|---|---|\n" + "\n".join(
        f"| batch {p['batch']}, {p['prompt_len']} tokens | {p['dreamjax_s']:.3f} | {p['transformers_s']:.3f} | "
        f"{_cell(p['tunix_s'], '.3f', tunix_missing or '-')} |" for p in prefill)
  if logits_check:
    md += (f"\n\ntunix vs transformers logits on a fixed {logits_check['prompt_tokens']}-token prompt: max abs diff "
           f"{logits_check['max_abs_diff']:.1e} (logits up to {logits_check['logits_max_abs']:.2f}), argmax agreement "
           f"{logits_check['argmax_agreement']:.0%}")
  print(md, flush=True)
  result = dict(
      setup=dict(model_dir=str(folder), small=args.small, new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                 runs=args.runs, passes=args.passes, threads=args.threads, cpus_available=len(os.sched_getaffinity(0)),
                 jax=jax.__version__, transformers=transformers.__version__, torch=torch.__version__,
                 jax_devices=[str(d) for d in jax.devices()], tunix=tunix_missing or "run side by side"),
      rows=rows, prefill=prefill, speculative=dict(config=dataclasses.asdict(spec_cfg), rows=spec_rows),
      tunix_logits_check=logits_check, table_md=md)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "table.md").write_text(md + "\n")
  (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
  log(f"wrote {args.out / 'results.json'}")
  return result


if __name__ == "__main__":
  main()
