"""google-tunix's side of the sampler and GRPO benchmarks, run in its own venv (`experiments/bench/tunix_venv.sh`).

Run by `experiments/bench/peers.py` as `.venv-tunix/bin/python experiments/bench/tunix_peer.py --model-dir DIR ...`;
it must not import dreamjax (tunix cannot share its venv). It loads the HF folder the dreamjax side built into tunix's
Qwen2 (`tunix.models.qwen2.params.create_model_from_safe_tensors`) and prints ONE JSON object on stdout (progress goes
to stderr):
- `logits` (with --check-logits): max |tunix - transformers| over the logits of a fixed 16-token prompt, so both sides
  are known to run the same model;
- `sampler` (with --prompts, the .npy of the dreamjax side's prompt ids, or --batch: `--prompt-len` random ids, seed
  `--prompt-seed`): tunix's `Sampler` for `--new-tokens` forced tokens, greedy or top-p 0.9 at temperature 1; the
  first call (compilation included) and `--runs` timed calls, the protocol of sampler.py; greedy tokens are returned;
- `grpo` (with --grpo): tunix's `GRPOLearner` on an `RLCluster` (vanilla rollout, actor, rollout and reference on one
  device): `--grpo-prompts` prompts x `--grpo-group` samples x `--grpo-new-tokens` new tokens at temperature 1, one
  update per step (AdamW, lr 1e-6, global-norm clip 1.0, KL to the reference: low-variance KL, coefficient 0.02,
  token-mean loss, clip 0.2: dreamjax's `dreamjax rl` defaults), reward = the fraction of even token ids in the
  completion. 1 warm-up step (compilation) then `--runs` timed steps, each split into rollout (`RLCluster.generate`),
  reference log-probs and update (`update_actor`); parameters are waited on at the end of each step.

Token ids go in and out unchanged: tunix's sampler takes strings, so prompts are written as space-separated ids and an
id tokenizer maps them back (no BOS; pad 0; EOS -1, an id no model emits, so every row runs the full budget as on the
dreamjax side). Threads: `--threads N` pins this process to N CPUs before XLA starts, as sampler.py does for itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

PAD, EOS = 0, -1
TOP_P = 0.9
KL_COEF, LR, CLIP_NORM = 0.02, 1e-6, 1.0


def log(msg: str) -> None:
  print(f"[tunix] {msg}", file=sys.stderr, flush=True)


class IdTokenizer:
  """Space-separated decimal ids <-> ids: the identity, through the text interface tunix's sampler requires."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self) -> int:
    return EOS

  def pad_id(self) -> int:
    return PAD


def even_fraction(ids: list[int]) -> float:
  """The benchmark's reward (dreamjax's side computes the same from its token ids)."""
  return float(np.mean([i % 2 == 0 for i in ids])) if len(ids) else 0.0


def reward_fn(prompts, completions, **_) -> list[float]:
  return [even_fraction([int(t) for t in c.split()]) for c in completions]


def hf_config(folder: Path) -> dict:
  cfg = json.loads((folder / "config.json").read_text())
  if cfg.get("model_type") != "qwen2":
    raise ValueError(f"{folder / 'config.json'}: model_type {cfg.get('model_type')!r}, tunix_peer loads only qwen2")
  return cfg


def load_model(folder: Path, cfg: dict):
  from tunix.models.qwen2 import model as qwen2
  from tunix.models.qwen2 import params as qwen2_params

  theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0
  heads = cfg["num_attention_heads"]
  mc = qwen2.ModelConfig(num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
                         embed_dim=cfg["hidden_size"], hidden_dim=cfg["intermediate_size"], num_heads=heads,
                         head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                         num_kv_heads=cfg["num_key_value_heads"], rope_theta=int(theta), norm_eps=cfg["rms_norm_eps"],
                         use_tied_embedding=bool(cfg.get("tie_word_embeddings")))
  return qwen2_params.create_model_from_safe_tensors(str(folder), mc), mc


