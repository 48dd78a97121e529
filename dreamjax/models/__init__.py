"""The Llama 3 / Qwen2 Flax transformer, its configs, parameters and HF checkpoint import/export."""

from dreamjax.models.config import ModelConfig, RopeScaling, from_hf_config, load_hf_config, tiny, to_hf_config
from dreamjax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from dreamjax.models.params import abstract_params, init_params, param_shardings
from dreamjax.models.transformer import KVCache, ModelOutput, Transformer

__all__ = [
    "ModelConfig", "RopeScaling", "from_hf_config", "load_hf_config", "tiny", "to_hf_config", "load_hf_checkpoint",
    "save_hf_checkpoint", "abstract_params", "init_params", "param_shardings", "KVCache", "ModelOutput",
    "Transformer",
]
