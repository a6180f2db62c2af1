"""How many tokens to draft per round: fixed, or chosen from measured acceptance and measured costs.

With per-token acceptance probability a, drafting k tokens yields (1 - a^(k+1)) / (1 - a) tokens per
round on average (Leviathan et al. 2023) and costs k draft steps plus one verification of k+1 tokens.
Verification cost grows with T at a rate that depends on the graph (fp32 on this CPU: 5 tokens cost
1.2x one; int4: 2.2x, FACTS), so it is measured per T on the device, not assumed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from specdec.runtime.drafters.base import MIN_CONFIDENCE, Draft

# Weight of the newest round in the running acceptance estimate: ~10 rounds of memory, so the
# policy follows a prompt that switches from copying (n-gram hits) to free writing within a sentence.
# A round of t trials counts as t observations (weight 1 - (1 - ACCEPT_EMA)^t), so one long draft
# that is fully accepted moves the estimate as much as several one-token probes.
ACCEPT_EMA = 0.1
# Prior acceptance before any round is seen. Optimistic on purpose: a drafter that disappoints is
# dropped after a round or two, while one written off on a pessimistic prior waits PROBE_EVERY rounds
# per probe to be tried again.
ACCEPT_PRIOR = 0.8
# Weight of the newest timing in the running step costs: the calibration's costs are a start, measured
# at an empty cache and perhaps while the machine was busy; the steps actually run correct them.
COST_EMA = 0.2
# While the policy thinks drafting does not pay, it still drafts one token every this many rounds:
# not drafting teaches nothing about acceptance, and a drafter written off on a poor prior or one
# hard passage would otherwise never be tried again.
PROBE_EVERY = 8
# A step width whose cost no round has timed for this many rounds gets one round now and then: the cut keeps one
# token more than it chose. Step costs are kept between runs (step_costs.py), so a width timed while the machine
# was busy would otherwise look dear for ever, never be chosen, and never be timed again (seen here: a cache entry
# with the 2-token step at 74 ms against 22 ms made corpus:auto run 1.09x instead of 1.47x over plain decoding).
PROBE_STALE_ROUNDS = 32
# Timing repetitions per step width at calibration; the median of 3 is robust to one scheduler hiccup.
CALIBRATION_REPS = 3


class DraftLenPolicy(Protocol):
    def next_k(self, limit: int, source: str = "") -> int:
        """Tokens to draft this round (<= limit) from `source` (the drafter's, see Drafter.source)."""

    def update(self, k: int, n_accepted: int, draft_s: float | None = None,
               verify_s: float | None = None, source: str = "", width: int | None = None) -> None:
        """After a round that drafted k tokens deep from `source`: how many were accepted, and (if timed) what
        drafting and the verification of `width` drafted tokens (default k; a tree's node count) took."""

    def cut(self, draft: Draft, source: str = "") -> Draft:
        """The part of a draft (from `source`) worth verifying: the whole draft unless it carries confidences,
        which the policy weighs."""


@dataclass
class FixedDraftLen:
    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"draft length must be >= 0, got {self.k}")

    def next_k(self, limit: int, source: str = "") -> int:
        return min(self.k, limit)

    def cut(self, draft: Draft, source: str = "") -> Draft:
        return draft.sure(MIN_CONFIDENCE)  # a fixed length verifies what the drafter proposed, but sure tokens only

    def update(self, k: int, n_accepted: int, draft_s: float | None = None,
               verify_s: float | None = None, source: str = "", width: int | None = None) -> None:
        pass


@dataclass
class SourceEstimate:
    """What the policy knows of one draft source: its running acceptance and cost per drafted token."""

    draft_s: float
    acceptance: float = ACCEPT_PRIOR
    idle_rounds: int = 0


