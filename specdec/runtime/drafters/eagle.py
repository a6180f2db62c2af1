"""EAGLE: a one-layer head drafting from the target's own residual stream.

The head's entry at position s is (feature f_s, token x_{s+1}), and it predicts f_{s+1}, read out by the
target's final norm and LM head rows of a draft vocabulary. The target keeps its last layer's residual stream
per cache slot (Decoder.keep_tap), so after each verification the head first catches up on the positions the
target has just computed (real features, kept in the head's own one-layer cache), then drafts step by step
from its own predicted features; those draft entries are dropped again (O(1): the head's cache length).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.runtime.decoder import MAX_STEP, Decoder
from specdec.runtime.drafters.base import Draft, chain_with_leaves, sample_with_siblings
from specdec.runtime.drafters.draft_model import CONFIDENCE_STOP, draft_confidence
from specdec.runtime.sampling import SamplingConfig, probs_from_logits


class EagleHead:
    """The head's graph, its draft vocabulary and what its one-layer cache holds: shared by every drafter that
    drafts from it (chain, tree, hybrid), so that switching between them keeps the cache's bookkeeping right."""

    def __init__(self, decoder: Decoder, vocab: np.ndarray) -> None:
        self.decoder = decoder
        self.vocab = np.asarray(vocab, dtype=np.int64)  # [N] target ids of the head's logits
        if decoder.model.vocab_size != len(self.vocab):
            raise ValueError(f"EAGLE head has {decoder.model.vocab_size} logits, its draft vocabulary {len(self.vocab)} ids")
        self.ids: list[int] = []  # cache entry s was made from ids[s] (its feature) and ids[s+1]


class EagleDrafter:
    def __init__(self, target: Decoder, head: EagleHead, confidence_stop: float = CONFIDENCE_STOP,
                 siblings: tuple[int, ...] = ()) -> None:
        """`siblings[d]`: the head's next-best tokens at draft depth d+1 (greedy; sampling: further draws without
        replacement) added as leaves beside the chain's token, on a tree-capable target; () drafts a plain chain."""
        if not 0.0 <= confidence_stop < 1.0:
            raise ValueError(f"confidence_stop must be in [0, 1), got {confidence_stop}")
        if any(n < 0 for n in siblings):
            raise ValueError(f"siblings must be >= 0, got {siblings}")
        if any(siblings) and not target.spec.has_tree_bias:
            raise ValueError("tree drafting needs a target graph with an attention_bias input")
        if head.decoder.model.hidden_size != target.model.hidden_size:
            raise ValueError("EAGLE head and target differ in hidden size")
        self.tap = target.model.n_layers  # the residual stream before the final norm
        target.keep_tap(self.tap)
        self.target, self.shared = target, head
        self.head, self.vocab = head.decoder, head.vocab
        self.confidence_stop = confidence_stop
        self.siblings = tuple(siblings)
        self.sampling = SamplingConfig()
        self.rng = np.random.default_rng(0)

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.sampling, self.rng = sampling, rng
        common = 0  # keep the head's entries for a prefix shared with the last sequence (a chat's earlier turns)
        for a, b in zip(self.shared.ids, prompt_ids):
            if a != b:
                break
            common += 1
        kept = max(common - 1, 0)  # entry s also depends on token s+1
        self.head.kv.truncate(kept)
        self.shared.ids = list(prompt_ids[:kept])

    def source(self, context: Sequence[int]) -> str:
        return "eagle"

    def _catch_up(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Add the head's entries for every position the target's cache holds; return the last step's
        logits [N] and predicted feature [hidden] (the target's next position)."""
        head, kv = self.head, self.head.kv
        n_target = int(self.target.kv.lengths[0])  # the target holds context[:-1]
        start = int(kv.lengths[0])
        logits = feature = None
        for lo in range(start, n_target, MAX_STEP):
            hi = min(lo + MAX_STEP, n_target)
            features = self.target.kept_tap(self.tap, lo, hi)[None]  # [1,T,hidden]
            tokens = np.asarray([context[lo + 1:hi + 1]], dtype=np.int64)  # [1,T]
            logits = head.forward(tokens, features=features)[0, -1].copy()  # [N]
            feature = head.hidden(1, hi - lo)[0, -1].copy()  # [hidden]
            kv.advance(hi - lo)
        self.shared.ids = list(context[:n_target])
        return logits, feature

    def propose(self, context: Sequence[int], k: int) -> Draft:
        head, kv = self.head, self.head.kv
        n_target = int(self.target.kv.lengths[0])
        k = min(k, kv.max_len - n_target)
        if k <= 0 or int(kv.lengths[0]) >= n_target:  # nothing new to draft from (cannot happen mid-generation)
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        logits, feature = self._catch_up(context)
        tokens = np.empty(k, dtype=np.int64)  # [k]
        vocab_size = self.target.model.vocab_size
        p_draft = None if self.sampling.greedy else np.zeros((k, vocab_size), dtype=np.float32)  # [k, vocab]
        n = k
        leaves: list[tuple[int, int]] = []  # (token, depth index) of the tree's extra leaves
        p_leaves: list[np.ndarray] = []  # sampling: the law each leaf was drawn from, [vocab] each
        tree = any(self.siblings)
        try:
            for i in range(k):
                extra = self.siblings[i] if tree and i < len(self.siblings) else 0
                if p_draft is None:
                    j = int(np.argmax(logits))
                    confidence = draft_confidence(logits, j, None)
                    if extra:
                        best = np.argpartition(-logits, extra)[:extra + 1]  # [extra+1] unordered top
                        leaves += [(int(self.vocab[t]), i) for t in best[np.argsort(-logits[best])][1:]]
                else:  # drafts come from the draft vocabulary only: p_draft is 0 elsewhere, still exact
                    p_small = probs_from_logits(logits, self.sampling)  # [N]
                    j, p_draft[i], siblings, laws = sample_with_siblings(p_small, extra, self.vocab, vocab_size, self.rng)
                    leaves += [(t, i) for t in siblings]
                    p_leaves += laws
                    confidence = float(p_small[j])
                tokens[i] = self.vocab[j]
                if i == k - 1 or confidence < self.confidence_stop:
                    n = i + 1
                    break
                logits = head.forward(tokens[i:i + 1][None, :], features=feature[None, None])[0, -1]  # [N]
                feature = head.hidden(1, 1)[0, -1].copy()  # [hidden]
                kv.advance(1)
        finally:
            kv.truncate(n_target)  # entries made from predicted features go; the real ones stay
        p_draft = None if p_draft is None else p_draft[:n]
        if tree:
            return chain_with_leaves(tokens[:n], leaves, self.target.kv.max_len - n_target - 1, p_draft,
                                     None if p_draft is None else p_leaves)
        return Draft(tokens=tokens[:n], p_draft=p_draft)

    def accept(self, n_accepted: int, next_token: int) -> None:
        pass  # the target kept the accepted positions' features; the next propose reads them
