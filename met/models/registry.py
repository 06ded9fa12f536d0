"""Hugging Face architecture name → met model class."""

from __future__ import annotations

from typing import Any

from met.models.bamba import BambaForCausalLM
from met.models.base import CausalLM
from met.models.deepseek import DeepseekForCausalLM
from met.models.gemma3 import Gemma3ForCausalLM
from met.models.gpt_oss import GptOssForCausalLM
from met.models.llama import LlamaForCausalLM
from met.models.olmo2 import Olmo2ForCausalLM
from met.models.phi3 import Phi3ForCausalLM
from met.models.qwen3_next import Qwen3NextForCausalLM

_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}

# GGUF-derived configs carry a model_type but no architectures list.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "bamba": "BambaForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def model_class_for(config: Any) -> type[CausalLM]:
    """The class that implements ``config.architectures[0]``, or a clear error."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and config.model_type in _MODEL_TYPES:
        archs = [_MODEL_TYPES[config.model_type]]
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {archs or config.model_type!r}; "
        f"met supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