def check_logits(model, folder: Path, vocab: int) -> dict:
  """max |tunix - transformers| over the logits of one fixed prompt, and the logits' scale for context."""
  import jax.numpy as jnp
  import torch
  import transformers

  ids = np.random.default_rng(1).integers(10, vocab, size=(1, 16))
  ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.inference_mode():
    want = ref(torch.from_numpy(ids)).logits.numpy()
  t = ids.shape[1]
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  got, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], None, mask)
  diff = float(np.max(np.abs(np.asarray(got) - want)))
  return dict(max_abs_diff=diff, logits_max_abs=float(np.max(np.abs(want))), prompt_tokens=t,
              argmax_agreement=float(np.mean(np.asarray(got).argmax(-1) == want.argmax(-1))))


def timed(fn, runs: int) -> tuple[float, list[float]]:
  t0 = time.perf_counter()
  fn(0)
  first = time.perf_counter() - t0
  times = []
  for i in range(runs):
    t0 = time.perf_counter()
    fn(i + 1)
    times.append(time.perf_counter() - t0)
  return first, times


def bench_sampler(model, mc, args) -> dict:
  from tunix.generate import sampler as sampler_lib

  prompts = np.load(args.prompts) if args.prompts else \
      np.random.default_rng(args.prompt_seed).integers(10, mc.vocab_size, size=(args.batch, args.prompt_len))
  if prompts.ndim != 2 or prompts.min() <= PAD or prompts.max() >= mc.vocab_size:
    raise ValueError(f"{args.prompts or 'prompts'}: expected [batch, length] ids in 1..{mc.vocab_size - 1} (0 is the "
                     f"pad id), got shape {prompts.shape}")
  batch, p, n = prompts.shape[0], prompts.shape[1], args.new_tokens
  texts = [IdTokenizer().decode(row) for row in prompts]
  # The smallest cache that holds prompt + budget: tunix attends over the whole cache every step.
  cache = sampler_lib.CacheConfig(cache_size=p + n, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                                  head_dim=mc.head_dim)
  sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
  mode = dict(temperature=1.0, top_p=TOP_P) if args.mode == "top_p" else dict(temperature=0.0)
  out = {}

  def call(i: int):
    res = sampler(texts, max_generation_steps=n, max_prompt_length=p, echo=False, seed=i, **mode)
    out["tokens"] = res.tokens

  first, times = timed(call, args.runs)
  lengths = [len(t) for t in out["tokens"]]
  if min(lengths) < n:
    raise RuntimeError(f"tunix sampler returned {min(lengths)} tokens for a row, expected {n} (forced budget)")
  med = statistics.median(times)
  return dict(batch=batch, mode=args.mode, prompt_len=p, new_tokens=n, first_s=first, times_s=times,
              median_s=med, tok_s=batch * n / med, compile_s=max(first - med, 0.0),
              tokens=[np.asarray(t[:n]).tolist() for t in out["tokens"]] if args.mode == "greedy" else None)


