"""Fidelity of the experience model and its ablations on held-out real trajectories (issue 4, item 7).

For the full format and each ablation (no reasoning, no history, no retrieval), M_exp is trained with
`dreamjax.commands.train_exp` (--train) or loaded from given checkpoints (--checkpoints name=folder,...; folders written by
exp_sft, whose exp_model.json gives the format), then scored on the held-out tasks of the config's split by
`dreamjax.experience.fidelity`: teacher-forced one step (exact match, also apart on the transitions that reveal
unseen rooms; token F1, reward/success/done/invalid accuracy with precision and recall, parse failures, eps_R,
the sampled and teacher-forced eps_P estimates, NLL by region) and open loop along the recorded actions (exact match
overall, by horizon, whole episodes), each beside the copy-the-state baseline. Writes table.md, results.json and
plot.svg to --out and prints the table.

Run (tiny, CPU; collect the small coin dataset first, see configs/train_exp_twx.py):
       python experiments/exp_model_quality.py --config configs/train_exp_twx.py:tiny --train \
         --out runs/exp_model_quality/tiny
Full scale: --config configs/train_exp_twx.py --set model.checkpoint=/path/to/Llama-3.2-3B-Instruct --train, or
--checkpoints full=runs/exp_sft/twx/checkpoint,no_reasoning=... to score models trained before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from dreamjax.commands.train_exp import ExpSftConfig, load_annotation_files, run
from dreamjax.config import load_config
from dreamjax.data.records import read_trajectory_files as load_records
from dreamjax.data.records import transitions
from dreamjax.experience.exp_model import META_FILE
from dreamjax.experience.exp_model import exp_retriever as make_retriever
from dreamjax.experience.fidelity import MIN_BUCKET, Predictor, one_step, open_loop
from dreamjax.experience.format import ExpFormatConfig
from dreamjax.experience.sft_data import ExampleBuilder, annotations_for, build_examples, split_by_task
from dreamjax.loop.config import run_mesh as mesh_of
from dreamjax.loop.model import load_model
from dreamjax.loop.plots import fidelity_plot
from dreamjax.rl.logprobs import LogpScorer

_ON = {"reasoning": True, "history": True, "retrieval": True}
VARIANTS = {"full": _ON, "no_reasoning": _ON | {"reasoning": False}, "no_history": _ON | {"history": False},
            "no_retrieval": _ON | {"retrieval": False}}
ONE_STEP_COLUMNS = [("exact_match", "EM"), ("exact_match_determined", "EM determined"),
                    ("exact_match_reveal", "EM reveal"), ("reveal_fraction", "reveal share"), ("token_f1", "F1"),
                    ("parse_failure", "parse fail"),
                    ("reward_acc", "reward acc"), ("reward_precision", "reward P"), ("reward_recall", "reward R"),
                    ("success_acc", "success acc"), ("done_acc", "done acc"), ("invalid_precision", "invalid P"),
                    ("invalid_recall", "invalid R"), ("eps_R_mean", "eps_R mean"), ("eps_R_max", "eps_R max"),
                    ("eps_P_sampled_mean", "eps_P samp mean"), ("eps_P_tf_mean", "eps_P tf mean"),
                    ("eps_P_tf_max", "eps_P tf max"), ("nll_reasoning", "NLL R"), ("nll_next_state", "NLL s'")]
OPEN_LOOP_COLUMNS = [("exact_match", "EM"), ("token_f1", "F1"), ("episode_exact", "episode exact"),
                     ("reward_acc", "reward acc"), ("done_acc", "done acc"), ("parse_failure", "parse fail")]


def evaluate(name: str, checkpoint: Path, base: ExpSftConfig, tv_samples: int, open_loop_steps: int,
             batch_size: int, retries: int = 0) -> dict[str, Any]:
  """One-step and open-loop fidelity of the M_exp in `checkpoint` (variant `name`) on the held-out side of `base`'s
  split."""
  meta_path = checkpoint / META_FILE
  if not meta_path.is_file():
    raise ValueError(f"{checkpoint}: no {META_FILE} (not a checkpoint written by dreamjax train-exp)")
  meta = json.loads(meta_path.read_text())
  fmt = ExpFormatConfig(**meta["format"])
  wrong = [k for k, v in VARIANTS[name].items() if getattr(fmt, k) != v]
  if wrong:
    raise ValueError(f"{checkpoint}: trained with {wrong[0]}={getattr(fmt, wrong[0])}, so it is not variant {name!r}")
  records = load_records(base.trajectories, "trajectories", base.max_episodes)
  notes = annotations_for(records, load_annotation_files(base.annotations))
  train_records, held = split_by_task(records, base.held_out_fraction, base.seed)
  summary_path = checkpoint.parent / "summary.json"
  if summary_path.is_file():  # the split must be the one the model was trained on
    trained_held = json.loads(summary_path.read_text()).get("held_out_episodes")
    if trained_held is not None and sorted(trained_held) != sorted(r.episode_id for r in held):
      raise ValueError(f"{summary_path}: the model's held-out episodes differ from this config's split (trajectories,"
                       " held_out_fraction and seed must match the training run)")
  if not held:
    raise ValueError("no held-out episodes: set held_out_fraction > 0")
  mesh = mesh_of(base)
  model_cfg, params, tokenizer = load_model(checkpoint, mesh=mesh)
  retriever = None
  if fmt.retrieval and fmt.k:
    retriever = make_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
    retriever.add(list(transitions(train_records, max_history=0)))
  builder = ExampleBuilder(tokenizer, fmt, meta["max_len"])
  stats: dict[str, int] = {}
  examples = build_examples(builder, held, notes, retriever, stats)
  predictor = Predictor(model_cfg, params, tokenizer, builder, meta["max_new_tokens"], batch_size, mesh)
  scorer = LogpScorer(model_cfg, batch_size, pad_to=MIN_BUCKET, mesh=mesh)
  one = one_step(predictor, examples, scorer=scorer, tv_samples=tv_samples, seed=base.seed, retries=retries)
  loop = open_loop(predictor, held, notes, retriever, max_steps=open_loop_steps)
  return {"checkpoint": str(checkpoint), "format": meta["format"], "data": stats, "one_step": one["model"],
          "one_step_copy": one["copy"], "one_step_retried": one.get("retried"), "open_loop": loop["model"],
          "open_loop_copy": loop["copy"], "horizon": loop["horizon"], "rows": one["rows"]}


def _cell(v: Any) -> str:
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return "n/a"
  return f"{v:.3f}" if isinstance(v, float) else str(v)


def table(results: dict[str, dict[str, Any]]) -> str:
  """Markdown tables: one step and open loop, one row per model, then the copy baseline."""
  first = next(iter(results.values()))
  lines = [f"One step, teacher-forced ({first['one_step']['n']} held-out transitions)", "",
           "| model | " + " | ".join(h for _, h in ONE_STEP_COLUMNS) + " |",
           "|---|" + "---|" * len(ONE_STEP_COLUMNS)]
  rows = [(name, r["one_step"]) for name, r in results.items()]
  rows += [(f"{name}, {r['one_step_retried']['retries']} resamples", r["one_step_retried"])
           for name, r in results.items() if r.get("one_step_retried")]
  rows += [("copy baseline", first["one_step_copy"])]
  for name, m in rows:
    m = m | ({"eps_P_tf_mean": m.get("eps_P_mean"), "eps_P_tf_max": m.get("eps_P_max"),
              "eps_P_sampled_mean": m.get("eps_P_mean")} if name == "copy baseline" else {})
    lines.append(f"| {name} | " + " | ".join(_cell(m.get(k)) for k, _ in ONE_STEP_COLUMNS) + " |")
  horizon = first["horizon"]
  shown = [h for h in (1, 2, 4, 8, 16) if h <= horizon]
  lines += ["", f"Open loop along the recorded actions ({first['open_loop']['n']} steps, "
            f"horizon up to {horizon})", "",
            "| model | " + " | ".join(h for _, h in OPEN_LOOP_COLUMNS) + " | " +
            " | ".join(f"EM@{h}" for h in shown) + " |",
            "|---|" + "---|" * (len(OPEN_LOOP_COLUMNS) + len(shown))]
  rows = [(name, r["open_loop"]) for name, r in results.items()] + [("copy baseline", first["open_loop_copy"])]
  for name, m in rows:
    lines.append(f"| {name} | " + " | ".join(_cell(m.get(k)) for k, _ in OPEN_LOOP_COLUMNS) + " | " +
                 " | ".join(_cell(m["exact_by_step"][h - 1]) for h in shown) + " |")
  return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> Path:
  """One-step metrics as grouped bars, open-loop exact match by step as lines, the copy baseline beside the models."""
  first = next(iter(results.values()))
  models = {name: r["one_step"] for name, r in results.items()} | {"copy baseline": first["one_step_copy"]}
  loops = {name: r["open_loop"]["exact_by_step"] for name, r in results.items()}
  loops["copy baseline"] = first["open_loop_copy"]["exact_by_step"]
  keys = [("exact_match", "EM"), ("token_f1", "F1"), ("reward_acc", "reward acc"), ("done_acc", "done acc"),
          ("parse_failure", "parse fail")]
  return fidelity_plot(models, loops, keys, path)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", required=True, help="configs/train_exp_twx.py[:variant]: data, split, training")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
  p.add_argument("--train", action="store_true", help="train each variant (reuses a finished run in --out)")
  p.add_argument("--checkpoints", default="", help="name=folder,... of trained variants to score instead")
  p.add_argument("--tv-samples", type=int, default=4, help="samples per transition for the sampled eps_P")
  p.add_argument("--open-loop-steps", type=int, default=12)
  p.add_argument("--retries", type=int, default=0,
                 help="also score greedy answers with up to this many resamples of a malformed one (SyntheticEnv's)")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--out", default="runs/exp_model_quality")
  args = p.parse_args(argv)
  try:
    base = load_config(args.config, args.set)
    given = dict(item.split("=", 1) for item in args.checkpoints.split(",") if item.strip())
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names + list(given) if n not in VARIANTS]
    if unknown:
      raise ValueError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    if not args.train and not given:
      raise ValueError("nothing to score: pass --train or --checkpoints")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name in names if args.train else [n for n in names if n in given]:
      if name in given:
        checkpoint = Path(given[name])
      else:
        cfg = dataclasses.replace(base, format=dataclasses.replace(base.format, **VARIANTS[name]),
                                  out_dir=str(out / name))
        checkpoint = out / name / "checkpoint"
        if not (out / name / "summary.json").is_file():
          print(f"== training {name}", file=sys.stderr, flush=True)
          run(cfg)
      print(f"== scoring {name} ({checkpoint})", file=sys.stderr, flush=True)
      results[name] = evaluate(name, checkpoint, base, args.tv_samples, args.open_loop_steps, args.batch_size,
                               args.retries)
  except (ValueError, FileNotFoundError) as e:
    print(f"exp_model_quality: {e}", file=sys.stderr)
    return 2
  text = table(results)
  (out / "table.md").write_text(text + "\n")
  (out / "results.json").write_text(json.dumps({k: {x: y for x, y in v.items() if x != "rows"}
                                                for k, v in results.items()}, indent=2, sort_keys=True))
  for name, r in results.items():
    (out / f"{name}_predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in r["rows"]))
  print(text)
  print(f"plot: {plot(results, out / 'plot.svg')}")
  print(f"table: {out / 'table.md'}; results: {out / 'results.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
