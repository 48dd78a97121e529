"""`dreamjax sample`: a chat-formatted batch sampled from a model loaded from an HF folder, with its tokens/s (a quick
check that a checkpoint loads, shards and samples).

Without a checkpoint it builds one: a byte-level BPE trained on a small built-in corpus and a tiny random Qwen2 model,
exported as an HF folder and loaded back, so it runs the same path a real Llama/Qwen checkpoint takes. Random
weights produce random text; the point is the pipeline and its speed.

Several processes (multi-host): `start_run(cfg)` first joins them; every process runs the same program (the rows are
sharded over every process's devices, and fetching the samples is a collective), process 0 alone builds the tiny
checkpoint (the others load it after a barrier) and writes sample.json; each process returns its own report (the same
but for its timings).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from dreamjax.loop.config import RunConfig, run_mesh, start_run
from dreamjax.loop.lock import lock_run_folder
from dreamjax.loop.model import ModelSource, prepare_model
from dreamjax.loop.track import json_dumps
from dreamjax.models import ModelConfig, tiny
from dreamjax.parallel import SAMPLE_RULES, is_primary, to_host
from dreamjax.sampling import Sampler, left_pad, sampling_params
from dreamjax.text import Kind, SegmentBuilder


@dataclasses.dataclass(frozen=True)
class SampleConfig(RunConfig):
  checkpoint: str = ""  # an HF checkpoint folder (config.json, safetensors, tokenizer); empty: build a tiny one
  out_dir: str = "runs/sample"
  model: ModelConfig = tiny("qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                            num_heads=4, num_kv_heads=2, head_dim=32)  # vocab is replaced by the tokenizer's
  batch: int = 8
  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 0.9


def _corpus(n: int, seed: int) -> list[str]:
  """Household-task sentences in the style of the text environments, enough to train a small BPE."""
  rng = np.random.RandomState(seed)
  rooms = ["kitchen", "bathroom", "bedroom", "living room", "garden", "hallway"]
  things = ["apple", "mug", "knife", "towel", "book", "lamp", "key", "soap", "plate", "pan", "sofa", "fridge"]
  verbs = ["take", "put", "open", "close", "heat", "cool", "clean", "examine", "go to", "use"]
  lines = []
  for _ in range(n):
    room, a, b = rng.choice(rooms), rng.choice(things), rng.choice(things)
    lines.append(f"You are in the {room}. You see a {a} and a {b}. Your task is to {rng.choice(verbs)} the {a}.")
    lines.append(f"<think>The {a} is here, so I should {rng.choice(verbs)} it.</think><action>{rng.choice(verbs)} "
                 f"{a}</action>")
  return lines


def run(cfg: SampleConfig) -> dict:
  start_run(cfg)  # before anything touches devices: joins the processes, points the compilation cache
  with lock_run_folder(cfg.out_dir):  # one run per folder (it builds tiny-checkpoint/ there)
    return _sample(cfg)


def _sample(cfg: SampleConfig) -> dict:
  out = Path(cfg.out_dir)
  mesh = run_mesh(cfg)
  folder, model_cfg, params, tokenizer = prepare_model(
      ModelSource(checkpoint=cfg.checkpoint, tiny=cfg.model), out / "tiny-checkpoint",
      lambda: _corpus(2000, cfg.seed), seed=cfg.seed, mesh=mesh, rules=SAMPLE_RULES)
  prompts = []
  for task in _corpus(cfg.batch, cfg.seed + 1)[::2]:
    conv = SegmentBuilder(tokenizer).append(Kind.SYSTEM, "You are a household agent. Answer with "
                                            "<think>...</think><action>...</action>.").append(Kind.TASK, task)
    prompts.append(conv.prompt())
  width = max(len(p) for p in prompts)
  tokens, mask = left_pad(prompts, len(prompts), width, tokenizer.pad_id)
  sampler = Sampler(model_cfg, cfg.max_new_tokens, pad_id=tokenizer.pad_id, mesh=mesh, rules=SAMPLE_RULES)
  sp = sampling_params(len(prompts), cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                       stop=[[i] for i in tokenizer.eos_ids])
  key = jax.random.key(cfg.seed)
  start = time.perf_counter()
  sampler(params, tokens, mask, key, sp).tokens.block_until_ready()
  first = time.perf_counter() - start
  # Forced full length for the timing run, so tokens/s does not depend on where random weights happen to stop.
  timed_sp = sp.replace(stop=np.full(sp.stop.shape, -1, np.int32))
  start = time.perf_counter()
  result = sampler(params, tokens, mask, key, timed_sp)
  result.tokens.block_until_ready()
  seconds = time.perf_counter() - start
  generated = int(np.sum(to_host(result.lengths)))  # rows on every process's devices: a collective
  sample = to_host(sampler(params, tokens, mask, key, sp))
  texts = [tokenizer.decode(sample.tokens[i, : sample.lengths[i]]) for i in range(len(prompts))]
  report = {
      "checkpoint": str(folder), "devices": len(jax.devices()), "batch": len(prompts), "prompt_tokens": width,
      "new_tokens_per_row": cfg.max_new_tokens, "tokens_per_s": generated / seconds, "first_call_s": first,
      "compilations": sampler.compilations(), "samples": texts,
  }
  if is_primary():  # the one writer of the run folder
    out.mkdir(parents=True, exist_ok=True)
    (out / "sample.json").write_text(json_dumps(report, indent=2))
  print(f"model: {model_cfg.family}, {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
        f"vocab {model_cfg.vocab_size}, from {folder}")
  for i, text in enumerate(texts[:3]):
    print(f"sample {i}: {text[:160]!r}")
  print(f"batch {len(prompts)} x {cfg.max_new_tokens} new tokens: {report['tokens_per_s']:.0f} tokens/s "
        f"(first call incl. compile {first:.1f} s); report in {out / 'sample.json'}")
  return report
