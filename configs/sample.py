"""Sample a chat-formatted batch from a tiny model built on the fly (or from a real HF checkpoint folder); tokens/s.

Run:   dreamjax sample --config configs/sample.py
Real:  dreamjax sample --config configs/sample.py --set checkpoint=/path/to/Qwen2.5-7B-Instruct --set batch=32
"""

from dreamjax.sample_report import SampleConfig


def config() -> SampleConfig:
  return SampleConfig()
