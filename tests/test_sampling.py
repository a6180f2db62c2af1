"""probs_from_logits / sample / select_token: hand-computed cases and hypothesis properties."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specdec.runtime.sampling import SamplingConfig, probs_from_logits, sample, select_token

LOG_P = np.log(np.array([0.5, 0.3, 0.2]))  # logits whose softmax at temperature 1 is [0.5, 0.3, 0.2]


class FixedDraw:
    """Stands in for a Generator whose next random() is chosen by the test (edges of [0, 1))."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def test_temperature_one_is_softmax():
    np.testing.assert_allclose(probs_from_logits(LOG_P, SamplingConfig(temperature=1.0)), [0.5, 0.3, 0.2])


def test_temperature_sharpens_and_flattens():
    # p ** (1/T) renormalised.
    for t in (0.5, 2.0):
        expected = np.array([0.5, 0.3, 0.2]) ** (1 / t)
        np.testing.assert_allclose(probs_from_logits(LOG_P, SamplingConfig(temperature=t)), expected / expected.sum())


def test_top_k_keeps_the_k_largest():
    np.testing.assert_allclose(probs_from_logits(LOG_P, SamplingConfig(temperature=1.0, top_k=2)), [0.625, 0.375, 0.0])


def test_top_k_ties_keep_the_lowest_index():
    probs = probs_from_logits(np.array([1.0, 2.0, 2.0, 2.0]), SamplingConfig(temperature=1.0, top_k=2))
    np.testing.assert_allclose(probs, [0.0, 0.5, 0.5, 0.0])
    # Long enough that an unstable sort (numpy's introsort beyond 16 elements) would reorder ties.
    probs = probs_from_logits(np.tile([1.0, 2.0], 50), SamplingConfig(temperature=1.0, top_k=5))
    np.testing.assert_array_equal(np.flatnonzero(probs), [1, 3, 5, 7, 9])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    cfg = SamplingConfig(temperature=1.0, top_p=0.6)  # 0.5 < 0.6 <= 0.5 + 0.3
    np.testing.assert_allclose(probs_from_logits(LOG_P, cfg), [0.625, 0.375, 0.0])
    cfg = SamplingConfig(temperature=1.0, top_p=0.5)  # the top token alone reaches 0.5
    np.testing.assert_allclose(probs_from_logits(LOG_P, cfg), [1.0, 0.0, 0.0])
    cfg = SamplingConfig(temperature=1.0, top_p=0.01)  # tiny p still keeps the top token
    np.testing.assert_allclose(probs_from_logits(LOG_P, cfg), [1.0, 0.0, 0.0])


def test_top_p_applies_after_top_k():
    # After top-k=2 the distribution is [0.625, 0.375]; top_p=0.6 then keeps only the first.
    cfg = SamplingConfig(temperature=1.0, top_k=2, top_p=0.6)
    np.testing.assert_allclose(probs_from_logits(LOG_P, cfg), [1.0, 0.0, 0.0])


def test_greedy_is_one_hot_at_lowest_argmax():
    probs = probs_from_logits(np.array([[0.0, 3.0, 3.0], [5.0, -1.0, 5.0]]), SamplingConfig())
    np.testing.assert_array_equal(probs, [[0, 1, 0], [1, 0, 0]])


def test_masked_logits_get_zero_mass():
    probs = probs_from_logits(np.array([0.0, -np.inf, 0.0]), SamplingConfig(temperature=0.7))
    np.testing.assert_allclose(probs, [0.5, 0.0, 0.5])
    # top-k wider than the unmasked tokens keeps them all and still gives the masked ones nothing.
    probs = probs_from_logits(np.array([-np.inf, 1.0, -np.inf, -np.inf]), SamplingConfig(temperature=1.0, top_k=2))
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("bad", [[-np.inf, -np.inf], [0.0, np.nan], [np.inf, 0.0]])
def test_unusable_logits_raise(bad):
    with pytest.raises(ValueError):
        probs_from_logits(np.array(bad), SamplingConfig(temperature=1.0))


@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=1.3),
    SamplingConfig(temperature=0.9, top_k=7),
    SamplingConfig(temperature=0.9, top_p=0.8),
    SamplingConfig(temperature=0.9, top_k=7, top_p=0.8),
])
@pytest.mark.parametrize("vocab, scale", [
    (64, 1.0),
    (3000, 1.5),  # the first 1024 tokens hold ~0.89 >= top_p: only they are sorted, normalised over all
    (3000, 0.1),  # flat: it does not, and the whole vocab is sorted
])
def test_matches_a_full_sort_reference(cfg, vocab, scale):
    # The implementation avoids sorting where it can; the plain one-sort recipe must agree.
    logits = np.round(np.random.default_rng(2).normal(size=(5, vocab)) * scale, 1)  # rounded: plenty of ties
    scaled = logits / cfg.temperature
    order = np.argsort(-scaled, axis=1, kind="stable")
    p = np.exp(np.take_along_axis(scaled, order, axis=1) - scaled.max(axis=1, keepdims=True))
    if cfg.top_k:
        p[:, cfg.top_k:] = 0.0
    p /= p.sum(axis=1, keepdims=True)
    p = np.where(np.cumsum(p, axis=1) - p < cfg.top_p, p, 0.0)
    p /= p.sum(axis=1, keepdims=True)
    expected = np.zeros_like(p)
    np.put_along_axis(expected, order, p, axis=1)
    np.testing.assert_allclose(probs_from_logits(logits, cfg), expected, rtol=1e-12, atol=1e-15)


