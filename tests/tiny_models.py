"""Tiny random Hugging Face checkpoints and a transformers greedy oracle.

``build_tiny_checkpoint(arch, out_dir)`` writes a complete model directory (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json with a
ChatML chat template) for a 2-layer, hidden-64, head_dim-16, 4-head / 2-kv-head (GQA)
float32 model of the given architecture. ``hf_greedy`` runs the transformers model on it
and returns the greedy tokens and their logprobs: the reference met must reproduce.

Random tiny models have near-flat logits (default init std 0.02), so greedy decoding would
hinge on ties and tell nothing. Every weight is therefore re-initialised here (``_reinit``):
fan-in init for linear weights, embeddings with std 1 (small for tied models, see _reinit),
every norm weight randomised, every bias non-zero, and the output scaled so the final logits
have a standard deviation of about 4. Among otherwise identical candidates, ``seed_offset``
picks one whose greedy runs over every test prompt have no near-tie. The result has clear
top-1 / top-2 margins, non-degenerate continuations (mean chosen logprob about -0.8), and
features that matter: test_oracle_models.py checks that ignoring the sliding window, the
llama3 rope scaling, or an off-by-one window changes the greedy output.

Observed (transformers 5.24.0, torch 2.13.0 CPU) over all test prompts (``all_test_prompts``:
random ids of length 5, 17, 40, 75 plus the two TEXT_PROMPTS; 32 greedy steps each), see
``OBSERVED``: the smallest top-1 minus top-2 logit margin is 0.014 (qwen2), i.e. >1e3 times
the ~1e-5 float32 disagreement between two implementations and ~3.5e-3 of the logit std;
median margins are ~0.8-1.1; every 32-token continuation has >= 18 distinct tokens.
qwen3_moe's smallest gap between the 2nd and 3rd router probability is ~1.4e-4 (mixtral's
2.5e-4, gpt_oss's 1.3e-4; transformers 5.25). gpt_oss's attention sinks are N(-1, 1): with
larger ones the tiny model attends to little and repeats itself.
Building all eight checkpoints takes ~0.2 s after the ~1.5 s transformers import.
The scaled-rope archs (llama_yarn, llama_dynamic, llama_longrope) start or cross their
original length of 32 on every test prompt; for the length-dependent ones (dynamic,
longrope) the reference is transformers' cached generate (``generate_trace``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

ARCHS = (
    "llama",
    "llama3_rope",
    "llama_tied",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "llama_yarn",
    "llama_dynamic",
    "llama_longrope",
    "bamba",
    "qwen3_next",
    "phi3",
    "gemma2",
    "olmo2",
    "granite",
    "deepseek_v3",
)

# Shared shape of every tiny model.
HIDDEN = 64
HEAD_DIM = 16
NUM_HEADS = 4
NUM_KV_HEADS = 2
NUM_LAYERS = 2
INTERMEDIATE = 128
MAX_POS = 512
SLIDING_WINDOW = 8
# llama3 rope: wavelengths with theta 1e4 and head_dim 16 are 6.3, 19.9, 62.8, 199, ... so
# with original_max_position_embeddings 64 (high-freq wavelen 16, low-freq wavelen 64) the
# first pair is kept, the next two are smoothly interpolated and the rest divided by 8.
LLAMA3_ORIGINAL_MAX_POS = 64
TIED_EMB_STD = 0.1
GPT_OSS_SWIGLU_LIMIT = 1.5
# Scaled ropes (yarn, dynamic NTK, longrope): an original length of 32, so the 40- and
# 75-token prompts start past it and the 5- and 17-token ones cross it while decoding.
# dynamic NTK grows from max_position_embeddings, so llama_dynamic's is 32 (factor 8: met
# allows 256 tokens).
SCALED_ROPE_ORIGINAL_MAX_POS = 32
HYBRID_NUM_LAYERS = 3
# phi3: rope on 12 of 16 head channels (Phi-4-mini's factor).
PHI3_PARTIAL_ROTARY = 0.75
# gemma2: an attention softcap small enough to bind on these scores (the real one is 50)
# and the real final softcap (30; binding on logits of std 6, see SPECS).
GEMMA2_ATTN_SOFTCAP = 5.0
GEMMA2_FINAL_SOFTCAP = 30.0
# != head_dim, and small: sharper attention (Gemma 2 has no q/k norms to sharpen it).
GEMMA2_QUERY_PRE_ATTN_SCALAR = 8
# granite: multipliers away from 1 (and from 1/sqrt(head_dim)) so each one matters.
GRANITE_MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                           attention_multiplier=0.4, logits_scaling=2.0)
# deepseek_v3's MLA widths: a cached latent row is KV_LORA_RANK + ROPE_DIM = 48 values per
# token and layer, where full K/V would be NUM_HEADS * (NOPE + ROPE + V) = 224.
DEEPSEEK_Q_LORA_RANK = 32
DEEPSEEK_KV_LORA_RANK = 32
DEEPSEEK_ROPE_DIM = 16
DEEPSEEK_NOPE_DIM = 16
DEEPSEEK_V_DIM = 24

# Per-arch vocab sizes (all in 256..512, deliberately not all equal).
VOCAB = {
    "llama": 384,
    "llama3_rope": 320,
    "llama_tied": 352,
    "mistral": 384,
    "qwen2": 416,
    "qwen3": 384,
    "gemma3": 448,
    "qwen3_moe": 384,
    "mixtral": 352,
    "gpt_oss": 416,
    "llama_yarn": 384,
    "llama_dynamic": 352,
    "llama_longrope": 320,
    "bamba": 400,
    "qwen3_next": 368,
    "phi3": 320,
    "gemma2": 448,
    "olmo2": 352,
    "granite": 384,
    "deepseek_v3": 384,
}

# Families whose tokenizer prepends BOS (Llama, Mistral, Gemma); Qwen's does not.
ADDS_BOS = {"llama", "llama3_rope", "llama_tied", "mistral", "gemma3", "mixtral",
            "llama_yarn", "llama_dynamic", "llama_longrope", "gemma2"}
# Gemma RMSNorms multiply by (1 + w): the checkpoint stores w = g - 1.
GEMMA_NORMS = {"gemma3", "gemma2"}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The old lighthouse stood at the edge of the cliff, and every night its keeper climbed the
narrow stairs to light the great lamp. Ships passing in the dark would see the beam sweep
across the water and know that the rocks were near. The keeper kept a small notebook in which
he wrote the weather, the number of ships, and the names of the birds that nested below the
gallery. In the spring there were gulls and terns; in the autumn, geese flying south in long
uneven lines. He liked the quiet of the early morning best, when the sea was grey and calm and
the lamp could rest. Then he would make tea, sit by the window, and read the letters that the
supply boat had brought the week before. His sister wrote about the garden, the apple trees,
the price of bread in the town, and the children who were growing taller every month. Once a
year the inspector came to check the lenses, the clockwork and the oil, and every year he
found everything in perfect order. People in the village said the keeper was lonely, but he
did not think so. He had the wind, the water, the light and the long patient rhythm of the
tides. When a storm came he stayed awake all night, watching the beam turn and turn, counting
the seconds between flashes, listening to the waves break against the stones. In the morning
the beach would be covered with seaweed, driftwood and sometimes a strange bottle or a piece of
rope from a distant harbour. He collected these things and kept them on a shelf, each with a
small label saying where and when it was found. A child from the village, who came with the
supply boat in summer, asked him what he would do when the lighthouse no longer needed a
keeper. He smiled and said that the sea would still need someone to watch it, and that he
would find another window, another notebook, and another light to keep.
"""


