"""One GRPO iteration (rollout + scoring + update) with dreamjax's own parts against google-tunix's GRPO step, one
DreamGym iteration with the experience model in the loop, and the update step's model FLOPs utilisation.

Run: `python experiments/bench/grpo_iteration.py` (standard model of BENCHMARKS.md, ~10 min on 2 cores; the first run
takes ~10-20 more to warm-start the DreamGym model) or `... --small --no-dreamgym` (tiny model, under a minute).
Writes table.md and results.json to --out.

`--shared-prefix` adds row 1 again with shared group prompts on, its iterations interleaved with row 1's
(`RolloutConfig.group_prefill`: the sampler prefills each group's prompt once; `RLConfig.shared_prefix`: reference
scoring and the update run it once per group, dreamjax/rl/update.py) and a table of the on/off ratios per phase
(rollout is one turn here, so rollout s is the time per turn); and the prefix statistics of a realistic multi-turn
batch (`prefix_report`: TextWorld-Express coin games played by a half-expert, half-random stand-in policy, turn prompts
built by the rollout engine with `dreamjax rl`'s defaults; host only).

Rows (each: `--warmup` iterations, which compile, then the median of `--runs` iterations; rows 1 and 2 have fixed
shapes, so nothing compiles after the first iteration; the DreamGym row's turn rows vary in length, so a new length
bucket can still compile in a timed iteration):
1. `dreamjax GRPO`: tunix's workload on dreamjax's parts, the code path of `dreamjax rl` (`PolicyLearner`): 4 prompts
   x 4 samples of `--prompt-len` random ids, `--new-tokens` new tokens at temperature 1 from the learner's rollout
   sampler (single turn, so no env and no text: prompt ids in, sampled ids and log-probs out), reward = the fraction
   of even ids in the completion (the same function tunix_peer.py gives tunix), then `PolicyLearner.build_batch`
   (reference log-probs for the KL term; GRPO advantages) and `PolicyLearner.update` (one AdamW step on all 16 rows, lr
   1e-6, clip 1.0, low-variance KL 0.02, token-mean loss). Phases: rollout (sampling), scoring (reference log-probs
   and batch), update.
2. `tunix GRPO`: the same workload in tunix's `GRPOLearner` (experiments/bench/tunix_peer.py, its own venv, run after
   row 1, not at the same time), with its phases from tunix's own calls; the ratio is tunix's seconds over dreamjax's.
3. `DreamGym GRPO`: `PolicyLearner.iteration` against `SyntheticEnv`, as `dreamjax dreamgym` runs it: 4 TextWorld-Express
   coin tasks x 4 rollouts, up to `--turns` turns, policy and M_exp alternating, both the standard model's
   architecture, M_exp retrieving its top-k from the offline transitions (backbone-pooled encoder, exact index) every
   step. No peer: tunix has no experience model. A random model never writes the answer format (no answer would
   parse, so M_exp would never be called), so both roles start from one warm start: the standard model SFT'd for
   `--warm-steps` steps on the policy's rows of a few expert episodes (and M_exp's with `--warm-exp`; see
   experiments/bench/dreamgym_row.py), cached under .cache/bench. The table reports how many answers parsed and how
   many M_exp steps ran, so the row says how much of the loop actually happened.

MFU of the update step: model FLOPs / (update seconds x the machine's float32 matmul ceiling). Model FLOPs (PaLM's
appendix B convention, counting the work the loss needs) = 6 x (N_layers x tokens + N_head x loss tokens) + 12 x L x
(H x D) x sum over rows of T_row^2, where N_layers counts the transformer layers' matmul weights (per layer q: E x HD,
k and v: E x KD each, o: HD x E, gate, up and down: 3 x E x F; biases, norm scales and the embedding lookup are not
matmuls), N_head the LM head's E x V, tokens and T_row count the valid tokens of the update's rows (padding is not
useful work), loss tokens the sampled tokens the loss reads log-probs of (the head's output at prompt positions is
not needed: dreamjax does not compute it, and a peer that does gets no credit for it), and the attention term is QK^T
and AV (2 x 2 x T^2 x HD per layer forward, x3 with the backward) over full T x T scores. The ceiling is measured in
the same run and thread setting: the best of a few jitted float32 matmuls (1024^3 and 2048^3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dreamjax.loop.learner import PolicyLearner, RLConfig, tokenizer_texts  # noqa: E402
from dreamjax.models import ModelConfig, load_hf_checkpoint, tiny  # noqa: E402
from dreamjax.rl.batch import prefix_stats, sft_batch, shared_prefix_batch  # noqa: E402
from dreamjax.rl.objectives import PolicyGradientConfig  # noqa: E402
from dreamjax.rl.optim import OptimConfig  # noqa: E402
from dreamjax.rollout.agent import AgentFormat, format_answer  # noqa: E402
from dreamjax.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from dreamjax.rollout.trajectory import Trajectories  # noqa: E402
from dreamjax.sampling import sampling_params  # noqa: E402
from dreamjax.text import Kind, train_bpe_tokenizer  # noqa: E402
from experiments.bench import dreamgym_row, peers  # noqa: E402
from experiments.bench.sampler import ensure_model  # noqa: E402

PROMPTS, GROUP = 4, 4
OPTIM = OptimConfig(lr=1e-6, clip_norm=1.0)  # tunix_peer.py uses the same: AdamW, no weight decay, clip 1.0
OBJECTIVE = PolicyGradientConfig(kl_coef=0.02, kl_kind="low_var_kl")  # `dreamjax rl`'s GRPO defaults
PHASES = ("rollout_s", "scoring_s", "update_s", "total_s")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def even_fraction(ids: np.ndarray) -> float:
  """The benchmark's reward, a deterministic function of the completion (tunix_peer.py's `even_fraction`)."""
  return float(np.mean(np.asarray(ids) % 2 == 0)) if len(ids) else 0.0


def matmul_weights(cfg: ModelConfig) -> tuple[int, int]:
  """(N_layers, N_head): matmul weights of the transformer layers and of the LM head (see the module docstring)."""
  e, f, hd, kd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_layer = e * hd + 2 * e * kd + hd * e + 3 * e * f
  return cfg.num_layers * per_layer, e * cfg.vocab_size


def update_flops(cfg: ModelConfig, row_lengths: Sequence[int], loss_tokens: int) -> float:
  """Model FLOPs of one update (forward + backward) over rows of these valid lengths with `loss_tokens` scored
  tokens in all (module docstring)."""
  lengths = np.asarray(row_lengths, np.float64)
  layers, head = matmul_weights(cfg)
  attention = 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * float(np.sum(lengths ** 2))
  return 6.0 * (layers * float(lengths.sum()) + head * float(loss_tokens)) + attention


def matmul_ceiling(sizes: Sequence[int] = (1024, 2048), repeats: int = 5) -> float:
  """Best float32 matmul FLOP/s of this process (same threads and affinity as the benchmark)."""
  best = 0.0
  mm = jax.jit(jnp.matmul)
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm(a, b).block_until_ready()
    for _ in range(repeats):
      t0 = time.perf_counter()
      mm(a, b).block_until_ready()
      best = max(best, 2.0 * n ** 3 / (time.perf_counter() - t0))
  return best


def id_tokenizer():
  """A small BPE with a chat template: `PolicyLearner` builds rollout engines that need one, though this row's single-turn
  rollout never turns ids into text."""
  with tempfile.TemporaryDirectory(prefix="bench_grpo_tok_") as folder:
    return train_bpe_tokenizer(["the benchmark prompts are random token ids", "no text is ever decoded"] * 4, folder,
                               vocab_size=300)


def grpo_learner(model_cfg: ModelConfig, params, tok, prompt_len: int, new_tokens: int, prompts: int = PROMPTS,
                 group: int = GROUP, shared: bool = False) -> PolicyLearner:
  rows = prompts * group
  cfg = RLConfig(objective=OBJECTIVE, optim=OPTIM, tasks_per_iteration=prompts, rows_per_step=rows, score_batch=rows,
                 pad_to=64, rollout=RolloutConfig(group_size=group, max_turns=1, max_action_tokens=new_tokens,
                                                  max_episode_tokens=new_tokens, prompt_buckets=(prompt_len,),
                                                  temperature=1.0, group_prefill=shared),
                 agent=AgentFormat(think=False), shared_prefix=shared)
  return PolicyLearner(cfg, model_cfg, params, tok)


def single_turn(prompts: np.ndarray, tokens: np.ndarray, logps: np.ndarray, lengths: np.ndarray,
                group: int = GROUP) -> Trajectories:
  """One-turn episodes (prompt ids + sampled ids) in the rollout engine's contract, rewarded by `even_fraction`."""
  n, p = prompts.shape
  width = p + tokens.shape[1]
  ids = np.zeros((n, width), np.int32)
  kinds = np.full((n, width), Kind.PAD, np.int32)
  logp = np.zeros((n, width), np.float32)
  ids[:, :p], kinds[:, :p] = prompts, Kind.TASK
  for r in range(n):
    k = int(lengths[r])
    ids[r, p:p + k], kinds[r, p:p + k], logp[r, p:p + k] = tokens[r, :k], Kind.ACTION, logps[r, :k]
  reward = np.asarray([even_fraction(tokens[r, :lengths[r]]) for r in range(n)], np.float32)
  rows = np.arange(n, dtype=np.int32)
  return Trajectories(
      tokens=ids, kinds=kinds, loss_mask=(kinds == Kind.ACTION).astype(np.int32), rollout_logp=logp,
      lengths=(p + lengths).astype(np.int32), prompt_lengths=np.full(n, p, np.int32), episode=rows,
      turn=np.zeros(n, np.int32), reward=reward, done=np.ones(n, bool), invalid=np.zeros(n, bool),
      truncated=np.ones(n, bool), group=rows // group, task_index=rows // group, num_turns=np.ones(n, np.int32),
      turn_rows=rows[:, None], episode_reward=reward, success=np.zeros(n, bool), ended=np.ones(n, bool),
      env_error=np.zeros(n, bool), records=())


