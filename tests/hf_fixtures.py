"""Tiny random transformers models (torch) used as parity references."""

from pathlib import Path

import numpy as np

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def make_tiny_hf_model(family: str, seed: int = 0):
  import torch
  import transformers

  torch.manual_seed(seed)
  if family == "llama":
    # Llama 3.2 style: tied embeddings and Llama 3 rope scaling (small original context so every band is exercised).
    cfg = transformers.LlamaConfig(
        **TINY, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = transformers.LlamaForCausalLM(cfg)
  else:
    cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    model = transformers.Qwen2ForCausalLM(cfg)
  with torch.no_grad():  # random biases and norm scales, so a mapping mistake cannot hide behind zeros and ones
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
  return model.eval()


def save_tiny_hf_model(family: str, folder: Path, seed: int = 0):
  make_tiny_hf_model(family, seed).save_pretrained(folder)


def hf_logits(folder: Path, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    kwargs = {}
    if attention_mask is not None:
      kwargs["attention_mask"] = torch.tensor(attention_mask)
    return model(torch.tensor(tokens), **kwargs).logits.numpy()
