"""Supervised training of the experience model M_exp (DreamGym Eq. 5) on annotated offline transitions.

  L = -log P(R*_t | s_t, a_t, H_t, D_k) - log P(s_{t+1}, r_{t+1} | s_t, a_t, R*_t, H_t, D_k)

Both terms are one token-level SFT loss over the target (reasoning, then next state and outcome flags, then the
end-of-turn token): the shared "sft" objective with the example's loss mask, through the shared jitted `TrainStep`
(micro-batches, mesh shardings, donation). `ExpFormatConfig` carries the ablation switches (reasoning, history,
retrieval), so each ablation is this same run with one switch off.

One code path for every scale: the model always comes from an HF folder, either the checkpoint named in
`ModelSource.checkpoint` or a tiny one built for the run (a BPE trained on the training side's own text and a random
model of `ModelSource.tiny`'s shape). Retrieval uses phi = MiniLM by default; "backbone" pools the initial M_exp
checkpoint's hidden states (no extra weights; meant for small models, as it loads the checkpoint a second time).

Batches are fixed shapes: `batch_size` rows (a multiple of micro-batches x data-parallel size) padded to one of a few
length buckets (powers of two up to `max_len`), so the step compiles at most once per bucket. Rows are drawn from a
seeded permutation per epoch; the PRNG key is folded with the step. With `group_rows` set, each window of that many
rows of the stream is sorted by length, cut into batches, and the batches are taken in a seeded random order; widths
are then multiples of 128. A batch then pads its rows to about their own length instead of the next power of two: on
twc, whose examples run 300-900 tokens, a batch padded to 896 unless all its rows fit in 512 (experiments/RESULTS.md,
twentieth stop).

Every `eval_every` steps the held-out side is scored (teacher-forced NLL by region: reasoning, next state, outcome;
greedy one-step exact match of a fixed subset against the copy baseline). At the end the model is saved as an HF
folder (with the tokenizer and `exp_model.json`, which records the format, max_len, decode budget and retrieval
encoder the model was trained with) and the final held-out fidelity goes into summary.json.

Annotations: the reasoning targets R*_t come from `annotations` (files written by `dreamjax annotate`: the
rule-based annotator or a teacher LLM behind an OpenAI-compatible endpoint, each line naming its `annotator`) or,
without files, from the rule-based annotator run on the fly. The paper's traces come from a teacher LLM, so
`require_teacher_annotations` (set by the scale configs' train-exp commands) refuses, before any model is built,
training on anything else: no files, or files whose annotations of the episodes read were written by the rules,
including a teacher's fallbacks to them ("<rules> (teacher fallback)", teacher.py), or by an unnamed annotator (a
format without reasoning or tutorial trains on no annotation, and is let through).

Tracking (`dreamjax.loop.track.Tracker`, `track`): config.json, metrics.jsonl, summary.json, and W&B when `track.wandb`
is "online" or "offline"; a progress bar over the steps when stderr is a terminal.

Checkpoints, preemption and resume as in policy SFT (`dreamjax.commands.train_policy`; `checkpoint_every`,
`keep_checkpoints`): the TrainState and, as JSON, the step, logged rows, training tokens, skip counts and tracker run
id, also after the final fidelity evaluation (with its result). The data position is the step: the seeded batch
stream is drawn again and its first `step` batches skipped (host work only), so a resumed run ends as an
uninterrupted one; periodic evaluations live in the logged rows, which metrics.jsonl keeps up to the checkpoint.

Several processes (multi-host): as policy SFT (its docstring): `start_run(cfg)` first, the same program
on every process (retrieval indexes are built per process from the same data; the scorer's and the decoder's
row-sharded outputs are gathered whole), process 0 alone writes the run folder (config, metrics, summary, held-out
predictions, the tiny init model, which the others load after a barrier, and the checkpoint with exp_model.json,
after a gather every process takes part in).

Run: dreamjax train-exp --config configs/train_exp_twx.py[:variant] [--set key=value ...]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dreamjax.data.records import TrajectoryRecord, read_trajectory_files
from dreamjax.experience.annotate import Annotation, read_annotations
from dreamjax.experience.exp_model import ENCODERS, META_FILE, exp_retriever
from dreamjax.experience.fidelity import MIN_BUCKET, Predictor, one_step, prompt_buckets, teacher_forced
from dreamjax.experience.format import ExpFormatConfig
from dreamjax.experience.teacher import FALLBACK_MARK
from dreamjax.experience.sft_data import (
    EXCLUDE,
    ExampleBuilder,
    ExpExample,
    annotations_for,
    build_sft_data,
    corpus,
    split_by_task,
)
from dreamjax.loop.config import RunConfig, checkpoint_folder, export_dtype, export_folder, run_mesh, start_run
from dreamjax.loop.model import ModelSource, prepare_model, save_model
from dreamjax.loop.run import RunFolder, resuming
from dreamjax.loop.track import Tracker, echo, json_dumps, progress, to_json
from dreamjax.rl.batch import GROUPED_WIDTH, length_grouped, sft_batch
from dreamjax.rl.logprobs import LogpScorer, score_len_for
from dreamjax.rl.objectives import make_objective
from dreamjax.rl.optim import OptimConfig, make_optimizer
from dreamjax.rl.train_state import create_train_state
from dreamjax.rl.update import SkipCounter, make_train_step


@dataclasses.dataclass(frozen=True)
class ExpSftConfig(RunConfig):
  trajectories: tuple[str, ...] = ()  # offline trajectory JSONL files (dreamjax collect)
  annotations: tuple[str, ...] = ()  # annotation JSONL files; empty: the rule-based annotator, run on the fly
  # Refuse reasoning targets that are not a teacher LLM's (module docstring); the scale configs' commands set it.
  require_teacher_annotations: bool = False
  max_episodes: int = 0  # read at most this many episodes (0: all)
  format: ExpFormatConfig = ExpFormatConfig()
  model: ModelSource = ModelSource()
  optim: OptimConfig = OptimConfig(lr=1e-5, warmup_steps=50, schedule="cosine", total_steps=1000,
                                   end_lr_factor=0.1, weight_decay=0.01)
  batch_size: int = 32  # rows per step; a multiple of micro_batches x the mesh's data-parallel size
  micro_batches: int = 1
  steps: int = 0  # optimizer steps; 0: `epochs` passes over the training examples
  epochs: float = 2.0
  max_len: int = 2048  # tokens per example (prompt + target); longer ones are trimmed, then dropped (counted)
  max_new_tokens: int = 0  # decode budget for fidelity; 0: the longest training target + 25%, rounded up to 32
  # Rows per length-sorted window of the row stream (module docstring; a multiple of batch_size); 0: no grouping.
  group_rows: int = 0
  # Copies of the training episodes added with their items renamed (dreamjax.experience.rename); 0: none.
  renamed_copies: int = 0
  eval_every: int = 200  # steps between held-out evaluations (0: only at the end)
  eval_examples: int = 64  # held-out examples decoded in periodic evaluations (the final one uses all)
  eval_batch_size: int = 16
  # The final evaluation also scores M_exp as a SyntheticEnv at temperature 0 serves it: a malformed greedy answer
  # resampled at temperature 1 up to this many times ("retried"; DreamGymConfig.exp_retries). 0: greedy only.
  eval_retries: int = 0
  held_out_fraction: float = 0.1  # of tasks
  retrieval_encoder: str = "minilm"  # "minilm" | "backbone"
  retrieval_exclude: str = "episode"  # what a training example's neighbours never share with it: "episode" | "task"
  log_every: int = 10
  # Updates skipped in a row for a non-finite loss or gradient (the step keeps the old weights) before the run stops.
  max_nonfinite_updates: int = 3
  checkpoint_every: int = 200  # steps between checkpoints (also after the last); 0: only after the last
  keep_checkpoints: int = 3  # the last N checkpoints are kept
  out_dir: str = "runs/exp_sft/twx"

  def __post_init__(self):
    if self.retrieval_exclude not in EXCLUDE:
      raise ValueError(f"ExpSftConfig.retrieval_exclude must be one of {EXCLUDE}, got {self.retrieval_exclude!r}")
    if self.retrieval_encoder not in ENCODERS:
      raise ValueError(f"ExpSftConfig.retrieval_encoder must be one of {ENCODERS}, got {self.retrieval_encoder!r}")
    for name in ("batch_size", "micro_batches", "max_len", "eval_batch_size", "max_nonfinite_updates",
                 "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"ExpSftConfig.{name} must be >= 1, got {getattr(self, name)}")
    if min(self.steps, self.epochs, self.eval_every, self.max_new_tokens, self.checkpoint_every,
           self.renamed_copies, self.eval_retries) < 0:
      raise ValueError("ExpSftConfig: steps, epochs, eval_every, max_new_tokens, checkpoint_every, renamed_copies "
                       "and eval_retries must be >= 0")
    if self.group_rows < 0 or self.group_rows % self.batch_size:
      raise ValueError(f"ExpSftConfig.group_rows must be 0 or a multiple of batch_size ({self.batch_size}), "
                       f"got {self.group_rows}")


def length_buckets(max_len: int, grouped: bool = False) -> tuple[int, ...]:
  """Batch widths the train step compiles for: powers of two up to `max_len`, or with grouped batches (whose rows
  are of about one length) multiples of GROUPED_WIDTH."""
  if not grouped:
    return prompt_buckets(max_len)
  top = -(-max_len // GROUPED_WIDTH) * GROUPED_WIDTH
  return tuple(range(GROUPED_WIDTH, top + 1, GROUPED_WIDTH))


def load_annotation_files(paths: tuple[str, ...]) -> dict[str, Annotation] | None:
  return merge_annotation_files({path: read_annotations(path) for path in paths})


def merge_annotation_files(by_file: Mapping[str, Mapping[str, Annotation]]) -> dict[str, Annotation] | None:
  """One map of every file's annotations (None for no files); an episode annotated in two files is an error."""
  if not by_file:
    return None
  out: dict[str, Annotation] = {}
  for path, notes in by_file.items():
    for key, a in notes.items():
      if key in out:
        raise ValueError(f"{path}: episode {key!r} is annotated in an earlier annotation file too")
      out[key] = a
  return out


