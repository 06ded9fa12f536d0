"""Suffix decoding: prompt lookup over this request and the last finished requests too.
Agentic loops and batch jobs repeat themselves across requests (the same tool output, the same
file rewritten); a match in an earlier request drafts what that request went on to say."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from met.spec.ngram import NgramIndex, NgramProposer, best_match


class SuffixProposer(NgramProposer):
    """method "suffix": the longest match wins, this request's own on a tie."""

    name = "suffix"

    def __init__(self, min_len: int, max_len: int, keep: int):
        super().__init__(min_len, max_len)
        self.keep = keep
        # Finished requests' tokens and their indexes, oldest first.
        self._done: OrderedDict[int, tuple[list[int], NgramIndex]] = OrderedDict()
        self._serial = 0

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        best_len, end = self.own_match(request_id, tokens)
        best: Sequence[int] = tokens[end:end + k] if best_len >= self.min_len else ()
        best_len = best_len if best else 0
        for source, src_index in reversed(self._done.values()):
            length, end = best_match(src_index, source, tokens, self.max_len)
            if length >= self.min_len and length > best_len:
                best_len, best = length, source[end:end + k]
                if length == self.max_len:
                    break
        return list(best)

    def finished(self, request_id: str, tokens: Sequence[int]) -> None:
        super().finished(request_id, tokens)
        if self.keep == 0 or len(tokens) < self.min_len:
            return
        index = NgramIndex(self.min_len)
        source = list(tokens)
        index.update(source)
        self._serial += 1  # request ids may come back; finished entries never collide
        self._done[self._serial] = (source, index)
        while len(self._done) > self.keep:
            self._done.popitem(last=False)