@dataclass(frozen=True)
class ArchSpec:
    """How a tiny model is initialised (gain on fan-in init, target logit std)."""

    gain: float = 1.0  # std of linear weights = gain / sqrt(fan_in)
    logit_std: float = 4.0  # target std of the final logits
    emb_std: float | None = None  # None: 1.0 untied, TIED_EMB_STD tied
    qk_norm_scale: float = 1.0  # mean of q_norm / k_norm weights (sharper attention if > 1)
    seed_offset: int = 0


# seed_offset picks, among equally-initialised candidates, one whose greedy runs over every
# test prompt have no near-tie (see OBSERVED); the other knobs are explained in _reinit.
SPECS = {
    "llama": ArchSpec(seed_offset=0),
    "llama3_rope": ArchSpec(seed_offset=10),
    "llama_tied": ArchSpec(emb_std=0.03, seed_offset=10),
    "mistral": ArchSpec(seed_offset=8),
    "qwen2": ArchSpec(seed_offset=10),
    "qwen3": ArchSpec(seed_offset=4),
    # Gemma scales the input embedding by sqrt(hidden)=8, so the stored one is 8x smaller;
    # sharper q/k norms keep attention from averaging everything into a constant.
    "gemma3": ArchSpec(emb_std=0.0125, qk_norm_scale=2.0, seed_offset=3),
    "qwen3_moe": ArchSpec(seed_offset=2),
    "mixtral": ArchSpec(seed_offset=5),
    "gpt_oss": ArchSpec(seed_offset=2),
    "llama_yarn": ArchSpec(seed_offset=8),
    "llama_dynamic": ArchSpec(seed_offset=1),
    "llama_longrope": ArchSpec(seed_offset=3),
    # Mamba-2 hybrid: mamba, attention, mamba (attn_layer_indices [1]).
    "bamba": ArchSpec(seed_offset=0),
    # Gated delta-net hybrid: linear, full, linear attention (dense MLPs).
    "qwen3_next": ArchSpec(seed_offset=0),
    "phi3": ArchSpec(seed_offset=1),
    "gemma2": ArchSpec(emb_std=0.0125, logit_std=6.0, seed_offset=0),
    "olmo2": ArchSpec(seed_offset=14),
    "granite": ArchSpec(seed_offset=3),
    "deepseek_v3": ArchSpec(seed_offset=28),
}

