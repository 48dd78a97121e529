"""`dreamjax <command> --config configs/<file>.py [--set key=value ...]`.

Errors a user fixes in a config or on disk (a ValueError: a bad setting, a malformed input file, an unreadable
checkpoint; a FileNotFoundError: a missing checkpoint, tokenizer or data file) are printed as one line,
`dreamjax <command>: <message>`, with exit status 2; a run stopped for too many non-finite updates in a row
(`NonFiniteUpdateError`) likewise, with status 1. A run stopped by a preemption notice (SIGTERM) after committing a
checkpoint (`dreamjax.loop.preemption.Preempted`) prints one line and exits with status 75 (`PREEMPTED_EXIT`): the
same command resumes it. Anything else keeps its traceback: it is a bug to report.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing

from dreamjax.config import load_config

# command -> (help, "module:function taking the config"); modules are imported only when their command runs.
COMMANDS = {
    "reproduce": ("the paper's comparison end to end (data, M_exp, SFT, baselines, DreamGym, S2R, ablations) and its "
                  "table; `make demo` runs its tiny default", "dreamjax.commands.reproduce:run"),
    "collect": ("run expert/random/eps policies on a real env; write trajectories (JSONL, TFDS) and a summary",
                "dreamjax.commands.collect:run"),
    "annotate": ("write per-step reasoning and task tutorials for collected trajectories (rule-based, or a teacher LLM "
                 "behind an OpenAI-compatible endpoint); resumable", "dreamjax.commands.annotate:run"),
    "train-exp": ("train the experience model (SFT, Eq. 5) on offline trajectories; report its fidelity",
                  "dreamjax.commands.train_exp:run"),
    "train-policy": ("behaviour-clone a policy on expert trajectories (the SFT baseline and RL warm start)",
                     "dreamjax.commands.train_policy:run"),
    "dpo": ("DPO on successful vs failed trajectories of the same tasks (baseline)", "dreamjax.commands.dpo:run"),
    "rl": ("PPO or GRPO against a real environment, with periodic held-out evaluation", "dreamjax.commands.rl:run"),
    "dreamgym": ("PPO or GRPO inside the experience model (curriculum, replay write-back), evaluated on the real env",
                 "dreamjax.commands.dreamgym:run"),
    "eval": ("a policy checkpoint's held-out success on a real env (greedy, optionally sampled)",
             "dreamjax.commands.eval:run"),
    "tables": ("merge several reproduce runs' results (environments x backbones) into the paper's Table 1 and Table 2 "
               "layouts", "dreamjax.commands.tables:run"),
    "sample": ("sample a batch from a (tiny or real) checkpoint and report tokens/s", "dreamjax.commands.sample:run"),
}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="dreamjax", description="DreamGym in JAX")
  sub = parser.add_subparsers(dest="command", required=True)
  for name, (help_text, _) in COMMANDS.items():
    p = sub.add_parser(name, help=help_text)
    p.add_argument("--config", required=True, help="a Python config file defining config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
  args = parser.parse_args(argv)
  try:
    cfg = load_config(args.config, args.set)
  except (FileNotFoundError, ValueError) as e:
    print(f"dreamjax {args.command}: {e}", file=sys.stderr)
    return 2
  module, function = COMMANDS[args.command][1].split(":")
  runner = getattr(importlib.import_module(module), function)
  expected = next(iter(typing.get_type_hints(runner).values()), None)  # the runner's config class
  if isinstance(expected, type) and not isinstance(cfg, expected):
    print(f"dreamjax {args.command}: {args.config} gives a {type(cfg).__name__}; this command runs a "
          f"{expected.__name__}", file=sys.stderr)
    return 2
  from dreamjax.loop.preemption import PREEMPTED_EXIT, Preempted

  try:
    runner(cfg)
  except Preempted as e:  # a launcher reruns the command on this status
    print(f"dreamjax {args.command}: {e}", file=sys.stderr)
    return PREEMPTED_EXIT
  except (ValueError, FileNotFoundError) as e:  # bad settings, paths or input files: the message names them
    print(f"dreamjax {args.command}: {e}", file=sys.stderr)
    return 2
  except RuntimeError as e:
    from dreamjax.rl.update import NonFiniteUpdateError  # loaded already: the runner's module imports it

    if not isinstance(e, NonFiniteUpdateError):
      raise
    print(f"dreamjax {args.command}: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
