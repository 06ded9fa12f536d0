"""Embeddings (pooling requests) from the engine, against transformers on the same weights:
last-token and mean pooling of the final-norm hidden states, normalized, in float32; chunked
prefill, batching beside generating requests and preemption change nothing; no KV block is
left behind."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_hf_model, oracle_prompts

from met import LLM, SamplingParams
from met.sampling.pooling import PoolingParams

ARCHS = ("llama", "qwen3", "gemma3", "qwen3_moe")


def _hf_embedding(model_dir, ids: list[int], pooling: str, normalize: bool = True,
                  dimensions: int | None = None) -> torch.Tensor:
    """transformers' final hidden state (post final norm) pooled as sentence-transformers
    pools it."""
    model = load_hf_model(str(model_dir))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1][0].float()
    v = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    return LLM(str(model_dir), dtype="float32", quantization=None, max_num_seqs=8, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_last_hidden_state_is_post_norm(tiny_checkpoint, arch):
    """The oracle itself: transformers' last hidden state is the one its LM head reads (the
    final norm applied), so pooling it is pooling what met's forward returns."""
    model = load_hf_model(str(tiny_checkpoint(arch)))
    ids = oracle_prompts(arch)[1]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        logits = model.lm_head(out.hidden_states[-1])
        if getattr(model.config, "final_logit_softcapping", None):
            cap = model.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_transformers(tiny_checkpoint, arch, pooling):
    model_dir = tiny_checkpoint(arch)
    llm = _llm(model_dir)
    prompts = oracle_prompts(arch)
    got = llm.embed([{"prompt_token_ids": p} for p in prompts], pooling=pooling)
    assert len(got) == len(prompts)
    for ids, vec in zip(prompts, got, strict=True):
        want = _hf_embedding(model_dir, ids, pooling)
        assert len(vec) == want.numel()
        torch.testing.assert_close(torch.tensor(vec), want, rtol=0, atol=1e-5)
        assert abs(torch.tensor(vec).norm().item() - 1.0) < 1e-5
    assert llm.kv_stats().num_blocks_in_use == 0


def test_unnormalized_and_dimensions(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3")
    llm = _llm(model_dir)
    ids = oracle_prompts("qwen3")[2]
    raw = llm.embed([{"prompt_token_ids": ids}], pooling="mean", normalize=False)[0]
    torch.testing.assert_close(torch.tensor(raw), _hf_embedding(model_dir, ids, "mean", False),
                               rtol=0, atol=1e-5)
    assert abs(torch.tensor(raw).norm().item() - 1.0) > 1e-3  # really not normalized
    short = llm.embed([{"prompt_token_ids": ids}], dimensions=16)[0]
    assert len(short) == 16
    torch.testing.assert_close(torch.tensor(short),
                               _hf_embedding(model_dir, ids, "last", dimensions=16),
                               rtol=0, atol=1e-5)
    assert abs(torch.tensor(short).norm().item() - 1.0) < 1e-5  # renormalized after the cut
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([{"prompt_token_ids": ids}], dimensions=65)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([{"prompt_token_ids": ids}], dimensions=0)
    with pytest.raises(ValueError, match="pooling"):
        llm.embed([{"prompt_token_ids": ids}], pooling="cls")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([{"prompt_token_ids": ids * 4}])
    assert llm.kv_stats().num_blocks_in_use == 0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_equals_unchunked(tiny_checkpoint, pooling):
    """A 75-token prompt in 16-token chunks pools to the one-step result."""
    model_dir = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts("llama")]
    whole = _llm(model_dir).embed(prompts, pooling=pooling)
    chunked_llm = _llm(model_dir, max_num_batched_tokens=16)
    chunked = chunked_llm.embed(prompts, pooling=pooling)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)
    assert chunked_llm.kv_stats().num_blocks_in_use == 0


def test_prefix_cache_never_skips_a_pooled_position(tiny_checkpoint):
    """A prompt whose prefix is cached (by a generation, then by itself) still pools every
    position: the mean equals the cold one."""
    model_dir = tiny_checkpoint("llama")
    ids = oracle_prompts("llama")[3]
    llm = _llm(model_dir)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=0))
    first = llm.embed([{"prompt_token_ids": ids}], pooling="mean")[0]
    again = llm.embed([{"prompt_token_ids": ids}], pooling="mean")[0]
    want = _hf_embedding(model_dir, ids, "mean")
    torch.testing.assert_close(torch.tensor(first), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(again), want, rtol=0, atol=1e-5)
    assert llm.kv_stats().num_blocks_in_use == 0


