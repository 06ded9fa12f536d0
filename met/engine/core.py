"""EngineCore: owns all mutable engine state; step() = schedule → run model → sample → update."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from met.cache.kv_manager import KVCacheManager, KVStats
from met.config import EngineConfig
from met.engine.drafter import ModelDrafter
from met.engine.pooling import PoolState, check_pooling
from met.kernels import kv_cache, native, registry
from met.loader.model_loader import LoadedModel, load_model
from met.lora.slots import LoRAManager
from met.runner.batch_plan import BatchPolicy
from met.runner.model_runner import ModelRunner, StepLogits, kv_bytes_per_block
from met.sampling.grammar import GrammarCompiler
from met.sampling.logit_edits import dry_breaker_ids
from met.sampling.params import SamplingParams
from met.sampling.sampler import Sampler
from met.sampling.thinking import ThinkingState
from met.scheduler.request import Request
from met.scheduler.scheduler import Scheduler
from met.spec.decoder import SpecDecoder

log = logging.getLogger(__name__)

_DEAD_END = ("structured output: the grammar allows no next token here (a dead end, e.g. "
             "min_tokens, bad_words or allowed_token_ids exclude what it needs)")

_DEFAULT_KV_CAP = 2 << 30  # bytes: default pool ceiling when kv_cache_memory is unset


@dataclass(frozen=True)
class RequestUpdate:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    # Set on the request's first update when it asked for prompt logprobs: one entry per
    # prompt token, None for the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Set (with finish_reason "error") when the request failed on its own, e.g. its grammar
    # reached a dead end; the server fails that request and no other.
    error: str | None = None
    # Set (finished, reason "stop") when the request pooled its prompt (an embedding).
    embedding: list[float] | None = None


def _check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's tokens: the same vocabulary, id for id."""
    t_size, d_size = target.hf_config.vocab_size, draft.hf_config.vocab_size
    same = d_size <= t_size
    if same and target.tokenizer is not None and draft.tokenizer is not None:
        same = target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    if not same:
        raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the "
                         f"target's (vocabularies of {d_size} and {t_size} tokens); a draft "
                         "model must share the target's tokenizer")


