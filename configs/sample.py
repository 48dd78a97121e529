"""Sample a chat-formatted batch from a tiny model built on the fly (or from a real HF checkpoint folder).

Run:   dreamjax demo --config configs/demo.py                      (what `make demo` runs)
Real:  dreamjax demo --config configs/demo.py --set checkpoint=/path/to/Qwen2.5-7B-Instruct --set batch=32
"""

from dreamjax.demo import DemoConfig


def config() -> DemoConfig:
  return DemoConfig()
