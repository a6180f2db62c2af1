"""The draft / verify / accept loop. Plain decoding is the same loop with nothing drafted."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from specdec.runtime.acceptance import (greedy_accept_choices, speculative_accept, tree_attention_bias, tree_depths,
                                        tree_greedy_accept_choices, tree_speculative_accept)
from specdec.runtime.decoder import MAX_STEP, Decoder
from specdec.runtime.draft_len import DraftLenPolicy
from specdec.runtime.drafters.base import Draft, Drafter
from specdec.runtime.sampling import SamplingConfig, probs_from_logits, select_token

NO_DRAFT = Draft(tokens=np.zeros(0, dtype=np.int64))


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # verification passes, prefill not counted
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # rounds that proposed a token at position i
    accepted_at: list[int] = field(default_factory=list)  # rounds whose draft at position i was accepted
    prefill_s: float = 0.0  # = time to first token
    decode_s: float = 0.0

    def record(self, k: int, n_accepted: int) -> None:
        self.target_forwards += 1
        self.drafted += k
        self.accepted += n_accepted
        grow = k - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification pass (accepted drafts + the target's own token)."""
        return (self.accepted + self.target_forwards) / max(self.target_forwards, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the decode time (the first token comes from prefill)."""
        return max(self.new_tokens - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "target_forwards": self.target_forwards, "drafted": self.drafted, "accepted": self.accepted,
                "tau": round(self.tau, 4), "acceptance_rate": round(self.acceptance_rate, 4),
                "acceptance_by_position": [round(a / d, 4) if d else None
                                           for a, d in zip(self.accepted_at, self.drafted_at)],
                "ttft_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "decode_tok_s": round(self.decode_tok_s, 2)}


def verify_tree(target: Decoder, step: np.ndarray, draft: Draft, sampling: SamplingConfig,
                rng: np.random.Generator) -> tuple[list[int], int]:
    """One verification of a token tree step [1, n+1] (the round's input, then the nodes): every node at
    position length + depth, seeing only its ancestors; the accepted path's K/V then moved into chain order.
    Returns (the accepted nodes, the next token)."""
    start = int(target.kv.lengths[0])
    positions = start + np.concatenate([[0], tree_depths(draft.parents)])[None, :]  # [1, n+1]
    bias = tree_attention_bias(draft.parents, start)
    if sampling.greedy:
        choice = target.forward_choices(step, positions, bias=bias)[0]  # [n+1]
        path, token = tree_greedy_accept_choices(draft.tokens, draft.parents, choice)
    else:
        p_target = probs_from_logits(target.forward(step, positions, bias=bias)[0], sampling)  # [n+1, vocab]
        path, token = tree_speculative_accept(draft.tokens, draft.parents, draft.p_draft, p_target, rng)
    target.keep_path(start + 1, np.asarray(path, dtype=np.int64))
    return path, token


def verify_chain(target: Decoder, step: np.ndarray, draft: Draft, sampling: SamplingConfig,
                 rng: np.random.Generator) -> tuple[int, int]:
    """One verification of a chain step [1, k+1]. Greedy reads only the target's argmax per position (computed
    in the graph where it has that output). Returns (n_accepted, the next token)."""
    if sampling.greedy:
        return greedy_accept_choices(draft.tokens, target.forward_choices(step)[0])  # [k+1] choices
    p_target = probs_from_logits(target.forward(step)[0], sampling)  # [k+1, vocab]
    return speculative_accept(draft.tokens, draft.p_draft, p_target, rng)


def speculate(target: Decoder, drafter: Drafter | None, prompt_ids: Sequence[int], n_cached: int,
              draft_len: DraftLenPolicy, sampling: SamplingConfig, rng: np.random.Generator,
              stats: SpecStats, max_new_tokens: int | None = None) -> Iterator[list[int]]:
    """Yield the tokens of each round. The first `n_cached` prompt tokens are already in the target's KV.
    With `max_new_tokens`, a round drafts no more than the budget can still take: a draft past it would be
    verified only to be cut.

    Invariant: after a round the KV holds every emitted token but the last one, which is the next
    round's first input. Rejected drafts are never rolled back explicitly: their K/V lie past the valid
    length and the next step overwrites them.
    """
    kv = target.kv
    t0 = time.perf_counter()
    last_logits = target.prefill(np.asarray([prompt_ids[n_cached:]], dtype=np.int64))[0]  # [vocab]
    token = select_token(last_logits, sampling, rng)
    stats.prompt_tokens, stats.prefill_s = len(prompt_ids), time.perf_counter() - t0
    yield [token]
    n_new = 1
    context = [*prompt_ids, token]
    t0 = time.perf_counter()  # before begin(): a drafter's own prefill is a cost of decoding this way
    if drafter is not None:
        drafter.begin(prompt_ids, sampling, rng)
    try:
        while (room := kv.max_len - int(kv.lengths[0])) > 0:
            # a round emits its accepted drafts and one token of the target's own
            left = max_new_tokens - n_new if max_new_tokens is not None else room
            if left <= 0:
                return
            source = drafter.source(context) if drafter is not None else ""
            k = draft_len.next_k(min(room - 1, left - 1, MAX_STEP - 1), source) if drafter is not None else 0
            proposed = k > 0
            t_round = time.perf_counter()
            draft = draft_len.cut(drafter.propose(context, k), source) if proposed else NO_DRAFT
            t_drafted = time.perf_counter()
            step = np.asarray([[token, *draft.tokens]], dtype=np.int64)  # [1, k+1]
            if draft.parents is not None:
                accepted, token = verify_tree(target, step, draft, sampling, rng)
                n_accepted = len(accepted)
            else:
                n_accepted, token = verify_chain(target, step, draft, sampling, rng)
                accepted = list(range(n_accepted))
            t_verified = time.perf_counter()
            kv.advance(1 + n_accepted)
            if proposed:
                drafter.accept(n_accepted, token)
            if drafter is not None:  # the policy learns costs from plain rounds (k = 0) too
                draft_len.update(draft.k, n_accepted, t_drafted - t_round, t_verified - t_drafted, source,
                                 width=len(draft.tokens))
            stats.record(draft.k, n_accepted)
            new = [*map(int, draft.tokens[accepted]), token]
            context += new
            n_new += len(new)
            stats.decode_s = time.perf_counter() - t0
            yield new
    finally:
        stats.decode_s = time.perf_counter() - t0
