"""Headroom of TextWorld-Express coin settings: how often a uniform random policy over the admissible actions and the
observation-only explorer (dreamjax.envs.twx_explorer) succeed on held-out games, per map size, doors and step limit.

A testbed can show learning only where random play fails (issue 18 asks for at most 0.10) and an agent that reads the
observations succeeds; this scan picks the settings. Each setting runs `dreamjax collect` (in process) with both
policies on the same `--tasks` games of the dev split; success rates come with 95% Wilson intervals.

Run: `python experiments/headroom_twx.py --out runs/experiments/headroom_twx` (about 2 minutes on 2 cores).
Writes results.md and results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from dreamjax.data.collect import CollectConfig, collect  # noqa: E402
from dreamjax.loop.evaluate import wilson_interval  # noqa: E402

# (game params, step limit): two rooms without doors (today's tiny testbed), then larger maps behind doors.
SETTINGS = (
    ("numLocations=2, includeDoors=0, numDistractorItems=0", 8),
    ("numLocations=4, includeDoors=1, numDistractorItems=0", 10),
    ("numLocations=6, includeDoors=1, numDistractorItems=0", 12),
    ("numLocations=6, includeDoors=1, numDistractorItems=0", 15),
    ("numLocations=8, includeDoors=1, numDistractorItems=0", 12),
    ("numLocations=8, includeDoors=1, numDistractorItems=0", 14),
    ("numLocations=8, includeDoors=1, numDistractorItems=4", 16),
    ("numLocations=11, includeDoors=1, numDistractorItems=0", 14),  # the coin11 testbed (configs/reproduce_coin11.py)
    ("numLocations=11, includeDoors=1, numDistractorItems=0", 16),
    ("numLocations=11, includeDoors=1, numDistractorItems=0", 20),
)
# Small maps (--maps small): where the explorer's failures are few, does random play stay at 0.10 or below?
SMALL_MAPS = (
    ("numLocations=3, includeDoors=1, numDistractorItems=0", 3),
    ("numLocations=3, includeDoors=1, numDistractorItems=0", 4),
    ("numLocations=3, includeDoors=1, numDistractorItems=10", 6),
    ("numLocations=4, includeDoors=1, numDistractorItems=0", 4),
    ("numLocations=4, includeDoors=1, numDistractorItems=0", 5),
    ("numLocations=4, includeDoors=1, numDistractorItems=0", 6),
    ("numLocations=4, includeDoors=1, numDistractorItems=0", 7),
    ("numLocations=4, includeDoors=1, numDistractorItems=10", 7),
    ("numLocations=4, includeDoors=1, numDistractorItems=10", 10),
    ("numLocations=5, includeDoors=1, numDistractorItems=0", 7),
    ("numLocations=5, includeDoors=1, numDistractorItems=0", 8),
    ("numLocations=6, includeDoors=1, numDistractorItems=0", 8),
)
POLICIES = ("random", "explorer")


def scan(settings: Sequence[tuple[str, int]], tasks: int, out: Path) -> list[dict]:
  rows = []
  for i, (params, limit) in enumerate(settings):
    cfg = CollectConfig(games=("coin",), split="dev", game_params=params, env_kwargs=(f"step_limit={limit}",),
                        policies=tuple(f"{p}:{tasks}" for p in POLICIES), num_workers=0, rows_per_worker=8,
                        max_steps=limit, out_dir=str(out / f"setting{i}"), build_tfds=False, progress=False)
    summary = collect(cfg)["policies"]
    row = dict(game_params=params, step_limit=limit, tasks=tasks)
    for p in POLICIES:
      s = summary[p]
      row[p] = dict(success=s["success_rate"], interval=wilson_interval(s["successes"], s["episodes"]),
                    mean_steps=s["mean_steps"])
    rows.append(row)
    print(f"{params}, limit {limit}: " + ", ".join(f"{p} {row[p]['success']:.2f}" for p in POLICIES), flush=True)
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| coin game params | step limit | random [95% CI] | random steps | explorer [95% CI] | explorer steps |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    cells = [f"{r[p]['success']:.2f} [{r[p]['interval'][0]:.2f}, {r[p]['interval'][1]:.2f}] | {r[p]['mean_steps']:.1f}"
             for p in POLICIES]
    lines.append(f"| {r['game_params']} | {r['step_limit']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", type=int, default=100, help="dev games per setting (the same games for both policies)")
  p.add_argument("--out", type=Path, default=ROOT / "runs/experiments/headroom_twx")
  p.add_argument("--maps", choices=("large", "small"), default="large", help="SETTINGS or SMALL_MAPS")
  p.add_argument("--settings", type=int, default=0, help="only the first N settings (0: all); the test uses 1")
  args = p.parse_args(argv)
  rows = scan((SETTINGS if args.maps == "large" else SMALL_MAPS)[:args.settings or None], args.tasks, args.out)
  md = table(rows)
  (args.out / "results.md").write_text(md + "\n")
  (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
  print(md)
  return rows


if __name__ == "__main__":
  main()
