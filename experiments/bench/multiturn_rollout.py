"""Multi-turn rollouts in the experience model: time and prefilled tokens per turn, with and without the fast paths.

Run (after `make demo`, which trains the models it reads):
`python experiments/bench/multiturn_rollout.py --run runs/demo`
or name the parts: `--config configs/demo.py --policy <SFT checkpoint> --exp-model <train-exp folder>
--records <trajectories.jsonl>`.

The workload is a DreamGym rollout as `dreamjax dreamgym` runs it: `--tasks` tasks of the offline data x `--group`
rollouts, up to `--turns` turns, the trained policy (the run's SFT checkpoint, its agent format and rollout settings)
and the trained M_exp (its format, retrieval over the offline transitions, the DreamGym section's temperature,
buckets, speculative setting (or `--draft-tokens`) and retries) alternating: one `RolloutEngine.run` against a
`SyntheticEnv`. Every setting runs the same rollout twice with the same key: the first compiles, the second is
timed. Settings (`--settings`):
- `off`: full prefill every turn, as before issue 17;
- `group`: `RolloutConfig.group_prefill` (a GRPO group's identical prompts prefilled once);
- `reuse`: KV reuse across turns for both models (`RolloutConfig.kv_reuse`, `DreamGymConfig.exp_kv_reuse`);
- `both`: group prefill and KV reuse.

Prints, per turn index: live rows, the policy's and M_exp's sampling seconds and prefilled prompt tokens for each
setting, then totals with the ratio to `off`, and whether every setting produced the same trajectories as `off` (token
for token; they are equal up to float32 rounding of the logits, so a sampled token may in principle differ where a
draw falls within rounding of a boundary). Writes table.md and results.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dreamjax.config import load_config  # noqa: E402
from dreamjax.data.records import read_trajectories, transitions  # noqa: E402
from dreamjax.experience.exp_model import exp_format, exp_retriever, load_exp_model  # noqa: E402
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from  # noqa: E402
from dreamjax.loop.model import load_model  # noqa: E402
from dreamjax.rollout.engine import RolloutEngine  # noqa: E402

SETTINGS = {"off": (False, False), "group": (True, False), "reuse": (False, True), "both": (True, True)}


class TimedSampler:
  """Forwards to a Sampler, recording each call's seconds and the prompt tokens it was given and prefilled (rows
  with a budget)."""

  def __init__(self, inner):
    self.inner, self.calls = inner, []

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def __call__(self, params, tokens, mask, key, sp, **kw):
    reuse = kw.get("reuse")
    before = reuse.prefilled if reuse is not None else 0
    t0 = time.perf_counter()
    out = jax.block_until_ready(self.inner(params, tokens, mask, key, sp, **kw))
    seconds = time.perf_counter() - t0
    live = np.asarray(sp.max_new_tokens) > 0
    prompt = int(np.asarray(mask)[live].sum())
    lengths = np.asarray(out.lengths)[live]
    forwards = lengths if out.forwards is None else np.asarray(out.forwards)[live]
    # rows: the call's batch; live: rows with a budget; longest: the most forward passes a live row took, which
    # bounds the decode loop's iterations (it runs until every row is done).
    self.calls.append(dict(seconds=seconds, prompt=prompt, rows=int(live.size), live=int(live.sum()),
                           longest=int(forwards.max(initial=0)), tokens=int(lengths.sum()),
                           prefilled=reuse.prefilled - before if reuse is not None else prompt))
    return out


class TurnMarkingEnv:
  """Forwards to a SyntheticEnv, noting which of the M_exp sampler's calls each `step_batch` (one turn) made."""

  def __init__(self, env, sampler: TimedSampler):
    self.env, self.sampler, self.turn_calls = env, sampler, []

  def __getattr__(self, name):
    return getattr(self.env, name)

  def step_batch(self, actions):
    first = len(self.sampler.calls)
    out = self.env.step_batch(actions)
    self.turn_calls.append((first, len(self.sampler.calls)))
    return out


