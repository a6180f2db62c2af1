"""LayerSkip self-speculation: the target's own first E layers draft, through a small exit head.

No second model: drafting runs the target's exit slice (runtime/split.py) over the target's KV cache, so the
K/V it writes for layers < E are exactly what verification needs, and verification computes only layers
>= E for the drafted positions. This drafter is the one that touches the target's cache (by design: the
sharing is the method); it leaves its valid length where it found it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.runtime.drafters.base import Draft
from specdec.runtime.drafters.draft_model import CONFIDENCE_STOP, draft_confidence
from specdec.runtime.sampling import SamplingConfig, probs_from_logits, sample
from specdec.runtime.split import ExitHead, SplitTarget


class LayerSkipDrafter:
    def __init__(self, target: SplitTarget, head: ExitHead, confidence_stop: float = CONFIDENCE_STOP) -> None:
        if not 0.0 <= confidence_stop < 1.0:
            raise ValueError(f"confidence_stop must be in [0, 1), got {confidence_stop}")
        self.target, self.head = target, head
        self.confidence_stop = confidence_stop
        self.sampling = SamplingConfig()
        self.rng = np.random.default_rng(0)

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.sampling, self.rng = sampling, rng  # the prompt is in the shared cache already

    def source(self, context: Sequence[int]) -> str:
        return "exit"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        target, kv = self.target, self.target.kv
        start = int(kv.lengths[0])
        pending = [int(t) for t in context[start:]]  # the emitted tokens the cache lacks (the last one)
        k = min(k, kv.max_len - start - len(pending))
        if k <= 0 or not pending:
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        vocab = self.head.vocab  # [N]
        tokens = np.empty(k, dtype=np.int64)  # [k]
        p_draft = None if self.sampling.greedy else np.zeros((k, target.model.vocab_size), dtype=np.float32)  # [k, vocab]
        residuals = []
        step = np.asarray([pending], dtype=np.int64)  # [1,T]
        n = k
        try:
            for i in range(k):
                target.exit.forward(step)
                residuals.append(target.exit.hidden(target.exit_layer, step.shape[1])[0].copy())  # [T, hidden]
                kv.advance(step.shape[1])
                logits = self.head.logits(residuals[-1][-1])  # [N]
                if p_draft is None:
                    j = int(np.argmax(logits))
                    confidence = draft_confidence(logits, j, None)
                else:  # drafts come from the draft vocabulary only: p_draft is 0 elsewhere, still exact
                    p_small = probs_from_logits(logits, self.sampling)  # [N]
                    j = sample(p_small, self.rng)
                    p_draft[i, vocab] = p_small
                    confidence = float(p_small[j])
                tokens[i] = vocab[j]
                step = tokens[i:i + 1][None, :]  # [1,1]
                if confidence < self.confidence_stop:
                    n = i + 1
                    break
        finally:
            kv.truncate(start)
        tokens = tokens[:n]  # [n]
        # Layers < E ran for pending + tokens[:n-1]; verification runs them for the last draft only.
        target.remember(start, pending + tokens[:-1].tolist(), np.concatenate(residuals, axis=0)[:len(pending) + n - 1])
        return Draft(tokens=tokens, p_draft=None if p_draft is None else p_draft[:n])

    def accept(self, n_accepted: int, next_token: int) -> None:
        pass  # the cache is the target's: its length moved with the verification
