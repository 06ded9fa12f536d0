"""Load a GGUF checkpoint: config, tokenizer and float32 weights under Hugging Face names.

The config and tokenizer come from transformers' own GGUF support (converted once per file and
kept on disk: met.loader.gguf_hf_cache); the file's own metadata
and the weights are read here (met.loader.gguf_file, one pass over a memory map), one tensor at
a time, so that loading a model never holds more than one dequantized tensor beyond what the
caller keeps.

llama.cpp's converter changes some tensors on the way into GGUF; this module undoes that so
every tensor matches the layout of the original Hugging Face checkpoint:

* llama/mistral: the rows of the Q and K projections are permuted from HF's "rotate half"
  rope layout to the interleaved (GPT-J style) layout that ggml's rope kernel uses.
* gemma2/gemma3: every RMSNorm weight is stored as (w + 1), because Gemma's RMSNorm
  multiplies by (1 + w) and ggml's multiplies by w.
* MoE models: each layer's experts are stacked into one [E, ...] tensor.
* phi3: the fused q|k|v and gate|up projections stay fused (``attn_qkv``, ``ffn_up`` of twice
  the width), as in the HF checkpoint; the model splits them at load.

transformers' GGUF config reader drops some of what llama.cpp writes; `_config_from_metadata`
puts it back: Gemma-2's softcaps and attention scale, Phi-3's partial rotary and window. The
architectures it does not read at all (olmo2, granite) get met's own config
(met.loader.gguf_config).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import gguf
import numpy as np
import torch
from transformers import MixtralConfig, PretrainedConfig, PreTrainedTokenizerBase

from met.kernels import gguf_blocks
from met.kernels.gguf_blocks import Blocks
from met.loader.gguf_config import OWN_CONFIGS, own_config
from met.loader.gguf_file import GGUFFile, GGUFTensor, read_gguf
from met.loader.gguf_hf_cache import load_config_and_tokenizer

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "gemma3",
    "phi3",
    "gemma2",
    "olmo2",
    "granite",
)

# Architectures whose Q/K rows llama.cpp permutes to the interleaved rope layout.
# Qwen2/Qwen3/Gemma2/Gemma3/Phi3/OLMo2 use NEOX-style rope in ggml, which matches HF's.
_QK_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral", "granite"})

# Architectures whose RMSNorm weights llama.cpp stores as (w + 1).
_NORM_SHIFTED_ARCHITECTURES = frozenset({"gemma2", "gemma3"})

# Architectures with a pre/post norm pair around both attention and MLP.
_GEMMA_NORM_ARCHITECTURES = frozenset({"gemma2", "gemma3"})

# Phi-3 keeps the checkpoint's fused projections: ffn_up holds gate|up rows.
_PHI3_NAMES: Mapping[str, str] = MappingProxyType(
    {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"})

_TOP_LEVEL_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
)

# Per-layer names shared by every supported architecture (GGUF part -> HF module path).
_BLOCK_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_norm": "input_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate",
    }
)

# The norm around the MLP: llama-like models have one (called post_attention_layernorm in HF),
# Gemma3 has a pre/post pair around both attention and MLP.
_LLAMA_NORM_NAMES: Mapping[str, str] = MappingProxyType({"ffn_norm": "post_attention_layernorm"})
_GEMMA3_NORM_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
)

# OLMo-2 has post-norms only: after attention and after the MLP.
_OLMO2_NORM_NAMES: Mapping[str, str] = MappingProxyType(
    {"post_attention_norm": "post_attention_layernorm",
     "post_ffw_norm": "post_feedforward_layernorm"})

# Stacked MoE expert tensors [E, out, in] -> per-expert projection names.
_EXPERT_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "ffn_gate_exps": "gate_proj",
        "ffn_up_exps": "up_proj",
        "ffn_down_exps": "down_proj",
    }
)

# Tensors that are not parameters of the HF model: llama3's rope_freqs holds the rope-scaling
# factors, which HF recomputes from config.rope_scaling.
_SKIPPED_TENSORS = frozenset({"rope_freqs"})

# Phi-3 LongRoPE's per-frequency factors: transformers' GGUF config keeps no rope scaling,
# so a file that has them would silently run with the plain rope.
_LONGROPE_TENSORS = frozenset({"rope_factors_long", "rope_factors_short"})

_Q = gguf.GGMLQuantizationType
# Bytes per 32-value block: float16 d [, float16 m], then 16 nibble bytes (Q4) or 32 int8s.
_BLOCK_BYTES = {_Q.Q4_0: 18, _Q.Q4_1: 20, _Q.Q8_0: 34}


@dataclass
class GGUFCheckpoint:
    """A GGUF model file opened for loading.

    config and tokenizer are built by transformers from the GGUF metadata; weights() streams
    the parameters, dequantized to float32, under HF transformers' names and shapes.
    """

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    eos_token_ids: list[int]
    path: str

    def weights(self, keep_blocks: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
        """Yield (hf_parameter_name, float32 tensor) pairs, one tensor at a time.

        lm_head.weight is yielded only when the file has its own output.weight; tied models
        reuse model.embed_tokens.weight. MoE experts are yielded one expert at a time as
        model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight. ``keep_blocks``: 2-D
        weights in a kept format (`gguf_blocks.keeps`) come as their `Blocks` instead,
        the file's bytes (rows reordered where llama.cpp permuted them).
        """
        file = read_gguf(self.path)
        arch = _architecture(file)
        n_head = int(file.get(f"{arch}.attention.head_count"))
        n_head_kv = int(file.get(f"{arch}.attention.head_count_kv", n_head))
        block_names = _block_names(arch)
        file.fields.clear()  # the vocabulary is not needed past this point
        for tensor in file.tensors:
            yield from _convert(tensor, arch, block_names, n_head, n_head_kv, keep_blocks)

    def weight_formats(self) -> dict[str, str]:
        """HF parameter name -> ggml type name of every 2-D weight (read from the tensor
        table only: what ``--quantization auto`` decides on before loading)."""
        file = read_gguf(self.path)
        arch = _architecture(file)
        names = _block_names(arch)
        formats = {}
        for tensor in file.tensors:
            name = _hf_name(tensor.name, arch, names)
            if name is not None and len(tensor.shape) == 2:
                formats[name] = tensor.tensor_type.name
        return formats


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open a GGUF file: read its config, tokenizer, chat template and EOS ids.

    Weights are not read here; iterate GGUFCheckpoint.weights() for them.
    Raises ValueError if the file's architecture is not one of SUPPORTED_ARCHITECTURES.
    """
    path = os.fspath(path)
    file = read_gguf(path)
    # Check the architecture before transformers does, so the error names what *we* support.
    _architecture(file)
    eos_keys = (
        gguf.Keys.Tokenizer.EOS_ID,
        gguf.Keys.Tokenizer.EOT_ID,
        gguf.Keys.Tokenizer.EOM_ID,
    )
    eos_token_ids: list[int] = []
    for key in eos_keys:
        token_id = file.get(key)
        if token_id is not None and int(token_id) not in eos_token_ids:
            eos_token_ids.append(int(token_id))
    chat_template = file.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    arch = _architecture(file)
    experts = _MoEMetadata(file.get(f"{arch}.expert_count"),
                           file.get(f"{arch}.expert_used_count"),
                           file.get(f"{arch}.expert_feed_forward_length"))
    rope = gguf_rope_scaling(file)
    fixes = _config_from_metadata(file)
    own = own_config(file, arch) if arch in OWN_CONFIGS else None
    del file  # the memory map of the whole file: dropped before transformers opens its own

    config, tokenizer = load_config_and_tokenizer(path, own)
    config = _moe_config(config, arch, experts)
    for key, value in fixes.items():
        if key == "partial_rotary_factor" and getattr(config, "rope_parameters", None):
            # transformers 5 reads the factor from rope_parameters (there 1.0 by default).
            config.rope_parameters = {**config.rope_parameters, key: value}
        setattr(config, key, value)
    if rope:  # transformers reads only rope.freq_base from a llama-family GGUF
        params = dict(getattr(config, "rope_parameters", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        config.rope_parameters = params | rope
    return GGUFCheckpoint(
        config=config,
        tokenizer=tokenizer,
        chat_template=chat_template,
        eos_token_ids=eos_token_ids,
        path=path,
    )


class _MoEMetadata(NamedTuple):
    count: int | None
    used: int | None
    feed_forward: int | None


def _moe_config(config: PretrainedConfig, arch: str, experts: _MoEMetadata
                ) -> PretrainedConfig:
    """What transformers' GGUF conversion leaves out of MoE configs: qwen3moe's expert width
    (``expert_feed_forward_length``, else moe_intermediate_size keeps the class default),
    and Mixtral, which llama.cpp writes as arch llama with experts."""
    if not experts.count:
        return config
    if arch == "qwen3moe" and experts.feed_forward:
        config.moe_intermediate_size = int(experts.feed_forward)
    if arch == "llama":
        fields = {k: v for k, v in config.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version")}
        fields |= {"num_local_experts": int(experts.count),
                   "num_experts_per_tok": int(experts.used or 2),
                   "intermediate_size": int(experts.feed_forward
                                            or fields["intermediate_size"])}
        mixtral = MixtralConfig(**fields)
        mixtral._name_or_path = getattr(config, "_name_or_path", "")
        return mixtral
    return config
def gguf_rope_scaling(file: GGUFFile) -> dict:
    """Rope scaling from llama.cpp's metadata as rope parameters (met.layers.rotary): the
    ``{arch}.rope.scaling.*`` keys (linear, yarn) and a Llama-3 ``rope_freqs`` tensor, the
    per-frequency divisors llama.cpp computes from the llama3 parameters (kept as
    ``freq_factors``: the parameters themselves are not in the file). {} when unscaled."""
    arch = file.get(gguf.Keys.General.ARCHITECTURE)
    key = lambda name: getattr(gguf.Keys.Rope, name).format(arch=arch)  # noqa: E731
    out: dict = {}
    kind = file.get(key("SCALING_TYPE"))
    factor = file.get(key("SCALING_FACTOR"))
    original = file.get(key("SCALING_ORIG_CTX_LEN"))
    if kind in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        out = {"rope_type": kind, "factor": float(factor)}
        if original:
            out["original_max_position_embeddings"] = int(original)
        for gguf_key, name in (("SCALING_YARN_BETA_FAST", "beta_fast"),
                               ("SCALING_YARN_BETA_SLOW", "beta_slow")):
            if kind == "yarn" and file.get(key(gguf_key)) is not None:
                out[name] = float(file.get(key(gguf_key)))
    elif kind not in (None, "none", "linear", "yarn"):
        raise ValueError(f"{key('SCALING_TYPE')}: {kind!r} is not supported; supported: "
                         "none, linear, yarn")
    freqs = next((t for t in file.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        out["freq_factors"] = [float(v) for v in np.asarray(freqs.data, dtype=np.float32)]
    return out


def _architecture(file: GGUFFile) -> str:
    arch = file.get(gguf.Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _config_from_metadata(file: GGUFFile) -> dict[str, object]:
    """Config fields transformers' GGUF reader leaves at their defaults although llama.cpp
    wrote them (or, for Gemma-2's attention scale, decides them the way llama.cpp does)."""
    arch = _architecture(file)
    out: dict[str, object] = {}
    if arch == "gemma2":
        for key, field in ((gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING, "attn_logit_softcapping"),
                           (gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping")):
            value = file.get(key.format(arch=arch))
            out[field] = None if value is None else float(value)
        # llama.cpp writes no query_pre_attn_scalar: it scales by 1/sqrt(head_dim), except
        # for the 46-layer 27B model, which uses 1/sqrt(hidden / heads) (as its config does).
        n_head = int(file.get(f"{arch}.attention.head_count"))
        hidden = int(file.get(f"{arch}.embedding_length"))
        head_dim = int(file.get(f"{arch}.attention.key_length", hidden // n_head))
        layers = int(file.get(f"{arch}.block_count"))
        out["query_pre_attn_scalar"] = hidden // n_head if layers == 46 else head_dim
    if arch == "phi3":
        n_head = int(file.get(f"{arch}.attention.head_count"))
        head_dim = int(file.get(f"{arch}.attention.key_length",
                                int(file.get(f"{arch}.embedding_length")) // n_head))
        rotary = file.get(gguf.Keys.Rope.DIMENSION_COUNT.format(arch=arch))
        if rotary is not None and int(rotary) != head_dim:
            out["partial_rotary_factor"] = int(rotary) / head_dim
        window = file.get(gguf.Keys.Attention.SLIDING_WINDOW.format(arch=arch))
        if window:
            out["sliding_window"] = int(window)
        longrope = sorted({t.name.rsplit(".", 1)[0] for t in file.tensors} & _LONGROPE_TENSORS)
        if longrope:
            raise ValueError(f"GGUF phi3 file has LongRoPE factors ({', '.join(longrope)}); "
                             "met does not read LongRoPE from GGUF yet")
    return out


def _block_names(arch: str) -> dict[str, str]:
    norms = (_GEMMA3_NORM_NAMES if arch in _GEMMA_NORM_ARCHITECTURES
             else _OLMO2_NORM_NAMES if arch == "olmo2" else _LLAMA_NORM_NAMES)
    extra = _PHI3_NAMES if arch == "phi3" else {}
    return {**_BLOCK_NAMES, **norms, **extra}


def _hf_name(gguf_name: str, arch: str, block_names: Mapping[str, str]) -> str | None:
    """The HF parameter a (non-expert) GGUF tensor fills; None for experts and skips."""
    base, kind = gguf_name.rsplit(".", 1)
    if base in _SKIPPED_TENSORS:
        return None
    if not base.startswith("blk."):
        return f"{_TOP_LEVEL_NAMES[base]}.{kind}" if base in _TOP_LEVEL_NAMES else None
    _, layer, part = base.split(".", 2)
    if part not in block_names:
        return None
    return f"model.layers.{int(layer)}.{block_names[part]}.{kind}"


def _convert(
    tensor: GGUFTensor,
    arch: str,
    block_names: Mapping[str, str],
    n_head: int,
    n_head_kv: int,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
    """Map one GGUF tensor to the HF parameter(s) it holds, undoing llama.cpp's changes."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if keep_blocks and gguf_blocks.keeps(tensor.tensor_type, shape):
        name = _hf_name(tensor.name, arch, block_names)
        if name is not None:
            yield name, _blocks(tensor, name, arch, n_head, n_head_kv)
            return
    base, kind = tensor.name.rsplit(".", 1)  # kind is "weight" or "bias"
    if base in _SKIPPED_TENSORS:
        return
    if not base.startswith("blk."):
        if base not in _TOP_LEVEL_NAMES:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r} for architecture {arch!r}")
        hf_name = f"{_TOP_LEVEL_NAMES[base]}.{kind}"
        yield hf_name, _fix_norm(_dequantize(tensor.data, tensor), hf_name, arch)
        return

    _, layer, part = base.split(".", 2)
    prefix = f"model.layers.{int(layer)}"
    if part in _EXPERT_NAMES:
        # Expert by expert: the stacked tensor can be far bigger than one expert. Kept as
        # blocks (each expert's rows as the file stores them) or dequantized one at a time.
        keep = keep_blocks and gguf_blocks.keeps(tensor.tensor_type, shape[1:])
        for expert in range(tensor.data.shape[0]):
            if keep:
                data = torch.from_numpy(np.array(tensor.data[expert], dtype=np.uint8, copy=True))
                weight = Blocks(int(tensor.tensor_type), data, int(tensor.shape[0]))
            else:
                weight = _dequantize(tensor.data[expert], tensor, leading_dims_dropped=1)
            yield f"{prefix}.mlp.experts.{expert}.{_EXPERT_NAMES[part]}.{kind}", weight
        return
    if part not in block_names:
        raise ValueError(f"unexpected GGUF tensor {tensor.name!r} for architecture {arch!r}")

    hf_name = f"{prefix}.{block_names[part]}.{kind}"
    parsed = _parse_blocks(np.asarray(tensor.data), tensor.tensor_type)  # once, for both
    weight = _dequantize(tensor.data, tensor, parsed=parsed)
    blocks = q4_blocks(tensor, parsed)
    if arch in _QK_PERMUTED_ARCHITECTURES and part in ("attn_q", "attn_k"):
        heads = n_head if part == "attn_q" else n_head_kv
        weight = _unpermute_qk(weight, heads)
        if blocks is not None:
            blocks = Q4Blocks(*(_unpermute_qk(x, heads) for x in blocks))
    weight = _fix_norm(weight, hf_name, arch)
    if blocks is not None:
        weight.q4_blocks = blocks  # type: ignore[attr-defined]  (kept by load_weights)
    yield hf_name, weight


def _blocks(tensor: GGUFTensor, name: str, arch: str, n_head: int, n_head_kv: int
            ) -> Blocks:
    """The tensor's bytes as `Blocks` (copied out of the memory map), llama.cpp's Q/K row
    permutation undone on whole rows."""
    data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
    if arch in _QK_PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight",
                                                             "k_proj.weight")):
        heads = n_head if "q_proj" in name else n_head_kv
        data = _unpermute_qk(data, heads).contiguous()
    return Blocks(int(tensor.tensor_type), data, int(tensor.shape[0]))


class Q4Blocks(NamedTuple):
    """A Q4_0 / Q4_1 matrix as its integers: ``w[n, k] = q[n, k] · scale[n, k // 32] +
    minimum[n, k // 32]`` (exactly what the file stores, for int4 weight-only kernels)."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / 32]
    minimum: torch.Tensor  # float32 [N, K / 32]


def q4_blocks(tensor: GGUFTensor, parsed: _Blocks | None = None) -> Q4Blocks | None:
    """The integers of a 2-D Q4_0 / Q4_1 tensor (None for any other type); ``parsed``: its
    data's `_parse_blocks`, when the caller has it already."""
    kind = tensor.tensor_type
    if kind not in (_Q.Q4_0, _Q.Q4_1) or np.ndim(tensor.data) != 2:
        return None
    if parsed is None:
        parsed = _parse_blocks(np.asarray(tensor.data), kind)
    rows = tensor.data.shape[0]
    scale = parsed.d.reshape(rows, -1)
    # Q4_0: w = scale · (q − 8)
    minimum = parsed.m.reshape(rows, -1) if parsed.m is not None else -8.0 * scale
    return Q4Blocks(parsed.q.reshape(rows, -1), scale, minimum)


def _dequantize(
    data: np.ndarray, tensor: GGUFTensor, leading_dims_dropped: int = 0,
    parsed: _Blocks | None = None,
) -> torch.Tensor:
    """Dequantize raw GGUF data to a float32 torch tensor in HF (row-major, [out, in]) shape.

    ggml lists dimensions innermost first, so the torch shape is the GGUF shape reversed.
    leading_dims_dropped says how many outer dimensions `data` has already been indexed away;
    parsed is `data`'s `_parse_blocks` when the caller has it.
    """
    shape = tuple(int(d) for d in reversed(tensor.shape))[leading_dims_dropped:]
    if parsed is None:
        parsed = _parse_blocks(np.asarray(data), tensor.tensor_type)
    if parsed is not None:
        return _dequantize_parsed(parsed).reshape(shape)
    array = np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
    if not array.flags.writeable:
        # F32 tensors come back as views of the read-only memory map; copy so the tensor owns
        # writable memory and the file can be closed.
        array = array.copy()
    return torch.from_numpy(array.reshape(shape))


class _Blocks(NamedTuple):
    """Q4_0 / Q4_1 / Q8_0 data as torch tensors, one row per 32-value block."""

    kind: gguf.GGMLQuantizationType
    q: torch.Tensor  # [blocks, 32]: uint8 0..15 (values 0-15, then 16-31) or int8 (Q8_0)
    d: torch.Tensor  # float32 [blocks, 1]
    m: torch.Tensor | None  # float32 [blocks, 1] (Q4_1's minimum), else None


def _parse_blocks(raw: np.ndarray, kind: gguf.GGMLQuantizationType) -> _Blocks | None:
    """Split raw Q4_0 / Q4_1 / Q8_0 bytes into integers and scales (None for other types)."""
    size = _BLOCK_BYTES.get(kind)
    if size is None:
        return None
    raw = np.ascontiguousarray(raw)
    if not raw.flags.writeable:  # a view of the file's read-only memory map
        raw = raw.copy()
    blocks = torch.from_numpy(raw.reshape(-1, size))
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if kind == _Q.Q8_0:
        return _Blocks(kind, blocks[:, 2:].contiguous().view(torch.int8), d, None)
    nibbles = blocks[:, size - 16:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float() if kind == _Q.Q4_1 else None
    return _Blocks(kind, q, d, m)


def _dequantize_parsed(blocks: _Blocks) -> torch.Tensor:
    """float32 [blocks, 32] with torch (all cores, no per-block numpy temporaries): the
    float32 operations of gguf-py's dequantize_blocks, in its order, so the same values (~6x
    faster; ~0.7 s of the embedded model's startup)."""
    if blocks.kind == _Q.Q8_0:
        return blocks.q.float() * blocks.d
    if blocks.kind == _Q.Q4_0:
        return blocks.d * (blocks.q.to(torch.int8) - 8).float()
    return blocks.d * blocks.q.float() + blocks.m


def _unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (works for weights [out, in] and biases [out]).

    Within each head HF orders rows as [first half | second half] of the rotary dims; llama.cpp
    interleaves them (row 2i is first-half row i, row 2i+1 is second-half row i).
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    rest = weight.shape[1:]
    return weight.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _fix_norm(weight: torch.Tensor, hf_name: str, arch: str) -> torch.Tensor:
    """Undo the +1 llama.cpp adds to Gemma's norm weights (every `*norm.weight`)."""
    if arch in _NORM_SHIFTED_ARCHITECTURES and hf_name.endswith("norm.weight"):
        return weight - 1.0
    return weight