@pytest.mark.parametrize("chunk", [2048, 16])
def test_batched_with_generation_equals_alone(tiny_checkpoint, chunk):
    """Embedding requests ride in the same steps as generating ones: the embeddings equal
    those computed alone and the generated tokens equal those generated alone."""
    model_dir = tiny_checkpoint("llama")
    prompts = oracle_prompts("llama")
    greedy = SamplingParams(max_tokens=8, temperature=0)
    llm = _llm(model_dir, max_num_batched_tokens=chunk)
    alone_gen = [o.outputs[0].token_ids
                 for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], greedy)]
    alone_emb = {pool: llm.embed([{"prompt_token_ids": p} for p in prompts], pooling=pool)
                 for pool in ("last", "mean")}
    mixed_prompts, mixed_params = [], []
    for i, p in enumerate(prompts):
        mixed_prompts.append({"prompt_token_ids": p})
        mixed_params.append(SamplingParams(pooling=PoolingParams("last")))
        mixed_prompts.append({"prompt_token_ids": p})
        mixed_params.append(SamplingParams(pooling=PoolingParams("mean")))
        if i < 2:
            mixed_prompts.append({"prompt_token_ids": p})
            mixed_params.append(greedy)
    llm.reset_prefix_cache()
    outs = llm.generate(mixed_prompts, mixed_params)
    k = 0
    for i in range(len(prompts)):
        for pool in ("last", "mean"):
            assert outs[k].outputs[0].token_ids == []
            torch.testing.assert_close(torch.tensor(outs[k].embedding),
                                       torch.tensor(alone_emb[pool][i]), rtol=0, atol=1e-5)
            k += 1
        if i < 2:
            assert outs[k].embedding is None
            assert outs[k].outputs[0].token_ids == alone_gen[i]
            k += 1
    assert llm.kv_stats().num_blocks_in_use == 0


def test_preempted_mean_counts_each_position_once(tiny_checkpoint):
    """With a KV pool too small for every request at once, requests are preempted mid-prompt
    and recomputed; the mean still covers each position once."""
    model_dir = tiny_checkpoint("llama")
    prompts = oracle_prompts("llama")
    llm = _llm(model_dir, max_num_batched_tokens=32)
    # 7 blocks (112 tokens): two growing generations and 75-token prompts in 32-token chunks
    # do not fit together, so pooling requests are preempted part-way through their prompt.
    small = _llm(model_dir, max_num_batched_tokens=32, kv_cache_memory=_block_bytes(llm) * 7)
    params = [SamplingParams(max_tokens=40, temperature=0)] * 2 + [
        SamplingParams(pooling=PoolingParams("mean"))] * 4
    ps = [{"prompt_token_ids": p} for p in prompts[:2] + prompts]
    outs = small.generate(ps, params)
    want = llm.embed([{"prompt_token_ids": p} for p in prompts], pooling="mean")
    for out, w in zip(outs[2:], want, strict=True):
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(w),
                                   rtol=0, atol=1e-5)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.kv_stats().num_blocks_in_use == 0


def _block_bytes(llm: LLM) -> int:
    from met.runner.model_runner import kv_bytes_per_block

    e = llm.engine
    return kv_bytes_per_block(e.loaded.model, e.config.block_size, e.dtype, e.kv_cache_dtype)


TEXTS = ("The keeper climbed the narrow stairs to light the lamp, and", "Once a year",
         "the inspector came to check")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_sentence_transformers(tiny_checkpoint, arch, pooling):
    """SentenceTransformer built as Qwen3-Embedding's config builds it (Transformer +
    Pooling + Normalize) encodes the same texts (padded as one batch) to met's vectors."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    model_dir = str(tiny_checkpoint(arch))
    # Plain text in, the backbone's last_hidden_state out: without the pin, sentence-
    # transformers renders a text through the model's chat template first.
    backbone = Transformer(model_dir, model_kwargs={"dtype": torch.float32,
                                                    "attn_implementation": "eager"},
                           modality_config={"text": {"method": "forward",
                                                     "method_output_name": "last_hidden_state"}},
                           module_output_name="token_embeddings")
    st = SentenceTransformer(modules=[
        backbone, Pooling(64, "lasttoken" if pooling == "last" else "mean"), Normalize()],
        device="cpu")
    want = st.encode(list(TEXTS), convert_to_tensor=True, batch_size=len(TEXTS))
    llm = _llm(model_dir)
    got = torch.tensor(llm.embed(list(TEXTS), pooling=pooling))
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)
    assert llm.kv_stats().num_blocks_in_use == 0
