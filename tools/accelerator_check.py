"""One command for the accelerator check: on a GPU or TPU host, the numerics tests, bf16 decode against the memory
roofline, a bf16 GRPO iteration's MFU and a tiny DreamGym iteration, written to one report.

Run on the accelerator host, from the repository root, with dreamjax installed over the accelerator's jax
(tpu/README.md, "Check the accelerator"):

  python tools/accelerator_check.py --out runs/accelerator_check
  python tools/accelerator_check.py --small --sections device,ceilings,decode,grpo --out /tmp/check   # CPU, seconds

Writes report.md and report.json to --out after every section, so a run cut short keeps what it measured.
Sections (`--sections`, in this order):
- device: platform, device kind and count, memory, versions.
- parity: the model-parity, sampler and speculative-decoding tests (pytest) on this device in float32 at the highest
  matmul precision (GPUs otherwise run float32 matmuls in TF32, which the tests' 1e-5 tolerances do not allow); the
  multi-device mesh tests are left out when there are fewer than 8 devices.
- ceilings: this device's memory bandwidth (the faster of a jitted sum over a large float32 array, bytes read over
  seconds, and a jitted scale of it, bytes read plus written) and bf16 matmul throughput (best of square matmuls),
  measured in this run, beside the published peaks of known devices.
- decode: greedy decoding with dreamjax's `Sampler` in bf16 (weights and activations) on random weights of published
  architectures (`--decode-archs`; nothing is downloaded), per batch size. One compilation per batch serves two
  budgets: 1 new token (the prefill) and `--decode-tokens`; decode tokens/s counts the tokens after the first over the
  difference. The roofline: a decode step must read every weight the step multiplies by (all parameters, less an
  untied embedding table, of which it gathers a row per sequence) and each row's keys and values, so its shortest
  time is those bytes over the measured bandwidth (and over the published one, a second column); the KV term uses
  each row's mean context over the decode.
- grpo: experiments/bench/grpo_iteration.py's GRPO iteration (rollout, reference scoring, one AdamW update) on
  `--grpo-arch` with bf16 compute and float32 master weights, scaled by `--grpo-prompts` x `--grpo-group` rows; update
  MFU = the benchmark's model FLOPs over update seconds, against the measured bf16 ceiling and the published peak.
- dreamgym: one tiny DreamGym iteration (experiments/bench/dreamgym_row.py: policy and M_exp alternating, retrieval
  every step, the update) on the small benchmark model in float32, from `--records` (a `dreamjax collect`
  trajectories JSONL; without it the episodes are recorded with TextWorld-Express, which needs Java).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dreamjax.models import ModelConfig, from_hf_config, init_params, tiny  # noqa: E402
from dreamjax.plan.memory import published_config  # noqa: E402
from dreamjax.sampling import Sampler, sampling_params  # noqa: E402
from experiments.bench.models import COMMON, STANDARD  # noqa: E402

SECTIONS = ("device", "parity", "ceilings", "decode", "grpo", "dreamgym")
PARITY_TESTS = ("tests/test_model_parity.py", "tests/test_sampler.py", "tests/test_speculative.py")
# Published dense bf16 matmul peaks (FLOP/s) and memory bandwidths (bytes/s), matched against the device kind.
PEAKS = {"H200": (989e12, 4.8e12), "H100 80GB HBM3": (989e12, 3.35e12), "H100 PCIe": (756e12, 2.0e12),
         "A100-SXM4-80GB": (312e12, 2.04e12), "A100-SXM4-40GB": (312e12, 1.56e12), "TPU v4": (275e12, 1.23e12),
         "TPU v5 lite": (197e12, 0.82e12), "TPU v5p": (459e12, 2.76e12), "TPU v6 lite": (918e12, 1.64e12)}
# The benchmark model of experiments/bench (a Qwen2 with hidden 512 and 8 layers), and a smaller one.
ARCHS = {"standard": from_hf_config({**COMMON, **STANDARD}, source="experiments/bench/models.py"),
         "tiny": tiny("qwen2", vocab_size=512)}


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def arch_config(name: str, dtype: str, param_dtype: str) -> ModelConfig:
  """A published architecture (dreamjax.plan.memory.PUBLISHED) or one of ARCHS, in the given dtypes."""
  if name in ARCHS:
    return ARCHS[name].replace(dtype=dtype, param_dtype=param_dtype)
  return published_config(name, dtype=dtype, param_dtype=param_dtype)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
  """Fastest of `repeats` timed calls after one untimed call (compilation)."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def published_peaks(kind: str) -> tuple[float | None, float | None]:
  for name, peaks in PEAKS.items():
    if name.lower() in kind.lower():
      return peaks
  return None, None


