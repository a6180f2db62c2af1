"""Prompt lookup where the text repeats, a draft model everywhere else.

The two win on different text: lookup drafts are free and long where the answer copies the prompt
(summaries, extraction, code edits); a draft model is right most of the time on free writing.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.runtime.drafters.base import Draft, Drafter
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.sampling import SamplingConfig

# Shortest n-gram match trusted over the draft model: a single repeated token predicts its old
# continuation poorly, while the int8 self-draft agrees with the target ~95% of the time.
LOOKUP_MIN_NGRAM = 2


class HybridDrafter:
    def __init__(self, lookup: NgramDrafter, model: Drafter) -> None:
        self.lookup, self.model = lookup, model
        self._last: Drafter = model

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.lookup.begin(prompt_ids, sampling, rng)
        self.model.begin(prompt_ids, sampling, rng)

    def source(self, context: Sequence[int]) -> str:
        return "lookup" if self.lookup.has_match(context) else "model"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        draft = self.lookup.propose(context, k)
        self._last = self.lookup
        if draft.k == 0:
            # The model drafter catches up on the tokens decided in lookup rounds inside propose().
            draft = self.model.propose(context, k)
            self._last = self.model
        return draft

    def accept(self, n_accepted: int, next_token: int) -> None:
        self._last.accept(n_accepted, next_token)
