"""Sampling parameters and the batched sampler."""

from met.sampling.params import RepetitionDetection, SamplingParams, StructuredOutputs
from met.sampling.thinking import ThinkingBudget

__all__ = ["RepetitionDetection", "SamplingParams", "StructuredOutputs", "ThinkingBudget"]