def paths(args) -> tuple[str, str, str, str]:
  """(config, policy, exp model, records), from --run's demo layout where not given."""
  run = Path(args.run) if args.run else None
  config = args.config or str(ROOT / "configs" / "demo.py")
  policy = args.policy or (str(run / "sft" / "checkpoint") if run else "")
  exp = args.exp_model or (str(run / "exp_model" / "checkpoint") if run else "")
  records = args.records or (str(run / "data" / "trajectories.jsonl") if run else "")
  missing = [n for n, v in (("--policy", policy), ("--exp-model", exp), ("--records", records))
             if not v or not Path(v).exists()]
  if missing:
    raise SystemExit(f"multiturn_rollout: {', '.join(missing)}: not given, or not found (under --run {args.run!r}: "
                     f"sft/checkpoint, exp_model/checkpoint, data/trajectories.jsonl)")
  return config, policy, exp, records


def run_setting(name, args, cfg, policy, exp, records) -> dict:
  """One setting's timed rollout. `cfg`: a reproduce config (its real-env RL and DreamGym sections) or a DreamGym
  config (its RL section)."""
  group_prefill, kv_reuse = SETTINGS[name]
  rl, dg = (cfg.real, cfg.dreamgym) if hasattr(cfg, "dreamgym") else (cfg.rl, cfg)
  pol_cfg, pol_params, pol_tok = policy
  exp_cfg, exp_params, exp_tok, meta, fmt, retriever = exp
  rollout = dataclasses.replace(rl.rollout, group_size=args.group, max_turns=args.turns,
                                group_prefill=group_prefill, kv_reuse=kv_reuse)
  engine = RolloutEngine(pol_cfg, pol_tok, rl.agent, rollout)
  engine.sampler = TimedSampler(engine.sampler)
  max_new = dg.exp_max_new_tokens or meta["max_new_tokens"]
  top = min(meta["max_len"], exp_cfg.max_position_embeddings - max_new)
  buckets = dg.exp_prompt_buckets or tuple(b for b in (256, 512, 1024, 2048, 4096, 8192) if b < top) + (top,)
  env = SyntheticEnv(exp_cfg, exp_params, exp_tok, fmt, retriever if fmt.retrieval else None,
                     initial_states=initial_states_from(records), max_new_tokens=max_new,
                     temperature=dg.exp_temperature, prompt_buckets=buckets, key=jax.random.key(args.seed),
                     max_steps=args.turns, exp_retries=dg.exp_retries,
                     retry_temperature=dg.exp_retry_temperature, kv_reuse=kv_reuse,
                     speculative=dg.exp_speculative if args.draft_tokens < 0 else
                     dataclasses.replace(dg.exp_speculative, draft_tokens=args.draft_tokens))
  env.sampler = TimedSampler(env.sampler)
  marked = TurnMarkingEnv(env, env.sampler)
  starts = [r for r in records if r.steps]
  tasks = [starts[i % len(starts)].task for i in range(args.tasks)]
  result = {}
  for attempt in ("compile", "timed"):
    engine.sampler.calls.clear()
    env.sampler.calls.clear()
    marked.turn_calls.clear()
    env.batches = 0  # the same episode-batch key both times
    env.reset_stats()
    t0 = time.perf_counter()
    traj = engine.run(pol_params, marked, tasks, jax.random.key(args.seed))
    total = time.perf_counter() - t0
    print(f"  {name} ({attempt}): {total:.1f} s, {traj.num_rows} turn rows", file=sys.stderr, flush=True)
    turns = []
    for t, call in enumerate(engine.sampler.calls):
      lo, hi = marked.turn_calls[t] if t < len(marked.turn_calls) else (0, 0)
      exp_calls = env.sampler.calls[lo:hi]
      turns.append(dict(turn=t, live=int(np.sum(traj.num_turns > t)), policy_s=call["seconds"],
                        policy_prompt=call["prompt"], policy_prefilled=call["prefilled"],
                        exp_s=sum(c["seconds"] for c in exp_calls), exp_prompt=sum(c["prompt"] for c in exp_calls),
                        exp_prefilled=sum(c["prefilled"] for c in exp_calls), exp_calls=len(exp_calls),
                        exp_call_log=exp_calls))
    result = dict(setting=name, total_s=total, turns=turns, tokens=traj.tokens, success=float(np.mean(traj.success)),
                  rows=int(traj.num_rows), compilations=engine.sampler.compilations() + env.sampler.compilations(),
                  exp_steps=int(env.stats["steps"]))
  return result


