"""A trained experience model on disk: the HF folder `dreamjax train-exp` writes, with `exp_model.json` recording the
format, prompt length, decode budget and retrieval encoder it was trained with, so every user of the model (DreamGym,
fidelity studies) prompts and retrieves exactly as in training. A folder written before the format had its actions
block (`ExpFormatConfig.actions`) records no such switch: it was trained without the block, and `exp_format` says so
rather than letting the switch's default claim otherwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dreamjax.experience.format import ExpFormatConfig
from dreamjax.models import load_hf_checkpoint
from dreamjax.parallel import SAMPLE_RULES
from dreamjax.replay.encoder import BackbonePooledEncoder, make_encoder
from dreamjax.replay.index import make_index
from dreamjax.replay.retriever import Retriever
from dreamjax.storage import local_copy
from dreamjax.text import load_tokenizer

META_FILE = "exp_model.json"
ENCODERS = ("minilm", "backbone")


def exp_retriever(name: str, encoder_folder: str | Path) -> Retriever:
  """A fresh retriever with the run's phi: MiniLM, or the pooled backbone of the checkpoint in `encoder_folder`.

  Encoder and exact index run on this process's first device: with several processes each one encodes and searches
  the same transitions itself, so nothing crosses processes. (Left to their defaults, `load_hf_checkpoint` and
  `ExactIndex` would use the first device of the whole cluster, which other processes cannot address.)"""
  device = jax.local_devices()[0]
  if name == "minilm":
    encoder = make_encoder("minilm")
  else:
    local = jax.sharding.Mesh(np.asarray([device]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    cfg, params = load_hf_checkpoint(encoder_folder, mesh=local)
    encoder = BackbonePooledEncoder(cfg, params, load_tokenizer(encoder_folder))
  return Retriever(encoder, make_index("auto", encoder.dim, exact_kw={"device": device}))


def exp_format(meta: dict[str, Any]) -> ExpFormatConfig:
  """The format an exp_model.json records; one without the actions switch predates the actions block (False)."""
  return ExpFormatConfig(**({"actions": False} | dict(meta["format"])))


def load_exp_model(folder: str, *, reasoning: bool, replay: bool, dtype: str, mesh, actions: bool = True
                   ) -> tuple[Any, Any, Any, dict[str, Any], ExpFormatConfig]:
  """(model config, params laid out for sampling, tokenizer, exp_model.json, the format the run uses) of an M_exp
  folder written by `dreamjax train-exp`. `reasoning` and `actions` are the format the run expects: a mismatch with the
  folder's is an error, so an ablation table cannot silently mix M_exp models up, and a DreamGym run (whose
  SyntheticEnv needs the actions block) never gets an M_exp that lists no admissible actions; so is `replay` against
  the folder's retrieval switch (the "w/o replay" row's M_exp is trained without retrieval)."""
  folder = str(local_copy(folder, "DreamGymConfig.exp_model")) if folder else folder  # a gs:// folder: a local copy
  meta_path = Path(folder) / META_FILE
  if not folder or not meta_path.is_file():
    raise ValueError(f"DreamGymConfig.exp_model: {folder} has no {META_FILE}; give a checkpoint folder written by "
                     f"`dreamjax train-exp`")
  meta = json.loads(meta_path.read_text())
  fmt = exp_format(meta)
  if fmt.actions != actions:
    raise ValueError(f"{meta_path} records format.actions={str(fmt.actions).lower()} (a folder without the switch "
                     f"predates the actions block), but this run expects actions={str(actions).lower()}: SyntheticEnv "
                     f"shows the policy the admissible actions M_exp predicts each turn, as the real env does; train "
                     f"the M_exp again (dreamjax train-exp, format.actions={str(actions).lower()})")
  if fmt.reasoning != reasoning:
    raise ValueError(f"DreamGymConfig.reasoning is {reasoning} but {meta_path} records format.reasoning="
                     f"{fmt.reasoning}; train the M_exp this run expects (dreamjax train-exp --set format.reasoning="
                     f"{str(reasoning).lower()}) or set reasoning={str(fmt.reasoning).lower()}")
  if fmt.retrieval != replay:
    # The "w/o replay" ablation is an M_exp trained without retrieved examples, not one trained with them and shown
    # none (a different experiment); a run with replay needs an M_exp that was taught to read them.
    raise ValueError(f"DreamGymConfig.replay is {replay} but {meta_path} records format.retrieval={fmt.retrieval}; "
                     f"train the M_exp this run expects (dreamjax train-exp --set format.retrieval="
                     f"{str(replay).lower()}) or set replay={str(fmt.retrieval).lower()}")
  model_cfg, params = load_hf_checkpoint(folder, mesh=mesh, rules=SAMPLE_RULES, dtype=dtype, param_dtype=dtype)
  return model_cfg, params, load_tokenizer(folder), meta, fmt
