"""DPO baseline: preference pairs of successful vs failed episodes of the same task, from an SFT checkpoint.

One run: load the SFT checkpoint (the policy's start and, frozen, the reference policy: the same weights), draw
pairs from offline trajectories (`dreamjax.loop.policy_data.preference_pairs`: per-turn rows in exactly the rollout
layout, leading turns common to both sides dropped), score every distinct row once under the reference
(`LogpScorer`), then train the shared DPO objective (`make_objective("dpo")`: -log sigmoid of beta times the
difference of the two trajectories' log-ratio sums) through the shared `TrainStep`. Evaluation (real env, held-out
tasks), checkpoint and summary are those of policy SFT (`dreamjax.commands.train_policy`).

Reference log-probs are looked up by row content: a row's log-probs depend only on its ids (and the positions and
mask derived from them), so identical rows, e.g. one chosen episode paired with two failures, share one entry, and
`dpo_batch`'s row placement needs no bookkeeping. Scoring happens once, before the first update, so the reference
weights need not stay in memory.

Fixed shapes: every batch is padded to the same row count (the largest batch of the planned epochs, bounded so each
micro-batch fits, see `_rows_per_micro`) and the same length (`pad_to`, or the longest row rounded up to 64), so the
step compiles once. Pairs are shuffled per epoch by `(seed, epoch)`.

Tracking as in policy SFT (`dreamjax.loop.track.Tracker`, `track`): config.json, metrics.jsonl, summary.json, W&B when
`track.wandb` asks for it, and a progress bar over the update steps.

Checkpoints, preemption and resume as in policy SFT (its docstring; `checkpoint_every`, `keep_checkpoints`): the
TrainState and, as JSON, the step, logged rows, evaluations, skip counts and tracker run id; the data position is the
step (epoch = step // steps per epoch, pairs shuffled by `(seed, epoch)`). A resumed run scores the reference again
(the same weights and rows give the same log-probs), then continues where the checkpoint ended.

Several processes (multi-host): as policy SFT (its docstring): `start_run(cfg)` first, the same program
on every process (the reference scorer's and the sampler's row-sharded outputs are gathered whole), process 0 alone
writes the run folder, the final checkpoint after a gather every process takes part in.

Run: `dreamjax dpo --config configs/dpo_twx.py[:variant] [--set key=value ...]`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.data.records import read_trajectory_files
from dreamjax.loop.config import (RunConfig, check_settings, checkpoint_folder, export_dtype, export_folder, run_mesh,
                                   start_run)
from dreamjax.loop.evaluate import EvalConfig, Evaluator, evaluate_and_log, format_eval, training_tasks
from dreamjax.loop.model import load_model, save_model
from dreamjax.loop.policy_data import PairConfig, PreferencePair, preference_pairs
from dreamjax.loop.run import RunFolder, resuming
from dreamjax.loop.track import Tracker, echo, progress
from dreamjax.parallel import TRAIN_RULES
from dreamjax.rl.batch import TokenBatch, dpo_batch
from dreamjax.rl.logprobs import LogpScorer, score_len_for
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import SkipCounter, data_parallel_size, make_train_step
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig


@dataclasses.dataclass(frozen=True)
class DpoConfig(RunConfig):
  data: tuple[str, ...] = ("runs/collect/twx/trajectories.jsonl",)  # TrajectoryRecord JSONL files
  # Offline real transitions the run may learn from (whole episodes in file order; 0: all): the paper's DPO budget.
  data_transitions: int = 0
  checkpoint: str = "runs/policy_sft/twx/checkpoint"  # the SFT policy: start and frozen reference
  env: str = "textworld_express"
  env_kwargs: tuple[str, ...] = ("step_limit=50",)
  agent: AgentFormat = AgentFormat(think=False)  # as in the SFT run
  think: str = "auto"  # answer layout of the pair rows (policy_data.RowConfig.think), as in the SFT run
  rollout: RolloutConfig = RolloutConfig(max_turns=50, max_action_tokens=32, max_episode_tokens=1024,
                                         prompt_buckets=(512, 1024))  # as in the SFT run
  pairs: PairConfig = PairConfig()
  beta: float = 0.1
  label_smoothing: float = 0.0
  sft_coef: float = 0.0  # > 0 adds the chosen trajectories' NLL (RPO)
  optim: OptimConfig = OptimConfig(lr=1e-6, warmup_steps=5)
  pairs_per_step: int = 8
  micro_batches: int = 1
  epochs: int = 1
  max_steps: int = 0  # 0: `epochs` decide
  pad_to: int = 0  # 0: the longest row rounded up to 64
  score_batch: int = 16  # rows per reference-scoring call
  eval: EvalConfig = EvalConfig(at_start=True)
  log_every: int = 10
  # Updates skipped in a row for a non-finite loss or gradient (the step keeps the old weights) before the run stops.
  max_nonfinite_updates: int = 3
  checkpoint_every: int = 200  # updates between checkpoints (also after the last); 0: only after the last
  keep_checkpoints: int = 3  # the last N checkpoints are kept
  out_dir: str = "runs/dpo/twx"

  def __post_init__(self):
    check_settings(self, ("pairs_per_step", "micro_batches", "epochs", "score_batch", "log_every",
                          "max_nonfinite_updates", "keep_checkpoints"),
                        ("max_steps", "pad_to", "devices", "data_transitions", "checkpoint_every"))
    if self.beta <= 0:
      raise ValueError(f"DpoConfig.beta must be > 0, got {self.beta}")


def _rows_per_micro(pairs: Sequence[PreferencePair], orders: Sequence[np.ndarray], per_step: int, micro: int,
                    dp: int) -> int:
  """Rows each micro-batch is padded to: an upper bound on `dpo_batch`'s fullest micro-batch over every planned batch.

  `dpo_batch` puts each pair in the micro-batch holding the fewest rows, so the fullest one holds at most
  total / micro + (largest pair) rows; with one micro-batch that bound is the total itself."""
  sizes = np.asarray([len(p.chosen) + len(p.rejected) for p in pairs])
  bound = 0
  for order in orders:
    for s in range(0, len(order), per_step):
      group = sizes[order[s:s + per_step]]
      bound = max(bound, int(group.sum()) if micro == 1 else math.ceil(group.sum() / micro) + int(group.max()))
  return -(-bound // dp) * dp


def reference_logps(scorer: LogpScorer, params, pairs: Sequence[PreferencePair], length: int) -> dict[bytes, np.ndarray]:
  """Reference log-probs of every distinct row on its loss tokens (0 elsewhere: the loss reads no others), keyed by
  the row's int32 ids; rows with equal ids are scored on the union of their loss masks."""
  unique: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
  for p in pairs:
    for row in (*p.chosen, *p.rejected):
      key = row.ids.astype(np.int32).tobytes()
      ids, mask = unique.get(key, (row.ids, np.zeros(len(row.ids), bool)))
      unique[key] = (ids, mask | (np.asarray(row.loss_mask) != 0))
  items = list(unique.items())
  out = {}
  chunk = 64 * scorer.batch_size  # host arrays of a bounded size, however many rows there are
  for start in range(0, len(items), chunk):
    part = items[start:start + chunk]
    tokens = np.zeros((len(part), length), np.int32)
    valid = np.zeros((len(part), length), bool)
    mask = np.zeros((len(part), length), bool)
    for i, (_, (ids, m)) in enumerate(part):
      tokens[i, :len(ids)], valid[i, :len(ids)], mask[i, :len(ids)] = ids, True, m
    logp, _ = scorer(params, tokens, None, valid, mask=mask)
    out.update((k, logp[i, :len(ids)].copy()) for i, (k, (ids, _)) in enumerate(part))
  return out


