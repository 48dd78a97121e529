"""Sample a chat-formatted batch from a tiny model built on the fly (or from a real HF checkpoint folder); tokens/s.

Run:   dreamjax sample --config configs/sample.py
Real:  dreamjax sample --config configs/sample.py --set checkpoint=/path/to/Qwen2.5-7B-Instruct --set batch=32
Tiny (CPU, seconds): a smaller 2-layer model, 4 rows of 16 new tokens:
       dreamjax sample --config configs/sample.py:tiny
"""

from dreamjax.commands.sample import SampleConfig
from dreamjax.models import tiny as tiny_model


def config() -> SampleConfig:
  return SampleConfig()


def tiny() -> SampleConfig:
  return SampleConfig(
      out_dir="runs/sample/tiny",
      model=tiny_model("qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=32),
      batch=4,
      max_new_tokens=16,
  )
