"""Prompt-lookup drafting: find the longest suffix of a token sequence seen earlier and propose
what followed it. An index of every m-gram's end positions (m = the shortest match allowed) is
kept up to date as tokens arrive, so a proposal costs the candidates of one key, not a scan."""

from __future__ import annotations

from collections.abc import Sequence

_MAX_CANDIDATES = 32  # most recent occurrences of the key tried per proposal


class NgramIndex:
    """End positions (exclusive) of every ``m``-gram of one growing token sequence."""

    def __init__(self, m: int):
        self.m = m
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # tokens[:indexed] are in the index

    def update(self, tokens: Sequence[int]) -> None:
        m = self.m
        for end in range(max(self.indexed + 1, m), len(tokens) + 1):
            self.ends.setdefault(tuple(tokens[end - m:end]), []).append(end)
        self.indexed = max(self.indexed, len(tokens))


def match_length(source: Sequence[int], end: int, query: Sequence[int], limit: int) -> int:
    """How many tokens before ``source[end]`` equal the last tokens of ``query`` (<= limit)."""
    n = 0
    q = len(query)
    while n < limit and end - n - 1 >= 0 and n < q and source[end - n - 1] == query[q - n - 1]:
        n += 1
    return n


def best_match(index: NgramIndex, source: Sequence[int], query: Sequence[int],
               max_len: int, skip_end: int | None = None) -> tuple[int, int]:
    """(match length, end position) of the longest earlier match of ``query``'s suffix in
    ``source`` (the most recent of equal length); (0, -1) when none has a token after it."""
    m = index.m
    if len(query) < m:
        return 0, -1
    ends = index.ends.get(tuple(query[-m:]))
    if not ends:
        return 0, -1
    best = (0, -1)
    tried = 0
    for end in reversed(ends):
        if end == skip_end or end >= len(source):
            continue  # the suffix itself, or nothing follows it
        length = match_length(source, end, query, max_len)
        if length > best[0]:
            best = (length, end)
            if length == max_len:
                break
        tried += 1
        if tried == _MAX_CANDIDATES:
            break
    return best


class NgramProposer:
    """method "ngram": the request's own prompt + output is the only source."""

    name = "ngram"

    def __init__(self, min_len: int, max_len: int):
        self.min_len = min_len
        self.max_len = max_len
        self._index: dict[str, NgramIndex] = {}

    def own_match(self, request_id: str, tokens: Sequence[int]) -> tuple[int, int]:
        """(length, end) of the best match of the request's suffix in its own tokens."""
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = NgramIndex(self.min_len)
        index.update(tokens)
        return best_match(index, tokens, tokens, self.max_len, skip_end=len(tokens))

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        length, end = self.own_match(request_id, tokens)
        if length < self.min_len:
            return []
        return list(tokens[end:end + k])

    def finished(self, request_id: str, tokens: Sequence[int]) -> None:
        self._index.pop(request_id, None)