# From the verification run (see module docstring): arch -> (min top1-top2 logit margin,
# median margin, fewest distinct tokens in a 32-token greedy continuation), all test prompts.
OBSERVED: dict[str, tuple[float, float, int]] = {
    "llama": (0.0152, 0.906, 25),
    "llama3_rope": (0.0158, 0.878, 24),
    "llama_tied": (0.0285, 0.944, 18),
    "mistral": (0.0578, 0.801, 26),
    "qwen2": (0.0139, 0.970, 20),
    "qwen3": (0.0186, 0.909, 19),
    "gemma3": (0.0208, 1.064, 21),
    "qwen3_moe": (0.0383, 1.016, 20),
    "mixtral": (0.0116, 0.889, 26),
    "gpt_oss": (0.0241, 1.055, 13),
    # transformers 5.25.0; the length-dependent ropes against transformers' cached generate
    # (generate_trace).
    "llama_yarn": (0.0106, 0.796, 24),
    "llama_dynamic": (0.0204, 0.843, 15),
    "llama_longrope": (0.0133, 1.018, 20),
    "bamba": (0.0154, 1.056, 26),  # transformers 5.25
    "qwen3_next": (0.0332, 1.946, 27),  # transformers 5.25
    # transformers 5.25.0, torch 2.13.0 CPU
    "phi3": (0.0189, 1.018, 25),
    "gemma2": (0.0125, 1.411, 13),
    "olmo2": (0.0308, 0.849, 13),
    "granite": (0.0121, 0.762, 9),
    "deepseek_v3": (0.0257, 0.695, 22),
}


