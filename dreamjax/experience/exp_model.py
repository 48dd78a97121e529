"""A trained experience model on disk: the HF folder `dreamjax train-exp` writes, with `exp_model.json` recording the
format, prompt length, decode budget and retrieval encoder it was trained with, so every user of the model (DreamGym,
fidelity studies) prompts and retrieves exactly as in training."""

from __future__ import annotations

import dataclasses
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


def load_exp_model(folder: str, *, reasoning: bool, replay: bool, dtype: str, mesh
                   ) -> tuple[Any, Any, Any, dict[str, Any], ExpFormatConfig]:
  """(model config, params laid out for sampling, tokenizer, exp_model.json, the format the run uses) of an M_exp
  folder written by `dreamjax train-exp`. `reasoning` is the format the run expects: a mismatch with the folder's is an
  error, so an ablation table cannot silently mix M_exp models up; `replay=False` turns retrieval off."""
  meta_path = Path(folder) / META_FILE
  if not folder or not meta_path.is_file():
    raise ValueError(f"DreamGymConfig.exp_model: {folder} has no {META_FILE}; give a checkpoint folder written by "
                     f"`dreamjax train-exp`")
  meta = json.loads(meta_path.read_text())
  fmt = ExpFormatConfig(**meta["format"])
  if fmt.reasoning != reasoning:
    raise ValueError(f"DreamGymConfig.reasoning is {reasoning} but {meta_path} records format.reasoning="
                     f"{fmt.reasoning}; train the M_exp this run expects (dreamjax train-exp --set format.reasoning="
                     f"{str(reasoning).lower()}) or set reasoning={str(fmt.reasoning).lower()}")
  if not replay:
    fmt = dataclasses.replace(fmt, retrieval=False)
  model_cfg, params = load_hf_checkpoint(folder, mesh=mesh, rules=SAMPLE_RULES, dtype=dtype, param_dtype=dtype)
  return model_cfg, params, load_tokenizer(folder), meta, fmt
