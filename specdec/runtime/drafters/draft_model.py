"""A smaller (or quantized) decoder drafting autoregressively with its own KV cache."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.runtime.decoder import Decoder
from specdec.runtime.drafters.base import Draft
from specdec.runtime.sampling import SamplingConfig, probs_from_logits, sample

# Drafting stops after a token the draft model itself gives less than this probability: the target
# rarely accepts past such a token, so further draft steps are mostly wasted. The choice depends only
# on the draft's distribution, so the output (greedy or sampled) is unchanged. 0.4 is Hugging Face's
# default `assistant_confidence_threshold` for the same rule; 0 drafts the full length always.
CONFIDENCE_STOP = 0.4
# A long prompt is drafted from its first SINK tokens and its last WINDOW tokens only. Draft prefill
# runs the quantized kernels at wide steps, where they are slower per token than the fp32 target's
# (1.1 s vs 0.67 s for 256 tokens on a 2-core AVX2 CPU), and it cost a quarter of a Spec-Bench
# generation's time; the tokens near the end predict the next ones best. The first tokens stay
# because models park attention on them (attention sinks): a window without them drafts worse.
# The draft's positions are its own, so RoPE sees the window as contiguous text. None = no window.
DRAFT_SINK = 4
DRAFT_WINDOW = 128


def draft_confidence(logits: np.ndarray, token: int, p_row: np.ndarray | None) -> float:
    """The draft's probability of the token it chose: from its sampling distribution when it sampled,
    else the plain softmax at the argmax."""
    if p_row is not None:
        return float(p_row[token])
    return 1.0 / float(np.exp(logits - logits[token]).sum())


class ModelDrafter:
    """Drafts k tokens with k forwards of a draft decoder.

    `ids` mirrors what the draft KV holds. Each propose first feeds the context tokens the drafter has
    not seen (the target's correction or bonus token, or a new prompt), then drafts one token per step.
    """

    def __init__(self, decoder: Decoder, confidence_stop: float = CONFIDENCE_STOP,
                 window: int | None = DRAFT_WINDOW) -> None:
        if not 0.0 <= confidence_stop < 1.0:
            raise ValueError(f"confidence_stop must be in [0, 1), got {confidence_stop}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.decoder = decoder
        self.confidence_stop = confidence_stop
        self.window = window
        self.ids: list[int] = []  # the context the drafter has seen; the KV holds it minus a skipped span
        self._skip = (0, 0)  # (start, length) of the span of `ids` left out of the draft KV
        self.sampling = SamplingConfig()
        self.rng = np.random.default_rng(0)
        self._proposed: list[int] = []

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.sampling, self.rng = sampling, rng
        # Keep the cached prefix shared with the new prompt (a chat's earlier turns): O(1) rollback.
        common = 0
        for a, b in zip(self.ids, prompt_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt_ids) - 1)  # leave one token for propose to feed
        start, n_skipped = self._skip
        if n_skipped and common < start + n_skipped:  # cutting into the skipped span: start over
            common, self._skip = 0, (0, 0)
        self.ids = self.ids[:common]
        self.decoder.kv.truncate(common - self._skip[1])
        # Prefill the prompt now rather than in the first propose(): it is the prompt's cost, not a
        # round's, and a policy timing rounds (draft_len="auto") must not take it for a draft step.
        self._catch_up(prompt_ids[common:-1])

    def _catch_up(self, tokens: Sequence[int]) -> np.ndarray | None:
        """Feed context tokens the draft KV lacks (a long run of them windowed, DRAFT_WINDOW); return the draft's
        logits [vocab] after the last of them (None when there were none)."""
        feed = list(tokens)
        if self.window is not None and not self._skip[1]:
            sink = max(0, DRAFT_SINK - len(self.ids))  # sink tokens still to come from this feed
            n_skipped = len(feed) - sink - self.window
            if n_skipped > 0:
                self._skip = (len(self.ids) + sink, n_skipped)
                feed = feed[:sink] + feed[sink + n_skipped:]
        self.ids += list(tokens)
        if not feed:
            return None
        return self.decoder.prefill(np.asarray([feed], dtype=np.int64))[0]  # [vocab]

    def source(self, context: Sequence[int]) -> str:
        return "model"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        dec, kv = self.decoder, self.decoder.kv
        pending = list(context[len(self.ids):])
        k = min(k, kv.max_len - int(kv.lengths[0]) - len(pending) + 1)
        if k <= 0 or not pending:
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        # The tokens the target settled since the last round (its correction or bonus token, and the accepted
        # drafts the draft KV lacks) go in one step with the first draft's: one forward, not one per token.
        logits = self._catch_up(pending)  # [vocab]
        step = np.zeros((1, 1), dtype=np.int64)  # [1,1]
        tokens = np.empty(k, dtype=np.int64)  # [k]
        p_draft = None if self.sampling.greedy else np.empty((k, dec.model.vocab_size), dtype=np.float32)  # [k, vocab]
        n = k
        for i in range(k):
            if i:
                logits = dec.forward(step)[0, -1]  # [vocab]
                kv.advance(1)
            if p_draft is None:
                tokens[i] = int(np.argmax(logits))
            else:
                p_draft[i] = probs_from_logits(logits, self.sampling)
                tokens[i] = sample(p_draft[i], self.rng)
            step[0, 0] = tokens[i]
            if draft_confidence(logits, tokens[i], None if p_draft is None else p_draft[i]) < self.confidence_stop:
                n = i + 1
                break
        tokens = tokens[:n]  # [n]
        p_draft = None if p_draft is None else p_draft[:n]  # [n, vocab]
        # The KV now holds pending + tokens[:n-1]; the last draft was never fed.
        self._proposed = tokens[:-1].tolist()
        self.ids += self._proposed
        return Draft(tokens=tokens, p_draft=p_draft)

    def accept(self, n_accepted: int, next_token: int) -> None:
        n_kept = min(n_accepted, len(self._proposed))
        keep = len(self.ids) - len(self._proposed) + n_kept
        self.ids = self.ids[:keep]
        self.decoder.kv.truncate(keep - self._skip[1])
