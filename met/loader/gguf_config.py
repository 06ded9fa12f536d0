"""Configs of the GGUF architectures transformers' GGUF reader does not know (olmo2,
granite), built here from llama.cpp's metadata keys.

Every field the file states is set even where it equals the config class's default (those
defaults are one checkpoint's values). The tokenizer of such a file is built by
`met.loader.gguf_hf_cache`, which needs no architecture for it.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import GraniteConfig, Olmo2Config, PretrainedConfig

from met.loader.gguf_file import GGUFFile


def _common(file: GGUFFile, arch: str) -> dict:
    """The llama-shaped fields every architecture here writes (no head_dim: both take
    hidden / heads, as llama.cpp's converter does)."""

    def key(name: str, default: object = None) -> object:
        value = file.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF {arch} file has no {arch}.{name}")
        return value

    n_head = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = file.get(f"{arch}.vocab_size") or len(file.get("tokenizer.ggml.tokens") or ())
    tensors = {t.name for t in file.tensors}
    return {
        "max_position_embeddings": int(key("context_length")),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(key("attention.head_count_kv", n_head)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": float(key("rope.freq_base", 10000.0))},
        "vocab_size": int(vocab),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": file.get("tokenizer.ggml.padding_token_id"),
    }


def _olmo2(file: GGUFFile) -> PretrainedConfig:
    fields = _common(file, "olmo2")
    bias = any(t.name.endswith("attn_q.bias") for t in file.tensors)
    return Olmo2Config(**fields, attention_bias=bias, architectures=["Olmo2ForCausalLM"])


def _granite(file: GGUFFile) -> PretrainedConfig:
    fields = _common(file, "granite")

    def scale(name: str) -> float:
        value = file.get(f"granite.{name}")
        return 1.0 if value is None else float(value)

    # The four multipliers, written by llama.cpp as scales (1.0 when absent).
    return GraniteConfig(**fields, embedding_multiplier=scale("embedding_scale"),
                         attention_multiplier=scale("attention.scale"),
                         residual_multiplier=scale("residual_scale"),
                         logits_scaling=scale("logit_scale"),
                         architectures=["GraniteForCausalLM"])


OWN_CONFIGS: dict[str, Callable[[GGUFFile], PretrainedConfig]] = {
    "olmo2": _olmo2,
    "granite": _granite,
}


def own_config(file: GGUFFile, arch: str) -> PretrainedConfig:
    """The config of a ``file`` whose ``arch`` is one of OWN_CONFIGS."""
    return OWN_CONFIGS[arch](file)