class EngineCore:
    """The single owner of scheduler, KV pool, model runner and sampler."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.device = torch.device(config.device)
        dtype = config.torch_dtype
        if self.device.type == "cpu":  # before ready: no request ever waits for a compiler
            native.prepare(progress=log.info)
        self.loaded = loaded or load_model(
            config.model, dtype, self.device, config.max_model_len, config.cache_dir,
            config.quantization, config.max_num_seqs, config.dtype == "auto",
            config.linear_backend, config.attention_backend)
        # What the model runs with: config's "auto" values resolved for this machine and file.
        self.dtype: torch.dtype = dtype
        self.quantization: str | None = self.loaded.quantization
        self.kv_cache_dtype: str = self._resolve_kv_cache_dtype()
        self.max_model_len = self.loaded.max_model_len
        num_blocks = self._num_blocks(dtype)
        # How rows are grouped per step for this machine's kernels: asked of the prepared
        # model once, then passed down as a value (the scheduler and cache get plain rules).
        self.batch_policy = BatchPolicy(prompt_rows_first=self.loaded.model.prompt_rows_first)
        plan = self.loaded.kernel_plan
        self.kernel_labels = tuple(plan.labels().items()) if plan is not None else ()
        self.runner = ModelRunner(self.loaded.model, num_blocks, config.block_size, dtype,
                                  self.device, self.kv_cache_dtype, policy=self.batch_policy,
                                  attention_backend="cpu-native" if plan is None
                                  else plan.attention.name)
        # What the weights and the KV pool take (startup line, /metrics).
        self.weight_bytes = self.loaded.model.weight_bytes()
        self.kv_pool_bytes = sum(kv_cache.nbytes(c) for c in self.runner.kv_caches)
        self.kv_pool_tokens = num_blocks * config.block_size
        self.kv_stored = str(kv_cache.stored_dtype(self.kv_cache_dtype, dtype)).removeprefix(
            "torch.")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 separate_generated=self.batch_policy.hash_generated_apart)
        self.lora = self._lora_manager()
        self.runner.lora = self.lora
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens,
            split_at_prompt_end=self.batch_policy.split_chunks_at_prompt_end, lora=self.lora)
        self.sampler = Sampler(config.seed)
        self.spec = self._spec_decoder(num_blocks)
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None
        log.info("memory: weights %.1f MiB, KV pool %.1f MiB (%d blocks x %d tokens = %d "
                 "tokens, %s)", self.weight_bytes / 2**20, self.kv_pool_bytes / 2**20,
                 num_blocks, config.block_size, self.kv_pool_tokens,
                 f"{self.kv_cache_dtype} rows + scales"
                 if self.kv_cache_dtype in kv_cache.QUANTIZED else self.kv_stored)

    def _spec_decoder(self, num_blocks: int) -> SpecDecoder | None:
        """Speculative decoding as configured; a model drafter gets a KV pool of as many
        tokens as the target's."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method not in ("draft_model", "self"):
            return SpecDecoder(spec)
        if spec.method == "self":
            layers = self.loaded.model.kv_layout[0]
            n = spec.num_draft_layers or max(1, layers // 4)
            model = self.loaded.model.first_layers(n)
            name = "self"
            log.info("speculative decoding: self drafts with %d of %d layers", n, layers)
            backend = self.runner.attention_backend
        else:
            draft = load_model(spec.model, self.dtype, self.device, self.max_model_len,
                               self.config.cache_dir, self.config.quantization,
                               self.config.max_num_seqs, self.config.dtype == "auto")
            _check_same_vocabulary(self.loaded, draft)
            model, name = draft.model, "draft_model"
            backend = ("cpu-native" if draft.kernel_plan is None
                       else draft.kernel_plan.attention.name)
        drafter = ModelDrafter(name, model, num_blocks, self.config.block_size, self.dtype,
                               self.device, self.kv_cache_dtype, backend)
        log.info("speculative decoding: %s drafts up to %d tokens per step", name,
                 spec.num_speculative_tokens)
        return SpecDecoder(spec, drafter)

    def _resolve_kv_cache_dtype(self) -> str:
        """--kv-cache-dtype as it runs: "auto" is the model's dtype, except where --dtype auto
        chose float32 for w4a8 (a CPU without native bfloat16): there the cache is int8 rows
        with a scale each. A float32 cache is four times the bytes, and at 16-64 streams
        decode attention is bound by reading it (AMD Zen 3, served: +19 % output tok/s at 16
        streams, +23 % at 64; perplexity on docs/benchmarks.md's text 25.27 vs 25.42 with a
        float32 cache, mean |dlogprob| from float32 0.061 vs 0.057). Only where the kernel
        reads int8 rows natively (head_dim a multiple of 64)."""
        config = self.config
        if config.kv_cache_dtype == "bf16" and self.dtype != torch.bfloat16:
            raise ValueError(f"kv_cache_dtype: bf16 needs a bfloat16 model (this one runs in "
                             f"{str(self.dtype).removeprefix('torch.')}); use model, int8 or "
                             "fp8, or --dtype bfloat16")
        if config.kv_cache_dtype != "auto":
            return config.kv_cache_dtype
        head_dim = self.loaded.model.kv_layout[2]
        if (config.dtype == "auto" and self.dtype == torch.float32 and self.quantization == "w4a8"
                and self.device.type == "cpu" and head_dim % 64 == 0):
            log.info("KV cache: int8 (auto, with float32 + w4a8 on this CPU; "
                     "--kv-cache-dtype model keeps float32)")
            return "int8"
        return "auto"

    def _num_blocks(self, dtype: torch.dtype) -> int:
        per_block = kv_bytes_per_block(self.loaded.model, self.config.block_size, dtype,
                                       self.kv_cache_dtype)
        budget = self.config.kv_cache_memory
        if budget is None:
            full_seqs = self.config.max_num_seqs * self.max_model_len
            full = full_seqs * per_block // self.config.block_size
            budget = min(full, _DEFAULT_KV_CAP)
        num_blocks = budget // per_block
        min_blocks = -(-self.max_model_len // self.config.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes holds no KV block ({per_block} bytes each)"
            )
        if num_blocks < min_blocks:
            log.warning("KV pool (%d blocks) cannot hold one max_model_len sequence (%d blocks)",
                        num_blocks, min_blocks)
        return num_blocks

    def _lora_manager(self) -> LoRAManager | None:
        """The adapter slots in the model's projections, with --lora-modules registered
        (a bad adapter is an AdapterError naming it); None without --enable-lora."""
        config = self.config
        if not config.enable_lora:
            return None
        backend = registry.lora_backend(self.device.type, config.lora_backend)
        manager = LoRAManager(self.loaded.model, config.max_loras, config.max_lora_rank,
                              backend.name, config.max_cpu_loras, self.dtype,
                              getattr(self.loaded.hf_config, "model_type", None))
        self.loaded.model.__dict__.pop("_layer_stack", None)  # built before the slots existed
        for name, path in (config.lora_modules or {}).items():
            adapter = manager.register(name, path)
            log.info("lora %s: rank %d, %d projections, %.1f MiB (%s)", name, adapter.rank,
                     len(adapter.weights), adapter.nbytes / 2**20, path)
        log.info("lora: %d slots of rank %d, %.1f MiB resident, kernel %s (%s)",
                 config.max_loras, config.max_lora_rank, manager.resident_bytes() / 2**20,
                 backend.name, backend.note)
        return manager

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            if self.loaded.tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer to compile "
                                 "a grammar against")
            self._grammars = GrammarCompiler(self.loaded.tokenizer,
                                             int(self.loaded.hf_config.vocab_size),
                                             sorted(self.loaded.eos_token_ids))
        return self._grammars

    @property
    def capacity_tokens(self) -> int:
        return self.kv.pool.num_blocks * self.config.block_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, lora: str | None = None) -> None:
        """Queue a request (under the LoRA adapter named ``lora``, if given); raises
        ValueError for input that can never be served."""
        adapter = None
        lora = lora if lora is not None else params.lora
        cache_salt = cache_salt if cache_salt is not None else params.cache_salt
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"lora: adapter {lora!r} asked for, but LoRA is not enabled "
                                 "(--enable-lora)")
            adapter = self.lora.adapters.get(lora)
            if adapter is None:
                known = ", ".join(sorted(self.lora.adapters)) or "none"
                raise ValueError(f"lora: unknown adapter {lora!r} (loaded: {known})")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.loaded.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.max_token_id() >= vocab:
            raise ValueError(f"sampling params: token id {params.max_token_id()} (in "
                             f"stop_token_ids, logit_bias, bad_words or allowed_token_ids) is "
                             f"outside the vocabulary [0, {vocab})")
        if params.pooling is not None:  # an embedding: its prompt runs, nothing is generated
            check_pooling(params.pooling, len(prompt_token_ids),
                          int(self.loaded.hf_config.hidden_size), self.max_model_len)
        total = len(prompt_token_ids) + (params.max_tokens if params.pooling is None else 0)
        if total > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds max_model_len ({self.max_model_len})"
            )
        blocks_needed = -(-total // self.config.block_size)
        if blocks_needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens needs {blocks_needed} KV blocks but the pool "
                f"has {self.kv.pool.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        req = Request(request_id, list(prompt_token_ids), params,
                      eos_token_ids=self.loaded.eos_token_ids, cache_salt=cache_salt,
                      rope_key=self.loaded.rope_key(len(prompt_token_ids)))
        if params.pooling is not None:
            req.pooled = PoolState(params.pooling)
        elif params.structured_outputs is not None:
            req.grammar = self.grammars.matcher(params.structured_outputs)
        if params.thinking_budget is not None:
            req.thinking = ThinkingState(params.thinking_budget, self.grammars.token_bytes,
                                         self.loaded.eos_token_ids)
        if params.dry_multiplier > 0:
            req.dry_breaker_ids = dry_breaker_ids(params.dry_sequence_breakers,
                                                  self.loaded.tokenizer)
        if adapter is not None:  # last: nothing below can fail and leave it held
            self.lora.hold(adapter.name)  # read back into memory if evicted; the scheduler
            req.lora_name, req.lora_id = adapter.name, adapter.lora_id  # unholds at finish
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")
            if self.spec is not None:
                self.spec.finished(req.request_id, req.all_token_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def kv_stats(self) -> KVStats:
        return self.kv.stats()

    def step(self) -> list[RequestUpdate]:
        """Run one engine step and report every request that produced a token or finished."""
        start = time.perf_counter()
        width = self._propose()
        sched = self.scheduler.schedule()
        if self.spec is not None:
            for req in self.scheduler.running:
                req.spec_token_ids = []  # what was scheduled rides in `sched`
        if not sched.scheduled:
            return []
        tables = {s.request.request_id: self.kv.block_table(s.request.request_id)
                  for s in sched.scheduled}
        try:
            step_logits = self.runner.execute(sched, tables)
        except BaseException:
            # The scheduler published this step's blocks to the prefix cache before they
            # were computed; after a failed forward their KV cannot be trusted.
            self.kv.pool.reset_prefix_cache()
            raise
        for rid, (start, logits) in step_logits.prompt_logits.items():
            self._add_prompt_logprobs(self.requests[rid], start, logits)

        drafts: dict[str, tuple[int, ...]] = {}
        for item in sched.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            if item.spec_token_ids:
                drafts[item.request.request_id] = item.spec_token_ids

        updates = self._sample(step_logits, drafts) if step_logits.request_ids else []
        if step_logits.pooled:
            updates += self._pool(step_logits.pooled)
        if self.spec is not None:
            emitted = sum(len(u.new_token_ids) for u in updates)
            self.spec.gate.record(width, emitted, time.perf_counter() - start)
        return updates

    def _propose(self) -> int:
        """Draft tokens for the running decodes that speculate this step; returns the step's
        batch width (the gate's bucket key)."""
        running = self.scheduler.running
        width = len(running) + (1 if self.scheduler.waiting else 0)
        spec = self.spec
        if spec is None or not spec.gate.on(width):
            return width
        asks = [(req.request_id, req.all_token_ids,
                 min(req.params.max_tokens - req.num_output_tokens,
                     self.max_model_len - req.num_tokens) - 1)
                for req in running
                if (req.params.speculative and req.num_computed_tokens == req.num_tokens - 1
                    and req.num_output_tokens > 0)]
        if asks:
            drafts = spec.propose(asks)
            for req in running:
                req.spec_token_ids = drafts.get(req.request_id, [])
        return width

    def _sample(self, step_logits: StepLogits,
                drafts: dict[str, tuple[int, ...]]) -> list[RequestUpdate]:
        """Tokens for every request with logits, in rounds: round j samples row j of each
        request still verifying, exactly as a decode would after the tokens accepted so far
        (penalties, grammar, thinking and seeded draws all advance one token at a time). A
        request keeps verifying while its sampled token equals its next draft: the emitted
        tokens are then the target's own samples, so every output distribution is the one
        without speculation (a draft only saves the forward passes it was right about)."""
        reqs = [self.requests[rid] for rid in step_logits.request_ids]
        num_rows = step_logits.num_rows or [1] * len(reqs)
        offsets = [0]
        for n in num_rows[:-1]:
            offsets.append(offsets[-1] + n)
        emitted: list[list[int]] = [[] for _ in reqs]
        lps: list[list[dict[int, float]]] = [[] for _ in reqs]
        accepted = [0] * len(reqs)
        failed: dict[int, RequestUpdate] = {}
        alive = list(range(len(reqs)))
        j = 0
        while alive:
            rows = [offsets[i] + j for i in alive]
            logits = (step_logits.logits if len(rows) == step_logits.logits.shape[0]
                      else step_logits.logits[torch.tensor(rows)])
            result = self.sampler(logits, [reqs[i] for i in alive])
            dead = set(result.dead_ends)
            still = []
            for row, (i, token, lp) in enumerate(
                    zip(alive, result.token_ids, result.logprobs, strict=True)):
                req = reqs[i]
                error = (_DEAD_END if row in dead else self._take(req, token, lp))
                if error is not None:
                    failed[i] = self._fail(req, error)
                    continue
                emitted[i].append(req.all_token_ids[-1])
                if lp is not None:
                    lps[i].append(lp)
                d = drafts.get(req.request_id, ())
                if not req.is_finished and j < len(d) and d[j] == req.all_token_ids[-1]:
                    req.num_computed_tokens += 1  # the draft's KV was computed: keep it
                    accepted[i] += 1
                    still.append(i)
            alive = still
            j += 1

        updates = []
        for i, req in enumerate(reqs):
            d = drafts.get(req.request_id)
            if d and self.spec is not None:
                self.spec.record(len(d), accepted[i])
            if i in failed:
                updates.append(failed[i])
                continue
            if d and not req.is_finished:
                self.kv.truncate(req.request_id, req.num_tokens)  # the rejected drafts' blocks
            first = (req.num_output_tokens == len(emitted[i])
                     and req.params.prompt_logprobs is not None)
            updates.append(RequestUpdate(
                req.request_id, emitted[i], lps[i], req.is_finished,
                req.finish_reason, req.stop_reason, req.num_cached_tokens or 0,
                list(req.prompt_logprobs) if first else None,
            ))
            if req.is_finished:
                self._forget(req)
        return updates

    def _pool(self, pooled: dict[str, tuple[int, torch.Tensor]]) -> list[RequestUpdate]:
        """Gather this step's rows of each pooling request; those whose prompt is done
        finish with their vector (no token, blocks freed now)."""
        updates = []
        for rid, (start, rows) in pooled.items():
            req = self.requests[rid]
            req.pooled.add(start, rows)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self.scheduler.finish(req, "stop")
                self._forget(req)
                updates.append(RequestUpdate(rid, [], [], True, "stop", None,
                                             req.num_cached_tokens or 0,
                                             embedding=req.pooled.vector()))
        return updates

    def _take(self, req: Request, token: int, lp: dict[int, float] | None) -> str | None:
        """Append one sampled token (thinking may replace it); an error message when the
        request fails on it."""
        grammar_applied = req.grammar_applies()
        if req.thinking is not None:
            token = req.thinking.on_token(token)  # an EOS inside thinking closes it
            grammar_applied = grammar_applied and not req.thinking.in_thinking
        req.all_token_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        if grammar_applied and not req.grammar.accept(token):
            return f"structured output: the grammar rejected token {token}"
        self._check_stop(req, token)
        return None

    def _forget(self, req: Request) -> None:
        del self.requests[req.request_id]
        if self.spec is not None:
            self.spec.finished(req.request_id, req.all_token_ids)

    def _fail(self, req: Request, message: str) -> RequestUpdate:
        self.scheduler.finish(req, "error")
        self._forget(req)
        return RequestUpdate(req.request_id, [], [], True, "error", None,
                             req.num_cached_tokens or 0, error=message)

    @staticmethod
    def _add_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
        """Logits of positions start.. predict prompt tokens start+1..; positions already
        done (a chunk recomputed after preemption) are skipped."""
        top = req.params.prompt_logprobs or 0
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + len(logprobs)],
                               device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_vals, top_ids = (logprobs.topk(top) if top else (None, None))
        for i, (target, lp) in enumerate(zip(targets.tolist(), chosen, strict=True)):
            if start + 1 + i != len(req.prompt_logprobs):
                continue
            entry = {target: lp}
            if top_vals is not None:
                for v, t in zip(top_vals[i].tolist(), top_ids[i].tolist(), strict=True):
                    entry.setdefault(t, v)
            req.prompt_logprobs.append(entry)

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        if req.grammar is not None and req.grammar.is_terminated:
            self.scheduler.finish(req, "stop")  # the grammar's stop token (EOS) was taken
            return
        if req.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                self.scheduler.finish(req, "stop")
                return
            if not p.ignore_eos and token in req.eos_token_ids:
                self.scheduler.finish(req, "stop")
                return
            rd = p.repetition_detection
            if rd is not None and rd.matches(  # type: ignore[union-attr]
                    req.all_token_ids, req.num_prompt_tokens):
                req.stop_reason = "repetition"
                self.scheduler.finish(req, "length")
                return
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            self.scheduler.finish(req, "length")

    def reset_prefix_cache(self) -> None:
        self.kv.pool.reset_prefix_cache()

    def drop_cached_prefixes(self) -> int:
        """Forget the hash of every cached block no request holds (``POST
        /reset_prefix_cache``): the next identical prompt computes from scratch. Blocks that
        running requests hold keep their hash and contents. How many were forgotten."""
        return self.kv.pool.drop_unreferenced_hashes()

    def _runners(self) -> list[ModelRunner]:
        drafter = getattr(self.spec, "proposer", None) if self.spec is not None else None
        extra = [drafter.runner] if isinstance(drafter, ModelDrafter) else []
        return [self.runner, *extra]

    def free_kv_cache(self) -> None:
        """Sleep: drop the KV tensors (the target's and a model drafter's) and, since their
        contents go with them, the prefix index. Only with no request in the core."""
        if self.requests:
            raise RuntimeError(f"{len(self.requests)} requests still hold KV blocks")
        self.kv.pool.reset_prefix_cache()
        for runner in self._runners():
            runner.free_kv()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed pool back to the driver

    def allocate_kv_cache(self) -> None:
        """Wake from ``free_kv_cache``: the KV tensors again, zeroed, of the same size."""
        for runner in self._runners():
            runner.allocate_kv()

