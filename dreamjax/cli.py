"""`dreamjax <command> --config configs/<file>.py [--set key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from dreamjax.config import load_config

COMMANDS = {
    "demo": "sample a batch from a (tiny or real) checkpoint and report tokens/s",
    "collect": "run expert/random/eps policies on a real env; write trajectories (JSONL, TFDS) and a summary",
}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="dreamjax", description="DreamGym in JAX")
  sub = parser.add_subparsers(dest="command", required=True)
  for name, help_text in COMMANDS.items():
    p = sub.add_parser(name, help=help_text)
    p.add_argument("--config", required=True, help="a Python config file defining config()")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
  args = parser.parse_args(argv)
  try:
    cfg = load_config(args.config, args.set)
  except (FileNotFoundError, ValueError) as e:
    print(f"dreamjax {args.command}: {e}", file=sys.stderr)
    return 2
  if args.command == "demo":
    from dreamjax import demo

    demo.run(cfg)
  elif args.command == "collect":
    from dreamjax.data import collect

    try:
      collect.run(cfg)
    except ValueError as e:  # bad settings or a malformed trajectory file: the message names the field or line
      print(f"dreamjax collect: {e}", file=sys.stderr)
      return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
