"""Medusa: K heads on the target's last hidden state guess the K tokens after its next one, in one small run.

The target keeps its residual stream per cache slot (Decoder.keep_tap); the state at the last slot is the one
whose LM head produced the round's input token, so head i's guess is the token i+1 places after that input.
No draft cache and no draft steps: a round costs one run of the heads graph, whatever k is.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.runtime.decoder import Decoder
from specdec.runtime.drafters.base import Draft, chain_with_leaves, sample_with_siblings
from specdec.runtime.drafters.draft_model import CONFIDENCE_STOP, draft_confidence
from specdec.runtime.sampling import SamplingConfig, probs_from_logits
from specdec.runtime.split import ExitHead


class MedusaDrafter:
    def __init__(self, target: Decoder, heads: ExitHead, confidence_stop: float = CONFIDENCE_STOP,
                 siblings: tuple[int, ...] = ()) -> None:
        """`heads` maps a residual stream [hidden] to logits [K, N] over heads.vocab; `siblings[d]` next-best
        guesses of head d (sampling: further draws without replacement) become leaves beside the chain
        (tree-capable target only)."""
        if not 0.0 <= confidence_stop < 1.0:
            raise ValueError(f"confidence_stop must be in [0, 1), got {confidence_stop}")
        if any(siblings) and not target.spec.has_tree_bias:
            raise ValueError("tree drafting needs a target graph with an attention_bias input")
        self.tap = target.model.n_layers
        target.keep_tap(self.tap)
        self.target, self.heads = target, heads
        self.confidence_stop, self.siblings = confidence_stop, tuple(siblings)
        self.sampling = SamplingConfig()
        self.rng = np.random.default_rng(0)

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.sampling, self.rng = sampling, rng

    def source(self, context: Sequence[int]) -> str:
        return "medusa"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        n_target = int(self.target.kv.lengths[0])
        logits = self.heads.logits(self.target.kept_tap(self.tap, n_target - 1, n_target)[0])  # [K, N]
        k = min(k, logits.shape[0], self.target.kv.max_len - n_target - 1)
        vocab = self.heads.vocab
        greedy = self.sampling.greedy
        vocab_size = self.target.model.vocab_size
        tokens = np.empty(max(k, 0), dtype=np.int64)  # [k]
        p_draft = None if greedy else np.zeros((max(k, 0), vocab_size), dtype=np.float32)  # [k, vocab]
        leaves: list[tuple[int, int]] = []
        p_leaves: list[np.ndarray] = []  # sampling: the law each leaf was drawn from, [vocab] each
        n = max(k, 0)
        for i in range(max(k, 0)):
            row = logits[i]  # [N]
            extra = self.siblings[i] if i < len(self.siblings) else 0
            if greedy:
                j = int(np.argmax(row))
                confidence = draft_confidence(row, j, None)
                if extra:
                    best = np.argpartition(-row, extra)[:extra + 1]
                    leaves += [(int(vocab[t]), i) for t in best[np.argsort(-row[best])][1:]]
            else:  # each head's own distribution: a valid proposal for its position (it ignores earlier drafts)
                p_small = probs_from_logits(row, self.sampling)  # [N]
                j, p_draft[i], siblings, laws = sample_with_siblings(p_small, extra, vocab, vocab_size, self.rng)
                leaves += [(t, i) for t in siblings]
                p_leaves += laws
                confidence = float(p_small[j])
            tokens[i] = vocab[j]
            if confidence < self.confidence_stop:
                n = i + 1
                break
        p_draft = None if p_draft is None else p_draft[:n]
        if any(self.siblings):
            return chain_with_leaves(tokens[:n], leaves, self.target.kv.max_len - n_target - 1, p_draft,
                                     None if greedy else p_leaves)
        return Draft(tokens=tokens[:n], p_draft=p_draft)

    def accept(self, n_accepted: int, next_token: int) -> None:
        pass  # the target kept the accepted positions' states; the next propose reads the last one