# --- sections ---------------------------------------------------------------------------------------------------

def check_device(args) -> dict:
  devices = jax.devices()
  stats = devices[0].memory_stats() or {}
  return dict(platform=devices[0].platform, kind=devices[0].device_kind, count=len(devices),
              processes=jax.process_count(), memory_bytes=stats.get("bytes_limit"), jax=jax.__version__,
              python=platform.python_version(), host_cpus=os.cpu_count())


def child_platform() -> str:
  """The JAX_PLATFORMS value that gives a child process this process's devices (tests/conftest.py defaults to cpu)."""
  if os.environ.get("JAX_PLATFORMS"):
    return os.environ["JAX_PLATFORMS"]
  device = jax.devices()[0]
  if device.platform == "gpu":
    return "cuda" if "nvidia" in device.device_kind.lower() else "rocm"
  return device.platform


def check_parity(args) -> dict:
  """pytest over `args.parity_tests` on this device; per-test outcomes from its JUnit XML."""
  with tempfile.TemporaryDirectory(prefix="accel_parity_") as tmp:
    xml = Path(tmp) / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow",
           f"--junitxml={xml}", *args.parity_tests]
    if len(jax.devices()) < 8:
      cmd += ["-k", "not mesh"]
    env = dict(os.environ, JAX_PLATFORMS=child_platform(), JAX_DEFAULT_MATMUL_PRECISION="highest")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    outcomes = {}
    if xml.is_file():
      for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[name] = ("failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed")
  counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
  tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
  return dict(command=" ".join(c for c in cmd[1:] if not c.startswith("--junitxml")), platform=env["JAX_PLATFORMS"],
              returncode=proc.returncode, seconds=seconds, **counts,
              failed_tests=[n for n, v in outcomes.items() if v == "failed"], summary=tail[0], output_tail=(proc.stdout + proc.stderr)[-3000:] if proc.returncode else "")


def bandwidth(n: int, repeats: int) -> tuple[float, float]:
  """(read, read + write) bytes/s over an n-element float32 array: a jitted sum only reads it (decode's pattern:
  weights and caches are read, little is written), a jitted scale reads and writes it."""
  x = jnp.ones((n,), jnp.float32)
  total, double = jax.jit(jnp.sum), jax.jit(lambda v: v * 2)  # jitted once: a new wrapper per call would recompile
  return 4 * n / best_seconds(lambda: total(x), repeats), 2 * 4 * n / best_seconds(lambda: double(x), repeats)


def matmul_flops(size: int, repeats: int) -> float:
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
  matmul = jax.jit(jnp.matmul)
  return 2 * size ** 3 / best_seconds(lambda: matmul(a, b), repeats)


def check_ceilings(args) -> dict:
  repeats = max(args.repeats, 10)  # cheap, and a GPU's clocks take a few calls to rise
  n = (1 << 22) if args.small else (1 << 30)  # elements: 16 MiB or 4 GiB of float32
  read_bw, scale_bw = bandwidth(n, repeats)
  size = 256 if args.small else 8192
  peak_flops, peak_bw = published_peaks(jax.devices()[0].device_kind)
  return dict(bandwidth_bytes_s=max(read_bw, scale_bw), read_bytes_s=read_bw, read_write_bytes_s=scale_bw,
              bandwidth_array_bytes=4 * n, bf16_matmul_flop_s=matmul_flops(size, repeats), matmul_size=size,
              published_bf16_flop_s=peak_flops, published_bandwidth_bytes_s=peak_bw)


def decode_bytes(cfg: ModelConfig, params, batch: int, context: float) -> tuple[int, float]:
  """(weight bytes one decode step reads, KV bytes it reads at this mean context per row); module docstring."""
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  if not cfg.tie_word_embeddings:
    weights -= params["embed"].size * params["embed"].dtype.itemsize
  per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  return weights, batch * context * per_token