def bench_grpo(folder: Path, cfg: dict, args) -> dict:
  import jax
  import optax
  from flax import nnx
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  actor, mc = load_model(folder, cfg)
  reference, _ = load_model(folder, cfg)
  p, n, g = args.prompt_len, args.grpo_new_tokens, args.grpo_group
  steps = 1 + args.runs
  rng = np.random.default_rng(args.prompt_seed)
  # An array, not a list: tunix repeats each batch G times with a tree map, which takes a list's strings as leaves.
  data = [{"prompts": np.array([IdTokenizer().decode(r) for r in rng.integers(10, mc.vocab_size,
                                                                             size=(args.grpo_prompts, p))])}
          for _ in range(steps)]
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  optimizer = optax.chain(optax.clip_by_global_norm(CLIP_NORM),
                          optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
  roles = rl_cluster_lib.Role
  cluster_cfg = rl_cluster_lib.ClusterConfig(
      role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh}, rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10**9,
                                                      max_steps=steps),
      rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=n, temperature=1.0, top_p=1.0,
                                                max_prompt_length=p, kv_cache_size=p + n))
  cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=IdTokenizer(),
                                     cluster_config=cluster_cfg)
  algo = grpo_learner.GRPOConfig(num_generations=g, num_iterations=1, beta=KL_COEF, kl_loss_mode="low_var_kl",
                                 loss_agg_mode="token-mean", epsilon=0.2)
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward_fn)
  # The cluster trains its own copy (it reshards `actor` onto the mesh): wait on, and probe, that one.
  trained = cluster.actor_trainer.model

  phases: list[dict[str, float]] = []

  def timing(name, fn):
    # Times a phase of tunix's own step; results are waited on so the phase's device work lands in it.
    def wrapped(*a, **kw):
      t0 = time.perf_counter()
      res = fn(*a, **kw)
      jax.block_until_ready(jax.tree.leaves(res) if res is not None else nnx.state(trained))
      phases[-1][name] = phases[-1].get(name, 0.0) + time.perf_counter() - t0
      return res
    return wrapped

  cluster.generate = timing("rollout_s", cluster.generate)
  cluster.get_ref_per_token_logps = timing("scoring_s", cluster.get_ref_per_token_logps)
  cluster.update_actor = timing("update_s", cluster.update_actor)
  run_step = learner._run_global_step

  def global_step(*a, **kw):
    phases.append({})
    t0 = time.perf_counter()
    run_step(*a, **kw)
    jax.block_until_ready(nnx.state(trained))
    phases[-1]["total_s"] = time.perf_counter() - t0

  learner._run_global_step = global_step
  probe = np.array(nnx.state(trained)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value())
  log(f"GRPO: {steps} steps of {args.grpo_prompts} prompts x {g} samples x {n} new tokens")
  learner.train(data)
  if len(phases) != steps:
    raise RuntimeError(f"tunix GRPO ran {len(phases)} global steps, expected {steps}")
  changed = bool(np.any(probe != np.array(nnx.state(trained)["layers"][0]["mlp"]["down_proj"]["kernel"].get_value())))
  if not changed:
    raise RuntimeError("tunix GRPO: the actor's parameters did not change; the steps did no update")
  timed_steps = phases[1:]
  med = {k: statistics.median(s.get(k, 0.0) for s in timed_steps) for k in ("total_s", "rollout_s", "scoring_s",
                                                                             "update_s")}
  return dict(prompts=args.grpo_prompts, group=g, new_tokens=n, prompt_len=p, first_s=phases[0]["total_s"],
              steps=phases, median=med, train_steps=int(cluster.actor_trainer.train_steps), params_changed=changed)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model-dir", type=Path, required=True, help="HF Qwen2 folder (config.json + model.safetensors)")
  p.add_argument("--check-logits", action="store_true", help="compare tunix's logits with transformers' first")
  p.add_argument("--batch", type=int, default=0, help="sampler batch of random prompts (0: no sampler measurement)")
  p.add_argument("--prompts", type=Path, default=None, help=".npy int [batch, length] prompt ids (instead of --batch)")
  p.add_argument("--mode", default="greedy", choices=("greedy", "top_p"))
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--prompt-seed", type=int, default=0)
  p.add_argument("--runs", type=int, default=3, help="timed runs (GRPO: steps) after the warm-up; median reported")
  p.add_argument("--grpo", action="store_true", help="time tunix's GRPO step")
  p.add_argument("--grpo-prompts", type=int, default=4)
  p.add_argument("--grpo-group", type=int, default=4)
  p.add_argument("--grpo-new-tokens", type=int, default=64)
  p.add_argument("--threads", type=int, default=2, help="CPUs this process may use; 0 leaves the affinity alone")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.threads and len(os.sched_getaffinity(0)) > args.threads:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import importlib.metadata as md

  import jax

  cfg = hf_config(args.model_dir)
  result: dict = dict(tunix=md.version("google-tunix"), jax=jax.__version__, flax=md.version("flax"),
                      cpus=len(os.sched_getaffinity(0)))
  sample = bool(args.batch or args.prompts)
  if args.check_logits or sample:
    t0 = time.perf_counter()
    model, mc = load_model(args.model_dir, cfg)
    result["load_s"] = time.perf_counter() - t0
    if args.check_logits:
      result["logits"] = check_logits(model, args.model_dir, mc.vocab_size)
      log(f"logits vs transformers: max abs diff {result['logits']['max_abs_diff']:.2e}")
    if sample:
      result["sampler"] = bench_sampler(model, mc, args)
      s = result["sampler"]
      log(f"sampler {args.mode} batch {s['batch']}: first {s['first_s']:.2f}s, runs "
          f"{[round(t, 3) for t in s['times_s']]}")
    del model
  if args.grpo:
    result["grpo"] = bench_grpo(args.model_dir, cfg, args)
    log(f"GRPO step median {result['grpo']['median']['total_s']:.2f}s (first {result['grpo']['first_s']:.1f}s)")
  print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
