"""The run's figures, drawn with matplotlib; the output format follows the path's suffix (".svg" or ".png").

- `learning_curve`: held-out success (a point per evaluation, bars for its 95% Wilson interval) against iteration
  (left panel) and against the training transitions (right panel: real ones, or synthetic ones for DreamGym), with
  the sampled-policy series when every evaluation has one and the training rollouts' success dashed.
- `metric_curves`: one small line chart per logged metric against the step, three to a row; metrics never logged
  are skipped and non-finite values are left out of their line.
- `success_bars`: held-out success per method as bars with their interval, each labelled with the real transitions
  it spent online.
- `data_efficiency`: held-out success against the online real transitions spent, a line per method (the paper's
  data-efficiency figure).
- `fidelity_plot`: experience models side by side: one-step metrics as grouped bars, open-loop exact match by step as
  lines.

Figures are built as `Figure` objects without pyplot, so nothing needs a display and no figure outlives its call.
Each call runs under fixed rcParams (the SVG id salt, text kept as text) and writes no date, so rerunning a run
rewrites the same bytes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib as mpl
import numpy as np
from matplotlib.figure import Figure

GREEDY, SAMPLED, TRAIN = "#2060c0", "#20a040", "#e08020"
COLOURS = (GREEDY, TRAIN, SAMPLED, "#c02040", "#8040c0", "#606060")
# svg.hashsalt fixes the ids matplotlib otherwise draws at random; fonttype "none" keeps labels as searchable text.
_RC = {"svg.hashsalt": "dreamjax", "svg.fonttype": "none", "font.size": 9, "savefig.dpi": 150,
       "savefig.facecolor": "white"}


def _save(fig: Figure, path: str | Path) -> Path:
  path = Path(path)
  # The SVG writer stamps the current date unless told not to; PNG metadata holds no date.
  fig.savefig(path, metadata={"Date": None} if path.suffix.lower() == ".svg" else None)
  return path


def _finite(v: Any) -> bool:
  return isinstance(v, numbers.Real) and math.isfinite(v)


def _success(ax, xs: Sequence[float], rows: Sequence[Mapping[str, Any]], colour: str, label: str, **style) -> None:
  rate = np.array([r["success_rate"] for r in rows], float)
  # An interval's ends are rounded separately from the rate: clip so a bar never points the wrong way.
  err = np.stack([np.clip(rate - [r["ci_low"] for r in rows], 0, None),
                  np.clip(np.array([r["ci_high"] for r in rows], float) - rate, 0, None)])
  style = {"marker": "o", "ms": 3, "lw": 1.8, "capsize": 2, **style}
  ax.errorbar(xs, rate, yerr=err, color=colour, label=label, **style)


@mpl.rc_context(_RC)
def learning_curve(evals: Sequence[Mapping[str, Any]], path: str | Path, *,
                   train: Sequence[tuple[float, float, float]] = (), title: str = "",
                   transitions: str = "real_transitions") -> Path:
  """Held-out success against iteration and against `transitions` (real_transitions, or synthetic_transitions for
  DreamGym). `evals` rows hold iteration, `transitions`, success_rate, ci_low, ci_high (greedy) and optionally
  "sampled" with the same rates; `train` rows are (iteration, transitions, rollout success), drawn dashed."""
  evals, train = list(evals), list(train)
  fig = Figure(figsize=(9, 3.6), layout="constrained")
  axes = fig.subplots(1, 2, sharey=True)
  sampled = bool(evals) and all("sampled" in e for e in evals)
  for ax, col, x_label in ((axes[0], 0, "iteration"), (axes[1], 1, f"{transitions.replace('_', ' ')} (training)")):
    x_key = "iteration" if col == 0 else transitions
    xs = [e[x_key] for e in evals]
    if train:
      ax.plot([t[col] for t in train], [t[2] for t in train], color=TRAIN, ls="--", lw=1.2,
              label="training rollouts (sampled)")
    if evals:
      _success(ax, xs, evals, GREEDY, "held-out, greedy (bars: 95% Wilson interval)")
    if sampled:
      _success(ax, xs, [e["sampled"] for e in evals], SAMPLED, "held-out, sampled")
    ax.set(xlabel=x_label, ylim=(-0.03, 1.03))
    ax.set_xlim(left=min(ax.get_xlim()[0], 0))  # the axis starts at 0 (or just before, so a point at 0 shows whole)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("success rate")
  if evals or train:
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3, frameon=False)
  if title:
    fig.suptitle(title)
  return _save(fig, path)


@mpl.rc_context(_RC)
def metric_curves(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], path: str | Path, *, title: str = "",
                  x_key: str = "step") -> Path:
  """One line chart per key against `x_key`, three to a row; keys with no number in any row are skipped, and rows
  whose value (or x) is missing or not finite are left out of that key's line."""
  keys = [k for k in keys if any(isinstance(r.get(k), numbers.Real) for r in rows)]
  cols, n_rows = 3, max(1, -(-len(keys) // 3))
  fig = Figure(figsize=(9, 0.4 + 2.3 * n_rows), layout="constrained")
  for i, key in enumerate(keys):
    ax = fig.add_subplot(n_rows, cols, i + 1)
    pts = [(float(r[x_key]), float(r[key])) for r in rows if _finite(r.get(key)) and _finite(r.get(x_key))]
    if pts:
      xs, ys = zip(*pts)
      # One point draws no line segment: mark it so a single logged step still shows.
      ax.plot(xs, ys, color=COLOURS[i % len(COLOURS)], lw=1.3, marker="o" if len(pts) == 1 else None, ms=3)
    ax.set_title(key, fontsize=9)
    ax.set_xlabel(x_key, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  return _save(fig, path)


@mpl.rc_context(_RC)
def success_bars(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
  """Held-out success per method (rows with method, success_rate, ci_low, ci_high, real_transitions) as bars with
  their 95% interval; each label names the real transitions the method spent online."""
  rows = list(rows)
  fig = Figure(figsize=(1.3 * max(1, len(rows)) + 1.2, 3.6), layout="constrained")
  ax = fig.subplots()
  if rows:
    xs = np.arange(len(rows))
    ax.bar(xs, [r["success_rate"] for r in rows], width=0.6, color=GREEDY)
    _success(ax, xs, rows, TRAIN, "", ls="none", marker="none", elinewidth=2, capsize=4)  # no line across methods
    ax.set_xticks(xs, [f"{r['method']}\n{r['real_transitions']} online real" for r in rows], fontsize=8)
  ax.set(ylim=(0, 1.03), ylabel="held-out success")
  ax.grid(axis="y", alpha=0.3)
  return _save(fig, path)


@mpl.rc_context(_RC)
def data_efficiency(curves: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *, title: str = "") -> Path:
  """Held-out success against the online real transitions spent: `curves[method]` are its evaluations in order (rows
  with real_transitions, success_rate, ci_low, ci_high). A method that spent none (DreamGym) has no curve along the
  axis: its last evaluation is drawn at 0 and continued as a dashed line, what it reached without online real
  transitions, for the others' curves to cross or not."""
  fig = Figure(figsize=(5.8, 3.8), layout="constrained")
  ax = fig.subplots()
  for i, (name, points) in enumerate((k, v) for k, v in curves.items() if v):
    colour = COLOURS[i % len(COLOURS)]
    if all(p["real_transitions"] == 0 for p in points):
      ax.axhline(points[-1]["success_rate"], color=colour, ls="--", lw=1.2)
      _success(ax, [0], points[-1:], colour, f"{name}, no online real")
    else:
      _success(ax, [p["real_transitions"] for p in points], points, colour, name)
  ax.set(ylim=(0, 1.03), xlabel="online real transitions spent", ylabel="held-out success", title=title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8, frameon=False)
  return _save(fig, path)


@mpl.rc_context(_RC)
def fidelity_plot(one_step: Mapping[str, Mapping[str, Any]], open_loop: Mapping[str, Sequence[float | None]],
                  keys: Sequence[tuple[str, str]], path: str | Path) -> Path:
  """Experience models compared: `one_step[model][key]` as bars grouped by metric (`keys` are (key, label) pairs;
  a missing value draws no bar), and `open_loop[model]` (exact match at step 1, 2, ...; None where no episode got
  that far) as a line per model."""
  fig = Figure(figsize=(9.6, 3.6), layout="constrained")
  bars, lines = fig.subplots(1, 2)
  width = 0.8 / max(1, len(one_step))
  for i, (name, metrics) in enumerate(one_step.items()):
    values = [metrics.get(k) if _finite(metrics.get(k)) else np.nan for k, _ in keys]
    bars.bar(np.arange(len(keys)) + (i - (len(one_step) - 1) / 2) * width, values, width=width,
             color=COLOURS[i % len(COLOURS)], label=name)
  bars.set_xticks(np.arange(len(keys)), [label for _, label in keys], fontsize=8)
  bars.set(ylim=(0, 1.03), title="one step, teacher-forced (held-out tasks)")
  for i, (name, by_step) in enumerate(open_loop.items()):
    pts = [(h + 1, v) for h, v in enumerate(by_step) if _finite(v)]
    if pts:
      lines.plot(*zip(*pts), color=COLOURS[i % len(COLOURS)], lw=1.8, marker="o", ms=3, label=name)
  lines.set(ylim=(-0.03, 1.03), xlabel="steps since the real first state", title="open loop along recorded actions: EM")
  for ax in (bars, lines):
    ax.grid(alpha=0.3)
  fig.legend(*bars.get_legend_handles_labels(), loc="outside lower center", ncols=len(one_step), frameon=False)
  return _save(fig, path)
