"""Batched jitted sampling with per-row settings, stop sequences and log-probs."""

from dreamjax.sampling.logits import choose_tokens, truncation_mask, verify_draft
from dreamjax.sampling.sampler import (
    KVReuse,
    SPECULATION_KEYS,
    SampleOutput,
    Sampler,
    SamplingParams,
    SpeculativeConfig,
    count_speculation,
    left_pad,
    prompt_lookup,
    sampling_params,
    speculation_rates,
)

__all__ = ["SPECULATION_KEYS", "KVReuse", "choose_tokens", "truncation_mask", "verify_draft", "SampleOutput", "Sampler",
           "SamplingParams", "SpeculativeConfig", "count_speculation", "left_pad", "prompt_lookup", "sampling_params",
           "speculation_rates"]
