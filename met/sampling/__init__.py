"""Sampling parameters and the batched sampler."""

from met.sampling.params import RepetitionDetection, SamplingParams

__all__ = ["RepetitionDetection", "SamplingParams"]
