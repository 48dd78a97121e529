"""Real-env throughput: steps/s in this process against EnvPool with 1, 2 and 4 workers, side by side.

Run: `python experiments/bench/envs.py` (TWX about 3 minutes on 2 cores; MiniWoB and ALFWorld step 5x longer per
contender, about 15 minutes each) or `... --envs textworld_express --rows 4 --seconds 3 --rounds 1` (smoke test).
Every contender steps the same tasks with uniformly random admissible actions (seeded), resetting the whole batch
when all its episodes have ended:
- `in-process x1`: one env, one row (the adapter's own speed);
- `in-process xB`: B envs stepped one after the other in this process (SerialBatchEnv);
- `pool W`: EnvPool with W workers and B rows (B/W env instances per worker).
Steps/s counts env steps over stepping time, pooled over --rounds runs of every contender in alternating order (the
load on these shared machines drifts); batch resets are timed apart, and the first one (which starts the envs: JVMs,
browsers) is reported on its own (the fastest round's). Prints a markdown table with the ratio to `in-process xB`
and writes table.md and results.json to --out. Envs whose adapter or package is missing are skipped with a line
saying why; to add an env, add an entry to BENCH_ENVS.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from dreamjax.envs.base import SerialBatchEnv, Task  # noqa: E402
from dreamjax.envs.pool import EnvPool  # noqa: E402
from dreamjax.envs.registry import ADAPTERS, env_tasks, make_env  # noqa: E402
from dreamjax.envs.web_state import instantiate  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BenchEnv:
  package: str  # the env's own package; the benchmark skips the env when it is not installed
  kwargs: dict
  tasks: Callable[[int], list[Task]]  # n tasks to step
  seconds_scale: float = 1.0  # slow envs (browsers, ALFWorld) need longer runs for more than a handful of steps


def _adapter_tasks(env: str, games: tuple[str, ...], split: str) -> Callable[[int], list[Task]]:
  """n tasks spread over games, drawn as the collector draws them."""

  def make(n: int) -> list[Task]:
    per_game = -(-n // len(games))
    pools = [env_tasks(env, g, split, per_game) for g in games]
    return [pools[i % len(games)][i // len(games)] for i in range(n)]

  return make


BENCH_ENVS = {
    "textworld_express": BenchEnv("textworld_express", {"step_limit": 50},
                                  _adapter_tasks("textworld_express", ("cookingworld", "twc", "coin"), "train")),
    "alfworld": BenchEnv("alfworld", {"step_limit": 50},
                         _adapter_tasks("alfworld", ("pick_and_place_simple", "look_at_obj_in_light"), "train"), 5.0),
    "miniwob": BenchEnv("browsergym.miniwob", {},
                        _adapter_tasks("miniwob", ("click-test", "click-button"), "train"), 5.0),
}


def missing(name: str) -> str | None:
  """Why the env cannot be benchmarked here, or None."""
  spec = BENCH_ENVS[name]
  module = ADAPTERS[name].split(":")[0]
  try:
    if importlib.util.find_spec(module) is None:
      return f"adapter {module} is not in this checkout"
    if importlib.util.find_spec(spec.package) is None:
      return f"package {spec.package} is not installed"
  except ModuleNotFoundError as e:
    return f"package {spec.package} is not installed ({e})"
  return None


def drive(batch, tasks: list[Task], seconds: float, seed: int) -> dict:
  """Steps random admissible actions for about `seconds` of stepping; returns counts and times."""
  rng = random.Random(seed)
  t0 = time.perf_counter()
  obs = batch.reset_batch(tasks)
  first_reset = time.perf_counter() - t0
  steps = episodes = errors = resets = 0
  step_s = reset_s = 0.0
  while step_s < seconds:
    done = [False] * len(tasks)
    while not all(done) and step_s < seconds:
      actions = [None if done[i] else instantiate(rng.choice(o.admissible), rng) if o.admissible else ""
                 for i, o in enumerate(obs)]
      t0 = time.perf_counter()
      results = batch.step_batch(actions)
      step_s += time.perf_counter() - t0
      for i, r in enumerate(results):
        if not done[i]:
          steps += 1
          errors += "error" in r.info
          done[i] = r.done
          episodes += r.done
      obs = [r.observation for r in results]
    if step_s < seconds:
      t0 = time.perf_counter()
      obs = batch.reset_batch(tasks)
      reset_s += time.perf_counter() - t0
      resets += 1
  return {"steps": steps, "episodes": episodes, "errors": errors, "step_s": step_s, "steps_per_s": steps / step_s,
          "first_reset_s": first_reset, "reset_s_mean": reset_s / resets if resets else None}


def bench_env(name: str, rows: int, workers: list[int], seconds: float, rounds: int, seed: int) -> list[dict]:
  """Each contender runs once per round, the order reversed every other round, so load that drifts during the run
  (these machines are shared) weighs on all contenders alike; steps/s pools the rounds."""
  spec = BENCH_ENVS[name]
  tasks = spec.tasks(rows)
  contenders: list[tuple[str, Callable[[], object], list[Task]]] = [
      ("in-process x1", lambda: SerialBatchEnv([make_env(name, **spec.kwargs)]), tasks[:1]),
      (f"in-process x{rows}", lambda: SerialBatchEnv([make_env(name, **spec.kwargs) for _ in range(rows)]), tasks),
  ]
  for w in workers:
    contenders.append((f"pool {w}", lambda w=w: EnvPool(name, spec.kwargs, num_workers=w), tasks))
  runs: dict[str, list[dict]] = {label: [] for label, _, _ in contenders}
  for k in range(rounds):
    for label, factory, batch_tasks in (contenders if k % 2 == 0 else contenders[::-1]):
      batch = factory()
      try:
        result = drive(batch, batch_tasks, seconds * spec.seconds_scale, seed + k)
      finally:
        batch.close()
      runs[label].append(result)
      print(f"  round {k}: {label}: {result['steps_per_s']:.0f} steps/s ({result['steps']} steps)", file=sys.stderr,
            flush=True)
  out = []
  for label, _, batch_tasks in contenders:
    rs = runs[label]
    resets = [r["reset_s_mean"] for r in rs if r["reset_s_mean"] is not None]
    steps, step_s = sum(r["steps"] for r in rs), sum(r["step_s"] for r in rs)
    out.append({"env": name, "contender": label, "rows": len(batch_tasks), "steps": steps, "step_s": step_s,
                "steps_per_s": steps / step_s, "per_round_steps_per_s": [r["steps_per_s"] for r in rs],
                "episodes": sum(r["episodes"] for r in rs), "errors": sum(r["errors"] for r in rs),
                "first_reset_s": min(r["first_reset_s"] for r in rs),
                "reset_s_mean": sum(resets) / len(resets) if resets else None})
  base = next(r["steps_per_s"] for r in out if r["contender"] == f"in-process x{rows}")
  for r in out:
    r["ratio_vs_in_process"] = r["steps_per_s"] / base
  return out


def table(results: list[dict]) -> str:
  lines = ["| env | contender | rows | steps/s | per round | ratio vs in-process xB | first reset s | reset s | steps "
           "| errors |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    reset = f"{r['reset_s_mean']:.3f}" if r["reset_s_mean"] is not None else "-"
    per_round = " / ".join(f"{x:.0f}" for x in r["per_round_steps_per_s"])
    lines.append(f"| {r['env']} | {r['contender']} | {r['rows']} | {r['steps_per_s']:.0f} | {per_round} | "
                 f"{r['ratio_vs_in_process']:.2f} | {r['first_reset_s']:.2f} | {reset} | {r['steps']} | "
                 f"{r['errors']} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--envs", default=",".join(BENCH_ENVS), help="comma-separated env names")
  parser.add_argument("--rows", type=int, default=8, help="episodes stepped together")
  parser.add_argument("--workers", default="1,2,4", help="pool sizes")
  parser.add_argument("--seconds", type=float, default=6.0,
                      help="stepping time per contender and round (times the env's seconds_scale)")
  parser.add_argument("--rounds", type=int, default=2, help="runs of every contender, in alternating order")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "envs"))
  args = parser.parse_args(argv)
  results, skipped = [], {}
  for name in args.envs.split(","):
    if name not in BENCH_ENVS:
      parser.error(f"unknown env {name!r}; known: {', '.join(BENCH_ENVS)}")
    why = missing(name)
    if why is None:
      print(f"{name}:", file=sys.stderr, flush=True)
      try:
        results += bench_env(name, args.rows, [int(w) for w in args.workers.split(",")], args.seconds, args.rounds,
                               args.seed)
        continue
      except Exception as e:  # noqa: BLE001 - one env's failure must not hide the others' numbers
        why = f"failed: {type(e).__name__}: {e}"
    skipped[name] = why
    print(f"skipped {name}: {why}")
  text = table(results)
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "table.md").write_text(text + "\n")
  (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results, "skipped": skipped},
                                               indent=1) + "\n")
  print(f"wrote {out / 'results.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
