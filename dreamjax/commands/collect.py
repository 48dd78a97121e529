"""`dreamjax collect`: expert, random and epsilon-noisy episodes on a real env, written to JSONL (and a TFDS dataset);
the collector itself is `dreamjax.data.collect`.

Several processes (a command started on every worker of a pod, as `dreamjax reproduce`'s first stage is): the
processes join (`initialize`), process 0 alone collects and writes out_dir, and the others wait for it at a barrier,
then every process returns the summary.json it wrote. The envs run on the host, not on the accelerators, so other
processes have nothing to add, and one writer makes the result a one-process run's: the same episodes, once each, in
one file.

Run: `dreamjax collect --config configs/collect_twx.py[:tiny]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dreamjax.data.collect import CollectConfig, collect
from dreamjax.loop.lock import lock_run_folder
from dreamjax.parallel import barrier, initialize, is_primary


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"{summary['episodes_done']}/{summary['episodes_planned']} episodes in {summary['jsonl']}; this run: "
           f"{summary['episodes_this_run']} episodes, {summary['steps_this_run']} steps in "
           f"{summary['seconds_this_run']:.1f} s ({summary['steps_per_s']:.1f} steps/s, "
           f"{summary['episodes_per_s']:.2f} episodes/s, {summary['rows']} rows, {summary['num_workers']} workers, "
           f"{summary['infrastructure_errors']} infrastructure errors, {summary['restarts']} restarts)",
           "", "| policy | episodes | success rate | mean steps | fallback steps |", "|---|---|---|---|---|"]
  for name, s in summary["policies"].items():
    lines.append(f"| {name} | {s['episodes']} | {s['success_rate']:.3f} | {s['mean_steps']:.1f} | "
                 f"{s['fallback_steps']} |")
  return "\n".join(lines)


def run(cfg: CollectConfig) -> dict[str, Any]:
  """The `dreamjax collect` command: the summary (as written to out_dir/summary.json) on every process."""
  initialize(cfg.distributed)  # before the lock, which process 0 alone takes once the processes have joined
  with lock_run_folder(cfg.out_dir):  # one collector per folder: two would append the same episodes
    if is_primary():
      collect(cfg)
    barrier("collect", host_work=True)  # the others read nothing before the JSONL and summary.json are whole
    summary = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
  print(format_summary(summary))
  print(f"summary: {Path(cfg.out_dir) / 'summary.json'}" +
        (f"; TFDS dataset: {Path(cfg.out_dir) / 'tfds'}" if cfg.build_tfds else ""))
  return summary
