"""What a policy typed against what the goal quoted, per task: from the episodes `dreamjax eval` writes
(episodes.jsonl, sampled_episodes.jsonl). It tells a policy that copies the goal's value from one that types values
it memorised or only the right length. MiniWoB's passwords are random letters and digits: a policy that does not
copy gets about 0.03 of their characters right in place (letter case ignored), and about 0.10 of the characters it
types are in the password, by chance (experiments/RESULTS.md, twenty-seventh stop).

Each `fill(ref, 'text')` of an episode is compared with the value its instruction quotes that it matches best,
letter case ignored (enter-text-2 asks for the quoted value in the other case). Per task: the fills, those typed
exactly, the share of the quoted value's characters typed right in their place (a shorter or longer fill counts
the missing or extra characters as wrong), and the share of the typed characters that the value holds anywhere
(its characters in another order score high here and low in place).

Run: `python experiments/typed_values.py runs/eval/sft/episodes.jsonl [more files] [--out F.json]`
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from dreamjax.data.records import TrajectoryRecord, read_trajectories  # noqa: E402
from dreamjax.loop.evaluate import task_family  # noqa: E402
from dreamjax.loop.value_copies import quoted_values  # noqa: E402

_FILL = re.compile(r"""fill\('[^']*', '(.*)'\)$""")


def chars_right(value: str, typed: str) -> int:
  return sum(a == b for a, b in zip(value.lower(), typed.lower()))


def typed_values(records: list[TrajectoryRecord]) -> dict[str, dict[str, Any]]:
  """Per task family (`task_family`, the key of eval.json's per_game): fills, exact fills, the share of characters
  right in place and the share of typed characters the value holds."""
  # fills, exact, characters right in place, characters compared, typed characters the value holds, typed characters
  counts: dict[str, list[int]] = defaultdict(lambda: [0] * 6)
  for record in records:
    values = quoted_values(record.instruction)
    if not values:
      continue
    task = task_family(record.task)
    for step in record.steps:
      match = _FILL.match(step.action.strip())
      if not match:
        continue
      typed = match.group(1)
      value = max(values, key=lambda v: chars_right(v, typed))
      c = counts[task]
      c[0] += 1
      c[1] += typed.lower() == value.lower()
      c[2] += chars_right(value, typed)
      c[3] += max(len(value), len(typed))
      c[4] += sum((Counter(value.lower()) & Counter(typed.lower())).values())
      c[5] += len(typed)
  return {task: {"fills": f, "exact": e, "char_accuracy": right / max(total, 1), "chars_in_value": held / max(n, 1)}
          for task, (f, e, right, total, held, n) in sorted(counts.items())}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("episodes", nargs="+", help="episodes.jsonl files written by `dreamjax eval`")
  parser.add_argument("--out", default="", help="also write the numbers to this JSON file")
  args = parser.parse_args(argv)
  try:
    result = {path: typed_values(read_trajectories(path)) for path in args.episodes}
  except (OSError, ValueError) as e:  # the record errors name the file, line and field
    raise SystemExit(str(e)) from e
  for path, per_task in result.items():
    print(path)
    for task, r in per_task.items():
      print(f"  {task}: {r['exact']} of {r['fills']} fills exact, characters right {r['char_accuracy']:.3f}, typed "
            f"characters the value holds {r['chars_in_value']:.3f}")
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
