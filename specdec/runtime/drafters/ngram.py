"""Prompt-lookup drafting: if the last n tokens occurred before, propose what followed them then.

No model and no randomness; it pays off on inputs that repeat (code edits, quoting, summaries).
An index of every n-gram -> the position after its most recent occurrence is kept up to date
as the context grows, so each new token costs O(max_ngram) and each lookup O(max_ngram^2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specdec.runtime.drafters.base import Draft
from specdec.runtime.sampling import SamplingConfig

# How many trailing tokens propose() compares to decide that `context` extends what it indexed.
# The context only ever grows between begin() calls; the check catches a caller that restarted
# or rewound without begin(), and costs O(1) instead of comparing the whole context.
_TAIL_CHECK = 16


@dataclass(frozen=True)
class NgramConfig:
    """Match lengths tried, longest first: a longer match is a better predictor when it exists."""

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )


class NgramDrafter:
    """Drafter (see base.py) that proposes the continuation of the latest earlier match of the context's tail."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.config = NgramConfig(max_ngram=max_ngram, min_ngram=min_ngram)
        self._tokens: list[int] = []  # the context indexed so far
        # n-gram -> index of the token that followed its latest occurrence. Only n-grams with a
        # follower are stored, so the context's own tail is never its own match.
        self._next_pos: dict[tuple[int, ...], int] = {}

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        # Deterministic: proposals ignore `sampling` and `rng`; the acceptance rule treats them as one-hot.
        self._tokens = []
        self._next_pos = {}
        self._extend(prompt_ids)

    def source(self, context: Sequence[int]) -> str:
        return "lookup"

    def has_match(self, context: Sequence[int]) -> bool:
        """Whether propose(context, k > 0) would find something to propose."""
        return self.lookup(context, 1)[1] > 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return Draft(tokens=np.asarray(self.lookup(context, k)[0], dtype=np.int64))  # [k], or [0]: no match

    def lookup(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """The k tokens that followed the latest earlier occurrence of the context's longest matching tail, and
        that tail's length n; ([], 0) when no tail of min_ngram..max_ngram tokens occurred before."""
        self._sync(context)
        tokens = self._tokens
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if k <= 0:
                break
            start = self._next_pos.get(tuple(tokens[-n:])) if n <= len(tokens) else None
            if start is None:
                continue
            # The match says the text repeats with period d = len(tokens) - start. When the
            # continuation runs into the tail (a loop such as "a b a b"), keep that period and read
            # on from the proposal itself, so a loop yields k tokens instead of stopping after d.
            proposal: list[int] = []
            for pos in range(start, start + k):
                proposal.append(tokens[pos] if pos < len(tokens) else proposal[pos - len(tokens)])
            return proposal, n
        return [], 0

    def accept(self, n_accepted: int, next_token: int) -> None:
        # Nothing to do: the context given to the next propose() holds the accepted tokens and
        # next_token, and propose() indexes whatever it has not seen yet.
        pass

    def _sync(self, context: Sequence[int]) -> None:
        """Index the tokens `context` added since the last call; start over if it is not an extension."""
        n_seen = len(self._tokens)
        tail = max(0, n_seen - _TAIL_CHECK)
        if len(context) < n_seen or [int(t) for t in context[tail:n_seen]] != self._tokens[tail:]:
            self._tokens = []
            self._next_pos = {}
            n_seen = 0
        self._extend(context[n_seen:])

    def _extend(self, new_tokens: Sequence[int]) -> None:
        tokens = self._tokens
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for token in new_tokens:
            pos = len(tokens)
            # Every n-gram ending just before `pos` is now followed by a token: record that position.
            # Later occurrences overwrite earlier ones, so lookups find the most recent match.
            for n in range(lo, min(hi, pos) + 1):
                self._next_pos[tuple(tokens[pos - n:pos])] = pos
            tokens.append(int(token))
