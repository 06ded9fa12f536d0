"""Sampling parameters and the batched sampler."""

from met.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
