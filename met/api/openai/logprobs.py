"""The engine's per-token logprob dicts → OpenAI's chat and completions ``logprobs`` shapes.

Logprobs are of the raw model distribution (log-softmax of the logits, before penalties,
logit_bias, temperature and filters), as in vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Entries = Sequence[tuple[int, dict[int, float] | None]]


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's dict holds the chosen token plus the k most likely: the k best of it are
    # the k most likely tokens whether or not the chosen one is among them.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(tokenizer: Any, entries: Entries, k: int) -> dict:
    """``choices[i].logprobs`` of a chat completion (or of one stream chunk)."""
    def item(t: int, lp: float) -> dict:
        text = token_text(tokenizer, t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, entry[t]),
                         "top_logprobs": [item(u, lp) for u, lp in _top(entry, k)]}
                        for t, entry in entries],
            "refusal": None}


def completion_logprobs(tokenizer: Any, entries: Entries, k: int, offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a text completion; ``offset`` is where the generated text
    starts in the choice's text (the echoed prompt's length)."""
    tokens, offsets = [], []
    for t, _ in entries:
        offsets.append(offset)
        tokens.append(token_text(tokenizer, t))
        offset += len(tokens[-1])
    # An entry of None: the first echoed prompt token, which has no logprob.
    return {
        "tokens": tokens,
        "token_logprobs": [None if entry is None else entry[t] for t, entry in entries],
        "top_logprobs": [None if entry is None
                         else {token_text(tokenizer, u): lp for u, lp in _top(entry, k)}
                         for _, entry in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(tokenizer: Any, token_ids: Sequence[int],
                    entries: Sequence[dict[int, float] | None], k: int) -> list[dict | None]:
    """vLLM's ``choices[i].prompt_logprobs``: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} for the token itself and the k most likely;
    ``rank`` is 1 for the most likely token, None where unknown (a prompt token outside
    the top k)."""
    out: list[dict | None] = []
    for t, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        top = _top(entry, k)
        ranks = {u: i + 1 for i, (u, _) in enumerate(top)}
        keep = dict(top) | {t: entry[t]}
        out.append({str(u): {"logprob": lp, "rank": ranks.get(u),
                             "decoded_token": token_text(tokenizer, u)}
                    for u, lp in keep.items()})
    return out
