"""Policy SFT (behaviour cloning) on expert trajectories: the warm start for RL and the paper's SFT baseline.

One run: read offline `TrajectoryRecord` JSONL files, load the model (an HF checkpoint, or a tiny one built for the
run with a BPE trained on the run's own text), turn demonstration turns into per-turn rows identical in layout to
rollout rows (`dreamjax.loop.policy_data`), train with the shared SFT objective (`make_objective("sft")`: token-mean
NLL over answer tokens) through the shared jitted `TrainStep`, evaluate the greedy policy's success in the REAL env on
held-out tasks (and optionally on training tasks) at the end and every `eval.every_steps` updates, and save an HF
checkpoint folder (RL's warm start) plus `summary.json`.

Tracking (`dreamjax.loop.track.Tracker`, `track`): config.json, metrics.jsonl, summary.json, and W&B when `track.wandb`
is "online" or "offline"; a progress bar over the update steps when stderr is a terminal.

Checkpoints and resume (`dreamjax.loop.run.RunFolder`, as the RL loop): every `checkpoint_every` updates, on a
preemption notice (SIGTERM: `dreamjax.loop.preemption`; the run then stops and the CLI exits with 75) and after the
final evaluation, `checkpoints/` gets the TrainState (parameters, optimizer state, step) and, as JSON, the step, the
logged rows, the evaluations, the skip counts, the tracker's run id and the config; the last `keep_checkpoints` are
kept. Rerunning the same command in the same `out_dir` resumes from the latest committed one: the data position is
the step itself (epoch = step // steps per epoch, batches drawn by `(seed, epoch)`), the step's key is
`fold_in(key(seed), step)`, metrics.jsonl keeps its rows up to that step and W&B continues the same run, so the
resumed run ends with the parameters, metrics rows (timings aside) and evaluations of an uninterrupted one. A fresh
folder starts a fresh metrics.jsonl and run id. A rerun of a finished run only rewrites its outputs.

Batches have fixed shapes so the step compiles once: every batch holds `batch_size` rows (the last batch of an epoch
is filled with empty rows, which the token-mean loss ignores) and, with `pad_to = 0`, every row is padded to the
longest row's length rounded up to 64. Rows are shuffled per epoch by `(seed, epoch)`, and the step's PRNG key is
`fold_in(key(seed), step)`, so a rerun repeats the run. With `group_rows` set, each window of that many rows of the
epoch's order is sorted by length and cut into batches, taken in a seeded order (`dreamjax.rl.batch.length_grouped`,
as M_exp's training), and each batch is padded to its own longest row rounded up to 128: one compilation per width
instead of one, but where rows run from a few hundred tokens to a thousand (ALFWorld's prompts with their admissible
lists), most of a padded batch is no longer padding. Every row is still seen once an epoch.

Evaluation is `dreamjax.loop.evaluate.evaluate`: the rollout engine (the RL code path), greedy, one episode per
task, in batches of `eval.num_envs` episodes; success rates come with a 95% Wilson interval. Held-out tasks come from
the env's own held-out fold (`eval.split`), so none of them is in the demonstrations.

A tiny model is built in out_dir/init_model on the first run and reused by reruns in the same folder.

Several processes (multi-host), as `dreamjax rl` (see its docstring): `run` first calls
`dreamjax.loop.config.start_run(cfg)`, every process runs the same program on the same data and seeds (each
evaluates on its own copy of the env; the sampler's rows are gathered whole), and process 0 alone writes the run
folder: config, metrics, summary, the tiny init model (the others load it after a barrier) and the final checkpoint
(after a gather of the parameters every process takes part in). The mesh must hold devices of every process, and
`out_dir` must be a filesystem every process sees.

Run: `dreamjax train-policy --config configs/train_policy_twx.py[:variant] [--set key=value ...]`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dreamjax.data.records import read_trajectory_files
from dreamjax.envs.base import BatchEnv
from dreamjax.loop.config import (RunConfig, check_settings, checkpoint_folder, export_dtype, export_folder, run_mesh,
                                   start_run)
from dreamjax.loop.evaluate import EvalConfig, Evaluator, evaluate_and_log, format_eval, training_tasks
from dreamjax.loop.model import ModelSource, prepare_model, save_model
from dreamjax.loop.policy_data import RowConfig, TurnRow, policy_texts, sft_rows
from dreamjax.loop.run import RunFolder, resuming
from dreamjax.loop.track import Tracker, echo, progress
from dreamjax.loop.value_copies import value_copies
from dreamjax.rl.batch import GROUPED_WIDTH, length_grouped, sft_batch
from dreamjax.rl.logprobs import score_len_for
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import SkipCounter, make_train_step
from dreamjax.rollout.agent import AgentFormat
from dreamjax.rollout.engine import RolloutConfig


@dataclasses.dataclass(frozen=True)
class PolicySftConfig(RunConfig):
  data: tuple[str, ...] = ("runs/collect/twx/trajectories.jsonl",)  # TrajectoryRecord JSONL files
  # Offline real transitions the run may learn from (whole episodes in file order; 0: all): the paper's SFT budget.
  data_transitions: int = 0
  # Copies of each episode whose goal quotes values or states dates (MiniWoB's Enter "Tula"..., Enter 02/04/2012...)
  # or names an object (ALFWorld's put a mug in microwave), the values replaced by others in each
  # (dreamjax.loop.value_copies), meant to teach copying or matching the goal's value; 0: none. On MiniWoB they
  # gained nothing over as many steps without them (experiments/RESULTS.md, twenty-sixth stop); made up and with the
  # prompt in the loss (rows.prompt_loss), they taught the policy to type passwords (twenty-eighth stop). On ALFWorld,
  # at 300 steps, they did not teach it to take the goal's object (thirty-third stop).
  value_copies: int = 0
  # The copies' values all made up character by character (value_copies.made_up) instead of drawn from the values
  # the records quote: no value comes back, so memorising cannot predict a copy's answer.
  value_copies_made_up: bool = False
  env: str = "textworld_express"
  env_kwargs: tuple[str, ...] = ("step_limit=50",)  # "key=value", as in CollectConfig
  agent: AgentFormat = AgentFormat(think=False)
  rows: RowConfig = RowConfig()
  # The RL run's rollout settings: rows are fitted to its largest prompt bucket and per-turn token budget, and
  # evaluation runs them greedily.
  rollout: RolloutConfig = RolloutConfig(max_turns=50, max_action_tokens=32, max_episode_tokens=1024,
                                         prompt_buckets=(512, 1024))
  model: ModelSource = ModelSource()
  optim: OptimConfig = OptimConfig(lr=1e-5, warmup_steps=10)
  batch_size: int = 32  # rows per update
  micro_batches: int = 1
  epochs: int = 1
  max_steps: int = 0  # 0: `epochs` decide; else stop after this many updates
  pad_to: int = 0  # row length multiple; 0: the longest row rounded up to 64 (one compilation)
  # Rows per length-sorted window of an epoch's shuffled rows (module docstring; a multiple of batch_size); 0: none.
  group_rows: int = 0
  eval: EvalConfig = EvalConfig()
  log_every: int = 10
  # Updates skipped in a row for a non-finite loss or gradient (the step keeps the old weights) before the run stops.
  max_nonfinite_updates: int = 3
  checkpoint_every: int = 200  # updates between checkpoints (also after the last); 0: only after the last
  keep_checkpoints: int = 3  # the last N checkpoints are kept
  out_dir: str = "runs/policy_sft/twx"

  def __post_init__(self):
    check_settings(self, ("batch_size", "micro_batches", "epochs", "log_every", "max_nonfinite_updates",
                          "keep_checkpoints"),
                   ("max_steps", "pad_to", "devices", "data_transitions", "checkpoint_every", "value_copies",
                    "group_rows"))
    if self.group_rows % self.batch_size or (self.group_rows and self.pad_to):
      raise ValueError(f"PolicySftConfig.group_rows must be a multiple of batch_size ({self.batch_size}) and is "
                       f"not used with pad_to (a fixed width), got group_rows={self.group_rows}, "
                       f"pad_to={self.pad_to}")


def _batches(rows: Sequence[TurnRow], batch_size: int, rng: np.random.Generator, group_rows: int = 0
             ) -> list[list[TurnRow]]:
  """One epoch's batches: a seeded permutation of the rows cut into batches, or with `group_rows` each window of
  that many rows of it length-grouped (`length_grouped`)."""
  order = rng.permutation(len(rows))
  if group_rows:
    lengths = np.array([len(r.ids) for r in rows])
    cuts = [b for s in range(0, len(rows), group_rows)
            for b in length_grouped(order[s:s + group_rows], lengths, batch_size, rng)]
  else:
    cuts = [order[s:s + batch_size] for s in range(0, len(rows), batch_size)]
  return [[rows[i] for i in cut] for cut in cuts]


def padded_length(rows: Sequence[TurnRow], pad_to: int) -> int:
  longest = max(len(r.ids) for r in rows)
  return pad_to if pad_to > 0 else -(-longest // 64) * 64


def run(cfg: PolicySftConfig, env: BatchEnv | None = None) -> dict[str, Any]:
  """Trains (resuming from the latest checkpoint in `out_dir` when there is one), evaluates and saves; returns the
  summary (also written to out_dir/summary.json). `env` (not closed here) replaces the evaluation env built from the
  config."""
  start_run(cfg)  # before anything touches devices: joins the processes, points the compilation cache
  return resuming(lambda: _run(cfg, env))


def _run(cfg: PolicySftConfig, env: BatchEnv | None) -> dict[str, Any]:
  run_folder = RunFolder(cfg, cfg.out_dir, cfg.keep_checkpoints, checkpoint_folder(cfg))
  with run_folder, run_folder.tracker(cfg.track) as tracker:
    return _train(cfg, env, run_folder, tracker)


def _train(cfg: PolicySftConfig, env: BatchEnv | None, run: RunFolder, tracker: Tracker
           ) -> dict[str, Any]:
  out = run.out
  mesh = run_mesh(cfg)
  records = read_trajectory_files(cfg.data, "PolicySftConfig.data", max_transitions=cfg.data_transitions)
  model_dir, model_cfg, params, tokenizer = prepare_model(
      cfg.model, out / "init_model", lambda: policy_texts(records, cfg.agent, cfg.rows.think), seed=cfg.seed, mesh=mesh,
      overrides=cfg.model.overrides())
  # after the tokenizer, which learns real text only
  copies = value_copies(records, cfg.value_copies, cfg.seed, cfg.value_copies_made_up)
  rows, row_stats = sft_rows([*records, *copies], tokenizer, cfg.agent, cfg.rows, cfg.rollout)
  row_stats["value_copies"] = len(copies)
  if not rows:
    raise ValueError(f"data {list(cfg.data)}: no demonstration turns (row counts: {row_stats}); check rows.experts "
                     f"(policies present: {sorted({r.policy for r in records})}) and rows.successful_only")
  optimizer = make_optimizer(cfg.optim)
  step_fn = make_train_step(model_cfg, make_objective("sft"), optimizer, micro_batches=cfg.micro_batches, mesh=mesh)
  if cfg.batch_size % step_fn.row_multiple:
    raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of {step_fn.row_multiple} (micro_batches x "
                     f"data-parallel size)")
  steps_per_epoch = math.ceil(len(rows) / cfg.batch_size)
  total = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * steps_per_epoch
  length = padded_length(rows, cfg.pad_to)
  width = GROUPED_WIDTH if cfg.group_rows else length  # grouped: each batch its own longest row, rounded up
  score_len = score_len_for([r.loss_mask for r in rows])  # one compilation for every batch
  # rows.restricted_loss: one width of allowed sets for every batch, a power of two as the rollout's
  allowed_width = 1 << (max(r.allowed.shape[1] for r in rows) - 1).bit_length() if cfg.rows.restricted_loss else 0
  demonstrated = {row.episode_id for row in rows}
  demo_tasks = training_tasks([r for r in records if r.episode_id in demonstrated], cfg.eval.train_tasks)
  evaluator = Evaluator(model_cfg, tokenizer, cfg.agent, cfg.rollout, cfg.env, cfg.env_kwargs, cfg.eval, demo_tasks,
                        env=env, mesh=mesh)
  key = jax.random.key(cfg.seed)
  state = create_train_state(model_cfg, params, optimizer, mesh)
  del params
  skips = SkipCounter(cfg.max_nonfinite_updates, "policy SFT")
  state, step, history, evals = run.resume_step_loop(state, skips, total)

  def save_state(at: int) -> None:
    run.save_step_loop(at, state, history, evals, skips, tracker)

  try:
    if cfg.eval.at_start and run.resume is None:
      evals.append(evaluate_and_log(evaluator, state.params, key, 0, tracker))
    t_train = time.perf_counter()
    with progress(total, "policy_sft", unit="step", initial=step,
                  enabled=cfg.track.progress and tracker.primary) as bar:
      while step < total:
        epoch, done = divmod(step, steps_per_epoch)  # a resumed run starts inside an epoch
        rng = np.random.default_rng([cfg.seed, epoch])
        for batch_rows in _batches(rows, cfg.batch_size, rng, cfg.group_rows)[done:]:
          if step >= total:
            break
          batch = sft_batch([r.ids for r in batch_rows], [r.loss_mask for r in batch_rows], pad_to=width,
                            row_multiple=cfg.batch_size, allowed_width=allowed_width,
                            allowed=[(r.prompt_len, r.allowed) for r in batch_rows] if allowed_width else None)
          state, metrics = step_fn(state, batch, jax.random.fold_in(key, step), score_len)
          step += 1
          skips.add(metrics, f"step {step}")
          bar.update()
          if step % cfg.log_every == 0 or step == total or step == 1:
            history.append(tracker.log(step, jax.device_get(metrics) | skips.check(), epoch=epoch))
            echo(f"policy_sft step {step}/{total}: loss {history[-1]['loss']:.4f}")
          if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total:
            evals.append(evaluate_and_log(evaluator, state.params, key, step, tracker))
          run.after_step(step, total, cfg.checkpoint_every, save_state, f"policy SFT in {out}")
    train_s = time.perf_counter() - t_train
    if run.resume != total:  # a finished run's rerun has its final evaluation in the checkpoint
      evals.append(evaluate_and_log(evaluator, state.params, key, step, tracker))
      save_state(step)
  finally:
    evaluator.close()
  checkpoint = save_model(state.params, model_cfg, model_dir, export_folder(cfg, "checkpoint"),
                          dtype=export_dtype(cfg))
  summary = {
      "checkpoint": str(checkpoint), "init_model": str(model_dir), "rows": row_stats, "steps": step,
      "offline_transitions": sum(r.num_steps for r in records),
      "epochs": round(step / steps_per_epoch, 3), "row_length": length, "compilations": step_fn.compilations(),
      "skipped_updates": skips.total, "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
      "train_seconds": round(train_s, 3),
      "eval": evals[-1]["result"], "eval_history": evals, "seconds": round(run.elapsed(), 3),
      "resumed_from": run.resume,
  }
  tracker.summary(summary)
  echo(format_summary(summary))
  return summary


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"{summary['steps']} steps ({summary['epochs']} epochs) on {summary['rows']['rows']} rows: loss "
           f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f} in {summary['train_seconds']:.1f} s"]
  lines += format_eval(summary["eval"])
  lines.append(f"checkpoint: {summary['checkpoint']}")
  return "\n".join(lines)
