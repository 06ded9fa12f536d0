"""Model argument → ready model on its device, plus tokenizer, chat template and EOS ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from met.kernels.registry import KernelPlan, LinearSpec
from met.kernels.registry import plan as plan_kernels
from met.layers.rotary import model_length_limit, rope_prefix_key
from met.loader.auto_quant import choose_gguf_blocks, choose_quantization
from met.loader.checkpoint_quant import dequantized_weights
from met.loader.resolve import ModelSource, resolve_model
from met.loader.safetensors_dir import config_eos_ids, generation_eos_ids, iter_safetensors
from met.models.base import CausalLM
from met.models.registry import model_class_for

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: Any
    tokenizer: Any | None
    chat_template: str | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    source: ModelSource
    quantization: str | None = None  # what the model runs with ("auto" already decided)
    kernel_plan: KernelPlan | None = None  # the linear method and attention backend chosen

    def rope_key(self, prompt_len: int) -> tuple:
        """The prefix-cache extra key a prompt of ``prompt_len`` tokens gets from the model's
        rope: () unless a length-dependent rope scales it (met.layers.rotary)."""
        return rope_prefix_key(self.model, prompt_len)


def _size(path) -> str:
    """A checkpoint's bytes on disk, for the log line that says what is being read."""
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    return f"{sum(p.stat().st_size for p in files) / 2**20:.0f} MiB"


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None, cache_dir: str | None = None,
               quantization: str | None = None, max_num_seqs: int = 64,
               dtype_from_auto: bool = False, linear_backend: str = "auto",
               attention_backend: str = "auto") -> LoadedModel:
    """Resolve, read config/tokenizer, build the model class and load weights into it.

    quantization is "int8", "int4", "w8a8", "w4a8", "gguf", None, or "auto" (decided here
    from the GGUF tensor table, or from the loaded weights and ``max_num_seqs``, the most
    sequences the engine will decode at once;
    ``dtype_from_auto``: the dtype is ``--dtype auto``'s pick, not one asked for by name).
    ``linear_backend`` / ``attention_backend``: registry entries forced by name (a forced
    entry that cannot run here is a ValueError saying why, before any weight is read).
    """
    if quantization != "auto":  # fail fast on a forced entry this machine cannot run
        plan_kernels(LinearSpec(quantization, dtype, device.type), linear_backend,
                     attention_backend)
    source = resolve_model(model, cache_dir)
    log.info("reading %s (%s)", source.path, _size(source.path))
    if source.kind == "gguf":
        from met.loader.gguf import load_gguf

        ckpt = load_gguf(source.path)
        if quantization == "auto":  # gguf is decided from the tensor table, before loading
            early = choose_gguf_blocks(ckpt.weight_formats(), device, dtype)
            if early is not None:
                log.info("quantization auto → %s", early.reason)
                quantization = early.quantization
        config, tokenizer = ckpt.config, ckpt.tokenizer
        weights = ckpt.weights(keep_blocks=quantization == "gguf")
        chat_template = ckpt.chat_template
        eos = set(ckpt.eos_token_ids)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(source.path))
        if _is_multimodal(config):  # e.g. Gemma 3 4B+: serve its text model
            config = config.text_config
        tokenizer = _load_tokenizer(source.path)
        chat_template = getattr(tokenizer, "chat_template", None) if tokenizer else None
        weights = dequantized_weights(iter_safetensors(source.path), config)
        eos = set(generation_eos_ids(source.path)) | set(config_eos_ids(config))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))

    cls = model_class_for(config)
    trained = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
    limit, why = model_length_limit(config)
    if max_model_len is not None and max_model_len > limit:
        scales = "" if limit > trained else "; its rope does not scale past the trained length"
        raise ValueError(f"max_model_len (--max-model-len): {max_model_len} exceeds the model's "
                         f"limit of {limit} tokens ({why}{scales})")
    max_len = max_model_len or trained
    with torch.device(device):
        net = cls(config, dtype, max_positions=max_len)
    net.load_weights(weights)
    if quantization == "auto":
        choice = choose_quantization(net, dtype, device, max_num_seqs, dtype_from_auto)
        log.info("quantization auto → %s", choice.reason)
        quantization = choice.quantization
    plan = plan_kernels(LinearSpec(quantization, dtype, device.type), linear_backend,
                        attention_backend)
    log.info("%s", plan.describe())
    net.prepare(quantization, plan.linear.kernel)
    net.eval()
    log.info("loaded %s (%s, quantization %s) from %s: weights take %.1f MiB",
             type(net).__name__, dtype, quantization or "none", source.path,
             net.weight_bytes() / 2**20)
    return LoadedModel(net, config, tokenizer, chat_template, frozenset(eos), max_len, source,
                       quantization, plan)


def _is_multimodal(config: Any) -> bool:
    return getattr(config, "text_config", None) is not None


def _load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts only)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                              "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
