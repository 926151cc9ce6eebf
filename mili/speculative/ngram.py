"""N-gram prompt lookup (vLLM's ``ngram``, llama.cpp's lookup decoding): drafts copied from the sequence itself.

The longest suffix of the sequence, of ``max_n`` down to ``min_n`` tokens, that occurred earlier in it
(prompt or output), and the tokens that followed its latest earlier occurrence are the draft (continuing
periodically where they run into the end of the sequence). No model runs:
it pays on text that repeats its context (editing, summarising, code, quoting).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (none when no suffix of min_n tokens recurs)."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows starting at 0 .. L - n - 1: each is followed by at least one token
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                return self._copy(token_ids, int(starts[-1]) + n, k)  # after the latest occurrence
        return []

    @staticmethod
    def _copy(token_ids: list[int], follow: int, k: int) -> list[int]:
        """``k`` tokens from ``follow`` on; where the copy reaches the end of the sequence it goes on over the
        draft itself (as LZ77 copies an overlapping match): a sequence repeating a period shorter than ``k``
        (a token over and over, a short cycle) drafts k tokens of it, not the few left before its end."""
        extended = token_ids[follow:follow + k]
        while len(extended) < k:
            extended.append(extended[len(extended) - (len(token_ids) - follow)])
        return extended
