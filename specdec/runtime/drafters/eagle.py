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
from specdec.runtime.drafters.base import Draft, Reliability, chain_with_leaves, sample_with_siblings
from specdec.runtime.drafters.draft_model import CONFIDENCE_STOP, draft_confidence
from specdec.runtime.sampling import SamplingConfig, probs_from_logits


def judged_nodes(chain: Sequence[int], scores: Sequence[float], leaves: Sequence[tuple[int, int, float]],
                 emitted: Sequence[int]) -> list[tuple[str, bool, float]]:
    """(kind, hit, score) of each node of a greedy draft that the target's tokens since (`emitted`) judge: the
    chain's node at depth i and the leaves beside it (token, depth, score) once the chain was right up to depth i
    and the target has emitted a token there. Greedy tokens are the target's argmax, so this holds whether or not
    the node was verified (the policy may have cut it)."""
    judged = []
    for i, (token, score) in enumerate(zip(chain, scores)):
        if i >= len(emitted):
            break
        judged.append(("chain", token == emitted[i], score))
        judged += [("leaf", leaf == emitted[i], s) for leaf, depth, s in leaves if depth == i]
        if token != emitted[i]:
            break
    return judged


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
        # Greedy drafts score each node by the head's softmax probability, which is not the chance that the target
        # agrees (a head trained here scored too low: its nodes scored 0.5-0.6 were right 69% of the time on
        # specdec's own held-out prompts, those scored 0.7-0.8 92%).
        # Kept across sequences: how the scores of chain nodes and of leaves (runners-up) translate on this
        # user's prompts. A node's confidence is its score times its kind's rate.
        self.calibration = {"chain": Reliability(1.0), "leaf": Reliability(1.0)}
        # The last greedy draft's chain and leaves with their scores, and the context length it was drafted
        # after: the target's tokens in the next round's context say which nodes were right (cut or not).
        self._pending: tuple[list[int], list[float], list[tuple[int, int, float]], int] | None = None

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
        self._pending = None

    def _settle(self, context: Sequence[int]) -> None:
        """Learn the calibration from the last greedy draft, judged by the target's tokens since (judged_nodes)."""
        if self._pending is not None:
            chain, scores, leaves, start = self._pending
            for kind, hit, score in judged_nodes(chain, scores, leaves, context[start:]):
                self.calibration[kind].learn(hit, score)
        self._pending = None

    def _calibrated(self, kind: str, score: float) -> float:
        return min(score * self.calibration[kind].rate, 1.0)

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
        self._settle(context)
        logits, feature = self._catch_up(context)
        tokens = np.empty(k, dtype=np.int64)  # [k]
        vocab_size = self.target.model.vocab_size
        p_draft = None if self.sampling.greedy else np.zeros((k, vocab_size), dtype=np.float32)  # [k, vocab]
        # Greedy: the head's probability of each node (its score), calibrated: the chance that the target agrees
        # once the parent was right.
        s_chain = np.zeros(k) if p_draft is None else None  # [k]
        n = k
        leaves: list[tuple[int, int]] = []  # (token, depth index) of the tree's extra leaves
        p_leaves: list[np.ndarray] = []  # sampling: the law each leaf was drawn from, [vocab] each
        s_leaves: list[float] = []  # greedy: each leaf's probability
        tree = any(self.siblings)
        try:
            for i in range(k):
                extra = self.siblings[i] if tree and i < len(self.siblings) else 0
                if p_draft is None:
                    j = int(np.argmax(logits))
                    s_chain[i] = draft_confidence(logits, j, None)
                    confidence = self._calibrated("chain", s_chain[i])
                    if extra:
                        best = np.argpartition(-logits, extra)[:extra + 1]  # [extra+1] unordered top
                        best = best[np.argsort(-logits[best])][1:]  # [extra] the runners-up, best first
                        leaves += [(int(self.vocab[t]), i) for t in best]
                        s_leaves += [s_chain[i] * float(np.exp(logits[t] - logits[j])) for t in best]
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
        c_chain = c_leaves = None
        if s_chain is not None:
            s_chain = s_chain[:n]
            self._pending = (tokens[:n].tolist(), s_chain.tolist(),
                             [(t, d, c) for (t, d), c in zip(leaves, s_leaves) if d < n], len(context))
            c_chain = np.asarray([self._calibrated("chain", c) for c in s_chain])  # [n]
            c_leaves = [self._calibrated("leaf", c) for c in s_leaves]
        if tree:
            return chain_with_leaves(tokens[:n], leaves, self.target.kv.max_len - n_target - 1, p_draft,
                                     None if p_draft is None else p_leaves, c_chain, c_leaves)
        return Draft(tokens=tokens[:n], p_draft=p_draft, confidence=c_chain)

    def accept(self, n_accepted: int, next_token: int) -> None:
        pass  # the target kept the accepted positions' features; the next propose reads them