TEACHER_PREFIX = "teacher:"  # teacher.py's annotator names: "teacher:<model>"


def annotation_source(a: Annotation) -> str:
  """"teacher" (a teacher LLM wrote it), "fallback" (the teacher failed; the rule-based annotator wrote it) or
  "rules" (the rule-based annotator, or an annotator the file does not name)."""
  if FALLBACK_MARK in a.annotator:
    return "fallback"
  return "teacher" if a.annotator.startswith(TEACHER_PREFIX) else "rules"


def check_teacher_annotations(by_file: Mapping[str, Mapping[str, Annotation]], records: Sequence[TrajectoryRecord],
                              trajectories: Sequence[str] = ()) -> None:
  """Raises a one-line ValueError when an annotation M_exp would train on is not a teacher LLM's: no files at all
  (the rule-based annotator would run on the fly), or a file in which some of the records' annotations come from the
  rules (teacher fallbacks included), naming the file, the annotator found and how many."""
  where = ", ".join(trajectories) or "the trajectories"
  hint = ("annotate with a teacher LLM (dreamjax annotate --set annotator=teacher, an OpenAI-compatible endpoint) or "
          "set require_teacher_annotations=false")
  if not by_file:
    envs = ", ".join(f"rules:{e}" for e in sorted({r.env for r in records}))
    raise ValueError(f"ExpSftConfig.require_teacher_annotations: no annotation files are given, so the rule-based "
                     f"annotator ({envs or 'rules'}) would write the reasoning for {where}; {hint}")
  used = {r.episode_id for r in records}
  for path, notes in by_file.items():
    found = [a for key, a in notes.items() if key in used]
    bad = [a for a in found if annotation_source(a) != "teacher"]
    if bad:
      fallbacks = sum(annotation_source(a) == "fallback" for a in bad)
      names = sorted({a.annotator or "(unnamed)" for a in bad})
      raise ValueError(f"{path}: {len(bad)} of the {len(found)} annotations used are not a teacher LLM's (annotator "
                       f"{', '.join(repr(n) for n in names)}; {fallbacks} of them teacher fallbacks) and "
                       f"ExpSftConfig.require_teacher_annotations is set; {hint}")


