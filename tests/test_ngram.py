"""NgramDrafter: prompt lookup, checked against a brute-force search of the whole context."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.runtime.drafters.base import Draft, Drafter
from specdec.runtime.drafters.ngram import NgramConfig, NgramDrafter
from specdec.runtime.sampling import SamplingConfig


def started(prompt, max_ngram=3, min_ngram=1) -> NgramDrafter:
    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    drafter.begin(prompt, SamplingConfig(), np.random.default_rng(0))
    return drafter


def brute_force(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The spec, written plainly: latest earlier occurrence of the longest matching tail, then
    copy what followed it, reading on from the proposal where the copy reaches the end."""
    length = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length:
            continue
        for end in range(length - 1, n - 1, -1):  # occurrences ending before the tail does
            if context[end - n:end] == context[length - n:]:
                extended = list(context)
                for _ in range(k):
                    extended.append(extended[len(extended) - (length - end)])
                return extended[length:]
    return []


def test_is_a_drafter():
    assert isinstance(NgramDrafter(), Drafter)


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 0), (2, 3), (0, 0)])
def test_config_is_validated(max_ngram, min_ngram):
    with pytest.raises(ValueError):
        NgramConfig(max_ngram=max_ngram, min_ngram=min_ngram)
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


def test_proposes_what_followed_an_earlier_match():
    context = [5, 6, 7, 8, 9, 1, 5, 6]
    draft = started(context).propose(context, 3)
    assert isinstance(draft, Draft) and draft.p_draft is None
    assert draft.tokens.dtype == np.int64
    assert draft.tokens.tolist() == [7, 8, 9]


def test_k_truncates():
    context = [5, 6, 7, 8, 9, 1, 5, 6]
    drafter = started(context)
    assert drafter.propose(context, 1).tokens.tolist() == [7]
    assert drafter.propose(context, 0).tokens.shape == (0,)


def test_prefers_the_longer_ngram():
    # Tail [1, 2]: the 1-gram [2] last occurred before 9, but the 2-gram [1, 2] before 7.
    context = [1, 2, 7, 3, 2, 9, 1, 2]
    assert started(context).propose(context, 1).tokens.tolist() == [7]
    assert started(context, max_ngram=1).propose(context, 1).tokens.tolist() == [9]


def test_prefers_the_most_recent_occurrence():
    context = [4, 1, 4, 2, 4]
    assert started(context).propose(context, 1).tokens.tolist() == [2]


def test_no_match_gives_an_empty_draft():
    context = [1, 2, 3, 4]
    draft = started(context).propose(context, 4)
    assert draft.tokens.shape == (0,) and draft.k == 0
    assert started([]).propose([], 4).k == 0


def test_min_ngram_forbids_short_matches():
    context = [1, 2, 3, 9, 3]  # only a 1-gram match exists
    assert started(context, min_ngram=2).propose(context, 2).k == 0
    assert started(context, min_ngram=1).propose(context, 2).tokens.tolist() == [9, 3]


def test_a_loop_keeps_its_period():
    context = [1, 2, 3, 1, 2, 3, 1]
    assert started(context).propose(context, 5).tokens.tolist() == [2, 3, 1, 2, 3]
    assert started([7, 7]).propose([7, 7], 4).tokens.tolist() == [7, 7, 7, 7]


def test_follows_a_growing_context():
    drafter = started([1, 2, 3, 4])
    assert drafter.propose([1, 2, 3, 4], 2).k == 0
    # Several tokens arrive between calls, with accept() told only about the last round.
    drafter.accept(0, 9)
    assert drafter.propose([1, 2, 3, 4, 9, 8, 1, 2], 2).tokens.tolist() == [3, 4]
    drafter.accept(2, 5)
    assert drafter.propose([1, 2, 3, 4, 9, 8, 1, 2, 3, 4, 5, 9], 3).tokens.tolist() == [8, 1, 2]


def test_restarts_when_the_context_is_not_an_extension():
    drafter = started([1, 2, 3, 1])
    assert drafter.propose([1, 2, 3, 1], 1).tokens.tolist() == [2]
    assert drafter.propose([4, 5, 4], 1).tokens.tolist() == [5]  # shorter: re-indexed
    assert drafter.propose([4, 6, 6, 4], 1).tokens.tolist() == [6]  # same length, new tokens


def test_begin_forgets_the_previous_sequence():
    drafter = started([1, 2, 3, 1])
    drafter.begin([8, 9], SamplingConfig(), np.random.default_rng(0))
    assert drafter.propose([8, 9, 1], 2).k == 0


def test_numpy_context():
    context = np.array([5, 6, 7, 5], dtype=np.int64)
    assert started(context).propose(context, 2).tokens.tolist() == [6, 7]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    prompt_len=st.integers(0, 60),
    steps=st.lists(st.integers(1, 5), max_size=20),
    k=st.integers(0, 6),
    ngram=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_matches_brute_force_as_the_context_grows(tokens, prompt_len, steps, k, ngram):
    min_ngram, extra = ngram
    drafter = started(tokens[:prompt_len], max_ngram=min_ngram + extra, min_ngram=min_ngram)
    end = min(prompt_len, len(tokens))
    for step in [0, *steps]:
        end = min(end + step, len(tokens))
        context = tokens[:end]
        expected = brute_force(context, k, min_ngram + extra, min_ngram)
        assert drafter.propose(context, k).tokens.tolist() == expected


def test_long_context_is_fast():
    import time

    rng = np.random.default_rng(0)
    context = rng.integers(0, 50, size=4000).tolist()
    drafter = started(context[:500])
    start = time.perf_counter()
    for end in range(500, 4000, 4):  # 875 rounds, a few tokens each
        drafter.propose(context[:end], 8)
    # Re-scanning 4k tokens per call would take seconds; the index makes it milliseconds.
    assert time.perf_counter() - start < 1.0