def bench_dreamjax_grpo(folder: Path, args) -> dict:
  model_cfg, params = load_hf_checkpoint(folder)
  return bench_grpo(model_cfg, params, args.prompt_len, args.new_tokens, args.warmup, args.runs)


def bench_grpo(model_cfg: ModelConfig, params, prompt_len: int, new_tokens: int, warmup: int, runs: int,
               prompts: int = PROMPTS, group: int = GROUP, shared: bool = False) -> dict:
  """Row 1's workload on these weights (the model config's dtypes are the run's: tools/accelerator_check.py runs it in
  bfloat16): `warmup` + `runs` iterations of `prompts` x `group` rows, phase seconds and the last update's FLOPs.
  `shared`: with shared group prompts (grouped prefill and the shared-prefix update); the same prompts and keys."""
  return bench_grpo_variants(model_cfg, params, prompt_len, new_tokens, warmup, runs, prompts, group, (shared,))[0]


def bench_grpo_variants(model_cfg: ModelConfig, params, prompt_len: int, new_tokens: int, warmup: int, runs: int,
                        prompts: int = PROMPTS, group: int = GROUP, variants: Sequence[bool] = (False, True)
                        ) -> list[dict]:
  """`bench_grpo` for each `shared` setting in `variants`, their iterations interleaved (iteration i of each on the
  same prompts and keys, one after the other), so that a machine shared with other work slows them alike."""
  tok = id_tokenizer()
  # A copy each: a learner's train step donates (deletes) the parameter arrays it was given.
  learners = [grpo_learner(model_cfg, jax.tree.map(jnp.array, params), tok, prompt_len, new_tokens, prompts, group, v)
              for v in variants]
  rows = prompts * group
  rng = np.random.default_rng(0)
  sp = sampling_params(rows, new_tokens, temperature=1.0)
  steps: list[list[dict]] = [[] for _ in variants]
  flops, batch = 0.0, None
  for it in range(warmup + runs):
    ids = np.repeat(rng.integers(10, model_cfg.vocab_size, size=(prompts, prompt_len)), group, axis=0)
    for v, (shared, learner) in enumerate(zip(variants, learners)):
      grouped = {"group": group} if shared else {}  # the engine's check (identical prompts per group) holds here
      t0 = time.perf_counter()
      keys = jax.random.split(jax.random.fold_in(learner.root, it), rows)
      out = learner.engine.sampler(learner.sampling_params(), ids.astype(np.int32), np.ones_like(ids, bool), keys,
                                   sp, **grouped)
      tokens, logps, lengths = (np.asarray(x) for x in (out.tokens, out.logps, out.lengths))
      t1 = time.perf_counter()
      traj = single_turn(ids, tokens, logps, lengths, group)
      batch, _ = learner.build_batch(traj)
      t2 = time.perf_counter()
      metrics = learner.update(batch, np.arange(rows), it)
      t3 = time.perf_counter()
      flops = update_flops(model_cfg, np.asarray(batch.valid).sum(-1)[:rows], int(np.asarray(batch.loss_mask).sum()))
      steps[v].append(dict(rollout_s=t1 - t0, scoring_s=t2 - t1, update_s=t3 - t2, total_s=t3 - t0,
                           loss=metrics["loss"], kl=metrics.get("kl"), mean_reward=float(traj.reward.mean())))
      log(f"[{_name(shared)}] iteration {it}: " + ", ".join(f"{k} {steps[v][-1][k]:.2f}" for k in PHASES))
  return [dict(name=_name(shared), steps=s, median=median_phases(s[warmup:]), first_s=s[0]["total_s"],
               update_flops=flops, update_rows=rows, update_tokens=int(np.asarray(batch.valid).sum()),
               sampler_compilations=learner.engine.sampler.compilations(),
               step_compilations=learner.step.compilations())
          for shared, s, learner in zip(variants, steps, learners)]


