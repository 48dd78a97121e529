"""One policy's held-out gain over another, paired over the tasks both were scored on: from two `dreamjax eval`
outputs (eval.json) of the same task set, e.g. an SFT policy and the RL run started from it. Greedy, and sampled
where both evaluations have it; each with a 95% bootstrap interval over tasks (`dreamjax.loop.evaluate.paired_gain`),
the tasks won and lost, and the per-game counts.

Run: `python experiments/paired_gain.py runs/eval/sft/eval.json runs/eval/grpo/eval.json`
(add `--out F.json` to keep the numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from dreamjax.loop.evaluate import paired_gain  # noqa: E402


def load_eval(path: str) -> dict[str, Any]:
  try:
    result = json.loads(Path(path).read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise SystemExit(f"{path}: not a readable eval.json ({e})") from e
  for field in ("outcomes", "per_game", "success_rate"):
    if field not in result:
      raise SystemExit(f"{path}: no {field!r} field; expected the eval.json `dreamjax eval` writes")
  return result


def compare(before: dict[str, Any], after: dict[str, Any], resamples: int) -> dict[str, Any]:
  modes = {"greedy": (before, after)}
  if "sampled" in before and "sampled" in after:
    modes["sampled"] = (before["sampled"], after["sampled"])
  return {mode: paired_gain(b["outcomes"], a["outcomes"], resamples=resamples) |
          {"before": b["success_rate"], "after": a["success_rate"],
           "before_per_game": {g: r["successes"] for g, r in b["per_game"].items()},
           "after_per_game": {g: r["successes"] for g, r in a["per_game"].items()}}
          for mode, (b, a) in modes.items()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("before", help="eval.json of the starting policy")
  parser.add_argument("after", help="eval.json of the policy compared with it")
  parser.add_argument("--resamples", type=int, default=10_000)
  parser.add_argument("--out", default="", help="also write the numbers to this JSON file")
  args = parser.parse_args(argv)
  result = compare(load_eval(args.before), load_eval(args.after), args.resamples)
  for mode, r in result.items():
    print(f"{mode}: {r['before']:.3f} -> {r['after']:.3f}, gain {r['gain']:+.3f} [{r['ci_low']:+.3f}, "
          f"{r['ci_high']:+.3f}] over {r['tasks']} tasks ({r['won']} won, {r['lost']} lost"
          f"{', %d unpaired' % r['unpaired'] if r['unpaired'] else ''})")
    print("  per game: " + ", ".join(f"{g} {r['before_per_game'].get(g, 0)} -> {n}"
                                     for g, n in r["after_per_game"].items()))
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