# --------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer(vocab_size: int, add_bos: bool, extra_text: str = ""):
    """A byte-level BPE trained on TRAINING_TEXT (+ ``extra_text``), with exactly
    ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT + extra_text], trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training produced {tok.get_vocab_size()} tokens, wanted {vocab_size}; "
            "lengthen TRAINING_TEXT"
        )
    bos_id = tok.token_to_id(BOS_TOKEN)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POS,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# --------------------------------------------------------------------------------------------
# configs


def _config(arch: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int,
            head_dim: int = HEAD_DIM):
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        max_position_embeddings=MAX_POS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        return tf.LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
    if arch == "llama3_rope":
        return tf.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POS,
            },
        )
    if arch == "llama_tied":
        return tf.LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
    if arch == "mistral":
        return tf.MistralConfig(
            **common,
            sliding_window=SLIDING_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "qwen2":
        return tf.Qwen2Config(
            **common,
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "qwen3":
        return tf.Qwen3Config(
            **common,
            tie_word_embeddings=False,
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "gemma3":
        common.pop("rms_norm_eps")
        return tf.Gemma3TextConfig(
            **common,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            # != head_dim on purpose: the attention scale is query_pre_attn_scalar**-0.5.
            query_pre_attn_scalar=32,
            tie_word_embeddings=True,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        )
    if arch == "mixtral":
        return tf.MixtralConfig(
            **(common | {"intermediate_size": 32}),
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            **(common | {"intermediate_size": 32}),
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attention_bias=True,
            # Low enough that both clamps of its SwiGLU bite on the tiny model's activations.
            swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "llama_yarn":
        return tf.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": MAX_POS / SCALED_ROPE_ORIGINAL_MAX_POS,
                "original_max_position_embeddings": SCALED_ROPE_ORIGINAL_MAX_POS,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
            },
        )
    if arch == "llama_dynamic":
        common["max_position_embeddings"] = SCALED_ROPE_ORIGINAL_MAX_POS
        return tf.LlamaConfig(
            **common, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                       "factor": 8.0},
        )
    if arch == "llama_longrope":
        half = head_dim // 2
        return tf.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": SCALED_ROPE_ORIGINAL_MAX_POS,
                "factor": MAX_POS / SCALED_ROPE_ORIGINAL_MAX_POS,
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [1.0 + 2.0 * i for i in range(half)],
            },
        )
    if arch == "bamba":
        # Three layers (mamba, attention, mamba) so state slots are indexed per mamba layer;
        # two groups of B/C, and HF's scan chunk (32) off met's 16-token block grid.
        common.update(num_hidden_layers=HYBRID_NUM_LAYERS)
        return tf.BambaConfig(
            **common,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=32,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "qwen3_next":
        # Same three-layer pattern as bamba; 4 value heads over 2 key heads; dense MLPs only
        # (met does not run Qwen3-Next's shared-expert MoE).
        common.update(num_hidden_layers=HYBRID_NUM_LAYERS)
        return tf.Qwen3NextConfig(
            **common,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=0,
            mlp_only_layers=[0, 1, 2],
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25},
        )
    if arch == "phi3":
        return tf.Phi3Config(
            **common,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": PHI3_PARTIAL_ROTARY},
        )
    if arch == "gemma2":
        common.pop("rms_norm_eps")
        return tf.Gemma2Config(
            **common,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=GEMMA2_QUERY_PRE_ATTN_SCALAR,
            tie_word_embeddings=True,
            attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
            final_logit_softcapping=GEMMA2_FINAL_SOFTCAP,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "olmo2":
        return tf.Olmo2Config(
            **common,
            tie_word_embeddings=False,
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )
    if arch == "granite":
        return tf.GraniteConfig(
            **common,
            **GRANITE_MULTIPLIERS,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "deepseek_v3":
        # MLA: q through a low-rank q_a/q_b pair, KV through one latent of kv_lora_rank plus
        # a shared rope key; v_head_dim != qk head dim on purpose. Layer 0 dense, layer 1
        # MoE with 8 experts in 2 groups (top-2 within the 1 best group) plus a shared one.
        # The reference repeats K/V per num_key_value_heads group: MLA needs kv heads == heads.
        common.pop("head_dim")
        return tf.DeepseekV3Config(
            **(common | {"num_key_value_heads": NUM_HEADS}),
            q_lora_rank=DEEPSEEK_Q_LORA_RANK,
            kv_lora_rank=DEEPSEEK_KV_LORA_RANK,
            qk_rope_head_dim=DEEPSEEK_ROPE_DIM,
            qk_nope_head_dim=DEEPSEEK_NOPE_DIM,
            v_head_dim=DEEPSEEK_V_DIM,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")


def _model_class(arch: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "llama3_rope": tf.LlamaForCausalLM,
        "llama_tied": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "gpt_oss": tf.GptOssForCausalLM,
        "llama_yarn": tf.LlamaForCausalLM,
        "llama_dynamic": tf.LlamaForCausalLM,
        "llama_longrope": tf.LlamaForCausalLM,
        "bamba": tf.BambaForCausalLM,
        "qwen3_next": tf.Qwen3NextForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
        "gemma2": tf.Gemma2ForCausalLM,
        "olmo2": tf.Olmo2ForCausalLM,
        "granite": tf.GraniteForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
    }[arch]


# --------------------------------------------------------------------------------------------
# weights


def _reinit(model, arch: str, spec: ArchSpec, seed: int) -> None:
    """Deterministic, decisive re-initialisation of every parameter (see module docstring).

    Untied models: embeddings ~ N(0, 1), lm_head ~ N(0, logit_std**2 / hidden), norms
    ~ U(0.5, 1.5). Tied models (llama_tied, gemma3) cannot have a large embedding: the
    residual stream would be dominated by the current token's own embedding and, the
    output projection being that same embedding, the model would predict its input token
    forever. There the embedding is small (std spec.emb_std, default TIED_EMB_STD) and the
    final norm weight large, which gives the same logit scale with a residual stream the
    layers dominate.
    """
    gen = torch.Generator().manual_seed(seed * 1000 + spec.seed_offset + sum(map(ord, arch)))
    gemma = arch in GEMMA_NORMS
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    final_norm_scale = 1.0
    emb_std = spec.emb_std if spec.emb_std is not None else (TIED_EMB_STD if tied else 1.0)
    if tied:
        # logits = norm(h) * g . E  with |norm(h)| ~ sqrt(H), E ~ N(0, emb_std^2)
        final_norm_scale = spec.logit_std / (emb_std * math.sqrt(HIDDEN))

    def u(shape, scale=1.0):  # U(0.5, 1.5) * scale
        return (torch.rand(shape, generator=gen) + 0.5) * scale

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                scale = 1.0
                if name == "model.norm.weight":
                    scale = final_norm_scale
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    scale = spec.qk_norm_scale
                w = u(p.shape, scale)
                # Gemma RMSNorm multiplies by (1 + w): store w = g - 1.
                p.copy_(w - 1.0 if gemma else w)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name or ("lm_head" in name and tied):
                p.copy_(torch.randn(p.shape, generator=gen) * emb_std)
            elif "lm_head" in name:
                # Granite divides the logits by logits_scaling: scale the head up to match.
                std = spec.logit_std / math.sqrt(p.shape[-1]) * getattr(
                    model.config, "logits_scaling", 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith(".mlp.gate.weight"):  # MoE router: make routing decisive
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / math.sqrt(p.shape[-1])))
            elif arch == "gpt_oss" and _init_gpt_oss(name, p, gen, spec):
                pass
            elif p.dim() >= 2:
                # nn.Linear weights are (out, in); fused MoE experts are (E, out, in).
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (spec.gain / math.sqrt(fan_in)))
            elif name.endswith(".mamba.A_log"):  # decay rates A = -exp(A_log) in [-8, -0.5]
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.5), math.log(8.0),
                                                      generator=gen))
            elif name.endswith(".mamba.D"):
                p.copy_(u(p.shape))
            elif name.endswith(".mamba.dt_bias"):  # softplus(dt_bias) log-uniform in [0.01, 0.3]
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(0.01), math.log(0.3),
                                                             generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith(".linear_attn.A_log"):
                # -exp(A_log) in [-0.5, -0.02]: a memory of tens of tokens, so a wrong state
                # restored at a block boundary still shows in the output after the prompt.
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.02), math.log(0.5),
                                                      generator=gen))
            elif name.endswith(".linear_attn.dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 2.0)
            else:
                raise RuntimeError(f"tiny_models: no init rule for {name} {tuple(p.shape)}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: steers the choice
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def _init_gpt_oss(name: str, p, gen, spec: ArchSpec) -> bool:
    """gpt-oss's own parameters: attention sinks (a logit per head, about as large as the
    attention scores so they take a visible share), a decisive router, experts stored
    transposed (E, in, out) and their (E, out) biases. False for the others."""
    if name.endswith(".self_attn.sinks"):
        p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
    elif name.endswith(".mlp.router.weight"):
        p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / math.sqrt(p.shape[-1])))
    elif name.endswith("_proj_bias"):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        p.copy_(torch.randn(p.shape, generator=gen) * (spec.gain / math.sqrt(p.shape[-2])))
    else:
        return False
    return True


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0,
                          head_dim: int = HEAD_DIM, tokenizer_text: str = "") -> Path:
    """Write a tiny random ``arch`` checkpoint with its tokenizer into ``out_dir``; return it.

    Deterministic for a given (arch, seed, head_dim). The near-tie-free margins recorded in
    OBSERVED were checked for seed=0 and the default head_dim only; test_hf_reference_is_decisive
    re-checks the built ones. Another ``head_dim`` (the attention heads' width; the hidden
    size stays 64) is for kernels that need wider heads (prompt attention: a multiple of 32).
    ``tokenizer_text`` is trained on beside TRAINING_TEXT (e.g. to make words single tokens).
    """
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = SPECS[arch]
    vocab_size = VOCAB[arch]

    tokenizer = build_tokenizer(vocab_size, add_bos=arch in ADDS_BOS, extra_text=tokenizer_text)
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    config = _config(arch, vocab_size, bos_id, eos_id, pad_id, head_dim)
    torch.manual_seed(seed)
    model = _model_class(arch)(config).to(torch.float32).eval()
    _reinit(model, arch, spec, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )
    with _quiet_transformers():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def _quiet_transformers():
    """No 'Writing model shards' progress bars in test output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------