def _name(shared: bool) -> str:
  return "dreamjax GRPO (shared prefix)" if shared else "dreamjax GRPO"


def prefix_report(games: int = 4, group: int = 8, max_turns: int = 15, rows_per_step: int = 64, seed: int = 0,
                  expert: float = 0.5) -> dict:
  """Prefix statistics of a realistic multi-turn batch (host only, no model): `games` TextWorld-Express coin tasks x
  `group` episodes of up to `max_turns` turns in `dreamjax rl`'s default env, agent format and prompt buckets, each
  turn's action the expert's with probability `expert`, else a random admissible one (a policy part way through
  training: groups agree on some turns and diverge on others). Turn rows are built as the rollout engine builds them
  (its `turn_prompt`, then `format_answer` as the answer, the loss on the answer), and `prefix_stats` is reported
  for the whole iteration as one step, for the learner's shuffled steps of `rows_per_step` rows, and for turn 0."""
  from dreamjax.envs.textworld_express import TextWorldExpressEnv, tasks as twx_tasks

  rl = RLConfig()
  env = TextWorldExpressEnv(step_limit=20)
  pool = twx_tasks("coin", "train", games, params=rl.train_tasks.game_params, env=env)

  class One:  # the BatchEnv face of one env, for tokenizer_texts
    def reset_batch(self, ts):
      return [env.reset(t) for t in ts]

  with tempfile.TemporaryDirectory(prefix="bench_prefix_tok_") as folder:
    tok = train_bpe_tokenizer(tokenizer_texts(rl.agent, One(), pool, games) * 2, folder, vocab_size=1024)
  engine = RolloutEngine(tiny("qwen2", vocab_size=1024, max_position_embeddings=1024), tok, rl.agent, rl.rollout)
  rng = np.random.default_rng(seed)
  ids, masks, turns = [], [], []
  for task in pool:
    for _ in range(group):
      obs, history = env.reset(task), []
      for turn in range(max_turns):
        gold = env.expert_action()
        action = gold if gold is not None and rng.random() < expert else str(rng.choice(list(obs.admissible)))
        prompt = engine.turn_prompt(obs.instruction or task.instruction, turn, history, obs.state, obs.admissible)
        head = np.asarray(prompt.prompt(), np.int32)
        answer = np.asarray(list(tok.encode(format_answer(action))) + [tok.chat_format.end_of_turn], np.int32)
        ids.append(np.concatenate([head, answer]))
        masks.append(np.r_[np.zeros(len(head)), np.ones(len(answer))].astype(np.int32))
        turns.append(turn)
        result = env.step(action)
        history.append((obs.state, action))
        obs = result.observation
        if result.done:
          break
  env.close()
  batch = sft_batch(ids, masks, pad_to=64)
  turns = np.asarray(turns)

  def stats(rows: np.ndarray) -> dict:
    part = jax.tree.map(lambda x: np.asarray(x)[rows], batch)
    return prefix_stats(shared_prefix_batch(part, pad_to=64))

  order = np.random.default_rng((seed, 1)).permutation(len(ids))
  steps = [stats(part) for part in np.array_split(order, -(-len(ids) // rows_per_step))]
  total = lambda key: sum(s[key] for s in steps)  # noqa: E731
  return dict(rows=len(ids), mean_row_tokens=float(np.mean([len(i) for i in ids])), whole=stats(np.arange(len(ids))),
              steps=dict(count=len(steps), shared_frac=1 - total("computed_tokens") / total("row_tokens"),
                         slot_ratio=float(np.mean([s["slot_ratio"] for s in steps]))),
              turn0=stats(np.flatnonzero(turns == 0)))


def prefix_table(report: dict) -> str:
  lines = [f"Prefix statistics, {report['rows']} turn rows (mean {report['mean_row_tokens']:.0f} tokens) of "
           "TextWorld-Express coin games (`prefix_report`):", "",
           "| rows in one step | shared fraction of row tokens | padded slots / per-row slots |", "|---|---|---|"]
  for label, s in (("the whole iteration", report["whole"]), (f"learner's shuffled steps ({report['steps']['count']})",
                   report["steps"]), ("turn-0 rows only", report["turn0"])):
    lines.append(f"| {label} | {s['shared_frac']:.1%} | {s['slot_ratio']:.2f} |")
  return "\n".join(lines)


def shared_table(off: dict, on: dict) -> str:
  lines = ["| shared group prompts (median s) | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
  for label, r in (("off", off), ("on", on)):
    lines.append(f"| {label} | " + " | ".join(fmt_s(r["median"][k]) for k in PHASES) + " |")
  lines.append("| off / on | " + " | ".join(f"{off['median'][k] / on['median'][k]:.2f}x" for k in PHASES) + " |")
  return "\n".join(lines)


def median_phases(steps: list[dict]) -> dict[str, float]:
  return {k: statistics.median(s[k] for s in steps) for k in PHASES}


def fmt_s(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def tables(rows: list[dict], tunix: dict | None, tunix_missing: str | None, ceiling: float) -> str:
  head = ["| iteration (median of timed runs) | rollout s | scoring s | update s | total s | tunix s | "
          "speed-up (tunix s / dreamjax s) |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    m = r["median"]
    if r["name"].startswith("dreamjax GRPO"):
      peer = fmt_s(tunix and tunix["median"]["total_s"]) if tunix else tunix_missing
      ratio = f"{tunix['median']['total_s'] / m['total_s']:.2f}x" if tunix else "-"
    else:
      peer, ratio = "no peer (tunix has no experience model)", "-"
    rollout = fmt_s(m["rollout_s"])
    if "policy_sample_s" in m:
      rollout += f" (policy {m['policy_sample_s']:.2f} + M_exp {m['exp_s']:.2f} + host {m['rollout_host_s']:.2f})"
    head.append(f"| {r['label']} | {rollout} | {fmt_s(m['scoring_s'])} | {fmt_s(m['update_s'])} | "
                f"{fmt_s(m['total_s'])} | {peer} | {ratio} |")
  if tunix:
    m = tunix["median"]
    head.append(f"| tunix GRPO (same workload as row 1) | {fmt_s(m['rollout_s'])} | {fmt_s(m['scoring_s'])} | "
                f"{fmt_s(m['update_s'])} | {fmt_s(m['total_s'])} | | |")
  mfu = ["| update step | rows | valid tokens | model GFLOP | update s | GFLOP/s | MFU |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    mfu.append(f"| {r['name']} | {r['update_rows']} | {r['update_tokens']} | {r['update_flops'] / 1e9:.1f} | "
               f"{r['median']['update_s']:.2f} | {r['update_gflop_s']:.1f} | {r['mfu_pct']:.1f}% |")
  if tunix:  # the same rows and tokens as dreamjax's GRPO row, so the same model FLOPs
    r, s = rows[0], tunix["median"]["update_s"]
    mfu.append(f"| tunix GRPO (same rows) | {r['update_rows']} | {r['update_tokens']} | {r['update_flops'] / 1e9:.1f} | "
               f"{s:.2f} | {r['update_flops'] / s / 1e9:.1f} | {100 * r['update_flops'] / s / ceiling:.1f}% |")
  notes = [f"float32 matmul ceiling measured in this run: {ceiling / 1e9:.1f} GFLOP/s."]
  for r in rows:
    if "parse" in r:
      p = r["parse"]
      notes.append(f"DreamGym row: {p['policy_parsed']:.0%} of policy answers parsed, {p['exp_steps']:.0f} M_exp steps "
                   f"per iteration ({p['exp_parse_failures']:.0f} malformed), {p['turns']:.2f} turns per episode "
                   f"(medians over the timed iterations); a malformed M_exp answer ends its episode (M_exp's format "
                   f"is warm-started only with --warm-exp).")
  return "\n".join(head) + "\n\n" + "\n".join(mfu) + "\n\n" + "\n".join(notes)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny model (seconds; the test uses it)")
  p.add_argument("--runs", type=int, default=3, help="timed iterations after the warm-up; medians reported")
  p.add_argument("--warmup", type=int, default=1, help="dreamjax warm-up iterations (compilation), not timed")
  p.add_argument("--prompt-len", type=int, default=None, help="prompt ids per row (default 128; 16 with --small)")
  p.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (default 64; 16 with --small)")
  p.add_argument("--threads", type=int, default=2, help="CPUs for every contender; 0 leaves the affinity alone")
  p.add_argument("--no-tunix", action="store_true", help="skip the tunix peer (also: DREAMJAX_SKIP_PEERS=1)")
  p.add_argument("--no-dreamgym", action="store_true", help="skip the DreamGym row")
  p.add_argument("--shared-prefix", action="store_true",
                 help="also row 1 with shared group prompts on, the on/off ratios, and multi-turn prefix statistics")
  dreamgym_row.add_args(p)
  p.add_argument("--model-dir", type=Path, default=None, help="HF folder of the benchmark model (made if missing)")
  p.add_argument("--out", type=Path, default=ROOT / "runs/bench/grpo_iteration")
  args = p.parse_args(argv)
  args.prompt_len = args.prompt_len or (16 if args.small else 128)
  args.new_tokens = args.new_tokens or (16 if args.small else 64)
  args.model_dir = args.model_dir or ROOT / ".cache/bench" / ("qwen2-small" if args.small else "qwen2-standard")
  if args.runs < 1 or args.warmup < 0:
    p.error(f"--runs must be >= 1 and --warmup >= 0, got {args.runs} and {args.warmup}")
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  if args.threads and len(os.sched_getaffinity(0)) > args.threads:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
  args.out.mkdir(parents=True, exist_ok=True)
  folder = ensure_model(args.model_dir, args.small)
  ceiling = matmul_ceiling()
  log(f"float32 matmul ceiling: {ceiling / 1e9:.1f} GFLOP/s")
  shared = prefixes = None
  if args.shared_prefix:  # both settings, iterations interleaved
    model_cfg, params = load_hf_checkpoint(folder)
    rows, shared = bench_grpo_variants(model_cfg, params, args.prompt_len, args.new_tokens, args.warmup, args.runs)
    rows = [rows]
    prefixes = prefix_report()
  else:
    rows = [bench_dreamjax_grpo(folder, args)]
  rows[0]["label"] = (f"dreamjax GRPO: {PROMPTS} prompts x {GROUP} samples x {args.new_tokens} new tokens "
                      f"({args.prompt_len}-token prompts), one update")
  if shared is not None:
    shared["label"] = rows[0]["label"] + ", shared group prompts"
  tunix_missing = peers.status(skip=args.no_tunix)
  tunix = None
  if tunix_missing is None:
    log("[tunix GRPO] ...")
    tunix = peers.run_tunix(["--model-dir", folder, "--grpo", "--prompt-len", args.prompt_len, "--grpo-new-tokens",
                             args.new_tokens, "--grpo-prompts", PROMPTS, "--grpo-group", GROUP, "--runs", args.runs],
                            threads=args.threads)["grpo"]
  if not args.no_dreamgym:
    rows.append(dreamgym_row.bench(folder, args, PROMPTS, GROUP, OBJECTIVE, OPTIM, update_flops, log))
  if shared is not None:
    rows.insert(1, shared)
  for r in rows:
    r.setdefault("update_gflop_s", r["update_flops"] / r["median"]["update_s"] / 1e9)
    r["mfu_pct"] = 100.0 * r["update_gflop_s"] * 1e9 / ceiling
  md = tables(rows, tunix, tunix_missing, ceiling)
  if shared is not None:
    md += "\n\n" + shared_table(rows[0], shared) + "\n\n" + prefix_table(prefixes)
  print(md, flush=True)
  result = dict(setup=dict(model_dir=str(folder), small=args.small, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens, runs=args.runs, threads=args.threads,
                           cpus_available=len(os.sched_getaffinity(0)), jax=jax.__version__,
                           optim=dataclasses.asdict(OPTIM), objective=dataclasses.asdict(OBJECTIVE),
                           tunix=tunix_missing or "run after dreamjax's row, same workload"),
                matmul_ceiling_flop_s=ceiling, rows=rows, tunix=tunix, prefix_report=prefixes, table_md=md)
  (args.out / "table.md").write_text(md + "\n")
  (args.out / "results.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
  log(f"wrote {args.out / 'results.json'}")
  return result


if __name__ == "__main__":
  main()
