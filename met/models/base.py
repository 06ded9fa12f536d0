"""What every model family provides to the runner, and shared weight-loading logic."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from met.config import QUANTIZATIONS
from met.kernels.gguf_blocks import Blocks
from met.layers.attention import KVCache
from met.layers.batch import ForwardBatch
from met.layers.linear import Linear, LMHead, attach_blocks, blocks_of
from met.layers.mamba import MambaLayout
from met.layers.moe import ExpertStack


class CausalLM(nn.Module):
    """Base class: forward() gives hidden states, compute_logits() the float32 logits.

    Subclasses set ``kv_layout`` = (num_layers, num_kv_heads, head_dim) so the runner can
    size the paged KV cache, and build modules whose parameter names match Hugging Face
    checkpoints, so loading is a name lookup.
    """

    kv_layout: tuple[int, int, int]
    # Hybrid models (attention + state-space layers) set the shape of their per-request
    # recurrent state; the runner then keeps state rows beside the KV (met.layers.mamba).
    state_layout: MambaLayout | None = None
    # The value rows' width in the cache: None as wide as the keys (head_dim); 0 no values
    # (MLA: one latent "head" per token, keys and values both derived from it).
    kv_v_head_dim: int | None = None
    tie_word_embeddings: bool = False
    # Prompt rows attend one by one through the decode kernel (ForwardBatch.row_attention):
    # set by prepare() for w8a8 and w4a8.
    row_attention: bool = False
    # Float32 activations take the fused element-wise ops (set by prepare() when quantized).
    fused_float32: bool = False

    @property
    def prompt_rows_first(self) -> bool:
        """Whether forward() computes prompt positions through other kernels than generated
        ones (`ForwardBatch.prompt_rows`): under w4a8 with AMX-BF16, prompt rows multiply
        the 4-bit weights dequantized to bfloat16, about twice as fast at many rows as
        int8 activations. A position's kernel then follows from the position alone, so the
        runner puts prompt chunks first, the scheduler never chunks across the prompt's
        end, and the prefix cache keeps generated blocks apart: a row's output still does
        not depend on its batch, its chunking or a cache hit."""
        return False

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        """Hidden states [T, hidden] for the flat batch, writing its KV into kv_caches: the
        plain path (embedding, each layer over its cache, final norm) unless overridden."""
        x = self.model.embed_tokens(batch.input_ids)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, batch, kv)
        return self.model.norm(x)

    def set_lm_head(self, config: Any, dtype: torch.dtype, tied_default: bool = False) -> None:
        """The LM head: the embedding table when the config ties them, else its own
        projection (`prepare` turns either into an `LMHead`)."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tied_default))
        self.lm_head = (self.model.embed_tokens if self.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, False, dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the selected hidden rows."""
        if isinstance(self.lm_head, LMHead):
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()

    def prepare(self, quantization: str | None = None, kernel: str | None = "auto") -> None:
        """After loading: fuse projections that share an input (q/k/v, gate/up), give the
        model its LM head, and with ``quantization`` ("int8", "int4", "w8a8", "w4a8" or
        "gguf") make every
        linear layer (and the head) quantized, run by the native extension ``kernel`` (the
        linear method's, `met.kernels.registry`; None: PyTorch ops)."""
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)} or "
                             f"None, got {quantization!r}")
        for module in list(self.modules()):
            fuse = getattr(module, "fuse_projections", None)
            if fuse is not None:
                fuse()
        self.lm_head = LMHead(self.lm_head.weight, quantization, kernel)  # 8-bit when quantized
        self.row_attention = quantization in ("w8a8", "w4a8")
        # A quantized model is not the exact float32 reference: its float32 activations may
        # take the fused element-wise ops too (met/kernels/fused_ops.py).
        # gguf sums in float32 over the file's own values: a float32 model stays the exact
        # reference, on the plain element-wise ops.
        self.fused_float32 = quantization not in (None, "gguf")
        if quantization is not None:
            for module in self.modules():
                if isinstance(module, Linear):
                    module.quantize(quantization, kernel)
        for module in self.modules():  # GGUF experts loaded as blocks run on them
            if isinstance(module, ExpertStack):
                module.keep_blocks(kernel)
        for param in self.parameters():  # the GGUF integers were needed only for int4
            if getattr(param, "q4_blocks", None) is not None:
                param.q4_blocks = None
        for module in self.modules():  # bfloat16 on CPU: oneDNN's weight layout, once
            if isinstance(module, (Linear, LMHead)):
                module.pack()

    def first_layers(self, n: int) -> CausalLM:
        """This model cut after its first ``n`` decoder layers, then its final norm and LM
        head: self-speculation's draft. It shares every weight (no copy); its KV layout has
        ``n`` layers, so it runs on its own small cache."""
        layers = self.model.layers
        if not 1 <= n < len(layers):
            raise ValueError(f"speculative_config.num_draft_layers: must be in [1, "
                             f"{len(layers) - 1}] for this {len(layers)}-layer model, got {n}")
        backbone = copy.copy(self.model)
        backbone._modules = dict(self.model._modules)
        backbone.layers = nn.ModuleList(list(layers)[:n])
        draft = copy.copy(self)
        # Cached execution plans (fused layers, native stacks) were derived from all layers.
        draft.__dict__ = {k: v for k, v in self.__dict__.items()
                          if not isinstance(getattr(type(self), k, None),
                                            functools.cached_property)}
        draft._modules = dict(self._modules)
        draft._modules["model"] = backbone
        draft.kv_layout = (n, *self.kv_layout[1:])
        return draft

    def weight_bytes(self) -> int:
        """Bytes the weights take: parameters and buffers, plus GGUF blocks (each storage
        counted once: a tied head and its embedding table share theirs)."""
        seen: dict[int, int] = {}
        tensors = list(self.parameters()) + list(self.buffers())
        for module in self.modules():
            tensors += [s.data for s in getattr(module, "segments", ())]
            tensors += [t for t in vars(module).values() if isinstance(t, torch.Tensor)]
        for t in tensors:
            for s in blocks_of(t) or ():
                seen[s.data.untyped_storage().data_ptr()] = s.data.untyped_storage().nbytes()
            try:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (NotImplementedError, RuntimeError):  # oneDNN's packed copies: no storage
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name → parameter name; None skips the tensor. Override to rename."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters; fail naming any parameter left unset."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = self.map_weight_name(ckpt_name)
            if name is None:
                continue
            filled = self.load_special_weight(name, tensor, params)
            if filled:
                loaded.update(filled)
                continue
            if name not in params:
                if name.startswith("lm_head.") and self.tie_word_embeddings:
                    continue
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} matches no parameter of the model"
                )
            param = params[name]
            if isinstance(tensor, Blocks):  # kept quantized (`--quantization gguf`)
                if (tensor.rows, tensor.cols) != tuple(param.shape):
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name!r} has shape "
                        f"{(tensor.rows, tensor.cols)}, the model expects {tuple(param.shape)}")
                attach_blocks(param, [tensor])
                loaded.add(name)
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            # A GGUF Q4 tensor's integers, for an exact int4 weight-only layer later.
            param.q4_blocks = getattr(tensor, "q4_blocks", None)
            loaded.add(name)
        missing = [n for n in params if n not in loaded and not self._is_tied(n)]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")

    def load_special_weight(
        self, name: str, tensor: torch.Tensor, params: dict[str, Any]
    ) -> list[str]:
        """Hook for tensors that fill part of a parameter (stacked experts).

        Returns the names of the parameters it filled; empty when the tensor is not special.
        """
        return []

    def _is_tied(self, name: str) -> bool:
        return self.tie_word_embeddings and name == "lm_head.weight"


def config_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