# transformers reference


@dataclass(frozen=True)
class GreedyTrace:
    tokens: list[int]
    logprobs: list[float]  # logprob of each chosen token under log_softmax(raw logits)
    margins: list[float]  # top-1 minus top-2 raw logit at each step
    # (max_new_tokens, vocab) log_softmax of the raw logits at each step, for top-k checks
    rows_logprobs: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def topk(self, step: int, k: int) -> dict[int, float]:
        """The k most likely tokens at ``step`` and their logprobs."""
        vals, idx = torch.topk(self.rows_logprobs[step], k)
        return {int(i): float(v) for i, v in zip(idx, vals, strict=False)}


@functools.lru_cache(maxsize=16)
def load_hf_model(model_dir: str):
    """The checkpoint as transformers loads it (float32, eager attention), cached per dir."""
    return load_hf_model_with(model_dir)


def load_hf_model_with(model_dir, **config_overrides):
    """Load with config overrides (e.g. sliding_window=...); fail on any missing/extra key."""
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
            **config_overrides,
        )
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if bad:
        raise RuntimeError(f"transformers did not load {model_dir} cleanly: {bad}")
    return model.eval()


def _full_context_logits(model, ids: list[int]) -> torch.Tensor:
    """Raw logits (float64 copy) at every position of ``ids``, one forward, no KV cache."""
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float64)