def time_decode(sampler: Sampler, params, prompts: np.ndarray, new_tokens: int, repeats: int
                ) -> tuple[float, float, float]:
  """(first call s, fastest prefill-only s, fastest s with `new_tokens`): greedy, one compilation for both budgets
  (a row's budget is an array, and a row whose budget is spent ends the loop)."""
  batch, mask = prompts.shape[0], np.ones_like(prompts, bool)

  def run(budget: int):
    return sampler(params, prompts, mask, jax.random.key(0), sampling_params(batch, budget, temperature=0.0)).tokens

  t0 = time.perf_counter()
  jax.block_until_ready(run(new_tokens))
  first_s = time.perf_counter() - t0
  return first_s, best_seconds(lambda: run(1), repeats), best_seconds(lambda: run(new_tokens), repeats)


def check_decode(args, ceilings: dict | None) -> dict:
  measured_bw = (ceilings or {}).get("bandwidth_bytes_s")
  _, published_bw = published_peaks(jax.devices()[0].device_kind)
  rows = []
  for arch in args.decode_archs:
    cfg = arch_config(arch, "bfloat16", "bfloat16")
    params = init_params(cfg, jax.random.key(0))
    sampler = Sampler(cfg, max_new_tokens=args.decode_tokens, pad_id=0)
    for batch in args.decode_batches:
      prompts = np.random.default_rng(0).integers(10, cfg.vocab_size, (batch, args.prompt_len)).astype(np.int32)
      first_s, prefill_s, full_s = time_decode(sampler, params, prompts, args.decode_tokens, args.repeats)
      decode_s = max(full_s - prefill_s, 1e-9)
      tok_s = batch * (args.decode_tokens - 1) / decode_s
      weights, kv = decode_bytes(cfg, params, batch, args.prompt_len + args.decode_tokens / 2)
      roof = batch * measured_bw / (weights + kv) if measured_bw else None
      rows.append(dict(arch=arch, batch=batch, prompt_len=args.prompt_len, new_tokens=args.decode_tokens,
                       compile_s=max(first_s - full_s, 0.0), prefill_s=prefill_s, total_s=full_s,
                       decode_tok_s=tok_s, step_ms=1e3 * decode_s / (args.decode_tokens - 1), weight_bytes=weights,
                       kv_bytes=kv, roofline_tok_s=roof, roofline_pct=roof and 100 * tok_s / roof,
                       published_roofline_tok_s=published_bw and batch * published_bw / (weights + kv),
                       total_tok_s=batch * args.decode_tokens / full_s))
      log(f"[decode] {arch} batch {batch}: {tok_s:.0f} tok/s"
          + (f", {rows[-1]['roofline_pct']:.0f}% of the {roof:.0f} tok/s roofline" if roof else ""))
    del params  # the next architecture's weights get the memory
  return dict(rows=rows)


def check_grpo(args, ceilings: dict | None) -> dict:
  from experiments.bench import grpo_iteration

  cfg = arch_config(args.grpo_arch, "bfloat16", "float32")
  params = init_params(cfg, jax.random.key(0))
  row = grpo_iteration.bench_grpo(cfg, params, args.prompt_len, args.grpo_tokens, warmup=1, runs=args.grpo_runs,
                                  prompts=args.grpo_prompts, group=args.grpo_group)
  med = row["median"]
  flop_s = row["update_flops"] / med["update_s"]
  ceiling = (ceilings or {}).get("bf16_matmul_flop_s")
  peak, _ = published_peaks(jax.devices()[0].device_kind)
  return dict(arch=args.grpo_arch, prompts=args.grpo_prompts, group=args.grpo_group, prompt_len=args.prompt_len,
              new_tokens=args.grpo_tokens, median=med, first_s=row["first_s"], update_flops=row["update_flops"],
              update_tokens=row["update_tokens"], update_flop_s=flop_s,
              mfu_measured_pct=ceiling and 100 * flop_s / ceiling, mfu_published_pct=peak and 100 * flop_s / peak,
              compilations=dict(sampler=row["sampler_compilations"], step=row["step_compilations"]))


