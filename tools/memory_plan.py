"""Prints the per-device memory plan of an RL or DreamGym config: parameters, AdamW, gradients, reference, M_exp,
KV caches, activations, and the peak of each phase of an iteration and of the final HF export (dreamjax/plan/memory.py
has the arithmetic). Also the supervised steps that precede an RL run: policy SFT (`dreamjax train-policy`,
PolicySftConfig), M_exp SFT (`dreamjax train-exp`, ExpSftConfig) and DPO (`dreamjax dpo`, DpoConfig), with their load,
update step, mid-training evaluation and export phases.

Model shapes come from each checkpoint folder's config.json when it exists here, from `--arch ROLE=NAME|FOLDER`
otherwise (NAME: a published model written into dreamjax.plan.memory.PUBLISHED), and from `model.tiny` for a
tiny policy built at run time. Nothing is loaded or allocated.

    python tools/memory_plan.py --config configs/scale/dreamgym_llama8b_gpu.py --accelerator h100 \\
      --arch policy=llama-3.1-8b --arch exp=llama-3.1-8b
    python tools/memory_plan.py --config configs/grpo_real_twx.py --devices 8 --arch policy=qwen2.5-7b \\
      --set mesh.fsdp=8 --dtype bfloat16 --remat full

The roles: `policy` is the policy of RL, DreamGym, policy SFT and DPO (DPO's shape comes from its `checkpoint`, the
SFT policy); `exp` is M_exp, in DreamGym and in M_exp SFT, where it is the model trained, so the same name gives it
in the train-exp step and in the run it feeds (a supervised config takes only its own role):

    python tools/memory_plan.py --config configs/train_exp_twx.py --accelerator v4 --arch exp=llama-3.1-8b \\
      --set mesh.fsdp=4 --set mesh.tensor=8 --set micro_batches=8
    python tools/memory_plan.py --config configs/dpo_twx.py --devices 8 --arch policy=llama-3.2-3b \\
      --set mesh.fsdp=8 --dpo-batch-rows 64

A trained model computes as the config's `model` (ModelSource: dtype, remat, attention_chunk) says, with float32
weights (DPO: as its checkpoint's config.json says, which it loads without overrides). `--dtype` and `--remat` show
what a change of the models' dtype (weights included) or of the trained model's rematerialisation would do. DPO's
update rows depend on its data (pairs of episodes); `--dpo-batch-rows` takes a run's summary.json `batch_rows`, and
without it the plan counts `dreamjax.plan.memory.dpo_batch_rows`' bound (every episode `rollout.max_turns` turns).
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
    SUPERVISED_FIELDS,
    MemoryPlan,
    mesh_sizes,
    missing_fields,
    plan_dreamgym,
    plan_rl,
    plan_supervised,
    published_config,
    supervised_kind,
)

ROLES = ("policy", "exp")
# Read here besides what the planner reads: configs are recognised by their fields, as the planner takes them, so the
# tool works wherever the loops define their config classes.
TOOL_RL_FIELDS = ("model.checkpoint", "model.tiny", "model.value_head", "model.overrides", "algorithm", "mesh",
                  "devices")
TOOL_DREAMGYM_FIELDS = ("exp_model", "exp_dtype")
# The supervised commands: where the trained model comes from (ModelSource; DPO: its SFT checkpoint) and the role
# `--arch` names it by.
TOOL_SOURCE_FIELDS = ("model.checkpoint", "model.tiny", "model.value_head", "model.overrides", "mesh", "devices")
TOOL_SUPERVISED = {"policy_sft": ("policy", TOOL_SOURCE_FIELDS), "exp_sft": ("exp", TOOL_SOURCE_FIELDS),
                   "dpo": ("policy", ("checkpoint", "mesh", "devices"))}


def is_dreamgym(cfg) -> bool:
  return not missing_fields(cfg, DREAMGYM_FIELDS + TOOL_DREAMGYM_FIELDS)


def is_rl(cfg) -> bool:
  return not missing_fields(cfg, RL_FIELDS + TOOL_RL_FIELDS)


def supervised(cfg) -> str | None:
  """The supervised command `cfg` configures ("policy_sft", "exp_sft", "dpo"), or None."""
  kind = supervised_kind(cfg)
  return kind if kind and not missing_fields(cfg, SUPERVISED_FIELDS[kind] + TOOL_SUPERVISED[kind][1]) else None


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
  parser.add_argument("--config", required=True, help="a config file (RLConfig, DreamGymConfig, PolicySftConfig, "
                      "ExpSftConfig or DpoConfig), FILE[:variant]")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
  parser.add_argument("--arch", action="append", default=[], metavar="ROLE=NAME",
                      help=f"model shape for a role ({', '.join(ROLES)}): a published name or an HF folder")
  parser.add_argument("--devices", type=int, default=0, help="device count (needed when a mesh axis is -1)")
  parser.add_argument("--accelerator", choices=sorted(ACCELERATORS), help="compare the peaks with its HBM")
  parser.add_argument("--hbm-gib", type=float, default=None, help="compare the peaks with this much memory per device")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights and compute dtype of every model")
  parser.add_argument("--remat", choices=("none", "full", "dots"),
                      help="the trained model's rematerialisation (the policy; M_exp in M_exp SFT)")
  parser.add_argument("--dpo-batch-rows", type=int, default=0,
                      help="DPO: rows per update (summary.json's batch_rows); default: the bound from the config")
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
    kind = supervised(cfg)
    if kind is None:
      raise ValueError(f"{args.config}: gives a {type(cfg).__name__}; memory_plan handles RLConfig and DreamGymConfig "
                       f"(the loops) and PolicySftConfig, ExpSftConfig and DpoConfig (the supervised commands)")
    return _supervised_plan(args, cfg, kind, arch)
  if args.dpo_batch_rows:
    parser.error("--dpo-batch-rows: only for a DpoConfig")
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


def _supervised_plan(args: argparse.Namespace, cfg, kind: str, arch: dict[str, str]) -> tuple[MemoryPlan, float | None]:
  """`build_plan` for a supervised command's config (`kind`, as `supervised` names it)."""
  role, _ = TOOL_SUPERVISED[kind]
  if set(arch) - {role}:
    raise ValueError(f"--arch {', '.join(sorted(set(arch) - {role}))}=...: a {type(cfg).__name__} trains one model, "
                     f"given as --arch {role}=NAME")
  if kind == "dpo":  # loaded as the checkpoint's config.json says (load_model, no overrides)
    model = resolve_arch(role, arch.get(role), cfg.checkpoint, None, "checkpoint")
  else:
    model = resolve_arch(role, arch.get(role), cfg.model.checkpoint, cfg.model.tiny, "model.checkpoint")
    model = model.replace(value_head=model.value_head or cfg.model.value_head, **cfg.model.overrides())
  changes = {}
  if args.dtype:
    changes.update(dtype=args.dtype, param_dtype=args.dtype)
  if args.remat:
    changes.update(remat=args.remat)
  model = dataclasses.replace(model, **changes)
  if args.dpo_batch_rows and kind != "dpo":
    raise ValueError("--dpo-batch-rows: only for a DpoConfig")
  sizes = mesh_sizes(cfg.mesh, cfg.devices or args.devices or None)
  extra = {"batch_rows": args.dpo_batch_rows} if args.dpo_batch_rows else {}
  plan = plan_supervised(cfg, model, sizes, title=f"{args.config} ({type(cfg).__name__})", **extra)
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
