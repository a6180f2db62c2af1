"""The one protocol every drafter implements.

Lifecycle (after llama.cpp's common/speculative.h): `begin` with the prompt, then per round
`propose` -> the target verifies -> `accept` tells the drafter how many of its tokens survived
and which token the target emitted after them. A drafter never sees the target's KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from specdec.runtime.acceptance import check_tree, tree_depths
from specdec.runtime.sampling import SamplingConfig, sample_distinct

# A scored chain (its tokens carry confidences) is worth verifying up to its first token below this wherever no
# step costs are weighed (a fixed draft length; a hybrid's trust in its lookup): a token this unlikely does not
# pay for a wider step on its own. Replaying 52 greedy Spec-Bench answers through the corpus drafter at k = 4:
# 1.60x modelled with it, 1.52x without (fp32 step costs on 2 cores), 1.51x against 1.36x with the fast int4
# bundle's steeper ones. `--draft-len auto` weighs costs instead (draft_len.py).
MIN_CONFIDENCE = 0.3


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for the next positions, and the distribution each was drawn from.

    `p_draft` is None for deterministic drafters (n-gram, greedy chain): the acceptance rule
    then treats each draft as drawn from a one-hot distribution.
    """

    tokens: np.ndarray  # [k] int64
    # Row i: the law token i was drawn from. For a tree, given its ancestors and its earlier siblings (see
    # acceptance.tree_speculative_accept); None: every token deterministic.
    p_draft: np.ndarray | None = None  # [k, vocab] float32, rows sum to 1
    # A token tree: node i hangs under node parents[i], -1 being the round's input token. None: a chain, each
    # token under the one before. The target verifies every node in one step (tree attention mask).
    parents: np.ndarray | None = None  # [k] int64
    # The drafter's estimate that token i is accepted once its parent was (a chain's: the tokens before it). An
    # adaptive draft length keeps the nodes worth their verification's cost (draft_len.py).
    confidence: np.ndarray | None = None  # [k] float64 in [0, 1]

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise ValueError(f"draft tokens must be 1-D, got shape {self.tokens.shape}")
        if self.parents is not None:
            check_tree(self.parents)
            if self.parents.shape != self.tokens.shape:
                raise ValueError("a tree draft needs one parent per token")
        if self.p_draft is not None and self.p_draft.shape[0] != self.tokens.shape[0]:
            raise ValueError(
                f"p_draft has {self.p_draft.shape[0]} rows for {self.tokens.shape[0]} draft tokens"
            )
        if self.confidence is not None:
            if self.confidence.shape != self.tokens.shape:
                raise ValueError("confidence is one value per token of the draft")
            if not ((self.confidence >= 0) & (self.confidence <= 1)).all():
                raise ValueError("confidence values are probabilities in [0, 1]")

    def head(self, n: int) -> "Draft":
        """The chain's first n tokens (with their rows and confidences)."""
        if self.parents is not None:
            raise ValueError("head() cuts chains; a tree is pruned by its drafter")
        return Draft(tokens=self.tokens[:n], p_draft=None if self.p_draft is None else self.p_draft[:n],
                     confidence=None if self.confidence is None else self.confidence[:n])

    def sure(self, min_confidence: float = MIN_CONFIDENCE) -> "Draft":
        """A scored chain up to its first token whose confidence is below min_confidence; an unscored draft or a
        tree as it is."""
        if self.confidence is None or self.parents is not None:
            return self
        unsure = np.flatnonzero(self.confidence < min_confidence)
        return self.head(int(unsure[0])) if len(unsure) else self

    def reach(self) -> np.ndarray:
        """P(token i is accepted) [k]: the product of the confidences from the root down to it. Accepted paths
        start at the root, so the expected number of accepted tokens is reach().sum()."""
        if self.confidence is None:
            raise ValueError("reach() needs a scored draft")
        if self.parents is None:
            return np.cumprod(self.confidence)
        reach = np.empty(len(self.tokens))  # [k]
        for i, parent in enumerate(self.parents):  # parents precede children
            reach[i] = self.confidence[i] * (1.0 if parent < 0 else reach[parent])
        return reach

    def subtree(self, keep: np.ndarray) -> "Draft":
        """The tree's nodes `keep` (indices; every kept node's parent kept too), in their order."""
        keep = np.sort(np.asarray(keep, dtype=np.int64))
        if self.parents is None:
            raise ValueError("subtree() prunes trees; a chain is cut with head()")
        index = np.full(len(self.tokens) + 1, -2, dtype=np.int64)  # old node (+1, so -1 -> 0) -> new index
        index[0] = -1
        index[keep + 1] = np.arange(len(keep))
        parents = index[self.parents[keep] + 1]  # [n]
        if (parents == -2).any():
            raise ValueError("a kept node's parent was not kept")
        return Draft(tokens=self.tokens[keep], parents=parents,
                     p_draft=None if self.p_draft is None else self.p_draft[keep],
                     confidence=None if self.confidence is None else self.confidence[keep])

    @property
    def k(self) -> int:
        """Draft length: the number of tokens, or a tree's depth (the most it can get accepted)."""
        if self.parents is None:
            return int(self.tokens.shape[0])
        return int(tree_depths(self.parents).max(initial=0))