def check_dreamgym(args) -> dict:
  from experiments.bench import dreamgym_row, grpo_iteration
  from experiments.bench.sampler import ensure_model

  p = argparse.ArgumentParser()
  dreamgym_row.add_args(p)
  row_args = p.parse_args(["--episodes", "8"] + (["--records", str(args.records)] if args.records else []))
  row_args.small, row_args.warmup, row_args.runs = True, 1, 1
  base = ensure_model(args.cache / "qwen2-small", small=True)
  row = dreamgym_row.bench(base, row_args, 2, 2, grpo_iteration.OBJECTIVE, grpo_iteration.OPTIM,
                           grpo_iteration.update_flops, log)
  return dict(median=row["median"], parse=row["parse"], first_s=row["first_s"], label=row["label"])


# --- report -----------------------------------------------------------------------------------------------------

def _f(x, fmt: str = ".1f", missing: str = "-") -> str:
  return missing if x is None else format(x, fmt)


def render(report: dict) -> str:
  out = ["# Accelerator check", ""]
  if d := report.get("device"):
    gib = d["memory_bytes"] and d["memory_bytes"] / 2 ** 30
    out += [f"{d['count']} x {d['kind']} ({d['platform']}, {_f(gib)} GiB each), {d['processes']} process(es); jax "
            f"{d['jax']}, Python {d['python']}, {d['host_cpus']} host CPUs.", ""]
  if p := report.get("parity"):
    out += ["## Numerics tests", "", f"`{p['command']}` with JAX_PLATFORMS={p['platform']}: {p['passed']} passed, "
            f"{p['failed']} failed, {p['skipped']} skipped in {p['seconds']:.0f} s (exit {p['returncode']})."]
    out += [f"- failed: {n}" for n in p["failed_tests"]] + [""]
  if c := report.get("ceilings"):
    pub_f, pub_b = c["published_bf16_flop_s"], c["published_bandwidth_bytes_s"]
    out += ["## Ceilings", "", "| | measured | published |", "|---|---|---|",
            f"| memory bandwidth, GB/s (read {c['read_bytes_s'] / 1e9:.0f}, read + write "
            f"{c['read_write_bytes_s'] / 1e9:.0f}) | {c['bandwidth_bytes_s'] / 1e9:.1f} | "
            f"{_f(pub_b and pub_b / 1e9, '.0f')} |",
            f"| bf16 matmul, TFLOP/s ({c['matmul_size']}^3) | {c['bf16_matmul_flop_s'] / 1e12:.3g} | "
            f"{_f(pub_f and pub_f / 1e12, '.0f')} |", ""]
  if rows := (report.get("decode") or {}).get("rows"):
    out += ["## bf16 greedy decode", "", "| model | batch | prompt + new | decode tok/s | ms / step | roofline tok/s | "
            "of roofline | of published roofline | weights GB | KV GB | prefill s | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      published = r["published_roofline_tok_s"]
      out.append(f"| {r['arch']} | {r['batch']} | {r['prompt_len']} + {r['new_tokens']} | {r['decode_tok_s']:.0f} | "
                 f"{r['step_ms']:.2f} | {_f(r['roofline_tok_s'], '.0f')} | {_f(r['roofline_pct'], '.0f')}% | "
                 f"{_f(published and 100 * r['decode_tok_s'] / published, '.0f')}% | "
                 f"{r['weight_bytes'] / 1e9:.2f} | {r['kv_bytes'] / 1e9:.2f} | {r['prefill_s']:.3f} | "
                 f"{r['compile_s']:.1f} |")
    out.append("")
  if g := report.get("grpo"):
    m = g["median"]
    out += ["## bf16 GRPO iteration", "", f"{g['arch']}, {g['prompts']} prompts x {g['group']} samples, "
            f"{g['prompt_len']}-token prompts, {g['new_tokens']} new tokens; bf16 compute, float32 master weights.", "",
            "| rollout s | scoring s | update s | total s | first (compiling) s | update TFLOP/s | MFU (measured "
            "ceiling) | MFU (published peak) |", "|---|---|---|---|---|---|---|---|",
            f"| {m['rollout_s']:.2f} | {m['scoring_s']:.2f} | {m['update_s']:.2f} | {m['total_s']:.2f} | "
            f"{g['first_s']:.1f} | {g['update_flop_s'] / 1e12:.1f} | {_f(g['mfu_measured_pct'])}% | "
            f"{_f(g['mfu_published_pct'])}% |", ""]
  if dg := report.get("dreamgym"):
    m, p = dg["median"], dg["parse"]
    out += ["## Tiny DreamGym iteration", "", dg["label"] + ".", "",
            f"total {m['total_s']:.2f} s (policy {m['policy_sample_s']:.2f}, M_exp {m['exp_s']:.2f}, scoring "
            f"{m['scoring_s']:.2f}, update {m['update_s']:.2f}); first iteration {dg['first_s']:.1f} s; "
            f"{p['exp_steps']:.0f} M_exp steps ({p['exp_parse_failures']:.0f} malformed), policy answers parsed "
            f"{p['policy_parsed']:.0%}, {p['turns']:.2f} turns per episode.", ""]
  if errors := report.get("errors"):
    out += ["## Sections that failed", ""] + [f"- {k}: {v}" for k, v in errors.items()] + [""]
  return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", type=Path, default=ROOT / "runs/accelerator_check")
  p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
  p.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke test)")
  p.add_argument("--parity-tests", nargs="+", default=list(PARITY_TESTS), help="pytest node ids of the parity section")
  p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (the fastest counts)")
  p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 16 with --small)")
  p.add_argument("--decode-archs", default=None, help="comma-separated (default llama-3.2-3b; tiny with "
                 "--small): names of dreamjax.plan.memory.PUBLISHED, or standard, tiny")
  p.add_argument("--decode-batches", default=None, help="comma-separated (default 1,64; 1,4 with --small)")
  p.add_argument("--decode-tokens", type=int, default=None, help="new tokens per row (default 256; 64 with --small)")
  p.add_argument("--grpo-arch", default=None, help="as --decode-archs, one (default llama-3.2-1b; tiny with --small)")
  p.add_argument("--grpo-prompts", type=int, default=None, help="default 8; 2 with --small")
  p.add_argument("--grpo-group", type=int, default=None, help="default 8; 2 with --small")
  p.add_argument("--grpo-tokens", type=int, default=None, help="new tokens per row (default 128; 8 with --small)")
  p.add_argument("--grpo-runs", type=int, default=2, help="timed GRPO iterations after one warm-up")
  p.add_argument("--records", type=Path, default=None, help="trajectories JSONL for the DreamGym section")
  p.add_argument("--cache", type=Path, default=ROOT / ".cache/bench", help="benchmark model folders")
  args = p.parse_args(argv)
  args.sections = [s for s in args.sections.split(",") if s]
  if unknown := set(args.sections) - set(SECTIONS):
    p.error(f"--sections: unknown {sorted(unknown)} (known: {', '.join(SECTIONS)})")
  small = args.small
  args.prompt_len = args.prompt_len or (16 if small else 128)
  args.decode_archs = (args.decode_archs or ("tiny" if small else "llama-3.2-3b")).split(",")
  args.decode_batches = [int(b) for b in (args.decode_batches or ("1,4" if small else "1,64")).split(",")]
  args.decode_tokens = args.decode_tokens or (64 if small else 256)
  args.grpo_arch = args.grpo_arch or ("tiny" if small else "llama-3.2-1b")
  args.grpo_prompts = args.grpo_prompts or (2 if small else 8)
  args.grpo_group = args.grpo_group or (2 if small else 8)
  args.grpo_tokens = args.grpo_tokens or (8 if small else 128)
  if args.decode_tokens < 2 or args.repeats < 1 or args.grpo_runs < 1:
    p.error("--decode-tokens must be >= 2, --repeats and --grpo-runs >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  report: dict = {"sections": args.sections, "errors": {}}
  steps = dict(device=lambda: check_device(args), parity=lambda: check_parity(args),
               ceilings=lambda: check_ceilings(args), decode=lambda: check_decode(args, report.get("ceilings")),
               grpo=lambda: check_grpo(args, report.get("ceilings")), dreamgym=lambda: check_dreamgym(args))
  for name in SECTIONS:
    if name not in args.sections:
      continue
    log(f"[accelerator check] {name} ...")
    t0 = time.perf_counter()
    try:
      report[name] = steps[name]()
    except Exception as e:  # noqa: BLE001 - a failed section is reported; the others still run
      report["errors"][name] = f"{type(e).__name__}: {e}"
      log(f"[accelerator check] {name} failed: {report['errors'][name]}")
    report.setdefault("seconds", {})[name] = time.perf_counter() - t0
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (args.out / "report.md").write_text(render(report) + "\n")
  log(f"wrote {args.out / 'report.md'}")
  print(render(report), flush=True)
  return report


if __name__ == "__main__":
  main()
