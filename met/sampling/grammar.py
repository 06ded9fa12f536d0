"""Grammar-constrained output with xgrammar: compile specs (cached), match tokens per request.

A ``StructuredOutputs`` spec is compiled once per distinct (kind, spec) against the model's
tokenizer; every request that uses it gets its own ``GrammarMatcher`` (the state of its
output so far). Each step the sampler asks the matchers of the constrained rows for a bitmask
of the tokens the grammar allows next and masks the rest, so constrained and free requests
share one batch.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from met.sampling.params import StructuredOutputs

# JSON specs are compiled without free whitespace: a small model given "any whitespace"
# can pad forever instead of closing the object.
_JSON_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A spec that does not compile (the message is the compiler's, prefixed by the field)."""


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one tokenizer; thread-safe, LRU-cached by spec.

    The HTTP side calls ``compile`` first (so a bad spec is a 400 before the engine sees the
    request); the engine thread's call then hits the cache.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = 256):
        import xgrammar as xgr  # imported here: only constrained requests need it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._info = info
        self._control_tokens: torch.Tensor | None = None
        self._token_bytes: list[bytes] | None = None
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs, field: str = "structured_outputs") -> Any:
        """The compiled grammar for ``spec``; raises GrammarError naming ``field``."""
        key = (spec.kind, spec.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(spec)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarError(f"{field}: invalid {spec.kind}: {_first_line(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self._compiler
        kind = spec.kind
        if kind == "json":
            schema = json.loads(spec.json)  # type: ignore[arg-type]
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return c.compile_json_schema(spec.json, any_whitespace=False,
                                         separators=_JSON_SEPARATORS, strict_mode=True)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                         separators=_JSON_SEPARATORS, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec.regex)  # type: ignore[arg-type]
        if kind == "choice":
            alts = " | ".join(json.dumps(choice) for choice in spec.choice or ())
            return c.compile_grammar(f"root ::= {alts}")
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)  # type: ignore[arg-type]
        return c.compile_structural_tag(spec.structural_tag)

    def matcher(self, spec: StructuredOutputs) -> GrammarState:
        compiled = self.compile(spec)
        # xgrammar's JSON strings admit raw control characters, which strict JSON parsers
        # (Python's json, JavaScript's JSON.parse) reject: JSON output never uses them.
        banned = self.control_tokens() if spec.kind in ("json", "json_object") else None
        return GrammarState(self._xgr.GrammarMatcher(compiled), banned)

    @property
    def token_bytes(self) -> list[bytes]:
        """Each token's text as bytes (index = token id); built once."""
        if self._token_bytes is None:
            self._token_bytes = list(self._info.decoded_vocab)
        return self._token_bytes

    def control_tokens(self) -> torch.Tensor:
        """Bool [vocab]: tokens whose text holds a control character (U+0000..U+001F)."""
        if self._control_tokens is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            stops = set(self._info.stop_token_ids)
            for i, piece in enumerate(self.token_bytes[:self.vocab_size]):
                if i not in stops and any(b < 0x20 for b in piece):
                    mask[i] = True
            self._control_tokens = mask
        return self._control_tokens


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, banned: torch.Tensor | None = None):
        self._matcher = matcher
        self.banned = banned  # bool [vocab]: tokens never allowed, whatever the grammar says

    def accept(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (only a stop token may follow)."""
        return bool(self._matcher.is_completed())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> GrammarState:
        return GrammarState(self._matcher.fork(), self.banned)


def apply_grammar_masks(logits: torch.Tensor, states: list[GrammarState | None]) -> list[int]:
    """Mask, in place, every token the row's grammar does not allow next; returns the rows
    it masked (the caller checks them for dead ends once all its masks are applied)."""
    import xgrammar as xgr

    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return []
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab)
    for i in rows:
        states[i].fill_bitmask(bitmask, i)  # type: ignore[union-attr]
    on_cpu = logits.to("cpu") if logits.device.type != "cpu" else logits
    xgr.apply_token_bitmask_inplace(on_cpu, bitmask, vocab_size=vocab, indices=rows)
    if on_cpu is not logits:
        logits.copy_(on_cpu)
    for i in rows:
        banned = states[i].banned  # type: ignore[union-attr]
        if banned is not None:
            logits[i, : len(banned)].masked_fill_(banned.to(logits.device), float("-inf"))
    return rows


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]