# Weight of a prior, in tokens tried: ~a dozen rounds of evidence outweigh it.
PRIOR_TRIALS = 30


@dataclass
class Reliability:
    """Running acceptance of one kind of draft token relative to the drafter's score for it (a corpus token's
    fitted probability, 1 for a lookup token, an EAGLE head's softmax probability): accepted tokens over the
    scores of the tokens tried. A token's confidence is its score times the rate, which calibrates the scores on
    the prompts this drafter actually meets.
    Starts as if PRIOR_TRIALS tokens had been tried at the prior rate, so one round cannot swing it."""

    prior: float
    hits: float = field(init=False)
    scores: float = field(init=False)

    def __post_init__(self) -> None:
        self.hits, self.scores = PRIOR_TRIALS * self.prior, float(PRIOR_TRIALS)

    @property
    def rate(self) -> float:
        return self.hits / self.scores

    def learn(self, hit: bool, score: float) -> None:
        self.hits += hit
        self.scores += score


def chain_with_leaves(chain: np.ndarray, leaves: list[tuple[int, int]], room: int,
                      p_chain: np.ndarray | None = None, p_leaves: list[np.ndarray] | None = None,
                      c_chain: np.ndarray | None = None, c_leaves: list[float] | None = None) -> Draft:
    """A tree draft: the chain, and beside its token at each depth that depth's leaves (token, depth index), hung
    under the previous chain node; parents before children. Nodes past `room` (the cache's free slots) are left
    out. Sampled drafts give each node's law: p_chain [len(chain), vocab] and p_leaves (one row per leaf); scored
    ones each node's confidence: c_chain [len(chain)] and c_leaves (one per leaf)."""
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[np.ndarray] = []
    scores: list[float] = []
    above = -1  # the previous chain node (-1: the root)
    for depth, t in enumerate(chain):
        if len(tokens) >= room:
            break
        here = len(tokens)
        nodes = [(int(t), None if p_chain is None else p_chain[depth], None if c_chain is None else c_chain[depth])]
        nodes += [(tok, None if p_leaves is None else p_leaves[j], None if c_leaves is None else c_leaves[j])
                  for j, (tok, d) in enumerate(leaves) if d == depth]
        for token, row, score in nodes:
            if len(tokens) < room:
                tokens.append(token)
                parents.append(above)
                rows.append(row)
                scores.append(score)
        above = here
    p_draft = None if p_chain is None else np.asarray(rows, dtype=np.float32).reshape(len(tokens), p_chain.shape[1])
    return Draft(tokens=np.asarray(tokens, dtype=np.int64), p_draft=p_draft,
                 parents=np.asarray(parents, dtype=np.int64),
                 confidence=None if c_chain is None else np.asarray(scores, dtype=np.float64))


def sample_with_siblings(p_small: np.ndarray, extra: int, vocab: np.ndarray, vocab_size: int,
                         rng: np.random.Generator) -> tuple[int, np.ndarray, list[int], list[np.ndarray]]:
    """A head's sampled draft at one depth: the chain's token and `extra` siblings, drawn without replacement from
    its law p_small [N] over the draft vocabulary `vocab` (target ids). Returns (the chain token's index in
    `vocab`, its law widened to the target's vocabulary [vocab_size], the siblings' target ids, each sibling's
    law [vocab_size]: p_small without the tokens drawn before it, as tree_speculative_accept needs)."""
    picks, laws = sample_distinct(p_small, 1 + extra, rng)  # [m], [m, N]
    wide = np.zeros((len(picks), vocab_size), dtype=np.float32)  # [m, vocab]
    wide[:, vocab] = laws
    return picks[0], wide[0], [int(vocab[t]) for t in picks[1:]], list(wide[1:])


@runtime_checkable
class Drafter(Protocol):
    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        """Start a new sequence whose prompt is `prompt_ids` (the target has prefilled it).

        A drafter that samples must process its logits with `sampling` exactly as the target's are
        processed, and draw from `rng`, so that rejection sampling stays lossless and seeded runs repeat.
        """

    def source(self, context: Sequence[int]) -> str:
        """Which of its sources the next propose(context, ...) will draft from ("lookup", "model"): an
        adaptive draft length keeps costs and acceptance per source (see draft_len.AdaptiveDraftLen)."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Propose up to `k` tokens following `context` (prompt + every emitted token).

        May return fewer than k tokens, or none (the target then decodes one token plainly).
        """

    def accept(self, n_accepted: int, next_token: int) -> None:
        """The first `n_accepted` proposed tokens were kept; the target then emitted `next_token`."""