def tables(results: list[dict]) -> str:
  names = [r["setting"] for r in results]
  head = "| turn | live rows | " + " | ".join(
      f"policy s {n} | policy prefilled {n} | M_exp s {n} | M_exp prefilled {n}" for n in names) + " |"
  lines = [head, "|" + "---|" * (2 + 4 * len(names))]
  for t, first in enumerate(results[0]["turns"]):
    cells = []
    for r in results:
      x = r["turns"][t] if t < len(r["turns"]) else None
      cells += ["-"] * 4 if x is None else [f"{x['policy_s']:.2f}", f"{x['policy_prefilled']} / {x['policy_prompt']}",
                                           f"{x['exp_s']:.2f}", f"{x['exp_prefilled']} / {x['exp_prompt']}"]
    lines.append(f"| {t} | {first['live']} | " + " | ".join(cells) + " |")
  base = results[0]
  lines += ["", "| setting | total s | vs off | policy s | M_exp s | synthetic transitions/s | prefilled / prompt tokens | "
            "turn rows | M_exp steps | compilations | trajectories equal off's |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    pol = sum(x["policy_s"] for x in r["turns"])
    ex = sum(x["exp_s"] for x in r["turns"])
    pre = sum(x["policy_prefilled"] + x["exp_prefilled"] for x in r["turns"])
    prompt = sum(x["policy_prompt"] + x["exp_prompt"] for x in r["turns"])
    same = r["tokens"].shape == base["tokens"].shape and bool(np.all(r["tokens"] == base["tokens"]))
    lines.append(f"| {r['setting']} | {r['total_s']:.1f} | {base['total_s'] / r['total_s']:.2f}x | {pol:.1f} | "
                 f"{ex:.1f} | {r['exp_steps'] / max(ex, 1e-9):.1f} | {pre} / {prompt} ({pre / max(prompt, 1):.0%}) | {r['rows']} | {r['exp_steps']} | "
                 f"{r['compilations']} | {'yes' if same else 'NO'} |")
  # Each M_exp sampler call: a turn's first call answers every live row, the rest draw malformed answers again.
  for r in results:
    lines += ["", f"M_exp sampler calls, {r['setting']}:", "",
              "| turn | call | batch rows | rows sampled | longest (forwards) | tokens | s | ms per forward |",
              "|---|---|---|---|---|---|---|---|"]
    for x in r["turns"]:
      for j, c in enumerate(x["exp_call_log"]):
        lines.append(f"| {x['turn']} | {j} | {c['rows']} | {c['live']} | {c['longest']} | {c['tokens']} | "
                     f"{c['seconds']:.2f} | {1e3 * c['seconds'] / max(c['longest'], 1):.1f} |")
  return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", default="", help="a `make demo` (reproduce) run folder to take the parts from")
  parser.add_argument("--config", default="", help="the run's reproduce config (default configs/demo.py)")
  parser.add_argument("--policy", default="")
  parser.add_argument("--exp-model", default="")
  parser.add_argument("--records", default="")
  parser.add_argument("--tasks", type=int, default=8)
  parser.add_argument("--group", type=int, default=4)
  parser.add_argument("--turns", type=int, default=8)
  parser.add_argument("--settings", default="off,group,reuse,both")
  parser.add_argument("--draft-tokens", type=int, default=-1,
                      help="M_exp's copy-speculative draft tokens (0: plain decoding; default: the config's)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "multiturn_rollout"))
  return parser.parse_args(argv)


def bench(args: argparse.Namespace, cfg, policy_dir: str, exp_dir: str, records_file: str) -> list[dict]:
  """Every setting of `args.settings` on the same workload."""
  records = read_trajectories(records_file)
  policy = load_model(policy_dir)
  meta = json.loads((Path(exp_dir) / "exp_model.json").read_text())
  fmt = exp_format(meta)
  exp_cfg, exp_params, exp_tok, meta, fmt = load_exp_model(exp_dir, reasoning=fmt.reasoning, replay=fmt.retrieval,
                                                           dtype="float32", mesh=None)
  retriever = exp_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
  retriever.add(list(transitions(records, max_history=0)))
  exp = (exp_cfg, exp_params, exp_tok, meta, fmt, retriever)
  return [run_setting(name, args, cfg, policy, exp, records) for name in args.settings.split(",")]


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  config, policy_dir, exp_dir, records_file = paths(args)
  results = bench(args, load_config(config), policy_dir, exp_dir, records_file)
  text = (f"Multi-turn rollout: {args.tasks} tasks x {args.group} rollouts, up to {args.turns} turns; policy "
          f"{policy_dir}, M_exp {exp_dir}\n\n" + tables(results))
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "table.md").write_text(text + "\n")
  (out / "results.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results],
                                               indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