def with_reference(batch: TokenBatch, ref: dict[bytes, np.ndarray]) -> TokenBatch:
  """`batch` with `ref_logp` filled from the precomputed table (padding rows stay zero)."""
  tokens, valid = np.asarray(batch.tokens), np.asarray(batch.valid)
  out = np.zeros(tokens.shape, np.float32)
  for r in range(tokens.shape[0]):
    n = int(valid[r].sum())
    if n:
      out[r, :n] = ref[tokens[r, :n].tobytes()]
  return batch.replace(ref_logp=out)


def run(cfg: DpoConfig, env=None) -> dict[str, Any]:
  """Trains DPO from the SFT checkpoint (resuming from the latest checkpoint in `out_dir` when there is one),
  evaluates, saves; returns the summary (also out_dir/summary.json)."""
  start_run(cfg)  # before anything touches devices: joins the processes, points the compilation cache
  if not cfg.checkpoint or not (Path(cfg.checkpoint) / "config.json").is_file():
    raise ValueError(f"checkpoint: {cfg.checkpoint!r} is not an HF checkpoint folder (train one with policy SFT)")
  return resuming(lambda: _run(cfg, env))


def _run(cfg: DpoConfig, env) -> dict[str, Any]:
  run_folder = RunFolder(cfg, cfg.out_dir, cfg.keep_checkpoints, checkpoint_folder(cfg))
  with run_folder, run_folder.tracker(cfg.track) as tracker:
    return _train(cfg, env, run_folder, tracker)


