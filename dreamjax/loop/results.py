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
