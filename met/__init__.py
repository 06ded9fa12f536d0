"""met: an LLM inference engine on PyTorch — paged, prefix-cached KV, continuous batching."""

from met.llm import LLM
from met.outputs import CompletionOutput, RequestOutput
from met.sampling.params import SamplingParams, StructuredOutputs
from met.sampling.pooling import PoolingParams
from met.sampling.thinking import ThinkingBudget

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "PoolingParams", "RequestOutput", "SamplingParams",
           "StructuredOutputs", "ThinkingBudget", "__version__"]
