"""How faithful M_exp was to the real env on the episodes a DreamGym run trained on (the on-policy audit).

The run's replay buffer holds every synthetic step M_exp answered (write-back). Each synthetic episode's actions are
replayed in the run's real env (its config.json's `rl.env` and `rl.env_kwargs`) from the same task's reset, and
`dreamjax.experience.fidelity.on_policy` compares M_exp's states, rewards and outcomes with the real ones, per
iteration (the policy version that played the episode) and over all of them. The held-out fidelity of
experiments/exp_model_quality.py follows the collectors' actions; this follows the policy's, which is what the update
learned from: above all, how often an episode M_exp called a success is one in the real env (success precision).
Writes table.md and results.json to --out and prints the table. The run may still be going: the buffer is read as
committed so far.

Run:  python experiments/on_policy_fidelity.py --run runs/dreamgym/grpo_twc --out runs/on_policy/grpo_twc
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dreamjax.envs import make_env
from dreamjax.envs.registry import parse_env_kwargs
from dreamjax.experience.fidelity import on_policy, replay_in_env, synthetic_episodes
from dreamjax.replay.buffer import ReplayBuffer

COLUMNS = [("episodes", "episodes"), ("ended_by_m_exp", "ended by M_exp"), ("m_exp_success", "M_exp success"),
           ("real_success", "real success, same actions"), ("success_precision", "success P"),
           ("success_recall", "success R"), ("n", "steps"), ("exact_match", "EM"), ("reward_precision", "reward P"),
           ("reward_recall", "reward R"), ("done_acc", "done acc"), ("real_invalid", "real invalid"),
           ("invalid_recall", "invalid R"), ("eps_R_mean", "eps_R mean"),
           ("real_ended_first", "real ended first")]


def audit(run: Path) -> dict[str, dict[str, Any]]:
  """{"iteration <v>": metrics, ..., "all": metrics} of the run folder's synthetic episodes."""
  cfg = json.loads((run / "config.json").read_text())
  with ReplayBuffer(run / "replay", read_only=True) as buffer:
    episodes = synthetic_episodes(buffer.iter_from(0))
  if not episodes:
    raise ValueError(f"{run / 'replay'}: no synthetic episodes (has an iteration finished?)")
  env = make_env(cfg["rl"]["env"], **parse_env_kwargs(cfg["rl"]["env_kwargs"]))
  try:
    replays = replay_in_env(env, episodes)  # once: each iteration's rows and "all" score the same replays
  finally:
    env.close()
  versions = [e[0].policy_version for e in episodes]
  results = {f"iteration {v + 1}": on_policy([r for r, w in zip(replays, versions) if w == v])
             for v in sorted(set(versions))}
  results["all"] = on_policy(replays)
  return results


def table(results: dict[str, dict[str, Any]], run: Path) -> str:
  def cell(v: Any) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

  lines = [f"On-policy fidelity of {run}: synthetic episodes replayed in the real env", "",
           "| episodes of | " + " | ".join(label for _, label in COLUMNS) + " | EM by step |",
           "|---|" + "---|" * (len(COLUMNS) + 1)]
  for name, r in results.items():
    curve = " ".join(f"{x:.2f}" for x in r["exact_by_step"])
    lines.append(f"| {name} | " + " | ".join(cell(r.get(k)) for k, _ in COLUMNS) + f" | {curve} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--run", required=True, help="a `dreamjax dreamgym` run folder (config.json, replay/)")
  p.add_argument("--out", required=True, help="folder for table.md and results.json")
  args = p.parse_args(argv)
  run = Path(args.run)
  try:
    results = audit(run)
  except (ValueError, FileNotFoundError) as e:
    print(f"on_policy_fidelity: {e}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  text = table(results, run)
  (out / "table.md").write_text(text + "\n")
  (out / "results.json").write_text(json.dumps(results, indent=2))
  print(text)
  print(f"table: {out / 'table.md'}; results: {out / 'results.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