def test_rows_match_one_row_at_a_time():
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    cfg = SamplingConfig(temperature=0.8, top_k=10, top_p=0.7)
    batched = probs_from_logits(logits, cfg)
    for row, probs in zip(logits, batched):
        np.testing.assert_array_equal(probs_from_logits(row, cfg), probs)


def test_sample_never_picks_zero_mass_at_the_edges_of_u():
    probs = np.array([0.0, 0.5, 0.5, 0.0])
    assert sample(probs, FixedDraw(0.0)) == 1  # u = 0 sits on token 0's empty interval
    assert sample(probs, FixedDraw(0.5)) == 2
    assert sample(probs, FixedDraw(np.nextafter(1.0, 0.0))) == 2  # u*total may round to total


@settings(max_examples=150, deadline=None)
@given(probs=hnp.arrays(np.float64, st.integers(1, 20), elements=st.floats(0, 1)))
def test_sample_stays_in_range_for_the_largest_u(probs):
    # Why sample() needs no clamp: the largest random() times any total stays below the total.
    if probs.sum() > 1e-300:
        token = sample(probs, FixedDraw(np.nextafter(1.0, 0.0)))
        assert token < probs.shape[0] and probs[token] > 0


def test_sample_matches_the_distribution():
    rng = np.random.default_rng(1)
    probs = np.array([0.1, 0.0, 0.6, 0.3], dtype=np.float32)
    counts = np.bincount([sample(probs, rng) for _ in range(20_000)], minlength=4) / 20_000
    np.testing.assert_allclose(counts, probs, atol=0.015)
    assert counts[1] == 0


def test_sample_rejects_empty_distribution():
    with pytest.raises(ValueError):
        sample(np.zeros(3), np.random.default_rng(0))


def test_select_token_greedy_uses_no_randomness():
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    assert select_token(np.array([0.1, 2.0, 2.0]), SamplingConfig(), rng) == 1
    assert rng.bit_generator.state == state


def test_select_token_samples_repeatably():
    cfg = SamplingConfig(temperature=1.0, top_k=2)
    draws = [[select_token(LOG_P, cfg, rng) for _ in range(50)] for rng in (np.random.default_rng(7), np.random.default_rng(7))]
    assert draws[0] == draws[1]
    assert set(draws[0]) == {0, 1}  # top-k removed token 2


# --- properties ---------------------------------------------------------------------------

logits_2d = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.integers(1, 40)),
    elements=st.floats(-30, 30, width=32),
)
configs = st.builds(
    SamplingConfig,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
)


@settings(max_examples=150, deadline=None)
@given(logits=logits_2d, cfg=configs)
def test_rows_are_distributions(logits, cfg):
    probs = probs_from_logits(logits, cfg)  # [rows, vocab]
    assert probs.shape == logits.shape
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-9)


@settings(max_examples=150, deadline=None)
@given(logits=logits_2d, cfg=configs)
def test_top_k_keeps_at_most_k(logits, cfg):
    probs = probs_from_logits(logits, cfg)  # [rows, vocab]
    if cfg.top_k:
        assert np.all((probs > 0).sum(axis=-1) <= cfg.top_k)


@settings(max_examples=150, deadline=None)
@given(logits=logits_2d, temperature=st.floats(0.05, 5.0), top_k=st.integers(0, 45), top_p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_with_mass_at_least_p(logits, temperature, top_k, top_p):
    before = probs_from_logits(logits, SamplingConfig(temperature=temperature, top_k=top_k))  # [rows, vocab]
    after = probs_from_logits(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    for p_before, p_after in zip(before, after):
        kept = p_after > 0
        kept_mass = p_before[kept].sum()
        assert kept_mass >= top_p - 1e-9
        # Minimal: without its smallest member the kept set falls short of top_p.
        assert kept_mass - p_before[kept].min() < top_p + 1e-9
        # Nothing dropped outweighs something kept (the set is a top prefix).
        if not kept.all():
            assert p_before[~kept].max() <= p_before[kept].min()
        np.testing.assert_allclose(p_after[kept], p_before[kept] / kept_mass, rtol=1e-9)