def _cached_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens using transformers' own KV cache (fast; verified afterwards)."""
    # transformers 5.24 renamed the forward kwarg / output field `past_key_values` -> `cache`
    # (the old name still works there but warns); support both spellings within 5.x.
    new_api = "cache" in inspect.signature(model.forward).parameters
    cache_kw = "cache" if new_api else "past_key_values"
    out = model(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens:
        past = out.cache if new_api else out.past_key_values
        out = model(
            input_ids=torch.tensor([[tokens[-1]]], dtype=torch.long),
            use_cache=True,
            **{cache_kw: past},
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def greedy_trace(model, prompt_ids, max_new_tokens: int) -> GreedyTrace:
    """The oracle: greedy decoding whose every step is a full-context (cache-free) forward.

    Computing that literally costs max_new_tokens forwards over growing contexts, so the
    tokens are first decoded with transformers' KV cache and then verified by one
    teacher-forced full-context forward over prompt + tokens[:-1] (row t of a causal model's
    logits depends only on tokens <= t, so this *is* the full-context greedy run as long as
    every argmax agrees). Logprobs and margins come from that full-context forward. Should
    the cached run disagree anywhere (a near-tie), the literal step-by-step loop is used.
    """
    prompt = [int(t) for t in prompt_ids]
    n = len(prompt)
    with torch.inference_mode():
        tokens = _cached_greedy(model, prompt, max_new_tokens)
        rows = _full_context_logits(model, prompt + tokens[:-1])[n - 1 :]
        if [int(r.argmax()) for r in rows] != tokens:
            tokens, step_rows = [], []
            for _ in range(max_new_tokens):
                last = _full_context_logits(model, prompt + tokens)[-1]
                step_rows.append(last)
                tokens.append(int(last.argmax()))
            rows = torch.stack(step_rows)
        logprobs = torch.log_softmax(rows, dim=-1)
        top2 = torch.topk(rows, 2, dim=-1).values
    return GreedyTrace(
        tokens=tokens,
        logprobs=[float(logprobs[i, t]) for i, t in enumerate(tokens)],
        margins=[float(m) for m in (top2[:, 0] - top2[:, 1])],
        rows_logprobs=logprobs.to(torch.float32),
    )


def generate_trace(model, prompt_ids, max_new_tokens: int, chunk: int = 0) -> GreedyTrace:
    """The oracle of a length-dependent rope (dynamic NTK, LongRoPE): transformers' own
    cached greedy generate, logprobs from each step's logits. Its rope rotates the prompt
    for the prompt's length and each new token for the length it makes, keeping cached keys
    as they were; a full-context forward instead rotates every position for the whole
    context, so `greedy_trace`'s teacher-forced check does not apply. ``model`` must be
    fresh (a dynamic rope keeps its longest length across calls). ``chunk``: feed the
    prompt in pieces of that many tokens."""
    new_api = "cache" in inspect.signature(model.forward).parameters
    cache_kw = "cache" if new_api else "past_key_values"
    prompt = [int(t) for t in prompt_ids]
    pieces = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)] if chunk else [prompt]
    rows, tokens, past = [], [], None
    with torch.inference_mode():
        for piece in pieces + [None] * (max_new_tokens - 1):
            ids = piece if piece is not None else [tokens[-1]]
            kw = {cache_kw: past} if past is not None else {}
            out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, **kw)
            past = out.cache if new_api else out.past_key_values
            if piece is None or piece is pieces[-1]:
                rows.append(out.logits[0, -1].to(torch.float64))
                tokens.append(int(rows[-1].argmax()))
        rows = torch.stack(rows)
        logprobs = torch.log_softmax(rows, dim=-1)
        top2 = torch.topk(rows, 2, dim=-1).values
    return GreedyTrace(
        tokens=tokens,
        logprobs=[float(logprobs[i, t]) for i, t in enumerate(tokens)],
        margins=[float(m) for m in (top2[:, 0] - top2[:, 1])],
        rows_logprobs=logprobs.to(torch.float32),
    )


