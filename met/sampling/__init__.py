"""Sampling parameters and the batched sampler."""

from met.sampling.params import RepetitionDetection, SamplingParams, StructuredOutputs

__all__ = ["RepetitionDetection", "SamplingParams", "StructuredOutputs"]