def decode_budget(examples: list[ExpExample], max_len: int) -> int:
  longest = max((int(e.loss_mask.sum()) for e in examples), default=32)
  return min(max_len, -(-int(longest * 1.25) // 32) * 32)


def _batches(n: int, batch_size: int, total_steps: int, seed: int, lengths: np.ndarray | None = None,
             group_rows: int = 0):
  """Row indices per step: seeded permutations of range(n), one per epoch, read in consecutive slices. With
  `group_rows`, each slice of that many rows is sorted by `lengths` (stably), cut into batches, and its batches
  are yielded in a seeded random order."""
  rng = np.random.default_rng(seed)
  take = group_rows or batch_size
  order = np.zeros(0, np.int64)
  ready: list[np.ndarray] = []
  for _ in range(total_steps):
    if not ready:
      while len(order) < take:
        order = np.concatenate([order, rng.permutation(n)])
      window, order = order[:take], order[take:]
      ready = (length_grouped(window, lengths, batch_size, rng) if group_rows
               else [window[i:i + batch_size] for i in range(0, take, batch_size)])
    yield ready.pop(0)


def _evaluate(predictor: Predictor, scorer: LogpScorer, params: Any, held: list[ExpExample],
              decode: list[ExpExample]) -> dict[str, Any]:
  predictor.set_params(params)
  out = {f"held_out_{k}": v for k, v in teacher_forced(scorer, predictor.params, held).items()}
  res = one_step(predictor, decode)
  predictor.set_params(None)  # the sampling copy lives only while evaluating, not beside every train step
  for k in ("exact_match", "token_f1", "parse_failure", "reward_acc", "done_acc", "invalid_acc"):
    out[f"held_out_{k}"] = res["model"].get(k)
  out["held_out_copy_exact_match"] = res["copy"].get("exact_match")
  return out


def run(cfg: ExpSftConfig) -> dict[str, Any]:
  """Trains M_exp (resuming from the latest checkpoint in `out_dir` when there is one); returns the summary (also
  written to out_dir/summary.json)."""
  start_run(cfg)  # before anything touches devices: joins the processes, points the compilation cache
  return resuming(lambda: _run(cfg))


def _run(cfg: ExpSftConfig) -> dict[str, Any]:
  run_folder = RunFolder(cfg, cfg.out_dir, cfg.keep_checkpoints, checkpoint_folder(cfg))
  with run_folder, run_folder.tracker(cfg.track) as tracker:
    return _train(cfg, run_folder, tracker)


def _train(cfg: ExpSftConfig, run: RunFolder, tracker: Tracker) -> dict[str, Any]:
  out = run.out
  records = read_trajectory_files(cfg.trajectories, "ExpSftConfig.trajectories", cfg.max_episodes)
  by_file = {path: read_annotations(path) for path in cfg.annotations}
  # Before any model is built. Without reasoning or tutorial (the "w/o reasoning" ablation) nothing is trained on them.
  if cfg.require_teacher_annotations and (cfg.format.reasoning or cfg.format.tutorial):
    check_teacher_annotations(by_file, records, cfg.trajectories)
  notes = annotations_for(records, merge_annotation_files(by_file))
  train_records, _ = split_by_task(records, cfg.held_out_fraction, cfg.seed)
  tiny = cfg.model.tiny.replace(max_position_embeddings=max(cfg.model.tiny.max_position_embeddings, cfg.max_len))
  mesh = run_mesh(cfg)
  init_folder, model_cfg, params, tokenizer = prepare_model(
      dataclasses.replace(cfg.model, tiny=tiny), out / "init", lambda: corpus(train_records, notes, cfg.format),
      seed=cfg.seed, mesh=mesh, overrides=cfg.model.overrides())
  retriever = exp_retriever(cfg.retrieval_encoder, init_folder) if cfg.format.retrieval and cfg.format.k else None
  builder = ExampleBuilder(tokenizer, cfg.format, cfg.max_len)
  data = build_sft_data(records, builder, retriever, held_out_fraction=cfg.held_out_fraction, seed=cfg.seed,
                        annotations=notes, exclude=cfg.retrieval_exclude, renamed_copies=cfg.renamed_copies)
  if not data.train:
    raise ValueError(f"no training examples fit max_len={cfg.max_len} ({data.stats})")
  echo(f"exp_sft: {len(data.train)} training and {len(data.held_out)} held-out examples; {data.stats}")
  max_new = cfg.max_new_tokens or decode_budget(data.train, cfg.max_len)

  optimizer = make_optimizer(cfg.optim)
  step_fn = make_train_step(model_cfg, make_objective("sft"), optimizer, micro_batches=cfg.micro_batches, mesh=mesh)
  if cfg.batch_size % step_fn.row_multiple:
    raise ValueError(f"ExpSftConfig.batch_size {cfg.batch_size} is not a multiple of {step_fn.row_multiple} "
                     "(micro_batches x data-parallel size)")
  state = create_train_state(model_cfg, params, optimizer, mesh)
  del params
  total = cfg.steps or max(1, math.ceil(cfg.epochs * len(data.train) / cfg.batch_size))
  predictor = Predictor(model_cfg, None, tokenizer, builder, max_new, cfg.eval_batch_size, mesh)  # params: _evaluate
  # It scores the Predictor's copy of the weights, which is unrolled whatever the training layout (`sampling_copy`).
  scorer = LogpScorer(model_cfg.replace(scan_layers=False), cfg.eval_batch_size, pad_to=MIN_BUCKET, mesh=mesh)
  decode_subset = data.held_out[: cfg.eval_examples]
  buckets = length_buckets(cfg.max_len, grouped=bool(cfg.group_rows))
  score_len = score_len_for([e.loss_mask for e in data.train])  # one compilation per length bucket
  key = jax.random.key(cfg.seed)
  history: list[dict[str, Any]] = []
  skips = SkipCounter(cfg.max_nonfinite_updates, "M_exp SFT")
  done, train_tokens, final = 0, 0, None
  if run.resume is not None:
    run.check_last(total, "steps (or epochs)")
    arrays, meta = run.restore({"state": state})
    state, done, history, train_tokens = arrays["state"], int(meta["step"]), meta["history"], int(meta["train_tokens"])
    skips.total, skips.streak = int(meta["skipped_updates"]), int(meta["nonfinite_streak"])
    final = meta.get("final")  # the final evaluation's result, once it ran

  def save_state(at: int) -> None:
    run.save(at, {"state": state}, {"step": at, "history": history, "train_tokens": train_tokens, "final": final,
                                    **skips.check()}, tracker)

  t_train = time.perf_counter()
  lengths = np.array([len(e.ids) for e in data.train])
  batches = itertools.islice(_batches(len(data.train), cfg.batch_size, total, cfg.seed, lengths, cfg.group_rows),
                             done, None)
  with progress(total, "exp_sft", unit="step", initial=done, enabled=cfg.track.progress and tracker.primary) as bar:
    for step, rows in enumerate(batches, start=done + 1):
      examples = [data.train[i] for i in rows]
      width = next(b for b in buckets if b >= max(len(e.ids) for e in examples))
      batch = sft_batch([e.ids for e in examples], [e.loss_mask for e in examples], pad_to=width,
                        row_multiple=cfg.batch_size)
      state, metrics = step_fn(state, batch, jax.random.fold_in(key, step), score_len)
      skips.add(metrics, f"step {step}")
      train_tokens += int(sum(len(e.ids) for e in examples))
      bar.update()
      # The last step's evaluation is the final one below, over every held-out example.
      evaluate = bool(cfg.eval_every) and step % cfg.eval_every == 0 and step != total
      if step % cfg.log_every == 0 or step == total or evaluate:
        row = {k: float(v) for k, v in jax.device_get(metrics).items()} | skips.check()
        row["epoch"] = step * cfg.batch_size / len(data.train)
        row["tokens_per_s"] = train_tokens / (time.perf_counter() - t_train)
        if evaluate and data.held_out:
          row |= _evaluate(predictor, scorer, state.params, data.held_out, decode_subset)
        history.append(tracker.log(step, row))
        echo(f"step {step}/{total}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(row.items())
                                                   if isinstance(v, float) and k in _SHOWN))
      run.after_step(step, total, cfg.checkpoint_every, save_state, f"M_exp SFT in {out}")
  skips.check()
  checkpoint = save_model(state.params, model_cfg, init_folder, export_folder(cfg, "checkpoint"),
                          dtype=export_dtype(cfg))
  meta = {"format": to_json(cfg.format), "max_len": cfg.max_len, "max_new_tokens": max_new,
          "retrieval_encoder": cfg.retrieval_encoder, "encoder_folder": str(init_folder), "env": records[0].env}
  if tracker.primary:
    (checkpoint / META_FILE).write_text(json_dumps(meta, indent=2, sort_keys=True))
  if final is None:  # not a finished run's rerun, whose final evaluation is in its checkpoint
    final = {}
    if data.held_out:
      predictor.set_params(state.params)
      res = one_step(predictor, data.held_out, scorer=scorer, seed=cfg.seed, retries=cfg.eval_retries)
      predictor.set_params(None)
      final = {k: res[k] for k in ("model", "copy", "retried") if k in res}
      tracker.log(total, {f"final_held_out_{'' if k == 'model' else k + '_'}{name}": v
                          for k, m in final.items() for name, v in m.items() if isinstance(v, int | float)})
      if tracker.primary:
        with open(out / "held_out_predictions.jsonl", "w", encoding="utf-8") as f:
          for r in res["rows"]:
            f.write(json_dumps(r, sort_keys=True) + "\n")
    save_state(total)
  summary = {
      "checkpoint": str(checkpoint), "steps": total, "examples": len(data.train), "held_out": len(data.held_out),
      "data": data.stats, "held_out_episodes": sorted(r.episode_id for r in data.held_out_records),
      "held_out_tasks": sorted({r.task.task_id for r in data.held_out_records}),
      "final_train_loss": history[-1].get("loss") if history else None, "held_out_fidelity": final,
      "max_new_tokens": max_new, "seconds": round(run.elapsed(), 1),
      "train_seconds": round(time.perf_counter() - t_train, 1), "compilations": step_fn.compilations(),
      "skipped_updates": skips.total, "resumed_from": run.resume,
  }
  summary_path = tracker.summary(summary)
  if final:
    retried = f", {final['retried']['exact_match']:.3f} with {cfg.eval_retries} resamples" if "retried" in final else ""
    echo(f"held-out one-step exact match {final['model']['exact_match']:.3f}{retried} (copy baseline "
         f"{final['copy']['exact_match']:.3f}) over {final['model']['n']} transitions")
  echo(f"checkpoint: {checkpoint}; summary: {summary_path}")
  return summary


_SHOWN = {"loss", "grad_norm", "learning_rate", "tokens_per_s", "held_out_nll", "held_out_nll_next_state",
          "held_out_exact_match", "held_out_copy_exact_match", "held_out_parse_failure"}
