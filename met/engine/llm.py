"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` (vLLM's shape)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from met.cache.kv_manager import KVStats
from met.config import EngineConfig, SpeculativeConfig
from met.engine.core import EngineCore
from met.outputs import CompletionOutput, RequestOutput
from met.sampling.beam_search import beam_state, live_beam_requests, top_pairs
from met.sampling.params import SamplingParams
from met.sampling.pooling import PoolingParams
from met.sampling.scoring import cosine, rerank_token_ids, resolve_score_mode

Prompt = str | dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    A prompt is a string or ``{"prompt_token_ids": [...]}``. Outputs come back in prompt order.
    ``dtype="auto"`` and ``quantization="auto"`` pick the fastest correct path for the machine
    and model file (see EngineConfig); ``dtype="float32", quantization=None`` is the exact
    reference. ``llm.engine.dtype`` / ``llm.engine.quantization`` say what was chosen.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        cache_dir: str | None = None,
        seed: int = 0,
        quantization: str | None = "auto",
        kv_cache_dtype: str = "auto",
        linear_backend: str = "auto",
        attention_backend: str = "auto",
        speculative_config: SpeculativeConfig | Mapping | str | None = None,
        enable_lora: bool = False,
        lora_modules: Mapping[str, str] | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        lora_backend: str = "auto",
        pooling: str = "last",
        normalize_embeddings: bool = True,
    ):
        self.config = EngineConfig(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, cache_dir=cache_dir, seed=seed,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            linear_backend=linear_backend, attention_backend=attention_backend,
            speculative_config=speculative_config, enable_lora=enable_lora,
            lora_modules=lora_modules, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, lora_backend=lora_backend, pooling=pooling,
            normalize_embeddings=normalize_embeddings,
        )
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` (a PEFT directory or a GGUF LoRA file) as ``name``
        (needs enable_lora)."""
        if self.engine.lora is None:
            raise ValueError("lora: construct LLM with enable_lora=True to load adapters")
        self.engine.lora.register(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (refused while running requests use it)."""
        if self.engine.lora is None:
            raise ValueError("lora: LoRA is not enabled")
        self.engine.lora.unregister(name)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.
        ``lora``: the adapter (a name in lora_modules) for every prompt, or one per prompt
        (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _broadcast_params(sampling_params, len(prompts))
        loras = ([lora] * len(prompts) if lora is None or isinstance(lora, str)
                 else list(lora))
        if len(loras) != len(prompts):
            raise ValueError(f"lora: {len(loras)} adapters for {len(prompts)} prompts")
        if any(p.num_beams > 1 for p in params_list):
            if any(name is not None for name in loras):
                raise ValueError("lora: beam search under an adapter is not supported")
            return self._generate_with_beams(prompts, params_list)
        entries = []
        for prompt, params in zip(prompts, params_list, strict=True):
            text, token_ids = self._tokenize(prompt)
            rid = str(next(self._ids))
            entries.append((rid, text, token_ids, params))
        try:
            for (rid, _, token_ids, params), name in zip(entries, loras, strict=True):
                self.engine.add_request(rid, token_ids, params, lora=name)
            finished = self._run_to_completion()
        except BaseException:
            for rid, *_ in entries:
                self.engine.abort_request(rid)
            raise
        return [self._make_output(rid, text, ids, params, finished[rid])
                for rid, text, ids, params in entries]

    def _generate_with_beams(self, prompts: Sequence[Prompt],
                             params_list: list[SamplingParams]) -> list[RequestOutput]:
        """Prompts with num_beams > 1 run beam search (all of them advancing together, one
        token per step); the others run as usual. Outputs stay in prompt order."""
        plain = [i for i, p in enumerate(params_list) if p.num_beams == 1]
        outputs: dict[int, RequestOutput] = {}
        if plain:
            done = self.generate([prompts[i] for i in plain], [params_list[i] for i in plain])
            outputs.update(zip(plain, done, strict=True))
        searches = {}
        for i, params in enumerate(params_list):
            if params.num_beams > 1:
                text, ids = self._tokenize(prompts[i])
                searches[i] = (text, ids, params, beam_state(
                    params, self.engine.loaded.eos_token_ids, params.num_beams))
        while any(not s.done for *_, s in searches.values()):
            pending = []
            order = list(searches)
            for k, b, ids, step in live_beam_requests([searches[i][3] for i in order],
                                                      [searches[i][1] for i in order]):
                rid = f"beam-{next(self._ids)}"
                pending.append((order[k], b, rid))
                self.engine.add_request(rid, ids, step)
            try:
                finished = self._run_to_completion()
            except BaseException:
                for _, _, rid in pending:
                    self.engine.abort_request(rid)
                raise
            per_search: dict[int, list] = {}
            for i, _b, rid in pending:
                state = searches[i][3]
                entry = finished[rid][-1].new_logprobs[0]
                per_search.setdefault(i, []).append(top_pairs(entry, state.candidates_per_beam))
            for i, pairs in per_search.items():
                searches[i][3].step(pairs)
        for i, (text, ids, params, state) in searches.items():
            completions = []
            for j, beam in enumerate(state.results()):
                tokens = list(beam.tokens)
                ended = bool(tokens) and tokens[-1] in state.eos_token_ids
                completions.append(CompletionOutput(
                    index=j, text=self._detokenize(tokens), token_ids=tokens,
                    finish_reason="stop" if ended else "length",
                    stop_reason=tokens[-1] if ended and tokens[-1] in params.stop_token_ids
                    else None, cumulative_logprob=beam.score))
            outputs[i] = RequestOutput(f"beam-{next(self._ids)}", text, ids, completions,
                                       finished=True)
        return [outputs[i] for i in range(len(params_list))]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None,
              normalize: bool | None = None,
              dimensions: int | None = None) -> list[list[float]]:
        """One embedding per prompt, in order: the prompt's final-norm hidden states pooled
        (``"last"`` token or ``"mean"``), truncated to ``dimensions`` and L2-normalized
        (``normalize``); None takes the LLM's ``pooling`` / ``normalize_embeddings``.
        The prompts run batched through the same engine as generation (``generate`` takes
        such requests too: ``SamplingParams(pooling=PoolingParams())`` gives a
        RequestOutput whose ``embedding`` is set)."""
        config = self.config
        params = SamplingParams(pooling=PoolingParams(
            pooling or config.pooling,
            config.normalize_embeddings if normalize is None else normalize, dimensions))
        outputs = self.generate(prompts, params)
        for out in outputs:
            if out.embedding is None:
                raise RuntimeError(f"embed: request failed: {out.outputs[0].error}")
        return [out.embedding for out in outputs]

    def score(self, query: str, documents: str | Sequence[str], mode: str = "auto",
              instruction: str | None = None) -> list[float]:
        """One relevance score per document, in order (met.sampling.scoring): with ``mode``
        "yesno" (a Qwen3-Reranker-style model) P("yes") for the pair in the reranker prompt,
        with "cosine" the cosine similarity of the two last-token embeddings; "auto" is
        yesno when the tokenizer has single-token "yes" and "no", else cosine.
        ``instruction`` replaces the reranker prompt's default one (yesno only)."""
        docs = [documents] if isinstance(documents, str) else list(documents)
        if not docs:
            raise ValueError("documents: must not be empty")
        if self.tokenizer is None:
            raise ValueError("score: this model has no tokenizer")
        used, ids = resolve_score_mode(mode, self.tokenizer)
        if used == "cosine":
            q, *d = self.embed([query, *docs], pooling="last", normalize=True)
            return [cosine(q, v) for v in d]
        params = SamplingParams(pooling=PoolingParams(kind="score", token_ids=ids))
        prompts = [{"prompt_token_ids": rerank_token_ids(self.tokenizer, query, doc,
                                                         instruction)} for doc in docs]
        outputs = self.generate(prompts, params)
        for out in outputs:
            if out.embedding is None:
                raise RuntimeError(f"score: request failed: {out.outputs[0].error}")
        return [out.embedding[1] for out in outputs]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = chat_template or self.engine.loaded.chat_template
        if self.tokenizer is None or not template:
            raise ValueError("chat: this model has no chat template; pass chat_template=")
        prompts = []
        for conv in conversations:
            ids = self.tokenizer.apply_chat_template(
                conv, chat_template=template, add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False, **template_kwargs,
            )
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params)

    def kv_stats(self) -> KVStats:
        """Blocks total / held by live requests / holding cached prefixes / free."""
        return self.engine.kv_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        return prompt, list(self.tokenizer(prompt)["input_ids"])

    def _run_to_completion(self) -> dict[str, list]:
        updates_by_id: dict[str, list] = {}
        while self.engine.has_unfinished():
            for update in self.engine.step():
                updates_by_id.setdefault(update.request_id, []).append(update)
        return updates_by_id

    def _make_output(self, rid: str, text: str | None, prompt_ids: list[int],
                     params: SamplingParams, updates: list) -> RequestOutput:
        token_ids = [t for u in updates for t in u.new_token_ids]
        logprobs = [lp for u in updates for lp in u.new_logprobs]
        last = updates[-1]
        out_text = self._detokenize(token_ids)
        completion = CompletionOutput(
            index=0, text=out_text, token_ids=token_ids, finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            logprobs=logprobs if params.logprobs is not None else None, error=last.error,
        )
        prompt_logprobs = next((u.prompt_logprobs for u in updates
                                if u.prompt_logprobs is not None), None)
        return RequestOutput(rid, text, prompt_ids, [completion], finished=True,
                             num_cached_tokens=last.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs, embedding=last.embedding)

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _broadcast_params(params: SamplingParams | Sequence[SamplingParams] | None,
                      n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)
