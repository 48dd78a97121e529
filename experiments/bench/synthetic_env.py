"""SyntheticEnv throughput: synthetic transitions/s at batch 64 on CPU against real env steps/s, side by side.

Run: `python experiments/bench/synthetic_env.py` (about 10 minutes on 2 cores, ALFWorld's start-up included) or
`... --rows 8 --new-tokens 32 --seconds 5 --real-envs textworld_express --real-seconds 3` (smoke test).

The synthetic contender is the full `step_batch` path: one batched retrieval (phi from the model's own backbone,
exact index over the offline transitions), prompt building and tokenisation of every row, one jitted sampler call,
decoding and parsing. The model is a tiny random Qwen2 (`ModelConfig.tiny`, as BENCHMARKS.md asks) with a BPE
tokenizer trained on the data, so it never writes the format: every row ends after one step as a malformed output,
and the batch is reset before the next call (resets cost no model time and are timed apart). Two consequences, both
conservative: rows rarely hit the end-of-turn token, so nearly every row generates all `--new-tokens`; and since the
sampler pads prompts to their bucket, the cost of a call is that of a full `--bucket`-token prompt whatever the text,
so one bucket holding real prompts with history stands for them. `--new-tokens` should cover a transition target:
the script prints the data's mean target length (next state and outcome, without reasoning) in these tokens.

Real contenders use experiments/bench/envs.py's `drive` (uniformly random admissible actions, the same tasks for
every round): each env in this process (`in-process x1`) and an EnvPool with `--workers` workers over `--real-rows`
rows (16 by default, not 64: these envs are CPU-bound per step, so on a 2-core machine more rows do not raise their
steps/s beyond what the workers' cores give, while 64 TextWorld-Express rows would start 64 JVMs). Envs whose package is missing are skipped with a line saying why. Prints a markdown table
with the synthetic contender's ratio to each real one, and writes table.md and results.json to --out.

A trained M_exp (`--exp-model`, a folder written by `dreamjax train-exp`, e.g. the demo's runs/demo/exp_model/checkpoint)
adds a second table: that M_exp stepping the first `--steps` recorded actions of --rows episodes (a batch of episodes
after another), greedy, at each `--draft-tokens` setting of copy-speculative decoding (0 is plain decoding) with and
without KV reuse across steps (`--kv-reuse`): transitions/s, the speedup over the first setting, the acceptance
rates, the share of prompt tokens prefilled, whether every answer equals the first setting's (it must: both are exact
under greedy decoding), and the ratio to each real env's pool contender when the real envs ran. Its
prompts use the model's own bucket (`--exp-bucket`) and retrieval (phi and the training format, from exp_model.json)
over the offline transitions.

Offline data: --records (a JSONL of TrajectoryRecords, e.g. from `dreamjax collect`), by default
runs/collect/twx_500/trajectories.jsonl when it exists, else a few dozen TextWorld-Express expert episodes collected
here (about a minute).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dreamjax.data.collect import play_expert  # noqa: E402
from dreamjax.data.records import TrajectoryRecord, read_trajectories, transitions  # noqa: E402
from dreamjax.envs.base import SerialBatchEnv  # noqa: E402
from dreamjax.envs.pool import EnvPool  # noqa: E402
from dreamjax.envs.registry import make_env  # noqa: E402
from dreamjax.experience.format import (  # noqa: E402
    ExpFormatConfig,
    action_lists,
    render_user,
    system_prompt,
    transition_target,
)
from dreamjax.experience.exp_model import exp_format, exp_retriever, load_exp_model  # noqa: E402
from dreamjax.experience.synthetic_env import SyntheticEnv, initial_states_from  # noqa: E402
from dreamjax.models import init_params, tiny  # noqa: E402
from dreamjax.replay.encoder import BackbonePooledEncoder  # noqa: E402
from dreamjax.replay.index import make_index  # noqa: E402
from dreamjax.replay.retriever import Retriever  # noqa: E402
from dreamjax.sampling import SpeculativeConfig  # noqa: E402
from dreamjax.text import train_bpe_tokenizer  # noqa: E402
from experiments.bench.envs import BENCH_ENVS, drive, missing  # noqa: E402

DEFAULT_RECORDS = ROOT / "runs" / "collect" / "twx_500" / "trajectories.jsonl"


def collect_twx(episodes: int) -> list[TrajectoryRecord]:
  """Expert episodes of TextWorld-Express cookingworld, twc and coin, recorded here."""
  from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks

  env, out = TextWorldExpressEnv(step_limit=50), []
  try:
    for game in ("cookingworld", "twc", "coin"):
      out += [play_expert(env, task)[0] for task in tasks(game, "train", -(-episodes // 3), env=env)]
  finally:
    env.close()
  return out


def bench_synthetic(args, records: list[TrajectoryRecord]) -> dict:
  fmt = ExpFormatConfig(k=args.k)
  # (transition, its state's admissible actions, its next state's); a cut episode's last step has no known next list
  ts = [(t, shown, following) for t, (shown, following) in zip(transitions(records), action_lists(records))
        if following is not None or t.done]
  rng = np.random.default_rng(args.seed)
  sample = [ts[i] for i in rng.choice(len(ts), min(len(ts), 2000), replace=False)]
  targets = [transition_target(fmt, t, "", following, shown) for t, shown, following in sample]
  texts = [system_prompt(fmt)] + [render_user(fmt, t.instruction, t.history, [], t.state, t.action, admissible=shown)
                                  for t, shown, _ in sample] + targets
  tok = train_bpe_tokenizer(texts, tempfile.mkdtemp(prefix="bench_tok_"), vocab_size=args.vocab)
  target_tokens = float(np.mean([len(tok.encode(x)) for x in targets]))
  cfg = tiny("qwen2", vocab_size=tok.vocab_size, max_position_embeddings=args.bucket + args.new_tokens)
  params = init_params(cfg, jax.random.key(args.seed))

  t0 = time.perf_counter()
  buffer = list(transitions(records, max_history=0))[: args.buffer]
  retriever = Retriever(BackbonePooledEncoder(cfg, params, tok), make_index("exact", cfg.hidden_size))
  retriever.add(buffer)
  index_s = time.perf_counter() - t0

  starts = [r for r in records if r.steps]
  rows = [starts[i % len(starts)] for i in range(args.rows)]
  tasks, actions = [r.task for r in rows], [r.steps[0].action for r in rows]
  env = SyntheticEnv(cfg, params, tok, fmt, retriever, initial_states=initial_states_from(records),
                     max_new_tokens=args.new_tokens, temperature=1.0, prompt_buckets=(args.bucket,),
                     key=jax.random.key(args.seed), exp_retries=0)  # one answer per step: a random M_exp never parses
  env.reset_batch(tasks)
  t0 = time.perf_counter()
  env.step_batch(actions)  # compiles the sampler for (rows, bucket)
  first_s = time.perf_counter() - t0
  env.reset_stats()
  steps = calls = 0
  step_s = reset_s = 0.0
  prompt_tokens: list[int] = []
  while step_s < args.seconds:
    t0 = time.perf_counter()
    env.reset_batch(tasks)
    t1 = time.perf_counter()
    results = env.step_batch(actions)
    step_s += time.perf_counter() - t1
    reset_s += t1 - t0
    steps += len(results)
    calls += 1
    prompt_tokens += [r.info["prompt_tokens"] for r in results]
  s = env.stats
  return {"contender": f"synthetic x{args.rows}", "env": "synthetic", "rows": args.rows, "steps": steps,
          "step_s": step_s, "steps_per_s": steps / step_s, "first_step_s": first_s, "reset_s_mean": reset_s / calls,
          "index_s": index_s, "buffer": len(buffer), "mean_prompt_tokens": float(np.mean(prompt_tokens)),
          "mean_generated_tokens": s["mean_generated_tokens"], "mean_target_tokens": target_tokens,
          "vocab": tok.vocab_size, "parse_failures": s["parse_failures"], "compilations": s["compilations"],
          "split": {k: s[k] / step_s for k in ("retrieval_s", "prompt_s", "sample_s", "parse_s")}}


def bench_trained(args, records: list[TrajectoryRecord]) -> list[dict]:
  """The trained M_exp of --exp-model at each --draft-tokens and --kv-reuse setting (module docstring), greedy."""
  meta = json.loads((Path(args.exp_model) / "exp_model.json").read_text())
  fmt = exp_format(meta)
  cfg, params, tok, meta, fmt = load_exp_model(args.exp_model, reasoning=fmt.reasoning, replay=fmt.retrieval,
                                               dtype="float32", mesh=None)
  retriever = exp_retriever(meta["retrieval_encoder"], meta["encoder_folder"])
  retriever.add(list(transitions(records, max_history=0))[: args.buffer])
  starts = [r for r in records if r.steps]
  rows = [starts[i % len(starts)] for i in range(args.rows)]
  tasks = [r.task for r in rows]
  exclude = {r.task.task_id: r.episode_id for r in rows}  # never the row's own episode, as in training
  bucket = args.exp_bucket or min(meta["max_len"], cfg.max_position_embeddings - meta["max_new_tokens"])

  def episode_batch(env) -> list[str]:
    """Steps every row through its episode's first --steps recorded actions (a row whose episode, recorded or
    predicted, has ended gets None); returns the answers."""
    env.reset_batch(tasks)
    answers, ended = [], [False] * len(rows)
    for j in range(args.steps):
      actions = [None if ended[i] or j >= len(r.steps) else r.steps[j].action for i, r in enumerate(rows)]
      if not any(actions):
        break
      for i, res in enumerate(env.step_batch(actions)):
        if actions[i] is not None:
          answers.append(res.info["output"])
          ended[i] = res.done
    return answers

  out, reference = [], None
  for k in [int(x) for x in args.draft_tokens.split(",")]:
    for reuse in [x == "on" for x in args.kv_reuse.split(",")]:
      env = SyntheticEnv(cfg, params, tok, fmt, retriever if fmt.retrieval else None,
                         initial_states=initial_states_from(records), max_new_tokens=meta["max_new_tokens"],
                         temperature=0.0, prompt_buckets=(bucket,), key=jax.random.key(args.seed),
                         exclude_episodes=exclude, speculative=SpeculativeConfig(draft_tokens=k), kv_reuse=reuse,
                         max_steps=args.steps)
      t0 = time.perf_counter()
      answers = episode_batch(env)  # compiles
      first_s = time.perf_counter() - t0
      env.reset_stats()
      steps, step_s = 0, 0.0
      while step_s < args.seconds:
        t0 = time.perf_counter()
        steps += len(episode_batch(env))
        step_s += time.perf_counter() - t0
      s = env.stats
      reference = answers if reference is None else reference
      out.append({"draft_tokens": k, "kv_reuse": reuse, "rows": args.rows, "bucket": bucket, "steps": steps,
                  "steps_per_s": steps / step_s, "first_s": first_s, "mean_generated_tokens": s["mean_generated_tokens"],
                  "parse_failures": s["parse_failures"], "accepted_per_step": s["accepted_per_step"],
                  "tokens_per_forward": s["tokens_per_forward"], "prompt_tokens": s["prompt_tokens"],
                  "prefilled_tokens": s["prefilled_tokens"], "same_answers_as_first": answers == reference})
      print(f"  trained M_exp, K={k}, KV reuse {'on' if reuse else 'off'}: {out[-1]['steps_per_s']:.1f} "
            f"transitions/s, {s['tokens_per_forward']:.2f} tokens per forward", file=sys.stderr, flush=True)
  return out


def trained_table(rows: list[dict], folder: str, real: list[dict]) -> str:
  """The trained M_exp's settings, with its speed over each real contender's (the real envs step random actions)."""
  ratios = [r for r in real if r["contender"].startswith("pool")]
  lines = [f"| trained M_exp ({folder}), greedy | KV reuse | transitions/s | vs first | accepted / step | "
           "tokens / forward | tokens / step | prefilled / prompt tokens | answers equal the first's |" +
           "".join(f" vs {r['env']} {r['contender']} |" for r in ratios), "|---|---|---|---|---|---|---|---|---|" +
           "---|" * len(ratios)]
  for r in rows:
    lines.append(f"| K={r['draft_tokens']}, {r['rows']} rows, bucket {r['bucket']} | "
                 f"{'on' if r['kv_reuse'] else 'off'} | {r['steps_per_s']:.1f} | "
                 f"{r['steps_per_s'] / rows[0]['steps_per_s']:.2f}x | {r['accepted_per_step']:.2f} | "
                 f"{r['tokens_per_forward']:.2f} | {r['mean_generated_tokens']:.0f} | "
                 f"{r['prefilled_tokens'] / max(r['prompt_tokens'], 1):.0%} | "
                 f"{'yes' if r['same_answers_as_first'] else 'NO'} |" +
                 "".join(f" {r['steps_per_s'] / x['steps_per_s']:.1f}x |" for x in ratios))
  return "\n".join(lines)


def bench_real(name: str, args) -> list[dict]:
  spec = BENCH_ENVS[name]
  tasks = spec.tasks(args.real_rows)
  contenders = [("in-process x1", lambda: SerialBatchEnv([make_env(name, **spec.kwargs)]), tasks[:1]),
                (f"pool {args.workers} x{args.real_rows}",
                 lambda: EnvPool(name, spec.kwargs, num_workers=args.workers), tasks)]
  out = []
  for label, factory, batch_tasks in contenders:
    batch = factory()
    try:
      r = drive(batch, batch_tasks, args.real_seconds * spec.seconds_scale, args.seed)
    finally:
      batch.close()
    print(f"  {name} {label}: {r['steps_per_s']:.1f} steps/s ({r['steps']} steps)", file=sys.stderr, flush=True)
    out.append({"contender": label, "env": name, "rows": len(batch_tasks), **r})
  return out


def table(synthetic: dict, real: list[dict]) -> str:
  lines = ["| contender | env | rows | steps/s | synthetic / this | notes |", "|---|---|---|---|---|---|"]
  split = ", ".join(f"{k[:-2]} {v:.0%}" for k, v in synthetic["split"].items())
  lines.append(f"| {synthetic['contender']} | tiny Qwen2, vocab {synthetic['vocab']} | {synthetic['rows']} | "
               f"{synthetic['steps_per_s']:.1f} | 1.00 | bucket {synthetic['bucket']}, "
               f"{synthetic['mean_generated_tokens']:.0f} tokens/step generated (data targets "
               f"{synthetic['mean_target_tokens']:.0f}), prompts {synthetic['mean_prompt_tokens']:.0f} tokens; "
               f"time: {split}; first call {synthetic['first_step_s']:.1f} s |")
  for r in real:
    lines.append(f"| {r['contender']} | {r['env']} | {r['rows']} | {r['steps_per_s']:.1f} | "
                 f"{synthetic['steps_per_s'] / r['steps_per_s']:.1f} | first reset {r['first_reset_s']:.1f} s |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--records", default=str(DEFAULT_RECORDS) if DEFAULT_RECORDS.exists() else "",
                      help="TrajectoryRecord JSONL; empty: collect TextWorld-Express expert episodes here")
  parser.add_argument("--episodes", type=int, default=60, help="episodes to collect when --records is empty")
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--bucket", type=int, default=1024, help="the one prompt bucket (prompts are padded to it)")
  parser.add_argument("--new-tokens", type=int, default=128, help="the sampler's budget per transition")
  parser.add_argument("--k", type=int, default=3, help="retrieved transitions per prompt")
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--buffer", type=int, default=5000, help="offline transitions in the retrieval index")
  parser.add_argument("--seconds", type=float, default=60.0, help="synthetic stepping time")
  parser.add_argument("--real-envs", default="textworld_express,alfworld")
  parser.add_argument("--real-rows", type=int, default=16)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--real-seconds", type=float, default=20.0, help="stepping time per real contender (times the "
                      "env's seconds_scale)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--exp-model", default="", help="a trained M_exp folder (dreamjax train-exp): adds its table")
  parser.add_argument("--draft-tokens", default="0,4,8", help="speculative settings for --exp-model (0: plain)")
  parser.add_argument("--kv-reuse", default="off,on", help="KV reuse settings for --exp-model (off, on, or both)")
  parser.add_argument("--steps", type=int, default=3, help="recorded steps per episode batch for --exp-model")
  parser.add_argument("--exp-bucket", type=int, default=0, help="--exp-model's prompt bucket (0: its max_len, "
                      "less its decode budget where the position table needs it)")
  parser.add_argument("--skip-random", action="store_true", help="skip the random-model contender and the real envs")
  parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "synthetic_env"))
  args = parser.parse_args(argv)

  records = read_trajectories(args.records) if args.records else collect_twx(args.episodes)
  print(f"{len(records)} episodes, {sum(r.num_steps for r in records)} transitions", file=sys.stderr, flush=True)
  trained = bench_trained(args, records) if args.exp_model else []
  synthetic, real, skipped = None, [], {}
  if not args.skip_random:
    synthetic = bench_synthetic(args, records) | {"bucket": args.bucket}
    print(f"  synthetic x{args.rows}: {synthetic['steps_per_s']:.1f} transitions/s", file=sys.stderr, flush=True)
  for name in [n for n in args.real_envs.split(",") if n and not args.skip_random]:
    if name not in BENCH_ENVS:
      parser.error(f"unknown env {name!r}; known: {', '.join(BENCH_ENVS)}")
    why = missing(name)
    if why is None:
      try:
        real += bench_real(name, args)
        continue
      except Exception as e:  # noqa: BLE001 - one env's failure must not hide the others' numbers
        why = f"failed: {type(e).__name__}: {e}"
    skipped[name] = why
    print(f"skipped {name}: {why}")
  text = "\n\n".join(([table(synthetic, real)] if synthetic else []) +
                     ([trained_table(trained, args.exp_model, real)] if trained else []))
  print(text)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "table.md").write_text(text + "\n")
  (out / "results.json").write_text(json.dumps({"args": vars(args), "synthetic": synthetic, "real": real,
                                                "skipped": skipped, "trained": trained}, indent=1) + "\n")
  print(f"wrote {out / 'results.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
