"""Scoring query/document pairs (/v1/rerank, /v1/score, LLM.score) with a decoder model:
the prompt format, the yes/no tokens and the mode; shared by the server and the offline LLM.

Two modes, chosen once per server (``--score-mode``):

- ``yesno`` (decoder rerankers, Qwen3-Reranker style): each pair is rendered into the
  reranker prompt below and runs as a pooling request of kind "score" over the tokens
  ("no", "yes"); the score is P(yes) = softmax([logit_no, logit_yes])[1] at the last
  position.
- ``cosine`` (embedding models, as vLLM's /v1/score does for them): both texts are embedded
  (last token, normalized) and the score is their dot product, the cosine similarity.

``auto`` picks yesno when the tokenizer spells "yes" and "no" as one token each, else cosine.
"""

from __future__ import annotations

from typing import Any

SCORE_MODES = ("auto", "yesno", "cosine")

# Qwen3-Reranker's prompt (its model card's format_instruction with prefix and suffix): a
# system turn asking for a yes/no judgement, the user turn with the instruction, query and
# document, and the assistant turn opened with an empty think block.
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and '
                 'the Instruct provided. Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                       "query")


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The text a yes/no reranker judges for one (query, document) pair."""
    return (f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def yes_no_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """(no id, yes id) when the tokenizer encodes "no" and "yes" as one token each."""
    if tokenizer is None:
        return None
    ids = []
    for word in ("no", "yes"):
        enc = list(tokenizer.encode(word, add_special_tokens=False))
        if len(enc) != 1:
            return None
        ids.append(int(enc[0]))
    return ids[0], ids[1]


def resolve_score_mode(mode: str, tokenizer: Any) -> tuple[str, tuple[int, int] | None]:
    """(the mode used, the (no, yes) ids for yesno); a ValueError naming --score-mode when
    yesno is asked of a tokenizer without single-token "yes"/"no"."""
    if mode not in SCORE_MODES:
        raise ValueError(f"--score-mode: must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
    ids = yes_no_token_ids(tokenizer)
    if mode == "cosine" or (mode == "auto" and ids is None):
        return "cosine", None
    if ids is None:
        raise ValueError('--score-mode: yesno needs a tokenizer with single-token "yes" and '
                         '"no"; use --score-mode cosine')
    return "yesno", ids


def rerank_token_ids(tokenizer: Any, query: str, document: str,
                     instruction: str | None = None) -> list[int]:
    """The pair's prompt tokens: the rendered prompt, which spells its own special tokens
    (no BOS added, as the model card encodes it)."""
    return list(tokenizer(rerank_prompt(query, document, instruction),
                          add_special_tokens=False)["input_ids"])


def pair_indices(n1: int, n2: int) -> list[tuple[int, int]]:
    """vLLM's pairing of text_1 with text_2: one text_1 scores against every text_2
    (1-to-N); otherwise they pair by position (N-to-N, equal lengths)."""
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 != n2:
        raise ValueError(f"text_2: {n2} texts do not pair with text_1's {n1} (give one text_1, "
                         "or as many as text_2)")
    return [(i, i) for i in range(n1)]


def cosine(a: list[float], b: list[float]) -> float:
    """The dot product of two normalized embeddings."""
    return float(sum(x * y for x, y in zip(a, b, strict=True)))
