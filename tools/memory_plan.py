"""Prints the per-device memory plan of an RL or DreamGym config: parameters, AdamW, gradients, reference, M_exp,
KV caches, activations, and the peak of each phase of an iteration and of the final HF export (dreamjax/plan/memory.py
has the arithmetic).

Model shapes come from each checkpoint folder's config.json when it exists here, from `--arch ROLE=NAME|FOLDER`
otherwise (NAME: a published model written into dreamjax.plan.memory.PUBLISHED), and from `model.tiny` for a
tiny policy built at run time. Nothing is loaded or allocated.

    python tools/memory_plan.py --config configs/scale/dreamgym_llama8b_gpu.py --accelerator h100 \\
      --arch policy=llama-3.1-8b --arch exp=llama-3.1-8b
    python tools/memory_plan.py --config configs/grpo_real_twx.py --devices 8 --arch policy=qwen2.5-7b \\
      --set mesh.fsdp=8 --dtype bfloat16 --remat full

The policy computes as the config's `model` (ModelSource: dtype, remat, attention_chunk) says, with float32 weights.
`--dtype` and `--remat` show what a change of the models' dtype (weights included) or rematerialisation would do.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from dreamjax.config import load_config
from dreamjax.models.config import ModelConfig, load_hf_config
from dreamjax.plan.memory import (
    ACCELERATORS,
    DREAMGYM_FIELDS,
    PUBLISHED,
    RL_FIELDS,
    MemoryPlan,
    mesh_sizes,
    missing_fields,
    plan_dreamgym,
    plan_rl,
    published_config,
)

ROLES = ("policy", "exp")
# Read here besides what the planner reads: configs are recognised by their fields, as the planner takes them, so the
# tool works wherever the loops define their config classes.
TOOL_RL_FIELDS = ("model.checkpoint", "model.tiny", "model.value_head", "model.overrides", "algorithm", "mesh",
                  "devices")
TOOL_DREAMGYM_FIELDS = ("exp_model", "exp_dtype")


def is_dreamgym(cfg) -> bool:
  return not missing_fields(cfg, DREAMGYM_FIELDS + TOOL_DREAMGYM_FIELDS)


def is_rl(cfg) -> bool:
  return not missing_fields(cfg, RL_FIELDS + TOOL_RL_FIELDS)


def resolve_arch(role: str, given: str | None, checkpoint: str, tiny: ModelConfig | None, field: str) -> ModelConfig:
  """A model's shape: `--arch` first, then the checkpoint folder's config.json, then the tiny config (no checkpoint)."""
  if given:
    if given in PUBLISHED:
      return published_config(given)
    if (Path(given) / "config.json").is_file():
      return load_hf_config(given)
    raise ValueError(f"--arch {role}={given}: neither a published model ({', '.join(PUBLISHED)}) nor a folder with a "
                     f"config.json")
  if checkpoint and (Path(checkpoint) / "config.json").is_file():
    return load_hf_config(checkpoint)
  if not checkpoint and tiny is not None:
    return tiny
  raise ValueError(f"{field} is {checkpoint!r}, which has no config.json here; give --arch {role}=NAME (one of "
                   f"{', '.join(PUBLISHED)}) or --arch {role}=FOLDER")


def build_plan(argv: Sequence[str] | None = None) -> tuple[MemoryPlan, float | None]:
  parser = argparse.ArgumentParser(prog="tools/memory_plan.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True, help="a config file (RLConfig or DreamGymConfig), FILE[:variant]")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
  parser.add_argument("--arch", action="append", default=[], metavar="ROLE=NAME",
                      help=f"model shape for a role ({', '.join(ROLES)}): a published name or an HF folder")
  parser.add_argument("--devices", type=int, default=0, help="device count (needed when a mesh axis is -1)")
  parser.add_argument("--accelerator", choices=sorted(ACCELERATORS), help="compare the peaks with its HBM")
  parser.add_argument("--hbm-gib", type=float, default=None, help="compare the peaks with this much memory per device")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights and compute dtype of every model")
  parser.add_argument("--remat", choices=("none", "full", "dots"), help="the policy's rematerialisation")
  args = parser.parse_args(argv)
  arch = {}
  for item in args.arch:
    role, _, name = item.partition("=")
    if role not in ROLES or not name:
      parser.error(f"--arch {item!r}: expected ROLE=NAME with ROLE one of {ROLES}")
    arch[role] = name
  cfg = load_config(args.config, args.set)
  dreamgym = is_dreamgym(cfg)
  rl = cfg.rl if dreamgym else cfg
  if not is_rl(rl):
    raise ValueError(f"{args.config}: gives a {type(cfg).__name__}; memory_plan handles RLConfig and DreamGymConfig")
  policy = resolve_arch("policy", arch.get("policy"), rl.model.checkpoint, rl.model.tiny, "model.checkpoint")
  policy = policy.replace(value_head=policy.value_head or rl.model.value_head or rl.algorithm == "ppo",
                          **rl.model.overrides())
  models = {"policy": policy}
  if dreamgym:
    models["exp"] = resolve_arch("exp", arch.get("exp"), cfg.exp_model, None, "exp_model").replace(
        dtype=cfg.exp_dtype, param_dtype=cfg.exp_dtype)
  for role, m in models.items():
    changes = {}
    if args.dtype:
      changes.update(dtype=args.dtype, param_dtype=args.dtype)
    if args.remat and role == "policy":
      changes.update(remat=args.remat)
    models[role] = dataclasses.replace(m, **changes)
  sizes = mesh_sizes(rl.mesh, rl.devices or args.devices or None)
  title = f"{args.config} ({type(cfg).__name__})"
  if dreamgym:
    plan = plan_dreamgym(cfg, models["policy"], models["exp"], sizes, title=title)
  else:
    plan = plan_rl(rl, models["policy"], sizes, title=title)
  return plan, args.hbm_gib or (ACCELERATORS[args.accelerator] if args.accelerator else None)


def render(argv: Sequence[str] | None = None) -> str:
  plan, hbm = build_plan(argv)
  return plan.table(hbm)


def main(argv: Sequence[str] | None = None) -> int:
  try:
    print(render(argv))
  except (FileNotFoundError, ValueError) as e:
    print(f"memory_plan: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
