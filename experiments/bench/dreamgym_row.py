"""The DreamGym row of experiments/bench/grpo_iteration.py: one `PolicyLearner.iteration` against `SyntheticEnv`, with the
benchmark model's architecture as both policy and M_exp (see grpo_iteration.py's docstring for what it measures).

Setup, all from dreamjax's own parts:
- offline data: `--episodes` expert episodes of TextWorld-Express coin (2 locations, no doors: short states), recorded
  here (the env is in-process and fast);
- tokenizer: a BPE trained on the policy's and M_exp's text of those episodes (the model keeps its vocabulary: ids
  past the BPE's are never targets and fade during the warm start);
- warm start: the benchmark model SFT'd (`make_objective("sft")`, the shared jitted step) for `--warm-steps` steps of
  `--warm-rows` rows drawn from the policy's behaviour-cloning rows (`sft_rows`), and with `--warm-exp` also M_exp's
  Eq. 5 rows (`build_examples`, rule-based reasoning). Whole rows: trained on cut prompts (the last 32 tokens before
  the target) the tiny model memorised its targets yet wrote neither format on whole prompts. M_exp's rows are off by
  default because they are 2-3x longer (a step of 4 of them took ~30 s on the shared 2-core machine, and 150 steps
  got the tiny model to 12% well-formed M_exp answers): without them M_exp's answers are malformed, which ends each
  episode after M_exp's first step (an outcome the env reports, not an error), so the row times one policy turn and
  one M_exp step per episode at M_exp's full `--exp-new-tokens` budget. Saved as an HF folder beside the benchmark
  model and reused by later runs. Short histories (1 turn) keep the rows cheap;
- M_exp: `SyntheticEnv` on a copy of the same weights (the learner's update donates its own), retrieving k=1
  neighbour per step through a backbone-pooled encoder and an exact index over the offline transitions.
Prompt buckets are single (policy: its longest recorded turn prompt; M_exp: `--exp-bucket`, prompts trimmed to fit),
so the warm-up iterations compile everything the timed ones use. M_exp's bucket defaults to the longest recorded step's
prompt plus room for its k neighbours.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dreamjax.data.records import TrajectoryRecord, read_trajectories, transitions
from dreamjax.envs.registry import env_tasks
from dreamjax.experience.format import ExpFormatConfig, render_example
from dreamjax.experience.sft_data import ExampleBuilder, annotations_for, build_examples, corpus
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from
from dreamjax.loop.learner import PolicyLearner
from dreamjax.loop.learner import RLConfig
from dreamjax.loop.model import load_model
from dreamjax.loop.policy_data import RowConfig, policy_texts, sft_rows
from dreamjax.models import load_hf_checkpoint, save_hf_checkpoint
from dreamjax.replay.encoder import BackbonePooledEncoder
from dreamjax.replay.index import make_index
from dreamjax.replay.retriever import Retriever
from dreamjax.rl.batch import sft_batch
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import make_train_step
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig
from dreamjax.text import train_bpe_tokenizer

COIN = "numLocations=2, includeDoors=0, numDistractorItems=0"
AGENT = AgentFormat(think=False, history_turns=1, history_token_budget=100)
EXP = ExpFormatConfig(k=1, max_history=1)


def add_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("DreamGym row")
  g.add_argument("--turns", type=int, default=3, help="turns per episode at most")
  g.add_argument("--action-tokens", type=int, default=24, help="policy tokens per turn")
  g.add_argument("--exp-new-tokens", type=int, default=None, help="M_exp tokens per step (default 160; 96 --small)")
  g.add_argument("--exp-bucket", type=int, default=0,
                 help="M_exp prompt width, prompts trimmed to fit (0: the longest recorded step with k neighbours)")
  g.add_argument("--episodes", type=int, default=8, help="expert episodes recorded for data and warm start")
  g.add_argument("--records", type=Path, default=None,
                 help="read the episodes from this trajectories JSONL (`dreamjax collect` output; its first "
                      "--episodes) instead of recording them with TextWorld-Express (for hosts without Java)")
  g.add_argument("--warm-steps", type=int, default=None, help="warm-start SFT steps (default 80; 150 --small)")
  g.add_argument("--warm-rows", type=int, default=4, help="rows per warm-start step")
  g.add_argument("--warm-lr", type=float, default=3e-3)
  g.add_argument("--warm-exp", action="store_true", help="warm-start M_exp's format too (slow: long rows)")


def collect_records(n: int) -> list[TrajectoryRecord]:
  """Expert episodes of TextWorld-Express coin, recorded with the env's own expert."""
  from dreamjax.data.collect import Episode, run_episodes
  from dreamjax.envs.base import SerialBatchEnv
  from dreamjax.envs.textworld_express import TextWorldExpressEnv

  env = TextWorldExpressEnv(step_limit=8)
  try:
    episodes = [Episode(f"expert:{t.task_id}", "expert", t, 0)
                for t in env_tasks("textworld_express", "coin", "train", n, 0, COIN)]
    batch = SerialBatchEnv([env])  # one JVM, one episode at a time
    out = {e.episode_id: r for episode in episodes for e, r in run_episodes(batch, [episode], max_steps=8)}
  finally:
    env.close()
  failed = [i for i, r in out.items() if isinstance(r, str)]
  if failed:
    raise RuntimeError(f"expert episodes failed in the env: {failed[:3]}")
  return [out[e.episode_id] for e in episodes]


