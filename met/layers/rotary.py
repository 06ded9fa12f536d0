"""Rotary position embeddings (half-rotation layout, as in Hugging Face checkpoints).

Rope types (``rope_type`` in a rope parameter dict, as transformers names them): default,
linear, llama3 and yarn change the frequencies once, so cos/sin are tabulated once. dynamic
(NTK) and longrope depend on the sequence length: transformers takes it from the batch's
highest position on every forward and keeps the keys already in its KV cache as they were
rotated, so in ``generate`` the prompt is rotated for the prompt's length and each
generated token for the length it makes. met gives every token that length from its own
request (``ForwardBatch.rope_seq_lens``: max(prompt length, position + 1)): exactly
transformers' generate for one sequence, and the same however the prompt is chunked or
batched (transformers' rule would make a row depend on its batch mates). Prefix-cache
blocks of such a model carry the prompt's rope state (`rope_prefix_key`) so a hit is
served only KV rotated as a miss would rotate it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Rope types whose frequencies depend on the sequence length (see the module docstring).
LENGTH_DEPENDENT_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def rope_type_of(params: dict[str, Any]) -> str:
    """The rope type of a parameter dict (transformers 5 ``rope_type``, 4.x ``type``)."""
    return params.get("rope_type", params.get("type", "default")) or "default"


def _need(params: dict[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise ValueError(f"rope_parameters.{key}: required for rope_type "
                         f"{rope_type_of(params)!r}, missing from the config")
    return value


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def rope_inv_freq(head_dim: int, params: dict[str, Any], seq_len: int | None = None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale for a rope parameter dict.

    ``head_dim`` is the rotated width (e.g. DeepSeek's qk_rope_head_dim; a partial rotary
    factor is the caller's to apply). ``params`` as `rope_parameters` returns them (the
    lengths these types need filled in). ``seq_len``: the sequence length, for the
    length-dependent types (dynamic, longrope); None means within the original length.
    """
    rope_type = rope_type_of(params)
    base = float(_need(params, "rope_theta"))
    inv_freq = 1.0 / (base ** _exponents(head_dim))
    if rope_type == "default":
        factors = params.get("freq_factors")
        if factors is None:
            return inv_freq, 1.0
        # A Llama-3 GGUF's rope_freqs tensor (met.loader.gguf): one divisor per frequency.
        if len(factors) != head_dim // 2:
            raise ValueError(f"rope_parameters.freq_factors: has {len(factors)} entries, the "
                             f"rotary dimension needs head_dim // 2 = {head_dim // 2}")
        return inv_freq / torch.tensor(factors, dtype=torch.float32), 1.0
    if rope_type == "linear":
        return inv_freq / float(_need(params, "factor")), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "dynamic":
        if seq_len is None:
            return inv_freq, 1.0
        return dynamic_inv_freq(head_dim, params, torch.tensor([seq_len]))[0], 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, params)
    if rope_type == "longrope":
        return _longrope(head_dim, base, params, seq_len)
    raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported; "
                     f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = _need(params, "factor")
    low, high = _need(params, "low_freq_factor"), _need(params, "high_freq_factor")
    old_len = _need(params, "original_max_position_embeddings")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def dynamic_inv_freq(head_dim: int, params: dict[str, Any], seq_lens: torch.Tensor
                     ) -> torch.Tensor:
    """Dynamic NTK inverse frequencies [len(seq_lens), head_dim // 2]: the base grows as
    ``base * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))`` for a length L past the
    original length L0, in float32 tensor arithmetic as transformers computes it."""
    factor = float(_need(params, "factor"))
    original = int(_need(params, "original_max_position_embeddings"))
    base = float(_need(params, "rope_theta"))
    lengths = torch.clamp(seq_lens.to(torch.int64).cpu(), min=original)
    grown = base * ((factor * lengths / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (grown[:, None] ** _exponents(head_dim)[None, :])


def _yarn(head_dim: int, base: float, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(_need(params, "factor"))
    original = _need(params, "original_max_position_embeddings")
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale)
                                     / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength turns ``rotations`` times over the original length.
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1); MLA
    models also fold it into the softmax scale through ``mscale_all_dim``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _longrope(head_dim: int, base: float, params: dict[str, Any], seq_len: int | None
              ) -> tuple[torch.Tensor, float]:
    original = int(_need(params, "original_max_position_embeddings"))
    factor = float(_need(params, "factor"))
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    key = "long_factor" if seq_len and seq_len > original else "short_factor"
    ext = _need(params, key)
    if len(ext) != head_dim // 2:
        raise ValueError(f"rope_parameters.{key}: has {len(ext)} entries, the rotary "
                         f"dimension needs head_dim // 2 = {head_dim // 2}")
    ext_factors = torch.tensor(ext, dtype=torch.float32)
    return 1.0 / (ext_factors * base ** _exponents(head_dim)), float(attention_factor)


def _tables(inv_freq: torch.Tensor, max_positions: int, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(max_positions, dtype=torch.float32)
    emb = _emb(pos[:, None] * inv_freq[None, :])
    return emb.cos() * scale, emb.sin() * scale


def _emb(freqs: torch.Tensor) -> torch.Tensor:
    return torch.cat([freqs, freqs], dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rope to query/key heads at given absolute positions.

    cos/sin are tabulated once in float32 up to max_positions and cast to the activation
    dtype at use, which reproduces the reference's per-call computation exactly. For a
    length-dependent rope (``length_dependent``), every call also takes each token's rope
    length (``seq_lens``, see the module docstring): longrope picks between its short and
    long tables, dynamic NTK computes the rows past the original length from their grown
    base.
    """

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]):
        super().__init__()
        self.rope_type = rope_type_of(params)
        self.length_dependent = self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES
        self.head_dim = head_dim
        self.params = dict(params)
        inv_freq, self.scale = rope_inv_freq(head_dim, params)
        cos, sin = _tables(inv_freq, max_positions, self.scale)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.original_len = 0
        if self.length_dependent:
            self.original_len = int(_need(params, "original_max_position_embeddings"))
        if self.rope_type == "longrope":
            long_inv, _ = rope_inv_freq(head_dim, params, seq_len=self.original_len + 1)
            cos_long, sin_long = _tables(long_inv, max_positions, self.scale)
            self.register_buffer("cos_long", cos_long, persistent=False)
            self.register_buffer("sin_long", sin_long, persistent=False)

    def prefix_key(self, prompt_len: int) -> int:
        """What of a prompt's length its KV depends on: 0 within the original length (no
        scaling), else the length (dynamic) or 1 (longrope: the long factors)."""
        if not self.length_dependent or prompt_len <= self.original_len:
            return 0
        return prompt_len if self.rope_type == "dynamic" else 1

    def seq_lens(self, batch: Any) -> torch.Tensor | None:
        """What ``seq_lens`` takes from a `ForwardBatch`: its rows' rope lengths when this rope
        needs them, else None (nothing computed)."""
        return batch.rope_seq_lens() if self.length_dependent else None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        memo: dict | None = None, seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]
        cos, sin = self.cos_sin(positions, q.dtype, memo, seq_lens)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, memo: dict | None = None,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] at ``positions``; ``memo`` (the step's) keeps them for the
        other layers that share this rotary. ``seq_lens`` [T]: each token's rope length,
        required when ``length_dependent``."""
        key = (id(self), dtype)
        if memo is not None and key in memo:
            return memo[key]
        if self.length_dependent:
            cos, sin = self._length_cos_sin(positions, seq_lens)
        else:
            cos, sin = self.cos[positions], self.sin[positions]
        out = cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
        if memo is not None:
            memo[key] = out
        return out

    def _length_cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_lens is None or seq_lens.shape != positions.shape:
            raise ValueError(f"rotary: rope_type {self.rope_type!r} depends on each request's "
                             "length; pass seq_lens (ForwardBatch.rope_seq_lens()), one per "
                             "position")
        cos, sin = self.cos[positions], self.sin[positions]
        past = (seq_lens > self.original_len)[:, None]
        if self.rope_type == "longrope":
            return (torch.where(past, self.cos_long[positions], cos),
                    torch.where(past, self.sin_long[positions], sin))
        if not bool(past.any()):
            return cos, sin
        lengths, row = torch.unique(seq_lens, return_inverse=True)
        inv = dynamic_inv_freq(self.head_dim, self.params, lengths).to(cos.device)
        emb = _emb(positions.to(torch.float32)[:, None] * inv[row])
        return (torch.where(past, emb.cos() * self.scale, cos),
                torch.where(past, emb.sin() * self.scale, sin))

    def apply_(self, x: torch.Tensor, positions: torch.Tensor, memo: dict | None = None,
               seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Rope on the heads of one tensor [T, H, D] (e.g. q and k side by side)."""
        cos, sin = self.cos_sin(positions, x.dtype, memo, seq_lens)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Read rope settings from a transformers 5 config (rope_parameters) or a 4.x one
    (rope_theta + rope_scaling), with the lengths the scaled types need filled in as
    transformers fills them: ``original_max_position_embeddings`` (a top-level config field
    first, as Phi-3 writes it, else max_position_embeddings; dynamic NTK always grows from
    max_position_embeddings) and a missing yarn/longrope ``factor`` (max_position_embeddings
    over the original length)."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        out = dict(params[layer_type])
    elif params and "rope_theta" in params:
        out = dict(params)
    else:
        out = {"rope_theta": getattr(config, "rope_theta", 10000.0)}
        scaling = getattr(config, "rope_scaling", None)
        if scaling:
            out.update(scaling)
    rope_type = rope_type_of(out)
    out["rope_type"] = rope_type
    max_pos = getattr(config, "max_position_embeddings", None)
    if rope_type == "dynamic" and max_pos:
        out["original_max_position_embeddings"] = int(max_pos)
    if rope_type in ("llama3", "yarn", "longrope"):
        top = getattr(config, "original_max_position_embeddings", None)
        if top:
            out["original_max_position_embeddings"] = int(top)
        elif max_pos:
            out.setdefault("original_max_position_embeddings", int(max_pos))
    if (rope_type in ("yarn", "longrope") and out.get("factor") is None and max_pos
            and out.get("original_max_position_embeddings")):
        out["factor"] = max_pos / out["original_max_position_embeddings"]
    return out


def rope_length_limit(config: Any, params: dict[str, Any]) -> tuple[int, str]:
    """The longest sequence the model's rope is meant for, and where that number comes from.

    Unscaled: max_position_embeddings. A scaled rope extends the original (pre-training)
    length by its factor: linear, llama3, yarn and longrope to
    ``original_max_position_embeddings × factor`` when the config names the original length
    (linear without one: its max_position_embeddings is already the scaled length), dynamic
    NTK to ``max_position_embeddings × factor``; never less than max_position_embeddings.
    """
    max_pos = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
    rope_type = rope_type_of(params)
    original, factor = params.get("original_max_position_embeddings"), params.get("factor")
    if rope_type == "default" or not original or not factor:
        return max_pos, f"max_position_embeddings {max_pos}, rope_type {rope_type!r}"
    scaled = int(original * float(factor))
    if scaled <= max_pos:
        return max_pos, f"max_position_embeddings {max_pos}, rope_type {rope_type!r}"
    # dynamic NTK's original length is max_position_embeddings (rope_parameters).
    name = ("max_position_embeddings" if rope_type == "dynamic"
            else "original_max_position_embeddings")
    return scaled, f"rope_type {rope_type!r}: {name} {original} x factor {factor}"


def model_length_limit(config: Any) -> tuple[int, str]:
    """`rope_length_limit` of a model: with a rope per layer type (Gemma 3's sliding and
    full layers), the smallest."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [t for t, v in params.items() if isinstance(v, dict)]
    limits = [rope_length_limit(config, rope_parameters(config, t)) for t in nested]
    return min(limits) if limits else rope_length_limit(config, rope_parameters(config))


def rope_prefix_key(module: nn.Module, prompt_len: int) -> tuple:
    """The prefix-cache extra key of a prompt of ``prompt_len`` tokens: () unless a
    length-dependent rope rotates the prompt differently from an unscaled one."""
    keys = tuple(m.prefix_key(prompt_len) for m in module.modules()
                 if isinstance(m, RotaryEmbedding) and m.length_dependent)
    return ("rope", keys) if any(keys) else ()
