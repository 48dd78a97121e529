"""Batched jitted sampling with per-row settings, stop sequences and log-probs."""

from dreamjax.sampling.logits import choose_tokens, truncation_mask
from dreamjax.sampling.sampler import SampleOutput, Sampler, SamplingParams, left_pad, sampling_params

__all__ = ["choose_tokens", "truncation_mask", "SampleOutput", "Sampler", "SamplingParams", "left_pad", "sampling_params"]
