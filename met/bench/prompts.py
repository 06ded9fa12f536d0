"""Prompts of about N tokens for any server, whatever its tokenizer.

A prompt is made of seeded units, by workload: ``random`` words; ``code-edit`` Python
functions to be rewritten (the prompt holds the code the answer repeats: what prompt lookup
speculation is for); ``chat`` open questions. Each request gets its own units from the first
one on, so no two requests share a cached prefix. How many tokens a unit costs (on this
server, with its chat template for the chat endpoint) is measured once with two
``max_tokens=1`` requests and their ``usage.prompt_tokens``, then the unit count is solved
for the target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import httpx

from met.bench.loadgen import Target, complete

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river garden stone light window paper music field bridge market letter ocean "
    "forest mountain engine signal winter summer island village doctor picture season"
).split()


def words(n: int, seed: int) -> str:
    """``n`` random words, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(n, 1)))


_FUNCTION = (
    "def {verb}_{noun}(items, limit={a}):\n"
    '    """Return the {noun} of each {other} up to limit."""\n'
    "    result = []\n"
    "    for item in items[:limit]:\n"
    "        if item.{noun} > {b}:\n"
    "            result.append(item.{noun} * {c} + item.{other})\n"
    "    return result\n"
)
_VERBS = "get load find count scale merge filter build sort check".split()


def code_edit(n: int, seed: int) -> str:
    """A request to rewrite ``n`` seeded Python functions with one change: the answer
    repeats most of the prompt's code."""
    rng = random.Random(seed)
    funcs = [_FUNCTION.format(verb=rng.choice(_VERBS), noun=rng.choice(_WORDS),
                              other=rng.choice(_WORDS), a=rng.randint(2, 99),
                              b=rng.randint(0, 9), c=rng.randint(2, 9))
             for _ in range(max(n, 1))]
    code = "\n".join(funcs)
    return ("Rewrite this Python code so that every function also takes a `verbose=False` "
            f"argument. Reply with the whole code only.\n\n```python\n{code}```")


def chat(n: int, seed: int) -> str:
    """An open question in ``n`` seeded sentences."""
    rng = random.Random(seed)
    parts = [f"How does the {rng.choice(_WORDS)} relate to the {rng.choice(_WORDS)}?"
             for _ in range(max(n, 1))]
    return "Tell me what you think, in your own words. " + " ".join(parts)


WORKLOADS = {"random": words, "code-edit": code_edit, "chat": chat}


@dataclass(frozen=True)
class PromptShape:
    """prompt tokens ≈ overhead + per_word · units (fitted on this server): words for the
    random workload, functions or sentences for the others."""

    overhead: float
    per_word: float

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.overhead) / self.per_word))


async def _prompt_tokens(client: httpx.AsyncClient, target: Target, text: str) -> int:
    out = await complete(client, target, target.body(text, 1, stream=False))
    usage = out.get("usage") or {}
    if usage.get("prompt_tokens") is None:
        raise RuntimeError(f"{target.root}{target.path} sent no usage.prompt_tokens; "
                           "cannot size prompts")
    return int(usage["prompt_tokens"])


async def measure_shape(client: httpx.AsyncClient, target: Target, tokens: int,
                        seed: int = 10_000, workload: str = "random") -> PromptShape:
    """Fit tokens-per-unit and the fixed overhead (BOS, chat template) on the server, with a
    second probe sized near ``tokens`` so it stays within the model's length."""
    make = WORKLOADS[workload]
    small = 8 if workload == "random" else 1
    a = await _prompt_tokens(client, target, make(small, seed))
    large = max(2 * small, round(tokens * small / max(a, 1)))
    b = await _prompt_tokens(client, target, make(large, seed + 1))
    per_word = max((b - a) / (large - small), 0.05)
    return PromptShape(overhead=a - per_word * small, per_word=per_word)


def prompt_set(shape: PromptShape, tokens: int, count: int, seed: int = 0,
               workload: str = "random") -> list[str]:
    """``count`` distinct prompts of about ``tokens`` tokens each."""
    n = shape.words_for(tokens)
    make = WORKLOADS[workload]
    return [make(n, seed * 1_000_003 + i) for i in range(count)]
