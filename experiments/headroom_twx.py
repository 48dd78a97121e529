"""Headroom of TextWorld-Express settings: how often a uniform random policy over the admissible actions and an agent
that acts on the observations succeed on held-out games, per setting. On coin games (`--maps large|small`, per map
size, doors and step limit) that agent is the explorer (dreamjax.envs.twx_explorer): TWX's gold path knows where the
coin is. On twc games (`--maps twc`, TextWorld Commonsense: put each item away where it belongs) it is TWX's gold
path: every object and container it names is in the observation, and where an item belongs follows from its name.

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
# twc (--maps twc): one room, items to put away. Dev games hold items no train game has (TWC's unseen split).
TWC_SETTINGS = (
    ("numLocations=1, numItemsToPutAway=2, includeDoors=0", 8),
    ("numLocations=1, numItemsToPutAway=3, includeDoors=0", 10),
    ("numLocations=2, numItemsToPutAway=2, includeDoors=0", 10),
)
# --maps: (game, settings, (the floor's policy, the observation-only agent's))
MAPS = {"large": ("coin", SETTINGS, ("random", "explorer")), "small": ("coin", SMALL_MAPS, ("random", "explorer")),
        "twc": ("twc", TWC_SETTINGS, ("random", "expert"))}


def scan(maps: str, settings: Sequence[tuple[str, int]], tasks: int, out: Path) -> list[dict]:
  game, _, policies = MAPS[maps]
  rows = []
  for i, (params, limit) in enumerate(settings):
    cfg = CollectConfig(games=(game,), split="dev", game_params=params, env_kwargs=(f"step_limit={limit}",),
                        policies=tuple(f"{p}:{tasks}" for p in policies), num_workers=0, rows_per_worker=8,
                        max_steps=limit, out_dir=str(out / f"setting{i}"), build_tfds=False, progress=False)
    summary = collect(cfg)["policies"]
    row = dict(game=game, game_params=params, step_limit=limit, tasks=tasks)
    for p in policies:
      s = summary[p]
      row[p] = dict(success=s["success_rate"], interval=wilson_interval(s["successes"], s["episodes"]),
                    mean_steps=s["mean_steps"])
    rows.append(row)
    print(f"{params}, limit {limit}: " + ", ".join(f"{p} {row[p]['success']:.2f}" for p in policies), flush=True)
  return rows


def table(maps: str, rows: list[dict]) -> str:
  game, _, policies = MAPS[maps]
  head = " | ".join(f"{p} [95% CI] | {p} steps" for p in policies)
  lines = [f"| {game} game params | step limit | {head} |", "|---|---|---|---|---|---|"]
  for r in rows:
    cells = [f"{r[p]['success']:.2f} [{r[p]['interval'][0]:.2f}, {r[p]['interval'][1]:.2f}] | {r[p]['mean_steps']:.1f}"
             for p in policies]
    lines.append(f"| {r['game_params']} | {r['step_limit']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", type=int, default=100, help="dev games per setting (the same games for both policies)")
  p.add_argument("--out", type=Path, default=ROOT / "runs/experiments/headroom_twx")
  p.add_argument("--maps", choices=tuple(MAPS), default="large", help="coin SETTINGS, coin SMALL_MAPS or TWC_SETTINGS")
  p.add_argument("--settings", type=int, default=0, help="only the first N settings (0: all); the test uses 1")
  args = p.parse_args(argv)
  rows = scan(args.maps, MAPS[args.maps][1][:args.settings or None], args.tasks, args.out)
  md = table(args.maps, rows)
  (args.out / "results.md").write_text(md + "\n")
  (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
  print(md)
  return rows


if __name__ == "__main__":
  main()