def length_dependent_rope(model_dir) -> bool:
    """Whether the checkpoint's rope depends on the sequence length (dynamic, longrope)."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope")


@functools.lru_cache(maxsize=512)
def _hf_greedy_cached(
    model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int
) -> GreedyTrace:
    if length_dependent_rope(model_dir):
        return generate_trace(load_hf_model_with(model_dir), prompt_ids, max_new_tokens)
    return greedy_trace(load_hf_model(model_dir), prompt_ids, max_new_tokens)


def hf_greedy_trace(model_dir, prompt_ids, max_new_tokens: int) -> GreedyTrace:
    return _hf_greedy_cached(str(model_dir), tuple(int(t) for t in prompt_ids), int(max_new_tokens))


def hf_greedy(
    model_dir, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers (float32, eager attention)."""
    trace = hf_greedy_trace(model_dir, prompt_ids, max_new_tokens)
    return list(trace.tokens), list(trace.logprobs)


# --------------------------------------------------------------------------------------------
# fixed prompts


PROMPT_LENS = (5, 17, 40, 75)
MAX_NEW_TOKENS = 32


def oracle_prompts(arch: str) -> list[list[int]]:
    """The fixed pseudo-random prompts (non-special ids) of lengths PROMPT_LENS for ``arch``.

    Only these (and TEXT_PROMPTS) are vetted for near-ties; do not decode others greedily.
    """
    rng = random.Random(f"met-oracle-{arch}")
    lo = len(SPECIAL_TOKENS)
    return [[rng.randrange(lo, VOCAB[arch]) for _ in range(n)] for n in PROMPT_LENS]


def oracle_prompt(arch: str, length: int) -> list[int]:
    """The oracle prompt of ``length`` (one of PROMPT_LENS) for ``arch``."""
    return oracle_prompts(arch)[PROMPT_LENS.index(length)]


TEXT_PROMPTS = (
    "The keeper climbed the narrow stairs to light the lamp, and",
    "Once a year the inspector came to check",
)


def text_prompt_ids(model_dir, text: str) -> list[int]:
    """``text`` as the checkpoint's own tokenizer encodes it (special tokens included)."""
    return list(load_tokenizer(str(model_dir))(text).input_ids)


@functools.lru_cache(maxsize=16)
def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def all_test_prompts(arch: str, model_dir) -> list[list[int]]:
    """Every prompt the oracle tests decode greedily (the margin test covers all of them)."""
    return oracle_prompts(arch) + [text_prompt_ids(model_dir, t) for t in TEXT_PROMPTS]
