"""Names and formats shared by the results `dreamjax reproduce` writes and the tables `dreamjax tables` merges them
into: the ablation rows and how a row's real-transition budget is printed."""

from __future__ import annotations

from typing import Any

# DreamGym GRPO without one component each. The first three are the paper's ablation rows; "no_curriculum" (uniform
# seed tasks, no generation) is an extra one. Each is a separate run from the same SFT policy; "no_replay" and
# "no_reasoning" train their own M_exp without that input or output (a model trained with it and shown nothing at run
# time would be a different experiment), and a run refuses an M_exp whose training switches do not match its row.
ABLATIONS = ("no_replay", "no_reasoning", "no_task_generation", "no_curriculum")
ABLATION_NAMES = {"no_replay": "w/o replay", "no_reasoning": "w/o reasoning",
                  "no_task_generation": "w/o task generation", "no_curriculum": "w/o curriculum"}


def ablation_method(ablation: str) -> str:
  """The row name of an ablation run."""
  return f"DreamGym GRPO {ABLATION_NAMES[ablation]}"


def budget_text(budget: dict[str, Any]) -> str:
  """A row's budget {"kind": "offline" | "online", "cap": transitions or None (no cap)} as a table cell."""
  return f"{'-' if budget['cap'] is None else budget['cap']} {budget['kind']}"


# The paper's four result shapes, each read off one table as comparisons of two of its rows (docs/paper_map.md, "The
# results tables"): (a) DreamGym, with no online real transitions, within WITHIN of real-env RL; (b) DreamGym-S2R
# above real-env RL on at most S2R_SHARE of its online real transitions; (c) every ablation below the full DreamGym
# GRPO; (d) DreamGym's training wall time a fraction of real-env RL's. Success differences are paired over the same
# held-out tasks and seeds (`paired_gain`); a shape holds on the point estimate, its interval says how firmly.
WITHIN, S2R_SHARE = 0.05, 0.1
SHAPES = {"a": f"DreamGym within {WITHIN:.2f} of real-env RL, no online real transitions",
          "b": "DreamGym-S2R above real-env RL on at most a tenth of its real transitions",
          "c": "the ablation below the full DreamGym GRPO",
          "d": "DreamGym's training wall time a fraction of real-env RL's"}


def shapes(rows: list[dict[str, Any]], outcomes: dict[str, list[tuple[int, list]]]) -> list[dict[str, Any]]:
  """The shapes a table can show: one entry per comparison whose two rows it has. `rows`: the table's rows;
  `outcomes`: method -> [(seed, that seed's final policy's greedy held-out outcomes)], as `dreamjax eval` writes them
  ((task id, success, turns) each). Entries: shape, method, base (the row it is compared with), holds; for a success
  comparison gain (method minus base) with its 95% bootstrap interval and the paired episodes; for (b) also
  real_ratio; for (d) seconds_ratio and each row's gain over SFT per training hour."""
  from dreamjax.loop.evaluate import paired_gain  # here: `dreamjax tables` reads this module without jax

  by = {r["method"]: r for r in rows}
  out: list[dict[str, Any]] = []

  def keyed(method: str) -> list[tuple[str, bool]]:
    return [(f"{seed}/{task}", ok) for seed, episodes in outcomes[method] for task, ok, *_ in episodes]

  def compare(shape: str, method: str, base: str, holds, **extra) -> None:
    if method in by and base in by:
      g = paired_gain(keyed(base), keyed(method))
      out.append({"shape": shape, "method": method, "base": base, "gain": g["gain"], "ci_low": g["ci_low"],
                  "ci_high": g["ci_high"], "episodes": g["tasks"], **extra, "holds": bool(holds(g["gain"]))})

  algorithms = [m.split(" ")[0] for m in by if m.endswith(" (real env)")]
  for alg in algorithms:
    compare("a", f"DreamGym {alg}", f"{alg} (real env)", lambda gain: gain >= -WITHIN)
  for alg in algorithms:
    real, s2r = f"{alg} (real env)", f"DreamGym-S2R {alg}"
    if s2r in by and by[real]["real_transitions"]:
      ratio = by[s2r]["real_transitions"] / by[real]["real_transitions"]
      compare("b", s2r, real, lambda gain, ratio=ratio: gain > 0 and ratio <= S2R_SHARE, real_ratio=ratio)
  for name in ABLATIONS:
    compare("c", ablation_method(name), "DreamGym GRPO", lambda gain: gain < 0)
  sft = by.get("SFT", {}).get("success_rate")
  for alg in algorithms:
    real, dream = by[f"{alg} (real env)"], by.get(f"DreamGym {alg}")
    if dream is None or not real["seconds"] or not dream["seconds"]:
      continue
    per_hour = {r["method"]: None if sft is None else (r["success_rate"] - sft) / (r["seconds"] / 3600)
                for r in (real, dream)}
    ratio = dream["seconds"] / real["seconds"]
    out.append({"shape": "d", "method": dream["method"], "base": real["method"], "seconds_ratio": ratio,
                "gain_per_hour": per_hour, "holds": ratio < 1})
  return out


def shapes_table(entries: list[dict[str, Any]]) -> str:
  """`shapes` as a markdown table under a line saying how to read it."""
  lines = ["The paper's result shapes on this table: success differences paired over the held-out tasks of each "
           "seed, with a 95% bootstrap interval; a shape holds on the point estimate.", "",
           "| shape | claim | compared | measured | holds |", "|---|---|---|---|---|"]
  for e in entries:
    if e["shape"] == "d":
      hours = ", ".join(f"{m} {'-' if v is None else f'{v:+.3f}'}" for m, v in e["gain_per_hour"].items())
      measured = f"{e['seconds_ratio']:.2f}x the wall time; gain over SFT per training hour: {hours}"
      compared = f"{e['method']} / {e['base']}"
    else:
      measured = f"{e['gain']:+.3f} [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}] over {e['episodes']} episodes"
      if "real_ratio" in e:
        measured += f"; {e['real_ratio']:.2f}x the real transitions"
      compared = f"{e['method']} - {e['base']}"
    lines.append(f"| ({e['shape']}) | {SHAPES[e['shape']]} | {compared} | {measured} | "
                 f"{'yes' if e['holds'] else 'no'} |")
  return "\n".join(lines)
