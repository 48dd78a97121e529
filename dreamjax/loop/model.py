"""Where a run's model comes from and where it goes: every model passes through an HF folder, a real checkpoint given
in the config or a tiny one built for the run (a BPE trained on the run's own text and a random model), so tiny CPU
runs take the code path a Llama/Qwen checkpoint takes; the trained model is saved as an HF folder again.

A model folder is checked whole before anything is read (`check_model_folder`: config.json, weights, tokenizer.json
and tokenizer_config.json), and commands that start envs (JVMs, browsers) check theirs first (`ModelSource.check`), so
a mistyped path is one line naming it rather than a traceback after the envs started. `save_model` refuses weights
holding a NaN or an infinity, naming the leaf: training skips non-finite updates, so this is the last line of defence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax

from dreamjax.models import ModelConfig, init_params, load_hf_checkpoint, save_hf_checkpoint, tiny
from dreamjax.parallel import TRAIN_RULES, Rules, barrier, is_primary
from dreamjax.rl.train_state import nonfinite_leaves
from dreamjax.storage import local_copy, storage_path
from dreamjax.text import Tokenizer, load_tokenizer, train_bpe_tokenizer
from dreamjax.text.tokenizer import REQUIRED_FILES as TOKENIZER_FILES


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where a run's model comes from: an HF checkpoint folder, or (empty `checkpoint`) a tiny model built for the run."""

  checkpoint: str = ""
  tiny: ModelConfig = tiny("qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32)  # vocab_size is the tokenizer's size
  value_head: bool = False  # PPO's critic; added (zero-initialised) when the checkpoint has none
  # How the loaded model computes (they override the checkpoint's config; the weights stay float32: with bfloat16
  # weights AdamW's steps of lr ~1e-6 on weights ~1e-2 fall below bfloat16's resolution and round away).
  dtype: str = "float32"  # activations and matmuls: "bfloat16" for mixed precision
  remat: str = "none"  # rematerialisation of each layer in the backward pass: "none", "full" or "dots"
  attention_chunk: int = 512  # queries per attention block (ModelConfig.attention_chunk)
  # Train with the layers stacked and scanned (ModelConfig.scan_layers): one layer to compile instead of all of them;
  # the sampler still gets an unrolled copy, and the exported HF folder is the same.
  scan_layers: bool = False

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"ModelSource.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  def check(self, field: str = "ModelSource.checkpoint") -> None:
    """A FileNotFoundError naming `field` when `checkpoint` is set but is not a loadable model folder (cheap: call it
    before starting envs)."""
    if self.checkpoint:
      check_model_folder(self.checkpoint, field)

  def overrides(self) -> dict[str, Any]:
    """What `load_model` applies over the checkpoint's own config."""
    return {"dtype": self.dtype, "remat": self.remat, "attention_chunk": self.attention_chunk,
            "scan_layers": self.scan_layers}


def check_model_folder(folder: str | Path, what: str = "model folder") -> Path:
  """`folder` when it holds what `load_model` reads (config.json, *.safetensors or their index, the tokenizer files);
  else a one-line FileNotFoundError naming `what`, the folder and the missing files. A URI (gs://...) is staged into a
  local folder first (`dreamjax.storage.local_copy`), which is what is returned and read."""
  path = local_copy(folder, what)
  if not path.is_dir():
    raise FileNotFoundError(f"{what}: {str(path)!r} does not exist or is not a folder")
  weights = (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
  missing = [name for name, there in [("config.json", (path / "config.json").is_file()), ("*.safetensors", weights),
                                      *[(n, (path / n).is_file()) for n in TOKENIZER_FILES]] if not there]
  if missing:
    raise FileNotFoundError(f"{what}: {str(path)!r} has no {', '.join(missing)} (a model folder holds config.json, "
                            f"*.safetensors, {' and '.join(TOKENIZER_FILES)})")
  return path


def build_tiny_checkpoint(source: ModelSource, texts: Iterable[str], folder: Path, seed: int) -> Path:
  """A BPE trained on `texts` plus a random model of `source.tiny`'s shape, saved as an HF folder."""
  tok_dir = folder / "tokenizer"
  tokenizer = train_bpe_tokenizer(texts, tok_dir, vocab_size=source.tiny.vocab_size)
  cfg = source.tiny.replace(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_ids[0],
                            value_head=source.value_head)
  save_hf_checkpoint(init_params(cfg, jax.random.key(seed)), cfg, folder, tokenizer_folder=tok_dir)
  return folder


def prepare_model(source: ModelSource, init_folder: str | Path, texts: Callable[[], Iterable[str]], *, seed: int,
                  mesh=None, value_head: bool = False, rebuild: bool = False, rules: Rules = TRAIN_RULES,
                  overrides: Mapping[str, Any] | None = None) -> tuple[Path, ModelConfig, Any, Tokenizer]:
  """(HF folder, config, params, tokenizer) of a run's starting model: `source.checkpoint`, or a tiny model of
  `source.tiny`'s shape with a tokenizer trained on `texts()`, built in `init_folder` when it holds none yet (or
  always, with `rebuild`) and reused by reruns in the same folder. Process 0 alone builds; every process meets the
  barrier, then loads the folder (it must be on a filesystem every process sees)."""
  source.check()
  folder = local_copy(source.checkpoint) if source.checkpoint else Path(init_folder)
  if not source.checkpoint:
    if is_primary() and (rebuild or not (folder / "config.json").is_file()):
      build_tiny_checkpoint(dataclasses.replace(source, value_head=source.value_head or value_head), texts(), folder,
                            seed)
    barrier("init_model")
  cfg, params, tokenizer = load_model(folder, value_head=source.value_head or value_head, mesh=mesh, rules=rules,
                                      seed=seed, overrides=overrides)
  return folder, cfg, params, tokenizer


def load_model(folder: str | Path, *, value_head: bool = False, mesh=None, rules: Rules = TRAIN_RULES,
               seed: int = 0, overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, Any, Tokenizer]:
  """(config, params, tokenizer) from an HF folder; a value head is added zero-initialised when asked and absent.
  `overrides` (ModelConfig fields, e.g. `ModelSource.overrides()`) replace the checkpoint config's."""
  folder = check_model_folder(folder)  # the tokenizer too, before the weights are read
  cfg, params = load_hf_checkpoint(folder, mesh=mesh, rules=rules, **(overrides or {}))
  if value_head and not cfg.value_head:
    cfg = cfg.replace(value_head=True)
    fresh = init_params(cfg, jax.random.key(seed), mesh=mesh, rules=rules)  # the value head initialises to zeros
    params = {**params, "value_head": fresh["value_head"]}
  return cfg, params, load_tokenizer(folder)


def save_model(params: Any, cfg: ModelConfig, tokenizer_folder: str | Path, folder: str | Path,
               dtype: str | None = None) -> Path:
  """Saves a trained model as an HF folder, leaf by leaf in `dtype` (None: the parameters' own; see
  `save_hf_checkpoint`): every process takes part in each leaf's gather (a collective), process 0 alone writes. No
  device holds more than one leaf in full beyond its shards, so the export fits wherever training did. `folder` may be a
  URI (gs://...), `tokenizer_folder` too (read through its staged copy)."""
  folder = storage_path(folder)
  bad = nonfinite_leaves(params)  # every process: a collective, like the gathers below
  if bad:
    raise ValueError(f"save_model ({folder}): refusing to export non-finite weights: {bad[0]!r} holds NaN or infinity"
                     + (f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""))
  return save_hf_checkpoint(params, cfg, folder, tokenizer_folder=local_copy(tokenizer_folder), dtype=dtype,
                            write=is_primary())