@dataclass
class AdaptiveDraftLen:
    """Picks k maximising expected tokens per second from measured costs and running acceptance rates.

    A drafter may draft from several sources (the hybrid: prompt lookup, free and right or wrong in long
    runs; a draft model, dear and right most of the time). Each source gets its own estimates, so one
    source's cost or acceptance never talks the policy out of drafting from the other.
    """

    verify_s: list[float]  # verify_s[T-1]: seconds of a target step of width T, T = 1..k_max+1
    draft_s: float  # starting seconds per drafted token of a source without its own in source_draft_s
    acceptance: float = ACCEPT_PRIOR  # starting acceptance of every source
    source_draft_s: dict[str, float] = field(default_factory=dict)  # measured cost per token of named sources
    history: list[int] = field(default_factory=list)  # chosen k per round, for stats
    _sources: dict[str, SourceEstimate] = field(default_factory=dict)  # running estimates, by source
    _scored: set[str] = field(default_factory=set)  # sources whose drafts carry confidences: cut, not capped
    _rounds: int = 0  # rounds seen by update()
    _timed: dict[int, int] = field(default_factory=dict)  # verify_s index -> the round that last timed it

    def __post_init__(self) -> None:
        if len(self.verify_s) < 2:
            raise ValueError("need verification costs for at least T = 1 and 2")

    @property
    def k_max(self) -> int:
        return len(self.verify_s) - 1

    def estimate(self, source: str = "") -> SourceEstimate:
        """The running estimates of `source` ("" for a drafter with one source)."""
        if source not in self._sources:
            self._sources[source] = SourceEstimate(draft_s=self.source_draft_s.get(source, self.draft_s),
                                                   acceptance=self.acceptance)
        return self._sources[source]

    def expected_rate(self, k: int, source: str = "") -> float:
        est = self.estimate(source)
        a = min(est.acceptance, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (k * est.draft_s + self.verify_s[k])

    def cut(self, draft: Draft, source: str = "") -> Draft:
        """Keep the d leading tokens that maximise expected tokens per second of verification, where token i
        survives with the product of the confidences up to it: on a CPU the first drafted token widens the step
        most (fp32 SmolLM2 on 2 cores: 20.3 / 24.0 / 24.8 / 25.6 / 27.1 ms at T = 1..5), so a shaky draft is
        better dropped whole, and a sure one run long."""
        if draft.confidence is None or draft.k == 0:
            return draft
        self._scored.add(source)
        reach = draft.reach()  # [n] P(token i accepted)
        # The nodes by reach, a parent before its children where they tie (a child never reaches further than
        # its parent, so every leading set is a tree); a chain's are in order already.
        order = np.lexsort((np.arange(len(reach)), -reach))[: self.k_max]  # [d]
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach[order])])  # [d+1] tokens per round if d are kept
        # A wider step never costs less: the running maximum irons out timing noise that would otherwise make
        # some width look like a bargain.
        cost = np.maximum.accumulate(np.asarray(self.verify_s[: len(expected)]))  # [d+1]
        d = int(np.argmax(expected / cost))
        if d < len(order) and self._stale(d + 1):
            d += 1
        if draft.parents is None:
            return draft.head(d)
        return draft.subtree(order[:d]) if d else Draft(tokens=np.zeros(0, dtype=np.int64))

    def _stale(self, k: int) -> bool:
        """Whether no round has timed a k-token draft's step for PROBE_STALE_ROUNDS rounds (then one should). Never
        for a policy whose rounds are not timed (a batched row's): a probe there would teach nothing."""
        return bool(self._timed) and self._rounds - self._timed.get(k, 0) >= PROBE_STALE_ROUNDS

    def next_k(self, limit: int, source: str = "") -> int:
        if source in self._scored:
            # Its tokens come scored one by one, so the cut sees where the draft stops paying better than an
            # average acceptance rate can: ask for the longest draft. Corpus drafter, modelled on replayed answers
            # with the fast int4 bundle's step costs: 1.67x against 1.62x when capped by the rate (Spec-Bench),
            # 1.66x against 1.60x (specdec's own held-out prompts); with fp32's, level (1.66x / 1.65x both ways).
            k = min(self.k_max, limit)
            self.history.append(k)
            return k
        est = self.estimate(source)
        k = max(range(min(self.k_max, limit) + 1), key=lambda k: self.expected_rate(k, source))
        est.idle_rounds = est.idle_rounds + 1 if k == 0 else 0
        if est.idle_rounds >= PROBE_EVERY and limit > 0:
            k, est.idle_rounds = 1, 0
        elif 0 < k < min(self.k_max, limit) and self._stale(k + 1):  # drafting anyway: one token more, now and then
            k += 1
        self.history.append(k)
        return k

    def update(self, k: int, n_accepted: int, draft_s: float | None = None,
               verify_s: float | None = None, source: str = "", width: int | None = None) -> None:
        self._rounds += 1
        width = k if width is None else width
        if verify_s is not None and width < len(self.verify_s):
            self._timed[width] = self._rounds
            if verify_s < self.verify_s[width] / 2:  # a stale estimate (timed on a busy machine): start afresh
                self.verify_s[width] = verify_s
            else:
                self.verify_s[width] += COST_EMA * (verify_s - self.verify_s[width])
        if k == 0:
            return
        est = self.estimate(source)
        if draft_s is not None:
            est.draft_s += COST_EMA * (draft_s / k - est.draft_s)
        # Positions tried: the accepted ones plus the first rejection (if any); a geometric-trial estimate.
        trials = n_accepted + (n_accepted < k)
        weight = 1.0 - (1.0 - ACCEPT_EMA) ** trials
        est.acceptance += weight * (n_accepted / trials - est.acceptance)


def choose_policy(draft_len: int | str, drafting: bool,
                  costs: Callable[[], tuple]) -> DraftLenPolicy | None:
    """None means plain decoding (no drafter, or a length of 0); else a fixed length, or an adaptive one
    built from `costs()` = (verify seconds by width 1..k_max+1, draft seconds per token, ...), called only then."""
    if not drafting or draft_len == 0:
        return None
    if draft_len != "auto":
        return FixedDraftLen(int(draft_len))
    verify_s, draft_s = costs()[:2]
    return AdaptiveDraftLen(verify_s=list(verify_s), draft_s=draft_s)


def median_seconds(fn: Callable[[], object], reps: int = CALIBRATION_REPS) -> float:
    fn()  # warm-up: first runs pay for allocation and kernel selection
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
