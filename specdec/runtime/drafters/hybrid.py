"""Lookup where the text repeats, a draft model everywhere else; or both at once, as one token tree.

The two win on different text: lookup drafts are free and long where the answer copies the prompt
(summaries, extraction, code edits) or, with a corpus of the target's own answers, where it writes what it
always writes; a draft model is right most of the time on free writing. Where a lookup match is wrong the
model's guess is often right, so given a `room` the lookup's chain and the model's draft hang side by side
under the round's input and the target verifies both in one step.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from specdec.runtime.drafters.base import Draft, Drafter
from specdec.runtime.sampling import SamplingConfig

# Shortest n-gram match trusted over the draft model: a single repeated token predicts its old
# continuation poorly, while the int8 self-draft agrees with the target ~95% of the time.
LOOKUP_MIN_NGRAM = 2


class HybridDrafter:
    def __init__(self, lookup: Drafter, model: Drafter, room: Callable[[], int] | None = None) -> None:
        """`lookup`: a deterministic drafter, prompt lookup (ngram.py) or prompt lookup then the corpus of the
        target's answers (corpus.py), whose drafts may carry confidences. `room`: given, where the lookup matches, draft with both and verify the two drafts as branches of one
        tree of at most room() nodes (the target must take a tree attention bias). Only for drafters that keep
        nothing from their proposals (EAGLE and Medusa heads read the target's own states), since the path
        accepted may be the lookup's."""
        self.lookup, self.model, self.room = lookup, model, room
        self._last: Drafter = model
        self.sampling = SamplingConfig()
        # The lookup's last chain and the context it was drafted after: which of its tokens the target kept is
        # known only from the next round's context (the accepted path may be the model's branch, or the chain
        # may not have been verified at all).
        self._pending: tuple[list[int], int] | None = None

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.sampling = sampling
        self._pending = None
        self.lookup.begin(prompt_ids, sampling, rng)
        self.model.begin(prompt_ids, sampling, rng)

    def source(self, context: Sequence[int]) -> str:
        self._settle(context)
        if self.lookup.propose(context, 1).sure().k == 0:
            return "model"
        return "lookup" if self.room is None else "both"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._settle(context)
        proposed = self.lookup.propose(context, k)
        if proposed.k:
            self._pending = (proposed.tokens.tolist(), len(context))
        draft = proposed.sure()  # a scored lookup (the corpus drafter's) is trusted while sure; the model drafts after
        self._last = self.lookup
        if draft.k == 0:
            # The model drafter catches up on the tokens decided in lookup rounds inside propose().
            draft = self.model.propose(context, k)
            self._last = self.model
        elif self.room is not None:
            draft = merge_drafts(draft, self.model.propose(context, k), self.room(), merge_equal=self.sampling.greedy)
        return draft

    def accept(self, n_accepted: int, next_token: int) -> None:
        if self._last is self.model:
            self.model.accept(n_accepted, next_token)
        # The lookup side learns at the next propose(), from what this round emitted (_settle).

    def _settle(self, context: Sequence[int]) -> None:
        """Tell the lookup how much of its last chain the target kept, read off the tokens the round emitted (the
        accepted path, then the target's token), whichever branch was accepted and whether or not its chain was
        verified at all (cut as untrusted): the token after the kept part is the target's own there."""
        if self._pending is None:
            return
        chain, before = self._pending
        self._pending = None
        emitted = [int(t) for t in context[before:]]
        n = 0
        while n < min(len(chain), len(emitted) - 1) and chain[n] == emitted[n]:
            n += 1
        if n < len(emitted):
            self.lookup.accept(n, emitted[n])


def merge_drafts(first: Draft, second: Draft, max_nodes: int, merge_equal: bool) -> Draft:
    """One tree holding both drafts under the round's input, `first`'s nodes first, cut at max_nodes nodes (a
    node whose parent was cut goes too).

    merge_equal (greedy): a node of `second` equal to a sibling already in the tree is that node, so shared
    prefixes are verified once (its confidence the higher of the two). Sampling keeps every node apart: each
    node's row must stay the law it was drawn from, and a duplicate is simply rejected (the residual has no mass
    left on its token). A deterministic draft's nodes (p_draft None) get one-hot rows when the other draft
    samples. The tree is scored only when both drafts are.
    """
    def nodes(d: Draft) -> tuple[np.ndarray, np.ndarray]:
        parents = d.parents if d.parents is not None else np.arange(d.tokens.shape[0]) - 1  # a chain
        return d.tokens, parents

    sampled = [d.p_draft for d in (first, second) if d.p_draft is not None]
    vocab = sampled[0].shape[1] if sampled else 0
    scored = first.confidence is not None and second.confidence is not None
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[np.ndarray] = []
    scores: list[float] = []
    for d in (first, second):
        where: dict[int, int] = {}  # d's node -> merged node
        for i, (token, parent) in enumerate(zip(*nodes(d))):
            up = -1 if parent < 0 else where.get(int(parent))
            if up is None:
                continue
            same = [j for j in range(len(tokens)) if parents[j] == up and tokens[j] == token] if merge_equal else []
            if same:
                where[i] = same[0]
                if scored:
                    scores[same[0]] = max(scores[same[0]], float(d.confidence[i]))
                continue
            if len(tokens) >= max_nodes:
                continue
            where[i] = len(tokens)
            tokens.append(int(token))
            parents.append(up)
            if scored:
                scores.append(float(d.confidence[i]))
            if sampled:
                if d.p_draft is None:
                    row = np.zeros(vocab, dtype=np.float32)  # [vocab]
                    row[token] = 1.0
                else:
                    row = d.p_draft[i]
                rows.append(row)
    return Draft(tokens=np.asarray(tokens, dtype=np.int64),
                 p_draft=np.asarray(rows, dtype=np.float32).reshape(len(tokens), vocab) if sampled else None,
                 parents=np.asarray(parents, dtype=np.int64),
                 confidence=np.asarray(scores, dtype=np.float64) if scored else None)