def _train(cfg: DpoConfig, env, run: RunFolder, tracker: Tracker) -> dict[str, Any]:
  out = run.out
  mesh = run_mesh(cfg)
  records = read_trajectory_files(cfg.data, "DpoConfig.data", max_transitions=cfg.data_transitions)
  model_cfg, params, tokenizer = load_model(cfg.checkpoint, mesh=mesh, rules=TRAIN_RULES, seed=cfg.seed)
  pairs, pair_stats = preference_pairs(records, tokenizer, cfg.agent, cfg.pairs, cfg.rollout, think=cfg.think)
  if not pairs:
    raise ValueError(f"data {list(cfg.data)}: no preference pairs (counts: {pair_stats}); pairs need a successful "
                     f"episode of {list(cfg.pairs.chosen_policies)} and a failed one of "
                     f"{list(cfg.pairs.rejected_policies)} on the same task")
  objective = make_objective("dpo", beta=cfg.beta, label_smoothing=cfg.label_smoothing, sft_coef=cfg.sft_coef)
  optimizer = make_optimizer(cfg.optim)
  step_fn = make_train_step(model_cfg, objective, optimizer, micro_batches=cfg.micro_batches, mesh=mesh)
  steps_per_epoch = math.ceil(len(pairs) / cfg.pairs_per_step)
  total = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * steps_per_epoch
  epochs = math.ceil(total / steps_per_epoch)
  orders = [np.random.default_rng([cfg.seed, e]).permutation(len(pairs)) for e in range(epochs)]
  per_micro = _rows_per_micro(pairs, orders, cfg.pairs_per_step, cfg.micro_batches,
                              data_parallel_size(mesh, TRAIN_RULES))
  longest = max(len(r.ids) for p in pairs for r in (*p.chosen, *p.rejected))
  length = cfg.pad_to if cfg.pad_to > 0 else -(-longest // 64) * 64

  t0 = time.perf_counter()
  scorer = LogpScorer(model_cfg, cfg.score_batch, pad_to=length, mesh=mesh)
  ref = reference_logps(scorer, params, pairs, length)
  ref_s = time.perf_counter() - t0
  score_len = score_len_for([r.loss_mask for p in pairs for r in (*p.chosen, *p.rejected)])  # one compilation
  used = {p.chosen_id for p in pairs}
  evaluator = Evaluator(model_cfg, tokenizer, cfg.agent, cfg.rollout, cfg.env, cfg.env_kwargs, cfg.eval,
                        training_tasks([r for r in records if r.episode_id in used], cfg.eval.train_tasks),
                        env=env, mesh=mesh)
  key = jax.random.key(cfg.seed)
  state = create_train_state(model_cfg, params, optimizer, mesh)
  del params
  skips = SkipCounter(cfg.max_nonfinite_updates, "DPO")
  state, step, history, evals = run.resume_step_loop(state, skips, total)

  def save_state(at: int) -> None:
    run.save_step_loop(at, state, history, evals, skips, tracker)

  try:
    if cfg.eval.at_start and run.resume is None:
      evals.append(evaluate_and_log(evaluator, state.params, key, 0, tracker))
    t_train = time.perf_counter()
    first_epoch, done = divmod(step, steps_per_epoch)  # a resumed run starts inside an epoch
    with progress(total, "dpo", unit="step", initial=step, enabled=cfg.track.progress and tracker.primary) as bar:
      for epoch in range(first_epoch, len(orders)):
        order = orders[epoch]
        for s in range(done * cfg.pairs_per_step if epoch == first_epoch else 0, len(order), cfg.pairs_per_step):
          if step >= total:
            break
          group = [pairs[i].as_rows() for i in order[s:s + cfg.pairs_per_step]]
          batch = dpo_batch(group, micro_batches=cfg.micro_batches, pad_to=length,
                            row_multiple=per_micro * cfg.micro_batches)
          state, metrics = step_fn(state, with_reference(batch, ref), jax.random.fold_in(key, step), score_len)
          step += 1
          skips.add(metrics, f"step {step}")
          bar.update()
          if step % cfg.log_every == 0 or step == total or step == 1:
            row = tracker.log(step, jax.device_get(metrics) | skips.check(), epoch=epoch)
            history.append(row)
            echo(f"dpo step {step}/{total}: loss {row['loss']:.4f}, margin {row['margin']:.4f}, reward accuracy "
                 f"{row['reward_accuracy']:.3f}")
          if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total:
            evals.append(evaluate_and_log(evaluator, state.params, key, step, tracker))
          run.after_step(step, total, cfg.checkpoint_every, save_state, f"DPO in {out}")
    train_s = time.perf_counter() - t_train
    if run.resume != total:  # a finished run's rerun has its final evaluation in the checkpoint
      evals.append(evaluate_and_log(evaluator, state.params, key, step, tracker))
      save_state(step)
  finally:
    evaluator.close()
  checkpoint = save_model(state.params, model_cfg, cfg.checkpoint, export_folder(cfg, "checkpoint"),
                          dtype=export_dtype(cfg))
  first, last = history[0], history[-1]
  summary = {
      "checkpoint": str(checkpoint), "reference": cfg.checkpoint, "pairs": pair_stats, "steps": step,
      "offline_transitions": sum(r.num_steps for r in records),
      "epochs": round(step / steps_per_epoch, 3), "batch_rows": per_micro * cfg.micro_batches, "row_length": length,
      "reference_rows": len(ref), "reference_seconds": round(ref_s, 3), "compilations": step_fn.compilations(),
      "skipped_updates": skips.total,
      **{f"first_{k}": first[k] for k in ("loss", "margin", "reward_accuracy")},
      **{f"final_{k}": last[k] for k in ("loss", "margin", "reward_accuracy")},
      "train_seconds": round(train_s, 3), "eval": evals[-1]["result"], "eval_history": evals,
      "seconds": round(run.elapsed(), 3), "resumed_from": run.resume,
  }
  tracker.summary(summary)
  echo(format_summary(summary))
  return summary


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"{summary['steps']} steps ({summary['epochs']} epochs) on {summary['pairs']['pairs']} pairs: loss "
           f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, margin {summary['first_margin']:.4f} -> "
           f"{summary['final_margin']:.4f}, reward accuracy {summary['final_reward_accuracy']:.3f}"]
  history = summary["eval_history"]
  for e in (history[0], history[-1]) if len(history) > 1 else history:
    lines += format_eval(e["result"], prefix=f"step {e['step']} ")
  lines.append(f"checkpoint: {summary['checkpoint']}")
  return "\n".join(lines)
