"""`dreamjax tables`: the paper's two tables from the results of several `dreamjax reproduce` runs.

Each reproduce run covers one environment with one policy backbone and writes results.json (its `env`, `backbone`,
and one row per method with held-out success and its 95% Wilson interval). This command merges several of them:

- table1.md, Table 1's layout: methods down (SFT, DPO, then real-env RL, DreamGym and DreamGym-S2R for GRPO and for
  PPO), one column per environment and backbone across, and the real-data column: each method's real-transition
  budget (offline data or online interaction) as the runs state it.
- table2.md, Table 2's layout: DreamGym GRPO in full and without each component, environments and backbones across.
- tables.json: both, as data.

Cells are success in percent with the interval, "-" where a run has no such row. Two runs for the same environment and
backbone are refused (which one is the table's is not for this command to guess).

  dreamjax tables --config configs/tables.py --set results=runs/reproduce/twx,runs/reproduce/alfworld
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dreamjax.loop.results import ABLATIONS, ablation_method, budget_text
from dreamjax.loop.track import json_dumps

# Table 1's methods, in the paper's order, as reproduce names its rows.
TABLE1 = ("SFT", "DPO", "GRPO (real env)", "DreamGym GRPO", "DreamGym-S2R GRPO", "PPO (real env)", "DreamGym PPO",
          "DreamGym-S2R PPO")
TABLE2 = ("DreamGym GRPO",) + tuple(ablation_method(a) for a in ABLATIONS)


@dataclasses.dataclass(frozen=True)
class TablesConfig:
  results: tuple[str, ...] = ()  # results.json files of `dreamjax reproduce`, or the run folders holding them
  out_dir: str = "runs/tables"


def load_results(paths: tuple[str, ...]) -> list[dict[str, Any]]:
  """Each run's results.json, checked: a missing file or field is an error naming it, as is a second run for the same
  environment and backbone."""
  if not paths:
    raise ValueError("TablesConfig.results: no results given (results.json files or reproduce run folders)")
  runs, seen = [], {}
  for given in paths:
    path = Path(given) / "results.json" if Path(given).is_dir() else Path(given)
    if not path.is_file():
      raise ValueError(f"TablesConfig.results: {path} does not exist (run `dreamjax reproduce` first)")
    try:
      run = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"TablesConfig.results: {path} is not JSON ({e})") from None
    for field in ("env", "backbone", "rows"):
      if field not in run:
        raise ValueError(f"TablesConfig.results: {path} has no {field!r} (written by an older reproduce; rerun "
                         f"`dreamjax reproduce` on its config: finished stages are reused)")
    column = (run["env"], run["backbone"])
    if column in seen:
      raise ValueError(f"TablesConfig.results: {path} and {seen[column]} are both {column[0]} / {column[1]}")
    seen[column] = path
    runs.append(run)
  return runs


def columns(runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
  """(env, backbone) columns grouped by environment, each in the order first given."""
  envs = list(dict.fromkeys(r["env"] for r in runs))
  return [(e, r["backbone"]) for e in envs for r in runs if r["env"] == e]


def cell(row: dict[str, Any] | None) -> str:
  if row is None:
    return "-"
  return f"{100 * row['success_rate']:.1f} [{100 * row['ci_low']:.1f}, {100 * row['ci_high']:.1f}]"


def merge(runs: list[dict[str, Any]], methods: tuple[str, ...], budgets: bool) -> dict[str, Any]:
  """The table as data: its columns and, per method present in some run, the cell of each column (and, with
  `budgets`, the real-transition budgets the runs state for it)."""
  cols = columns(runs)
  by_column = {(r["env"], r["backbone"]): {row["method"]: row for row in r["rows"]} for r in runs}
  out = []
  for method in methods:
    found = [by_column[c].get(method) for c in cols]
    if not any(found):
      continue
    entry: dict[str, Any] = {"method": method, "cells": [cell(f) for f in found]}
    if budgets:
      stated = list(dict.fromkeys(budget_text(f["budget"]) for f in found if f is not None and "budget" in f))
      entry["real_transitions"] = " / ".join(stated) or "?"
    out.append(entry)
  return {"columns": [f"{e} / {b}" for e, b in cols], "rows": out}


def markdown(table: dict[str, Any], title: str, budgets: bool) -> str:
  head = ["method"] + (["real transitions"] if budgets else []) + table["columns"]
  lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in table["rows"]:
    lines.append("| " + " | ".join([r["method"]] + ([r["real_transitions"]] if budgets else []) + r["cells"]) + " |")
  return "\n".join(lines)


def run(cfg: TablesConfig) -> dict[str, Any]:
  runs = load_results(cfg.results)
  t1, t2 = merge(runs, TABLE1, budgets=True), merge(runs, TABLE2, budgets=False)
  out = Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  note = ("Held-out success (%) with a 95% Wilson interval over every seed's episodes; each column is one "
          "`dreamjax reproduce` run (its results.json states the tasks and seeds).")
  texts = {"table1.md": markdown(t1, "Table 1: methods by environment and backbone. " + note, budgets=True),
           "table2.md": markdown(t2, "Table 2: DreamGym GRPO and its ablations. " + note, budgets=False)}
  for name, text in texts.items():
    (out / name).write_text(text + "\n")
    print(text + "\n", flush=True)
  result = {"table1": t1, "table2": t2, "sources": [str(p) for p in cfg.results]}
  (out / "tables.json").write_text(json_dumps(result, indent=1) + "\n")
  return result
