"""Rope scaling: met's frequencies against transformers' own ROPE_INIT_FUNCTIONS, the
per-request length rule of the length-dependent types, and the length limit each allows."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from met.layers.batch import ForwardBatch, SeqSpan
from met.layers.rotary import (
    RotaryEmbedding,
    rope_inv_freq,
    rope_length_limit,
    rope_parameters,
    rope_prefix_key,
)

HEAD_DIM = 16
MAX_POS = 64


def _config(rope: dict, max_pos: int = MAX_POS, **extra) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                       max_position_embeddings=max_pos, rope_parameters=dict(rope), **extra)


ROPES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16},
    "yarn_untruncated": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "truncate": False,
                         "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                    "original_max_position_embeddings": 16, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "yarn_attention_factor": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 2.0,
                              "original_max_position_embeddings": 32,
                              "attention_factor": 1.3},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0,
                 "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.9 * i for i in range(HEAD_DIM // 2)]},
}


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("seq_len", [None, 10, MAX_POS + 37])
def test_inv_freq_matches_transformers(name, seq_len):
    config = _config(ROPES[name])
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    got, scale = rope_inv_freq(HEAD_DIM, params, seq_len=seq_len)
    # transformers computes the dynamic base in Python floats for an int seq_len, met in
    # float32 tensors as transformers' forward does (a tensor seq_len): an ulp of the base.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)
    if name != "dynamic" or seq_len is None or seq_len <= MAX_POS:
        assert torch.equal(got, want)


def test_factor_and_original_length_defaults_follow_transformers():
    # Phi-3 keeps the original length at the config's top level; factor = 128k / 4k.
    rope = dict(ROPES["longrope"])
    rope.pop("original_max_position_embeddings")
    config = _config(rope, max_pos=256, original_max_position_embeddings=16)
    params = rope_parameters(config)
    assert params["original_max_position_embeddings"] == 16 and params["factor"] == 16.0
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=100)
    got, scale = rope_inv_freq(HEAD_DIM, params, seq_len=100)
    assert torch.equal(got, want) and scale == pytest.approx(want_scale)
    assert scale == pytest.approx(math.sqrt(1 + math.log(16) / math.log(16)))
    # dynamic NTK always grows from max_position_embeddings, whatever else the dict says.
    dyn = rope_parameters(_config(ROPES["dynamic"] | {"original_max_position_embeddings": 8}))
    assert dyn["original_max_position_embeddings"] == MAX_POS


def test_missing_and_bad_fields_name_the_field():
    with pytest.raises(ValueError, match=r"rope_parameters\.factor"):
        rope_inv_freq(HEAD_DIM, {"rope_type": "linear", "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_type: 'ntk-by-parts'"):
        rope_inv_freq(HEAD_DIM, {"rope_type": "ntk-by-parts", "rope_theta": 1e4})
    bad = dict(ROPES["longrope"], factor=4.0, short_factor=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"rope_parameters\.short_factor: has 2 entries"):
        rope_inv_freq(HEAD_DIM, bad)


def _hf_cos_sin(config, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary forward over one sequence at ``positions`` (a fresh module:
    dynamic rope keeps state across calls)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, len(positions), HEAD_DIM)
    cos, sin = rotary(x, torch.tensor([positions]))
    return cos[0], sin[0]


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn", "llama3"])
def test_tables_match_transformers_forward(name):
    """met's cos/sin equal transformers' rotary forward, for a sequence whose length is
    within the original length and for one past it (prompt of 100 > 64 or > 16)."""
    config = _config(ROPES[name])
    params = rope_parameters(config)
    met_rope = RotaryEmbedding(HEAD_DIM, 256, params)
    for length in (12, 100):
        positions = list(range(length))
        want_cos, want_sin = _hf_cos_sin(config, positions)
        pos = torch.tensor(positions)
        lens = torch.full_like(pos, length)
        cos, sin = met_rope.cos_sin(pos, torch.float32, seq_lens=lens)
        torch.testing.assert_close(cos[:, 0], want_cos, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin[:, 0], want_sin, rtol=0, atol=2e-6)


def test_length_rule_is_per_request():
    """Two requests in one step: each token's frequencies come from its own request's
    length, the same as when the request runs alone (batch invariance)."""
    params = rope_parameters(_config(ROPES["dynamic"]))
    rope = RotaryEmbedding(HEAD_DIM, 256, params)
    assert rope.length_dependent
    short = torch.arange(20)
    long_ = torch.arange(90)
    pos = torch.cat([short, long_])
    lens = torch.cat([torch.full_like(short, 20), torch.full_like(long_, 90)])
    cos, sin = rope.cos_sin(pos, torch.float32, seq_lens=lens)
    alone_s, _ = rope.cos_sin(short, torch.float32, seq_lens=torch.full_like(short, 20))
    alone_l, _ = rope.cos_sin(long_, torch.float32, seq_lens=torch.full_like(long_, 90))
    assert torch.equal(cos[:20], alone_s) and torch.equal(cos[20:], alone_l)
    assert torch.equal(alone_s[:, 0], rope.cos[:20])  # within the original length: unscaled
    assert not torch.allclose(alone_l[:, 0], rope.cos[:90])
    with pytest.raises(ValueError, match="seq_lens"):
        rope.cos_sin(pos, torch.float32)


def test_batch_rope_seq_lens():
    """Prompt positions take the request's prompt length (whatever chunk they run in),
    generated ones (decodes, speculative drafts) their own length."""
    slots = torch.arange(64)
    seqs = (SeqSpan(0, 3, 10, slots[:10], prompt_len=30),  # a prefill chunk
            SeqSpan(3, 1, 40, slots[:40], prompt_len=30),  # a decode
            SeqSpan(4, 3, 32, slots[:32], rows_apart=True, prompt_len=30))  # a verify
    positions = torch.tensor([7, 8, 9, 39, 29, 30, 31])
    batch = ForwardBatch(input_ids=torch.zeros(7, dtype=torch.long), positions=positions,
                         slot_mapping=torch.zeros(7, dtype=torch.long), seqs=seqs)
    assert batch.rope_seq_lens().tolist() == [30, 30, 30, 40, 30, 31, 32]


def test_prefix_key_separates_prompt_rope_states():
    dyn = RotaryEmbedding(HEAD_DIM, 256, rope_parameters(_config(ROPES["dynamic"])))
    lr = RotaryEmbedding(HEAD_DIM, 256, rope_parameters(_config(ROPES["longrope"])))
    both = torch.nn.ModuleList([dyn, lr])
    assert rope_prefix_key(both, 10) == ()  # unscaled in both: shares blocks with anyone
    assert rope_prefix_key(both, 40) == ("rope", (0, 1))  # past longrope's 16 only
    assert rope_prefix_key(both, 70) == ("rope", (70, 1))
    plain = RotaryEmbedding(HEAD_DIM, 256, {"rope_theta": 1e4})
    assert rope_prefix_key(plain, 1000) == () and not plain.length_dependent


@pytest.mark.parametrize(("rope", "max_pos", "extra", "limit"), [
    ({"rope_type": "default", "rope_theta": 1e4}, 512, {}, 512),
    (ROPES["linear"], 512, {}, 512),  # no original length: max_position is the scaled one
    (ROPES["linear"] | {"original_max_position_embeddings": 256}, 512, {}, 1024),
    (ROPES["dynamic"], 512, {}, 1024),
    (ROPES["yarn"], 32, {}, 64),
    (ROPES["yarn"] | {"original_max_position_embeddings": 32}, 32, {}, 128),
    (ROPES["llama3"], 256, {}, 256),  # 16 x 8 = 128 < 256
    ({k: v for k, v in ROPES["longrope"].items() if k != "original_max_position_embeddings"},
     4096, {"original_max_position_embeddings": 256}, 4096),
])
def test_rope_length_limit(rope, max_pos, extra, limit):
    config = _config(rope, max_pos=max_pos, **extra)
    got, why = rope_length_limit(config, rope_parameters(config))
    assert got == limit, why
