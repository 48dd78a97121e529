"""Annotates a trajectories JSONL with per-step reasoning and task tutorials, into an annotations JSONL (resumable).

Rule-based (privileged env information; seconds for thousands of episodes):
    python tools/annotate_reasoning.py runs/collect/twx/trajectories.jsonl --annotator rules
Teacher LLM behind an OpenAI-compatible endpoint (key from $OPENAI_API_KEY when set; answers cached on disk):
    python tools/annotate_reasoning.py runs/collect/twx/trajectories.jsonl --annotator teacher \
        --base-url http://localhost:8000/v1 --model meta-llama/Llama-3.3-70B-Instruct --workers 8

The output defaults to annotations.<annotator>.jsonl beside the input. A rerun skips episodes already annotated, so an
interrupted run is resumed by running the same command. The env's step limit (used to tell a step-limit ending from a
failure) is read from collect_config.json beside the input when the collector wrote one, unless --step-limit is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dreamjax.data.records import iter_trajectories
from dreamjax.experience.annotate import annotate_file, rule_annotator, success_references


def collected_step_limit(trajectories: Path) -> int | None:
  """The step limit in the collector's collect_config.json beside `trajectories` (env_kwargs "step_limit=N" or
  "max_steps=N"), None when there is none."""
  path = trajectories.parent / "collect_config.json"
  if not path.is_file():
    return None
  try:
    config = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
  for item in config.get("env_kwargs", []):
    key, _, value = str(item).partition("=")
    if key.strip() in ("step_limit", "max_steps") and value.strip().isdigit():
      return int(value)
  return None


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("trajectories", type=Path, help="trajectories JSONL (dreamjax.trajectory.v1 records)")
  parser.add_argument("--out", type=Path, help="annotations JSONL (default: annotations.<annotator>.jsonl beside it)")
  parser.add_argument("--annotator", choices=("rules", "teacher"), default="rules")
  parser.add_argument("--step-limit", type=int, help="the env's step limit (default: from collect_config.json)")
  parser.add_argument("--limit", type=int, help="annotate at most this many episodes in this run")
  parser.add_argument("--workers", type=int, default=1, help="episodes annotated at once (teacher)")
  teacher = parser.add_argument_group("teacher")
  teacher.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://localhost:8000/v1")
  teacher.add_argument("--model", help="model name the endpoint serves")
  teacher.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key")
  teacher.add_argument("--cache-dir", type=Path, help="answer cache (default: teacher_cache/ beside the output)")
  teacher.add_argument("--max-retries", type=int, default=4)
  teacher.add_argument("--timeout-s", type=float, default=120.0)
  teacher.add_argument("--temperature", type=float, default=0.0)
  teacher.add_argument("--on-failure", choices=("raise", "fallback"), default="raise",
                       help="when every retry fails: stop, or use the rule-based annotation for that episode")
  teacher.add_argument("--no-json-mode", action="store_true", help="do not send response_format=json_object")
  args = parser.parse_args(argv)
  if not args.trajectories.is_file():
    parser.error(f"trajectories file not found: {str(args.trajectories)!r}")
  out = args.out or args.trajectories.parent / f"annotations.{args.annotator}.jsonl"
  step_limit = args.step_limit if args.step_limit is not None else collected_step_limit(args.trajectories)
  records = list(iter_trajectories(args.trajectories))  # validates the whole file before any output is written
  envs = sorted({r.env for r in records})
  if len(envs) > 1:
    parser.error(f"{args.trajectories} mixes envs {envs}; annotate one env per file")
  env = envs[0] if envs else "textworld_express"
  if args.annotator == "rules":
    annotator = rule_annotator(env, step_limit, success_references(records))
  else:
    if not args.base_url or not args.model:
      parser.error("--annotator teacher needs --base-url and --model")
    from dreamjax.experience.teacher import TeacherAnnotator

    annotator = TeacherAnnotator(
        args.base_url, args.model, api_key_env=args.api_key_env, max_retries=args.max_retries,
        timeout_s=args.timeout_s, cache_dir=args.cache_dir or out.parent / "teacher_cache",
        temperature=args.temperature, on_failure=args.on_failure, json_mode=not args.no_json_mode,
        step_limit=step_limit,
        fallback=rule_annotator(env, step_limit, success_references(records)) if args.on_failure == "fallback"
        else None)
  summary = annotate_file(args.trajectories, out, annotator, limit=args.limit, workers=args.workers)
  summary["step_limit"] = step_limit
  if hasattr(annotator, "stats"):
    stats = annotator.stats
    summary.update(requests=stats.requests, cache_hits=stats.cache_hits, retries=stats.retries,
                   fallbacks=stats.fallbacks, errors=stats.errors[:10])
  print(json.dumps(summary, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