def warm_start(base: Path, records: list[TrajectoryRecord], rollout: RolloutConfig, args, log: Callable) -> Path:
  """The SFT'd benchmark model with its tokenizer (module docstring), made once and cached beside `base`."""
  kinds = "pe" if args.warm_exp else "p"
  # "-actions": M_exp's format lists the admissible actions (a cached model from before is not reused)
  folder = base.parent / f"{base.name}-dreamgym-{kinds}-w{args.warm_steps}-r{args.warm_rows}-e{args.episodes}-actions"
  if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
    return folder
  cfg, params = load_hf_checkpoint(base)
  tmp = folder.with_name(folder.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  notes = annotations_for(records)
  texts = policy_texts(records, AGENT) + corpus(records, notes, EXP)
  tok = train_bpe_tokenizer(texts, tmp / "tokenizer", vocab_size=min(1024, cfg.vocab_size))
  cfg = cfg.replace(eos_token_id=tok.eos_ids[0])
  policy, _ = sft_rows(records, tok, AGENT, RowConfig(), rollout)
  exp = build_examples(ExampleBuilder(tok, EXP, 1024), records, notes, None, {}) if args.warm_exp else []
  rows = [(r.ids, r.loss_mask) for r in policy] + [(e.ids, e.loss_mask) for e in exp]
  width = -(-max(len(i) for i, _ in rows) // 64) * 64  # one length for every step: one compilation
  log(f"[DreamGym] warm start: {len(policy)} policy rows + {len(exp)} M_exp rows (<= {width} tokens), "
      f"{args.warm_steps} steps of {args.warm_rows} rows")
  optimizer = make_optimizer(OptimConfig(lr=args.warm_lr, clip_norm=1.0))
  step = make_train_step(cfg, make_objective("sft"), optimizer)
  state = create_train_state(cfg, params, optimizer)
  rng = np.random.default_rng(0)
  for i in range(args.warm_steps):
    pick = rng.choice(len(rows), size=min(args.warm_rows, len(rows)), replace=False)
    state, metrics = step(state, sft_batch([rows[j][0] for j in pick], [rows[j][1] for j in pick], pad_to=width),
                          jax.random.key(i))
    if i % 10 == 0 or i == args.warm_steps - 1:
      log(f"[DreamGym] warm start step {i}: loss {float(metrics['loss']):.3f}")
  save_hf_checkpoint(jax.device_get(state.params), cfg, tmp, tokenizer_folder=tmp / "tokenizer")
  shutil.rmtree(tmp / "tokenizer")
  shutil.rmtree(folder, ignore_errors=True)
  tmp.rename(folder)
  return folder


def bench(base: Path, args, prompts: int, group: int, objective, optim, flops_fn: Callable, log: Callable) -> dict:
  args.exp_new_tokens = args.exp_new_tokens or (96 if args.small else 160)
  args.warm_steps = args.warm_steps if args.warm_steps is not None else (150 if args.small else 80)
  if args.records:
    records = read_trajectories(args.records)[:args.episodes]
    log(f"[DreamGym] {len(records)} episodes from {args.records}")
  else:
    log("[DreamGym] recording expert episodes ...")
    records = collect_records(args.episodes)
  budget = RolloutConfig(group_size=group, max_turns=args.turns, max_action_tokens=args.action_tokens,
                         max_episode_tokens=args.turns * args.action_tokens, prompt_buckets=(2048,), temperature=1.0)
  folder = warm_start(base, records, budget, args, log)
  cfg, params, tok = load_model(folder)
  longest = max(r.prompt_len for r in sft_rows(records, tok, AGENT, RowConfig(), budget)[0])
  rollout = RolloutConfig(group_size=group, max_turns=args.turns, max_action_tokens=args.action_tokens,
                          max_episode_tokens=args.turns * args.action_tokens,
                          prompt_buckets=(-(-(longest + 32) // 64) * 64,), temperature=1.0)
  if not args.exp_bucket:
    items = list(transitions(records))
    longest = max(e.prompt_len for e in build_examples(ExampleBuilder(tok, EXP, 4096), records,
                                                        annotations_for(records), None, {}))
    shown = EXP.k * max(len(tok.encode(render_example(EXP, t))) for t in items)
    args.exp_bucket = min(-(-(longest + shown) // 64) * 64, cfg.max_position_embeddings - args.exp_new_tokens)
  log(f"[DreamGym] prompt buckets: policy {rollout.prompt_buckets[0]}, M_exp {args.exp_bucket}")
  # `dreamjax rl`'s unit: a fixed number of turn rows per optimizer step (one step per B x G rows; more turns, more
  # steps), so a step never computes on padding rows beyond the last partial one.
  rows = prompts * group
  rl = RLConfig(objective=objective, optim=optim, agent=AGENT, rollout=rollout, tasks_per_iteration=prompts,
                rows_per_step=rows, score_batch=rows, pad_to=64)
  exp_params = jax.tree.map(jnp.copy, params)  # the learner's update donates `params`; M_exp keeps its own
  retriever = Retriever(BackbonePooledEncoder(cfg, exp_params, tok), make_index("exact", cfg.hidden_size))
  retriever.add(list(transitions(records, max_history=0)))
  synthetic = SyntheticEnv(cfg, exp_params, tok, EXP, retriever, initial_states=initial_states_from(records),
                           max_new_tokens=args.exp_new_tokens, temperature=1.0, prompt_buckets=(args.exp_bucket,),
                           key=jax.random.key(1), max_steps=args.turns)
  learner = PolicyLearner(rl, cfg, params, tok)
  tasks = list({r.task.task_id: r.task for r in records}.values())[:prompts]
  if len(tasks) < prompts:
    raise ValueError(f"DreamGym row: {len(tasks)} distinct tasks recorded, {prompts} needed; raise --episodes")
  steps = []
  for it in range(args.warmup + args.runs):
    synthetic.start_iteration(it)
    metrics, traj = learner.iteration(synthetic, tasks, it)
    s = synthetic.stats
    # Every row is updated (no zero-variance filter).
    update_flops = flops_fn(cfg, traj.lengths, int(np.asarray(traj.loss_mask).sum()))
    steps.append(dict(
        rollout_s=metrics["rollout_s"], policy_sample_s=metrics["sample_s"], exp_s=metrics["env_s"],
        rollout_host_s=metrics["rollout_s"] - metrics["sample_s"] - metrics["env_s"], scoring_s=metrics.get("ref_s", 0.0),
        update_s=metrics["update_s"], total_s=metrics["iteration_s"], exp_sample_s=s["sample_s"],
        exp_retrieval_s=s["retrieval_s"], exp_steps=s["steps"], exp_parse_failures=s["parse_failures"],
        policy_parsed=1.0 - metrics["parse_failure_rate"], turns=metrics["mean_turns"], rows=traj.num_rows,
        update_tokens=int(traj.lengths.sum()), update_flops=update_flops,
        update_gflop_s=update_flops / metrics["update_s"] / 1e9, update_steps=metrics["update_steps"],
        loss=metrics.get("loss")))
    log(f"[DreamGym] iteration {it}: total {metrics['iteration_s']:.2f}s (policy {metrics['sample_s']:.2f}, M_exp "
        f"{metrics['env_s']:.2f}, ref {metrics.get('ref_s', 0.0):.2f}, update {metrics['update_s']:.2f}); "
        f"{s['steps']:.0f} M_exp steps ({s['parse_failures']:.0f} malformed), policy parsed "
        f"{1 - metrics['parse_failure_rate']:.0%}, {metrics['mean_turns']:.2f} turns")
  timed = steps[args.warmup:]
  med = {k: statistics.median(s[k] for s in timed) for k in timed[0] if k != "loss"}
  return dict(name="DreamGym GRPO", steps=steps, median=med, first_s=steps[0]["total_s"], warm_model=str(folder),
              label=(f"DreamGym GRPO: {prompts} tasks x {group} rollouts, <= {args.turns} turns, policy and M_exp "
                     f"alternating, update on the turn rows ({rows} per optimizer step)"),
              update_rows=int(med["rows"]), update_tokens=int(med["update_tokens"]), update_flops=med["update_flops"],
              update_gflop_s=med["update_gflop_s"],
              parse={k: med[k] for k in ("policy_parsed", "exp_steps", "exp_parse_failures", "turns")})
