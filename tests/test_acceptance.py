"""The acceptance rule: hand-computed rounds, residual properties, and a statistical losslessness check.

The statistical tests simulate a tiny Markov "language": the target emits token0 ~ p0 and then
token ~ T[previous]; the drafter drafts from its own (q0, Q). Speculative decoding is lossless
iff the emitted tokens follow the target's law, so the first two emitted tokens must have the
joint p0[a] * T[a, b] whatever the drafter does. A chi-square test checks that, and must reject a
rule with a deliberately wrong correction.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.stats import chisquare

from specdec.runtime import acceptance
from specdec.runtime.acceptance import greedy_accept, residual, speculative_accept
from specdec.verify_stats import continuation_check

VOCAB = 6
ROUNDS = 100_000


def one_hot(token: int, vocab: int = 4) -> np.ndarray:
    row = np.zeros(vocab)
    row[token] = 1.0
    return row


def draw_rows(rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `rows` [n, vocab], vectorised inverse CDF."""
    cdf = np.cumsum(rows, axis=1)  # [n, vocab]
    u = rng.random(rows.shape[0])[:, None] * cdf[:, -1:]  # [n, 1]
    return np.minimum((u >= cdf).sum(axis=1), rows.shape[1] - 1)  # [n]


# --- greedy_accept ------------------------------------------------------------------------

def test_greedy_accepts_all_and_emits_the_bonus():
    target_logits = np.log(np.array([one_hot(2), one_hot(0), one_hot(3)]) + 1e-3)  # [3, 4]
    assert greedy_accept(np.array([2, 0]), target_logits) == (2, 3)


def test_greedy_stops_at_the_first_mismatch():
    target_logits = np.log(np.array([one_hot(2), one_hot(0), one_hot(3)]) + 1e-3)
    assert greedy_accept(np.array([1, 0]), target_logits) == (0, 2)  # later match does not count
    assert greedy_accept(np.array([2, 1]), target_logits) == (1, 0)


def test_greedy_without_drafts_decodes_one_token():
    assert greedy_accept(np.zeros(0, dtype=np.int64), np.array([[0.0, 1.0, 1.0]])) == (0, 1)


def test_greedy_returns_python_ints():
    n_accepted, next_token = greedy_accept(np.array([1]), np.eye(3)[[1, 2]])
    assert type(n_accepted) is int and type(next_token) is int


def test_target_rows_must_be_k_plus_one():
    with pytest.raises(ValueError):
        greedy_accept(np.array([1, 2]), np.zeros((2, 4)))
    with pytest.raises(ValueError):
        speculative_accept(np.array([1, 2]), None, np.full((2, 4), 0.25), np.random.default_rng(0))


# --- speculative_accept: hand-computed rounds -----------------------------------------------

def test_accept_all_then_bonus():
    # p_target >= p_draft at each draft token: accepted with probability 1.
    p_draft = np.array([[0.2, 0.5, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p_target = np.array([[0.0, 0.6, 0.4, 0.0], [0.0, 0.0, 0.0, 1.0], one_hot(2)])
    rng = np.random.default_rng(0)
    for _ in range(100):
        assert speculative_accept(np.array([1, 3]), p_draft, p_target, rng) == (2, 2)


def test_reject_first_samples_the_residual():
    # p_target[0, 0] == 0: the draft is always rejected; the residual max(0, p_t - p_d) is one-hot at 1.
    p_draft = np.array([[0.7, 0.1, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p_target = np.array([[0.0, 0.8, 0.2, 0.0], one_hot(0), one_hot(0)])
    rng = np.random.default_rng(0)
    for _ in range(100):
        assert speculative_accept(np.array([0, 0]), p_draft, p_target, rng) == (0, 1)


def test_partial_acceptance():
    # Row 0 accepts surely (p_t = p_d); row 1 rejects surely (p_t = 0); the residual is one-hot at 3.
    p_draft = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p_target = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], one_hot(0), one_hot(0)])
    rng = np.random.default_rng(0)
    for _ in range(100):
        assert speculative_accept(np.array([1, 1, 2]), p_draft, p_target, rng) == (1, 3)


def test_residual_by_hand():
    p_target = np.array([0.4, 0.1, 0.3, 0.2])
    p_draft = np.array([0.1, 0.5, 0.1, 0.3])
    np.testing.assert_allclose(residual(p_target, p_draft), [0.6, 0.0, 0.4, 0.0])


def test_residual_of_equal_rows_falls_back_to_target():
    p = np.array([0.1, 0.2, 0.7])
    np.testing.assert_allclose(residual(p, p), p)


def test_one_round_outcome_distribution():
    # Draft 1 is accepted with min(1, 0.1/0.5) = 0.2; otherwise the correction follows the residual
    # [0.6, 0, 0.4, 0]: outcomes (1, bonus 3) 0.2, (0, 0) 0.8*0.6 = 0.48, (0, 2) 0.8*0.4 = 0.32.
    p_draft = np.array([[0.1, 0.5, 0.1, 0.3]])
    p_target = np.array([[0.4, 0.1, 0.3, 0.2], one_hot(3)])
    rng = np.random.default_rng(3)
    outcomes = [speculative_accept(np.array([1]), p_draft, p_target, rng) for _ in range(20_000)]
    observed = [outcomes.count(o) for o in [(1, 3), (0, 0), (0, 2)]]
    assert sum(observed) == len(outcomes)
    assert chisquare(observed, np.array([0.2, 0.48, 0.32]) * len(outcomes)).pvalue > 1e-4


def test_deterministic_draft_is_one_hot():
    # p_draft None: accept draft 1 with p_target[0, 1] = 0.75; the correction is p_target with
    # token 1 removed, i.e. always token 0 here.
    p_target = np.array([[0.25, 0.75, 0.0, 0.0], one_hot(2)])
    rng = np.random.default_rng(4)
    outcomes = [speculative_accept(np.array([1]), None, p_target, rng) for _ in range(20_000)]
    observed = [outcomes.count(o) for o in [(1, 2), (0, 0)]]
    assert sum(observed) == len(outcomes)
    assert chisquare(observed, np.array([0.75, 0.25]) * len(outcomes)).pvalue > 1e-4


def test_deterministic_draft_extremes():
    rng = np.random.default_rng(5)
    sure = np.array([one_hot(1), one_hot(2)])  # target certain of the draft: always accepted
    assert all(speculative_accept(np.array([1]), None, sure, rng) == (1, 2) for _ in range(100))
    never = np.array([[0.0, 0.0, 1.0, 0.0], one_hot(2)])  # target gives it no mass: always corrected
    assert all(speculative_accept(np.array([1]), None, never, rng) == (0, 2) for _ in range(100))


def test_zero_draft_mass_decodes_from_the_target():
    # The drafter claims p_draft[2] = 0 yet proposed 2: the draft is discarded and the token comes
    # from p_target itself. The residual would be one-hot at 2 and accepting would emit (1, 3);
    # drawing from p_target gives 0, 1 and 2 in proportion 0.2 : 0.3 : 0.5.
    p_draft = np.array([[0.5, 0.5, 0.0, 0.0]])
    p_target = np.array([[0.2, 0.3, 0.5, 0.0], one_hot(3)])
    rng = np.random.default_rng(6)
    outcomes = [speculative_accept(np.array([2]), p_draft, p_target, rng) for _ in range(20_000)]
    observed = [outcomes.count((0, token)) for token in range(3)]
    assert sum(observed) == len(outcomes)
    assert chisquare(observed, np.array([0.2, 0.3, 0.5]) * len(outcomes)).pvalue > 1e-4


def test_seeded_rounds_repeat():
    p_draft = np.array([[0.1, 0.5, 0.1, 0.3]] * 2)
    p_target = np.array([[0.4, 0.1, 0.3, 0.2]] * 3)
    runs = [
        [speculative_accept(np.array([1, 1]), p_draft, p_target, rng) for _ in range(200)]
        for rng in (np.random.default_rng(9), np.random.default_rng(9))
    ]
    assert runs[0] == runs[1]
    assert all(type(n) is int and type(t) is int for n, t in runs[0])


# --- residual properties ------------------------------------------------------------------

distributions = hnp.arrays(np.float64, 8, elements=st.floats(0, 1)).filter(lambda p: p.sum() > 1e-6).map(lambda p: p / p.sum())


@settings(max_examples=200, deadline=None)
@given(p_target=distributions, p_draft=distributions)
def test_residual_is_a_distribution(p_target, p_draft):
    r = residual(p_target, p_draft)
    assert np.all(r >= 0)
    np.testing.assert_allclose(r.sum(), 1.0, atol=1e-12)
    # It lives where the target has more mass than the drafter (or is p_target if nowhere).
    if np.any(p_target > p_draft):
        assert np.all(r[p_target <= p_draft] == 0)


# --- losslessness, statistically ---------------------------------------------------------

class MarkovPair:
    """A fixed target law (p0, T) and a drafter law (q0, Q) over VOCAB tokens."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # alpha = 2 keeps every cell of the joint well above chi-square's minimum expected count.
        alpha = np.full(VOCAB, 2.0)
        self.p0 = rng.dirichlet(alpha)  # [vocab] target's first token
        self.T = rng.dirichlet(alpha, size=VOCAB)  # [vocab, vocab] target's next-token law
        self.q0 = rng.dirichlet(alpha)  # [vocab] drafter's first token
        self.Q = rng.dirichlet(alpha, size=VOCAB)  # [vocab, vocab]

    def joint(self) -> np.ndarray:
        return self.p0[:, None] * self.T  # [vocab, vocab] P(first = a, second = b)


def first_two_emitted(
    pair: MarkovPair, k: int, rng: np.random.Generator, q0_drawn: np.ndarray | None = None, one_hot_drafts: bool = False
):
    """Run ROUNDS independent decodes until two tokens are out; return both as arrays [ROUNDS].

    One speculative round drafts k tokens from (q0, Q) and verifies them. When it emits a single
    token, the second comes from the target decoding plainly after it (the first-token law of a
    round is what is under test, so a second speculative round would add time, not coverage).
    `q0_drawn` lets a test draft the first token from a distribution other than the q0 it reports;
    `one_hot_drafts` passes p_draft=None, as a deterministic drafter does.
    """
    drafts = np.empty((ROUNDS, k), dtype=np.int64)  # [rounds, k]
    drafts[:, 0] = draw_rows(np.broadcast_to(pair.q0 if q0_drawn is None else q0_drawn, (ROUNDS, VOCAB)), rng)
    for i in range(1, k):
        drafts[:, i] = draw_rows(pair.Q[drafts[:, i - 1]], rng)
    p_draft = np.concatenate([np.broadcast_to(pair.q0, (ROUNDS, 1, VOCAB)), pair.Q[drafts[:, :-1]]], axis=1)  # [rounds, k, vocab]
    p_target = np.concatenate([np.broadcast_to(pair.p0, (ROUNDS, 1, VOCAB)), pair.T[drafts]], axis=1)  # [rounds, k+1, vocab]

    n_accepted = np.empty(ROUNDS, dtype=np.int64)  # [rounds]
    next_token = np.empty(ROUNDS, dtype=np.int64)  # [rounds]
    for r in range(ROUNDS):
        n_accepted[r], next_token[r] = speculative_accept(drafts[r], None if one_hot_drafts else p_draft[r], p_target[r], rng)

    first = np.where(n_accepted >= 1, drafts[:, 0], next_token)  # [rounds]
    plain = draw_rows(pair.T[first], rng)  # [rounds] the target's own next token after `first`
    second = np.where(n_accepted >= 2, drafts[:, min(1, k - 1)], np.where(n_accepted == 1, next_token, plain))
    return first, second


def joint_pvalue(pair: MarkovPair, first: np.ndarray, second: np.ndarray) -> float:
    """The engines' check (specdec.verify_stats) on the pair's law: a fixed token 0 stands for the prefill's token
    the check takes as given, after which the law is p0, then T[previous]."""
    check = continuation_check({(): [(0, a, b) for a, b in zip(first.tolist(), second.tolist())]},
                               lambda context: pair.p0 if len(context) == 1 else pair.T[context[-1]], depth=2)
    assert check.cells == VOCAB * VOCAB  # every cell expects enough answers to stand alone
    return check.pvalue


def marginal_pvalue(p: np.ndarray, tokens: np.ndarray) -> float:
    return continuation_check({(): [(0, t) for t in tokens.tolist()]}, lambda context: p, depth=1).pvalue


@pytest.fixture(scope="module")
def pair() -> MarkovPair:
    return MarkovPair(seed=11)


def test_speculative_sampling_is_lossless(pair):
    first, second = first_two_emitted(pair, k=3, rng=np.random.default_rng(12))
    assert marginal_pvalue(pair.p0, first) > 1e-4
    assert joint_pvalue(pair, first, second) > 1e-4


def test_the_check_rejects_a_wrong_correction(pair, monkeypatch):
    # Drawing the correction from p_target instead of the residual is the classic mistake: it
    # double-counts the mass already given to accepted drafts. The same statistic must catch it.
    monkeypatch.setattr(acceptance, "residual", lambda p_target_row, p_draft_row: p_target_row)
    first, second = first_two_emitted(pair, k=3, rng=np.random.default_rng(12))
    assert marginal_pvalue(pair.p0, first) < 1e-6
    assert joint_pvalue(pair, first, second) < 1e-6


def test_off_support_drafts_stay_lossless(pair):
    # The drafter reports q0 with q0[z] = 0 but draws z one time in five: the p_draft=0 guard must
    # still emit tokens distributed as p0 (accepting z, or correcting from the residual, would not).
    z = int(np.argmin(pair.q0))
    q0_reported = pair.q0.copy()
    q0_reported[z] = 0.0
    q0_reported /= q0_reported.sum()
    drifting = copy.copy(pair)
    drifting.q0 = q0_reported
    q0_drawn = 0.8 * q0_reported + 0.2 * np.eye(VOCAB)[z]  # [vocab]
    # k = 1 makes the second token the bonus token whenever the draft is accepted.
    first, second = first_two_emitted(drifting, k=1, rng=np.random.default_rng(13), q0_drawn=q0_drawn)
    assert marginal_pvalue(pair.p0, first) > 1e-4
    assert joint_pvalue(pair, first, second) > 1e-4


def test_one_hot_drafts_are_lossless_whatever_the_drafter_does(pair):
    # With p_draft None the rule is exact given any draft token (accept x w.p. p(x), else draw from
    # p with x removed), so drafts drawn from (q0, Q) but reported as one-hot must still be lossless.
    first, second = first_two_emitted(pair, k=2, rng=np.random.default_rng(14), one_hot_drafts=True)
    assert marginal_pvalue(pair.p0, first) > 1e-4
    assert joint_pvalue(pair, first, second) > 1e-4


# ---- token trees


def _onehot_rows(choices, vocab=8):
    rows = np.full((len(choices), vocab), -1.0)
    rows[np.arange(len(choices)), choices] = 1.0
    return rows


def test_tree_accept_follows_the_branch_holding_the_targets_choice():
    from specdec.runtime.acceptance import tree_greedy_accept

    # root -> {a=3 (node 0), b=5 (node 1)}; node 0 -> c=4 (node 2); node 1 -> d=6 (node 3)
    tokens, parents = np.array([3, 5, 4, 6]), np.array([-1, -1, 0, 1])
    # target: after root 5 (node 1's token), after node 1: 6 (node 3), after node 3: 7 (bonus)
    logits = _onehot_rows([5, 0, 0, 0, 7])  # rows: root, node0, node1, node2, node3
    logits[2] = _onehot_rows([6])[0]
    assert tree_greedy_accept(tokens, parents, logits) == ([1, 3], 7)
    # The target wants 2 at the root: nothing accepted, 2 emitted.
    assert tree_greedy_accept(tokens, parents, _onehot_rows([2, 0, 0, 0, 0])) == ([], 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.lists(st.integers(0, 3), min_size=7, max_size=7))
def test_a_chain_shaped_tree_accepts_what_greedy_accept_does(drafts, choices):
    from specdec.runtime.acceptance import tree_greedy_accept

    k = len(drafts)
    logits = _onehot_rows(choices[:k + 1], vocab=4)
    n, token = greedy_accept(np.array(drafts), logits)
    path, tree_token = tree_greedy_accept(np.array(drafts), np.arange(k) - 1, logits)
    assert (path, tree_token) == (list(range(n)), token)


def test_tree_bias_lets_each_node_see_the_past_its_ancestors_and_itself():
    from specdec.runtime.acceptance import tree_attention_bias, tree_depths

    parents = np.array([-1, -1, 0, 1])
    bias = tree_attention_bias(parents, past=2)
    assert bias.shape == (1, 1, 5, 7)
    sees = bias[0, 0] == 0
    assert sees[:, :2].all()  # the past
    expected = np.array([[1, 0, 0, 0, 0],   # root
                         [1, 1, 0, 0, 0],   # node 0
                         [1, 0, 1, 0, 0],   # node 1 (sibling of node 0: not seen)
                         [1, 1, 0, 1, 0],   # node 2 under node 0
                         [1, 0, 1, 0, 1]], dtype=bool)  # node 3 under node 1
    assert (sees[:, 2:] == expected).all()
    assert tree_depths(parents).tolist() == [1, 1, 2, 2]



def test_a_node_under_a_later_node_is_refused():
    from specdec.runtime.acceptance import tree_greedy_accept

    with pytest.raises(ValueError, match="earlier node"):
        tree_greedy_accept(np.array([1, 2, 3]), np.array([-1, 2, 0]), np.zeros((4, 5)))


# ---- token trees, sampled: recursive rejection sampling


class FixedUniforms:
    """An rng whose random() returns the given values in order: hand-computed rounds."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_tree_sampling_takes_the_first_sibling_the_target_accepts():
    from specdec.runtime.acceptance import tree_speculative_accept

    # Deterministic siblings 1 and 2 under the root; the target is sure of 2: sibling 1 (p = 0) is rejected,
    # the residual (the target without token 1) is still one-hot at 2, which accepts node 1; node 1 has no
    # children, so the next token is drawn from its row: one-hot at 0.
    p_target = np.array([one_hot(2), one_hot(3), one_hot(0)])  # [3, 4]
    assert tree_speculative_accept(np.array([1, 2]), np.array([-1, -1]), None, p_target, FixedUniforms(0.0, 0.0, 0.5)) == ([1], 0)


def test_tree_sampling_corrects_from_the_residual_left_by_every_rejected_sibling():
    from specdec.runtime.acceptance import tree_speculative_accept

    p_target = np.array([[0.2, 0.3, 0.5, 0.0], one_hot(0), one_hot(0)])  # [3, 4]
    # u = 0.9 rejects token 2 (p = 0.5): p becomes [0.4, 0.6, 0, 0]; u = 0.7 rejects token 1 (p = 0.6): p
    # becomes [1, 0, 0, 0], from which the correction is drawn, whatever u is.
    assert tree_speculative_accept(np.array([2, 1]), np.array([-1, -1]), None, p_target, FixedUniforms(0.9, 0.7, 0.99)) == ([], 0)
    # u = 0.55 accepts token 1 at the second stage (0.55 < 0.6), though 0.55 >= p_target[0, 1] = 0.3.
    assert tree_speculative_accept(np.array([2, 1]), np.array([-1, -1]), None, p_target, FixedUniforms(0.9, 0.55, 0.0)) == ([1], 0)


def test_tree_sampling_reads_each_siblings_own_law():
    from specdec.runtime.acceptance import tree_speculative_accept

    q = np.array([0.5, 0.25, 0.25, 0.0])  # the drafter's law at the root
    p_draft = np.array([q, [0.0, 0.5, 0.5, 0.0]])  # sibling 2 drawn from q without token 0
    p_target = np.array([[0.25] * 4, one_hot(2), one_hot(1)])  # [3, 4]
    # Stage 1: token 0 accepted w.p. 0.25 / 0.5: u = 0.6 rejects, p becomes norm(max(0, p - q)) = one-hot 3;
    # stage 2: token 1 has p = 0: rejected; the residual of one-hot 3 against its law is one-hot 3.
    assert tree_speculative_accept(np.array([0, 1]), np.array([-1, -1]), p_draft, p_target, FixedUniforms(0.6, 0.0, 0.3)) == ([], 3)
    # u = 0.4: 0.4 * 0.5 < 0.25 accepts token 0; its row (one-hot 2) gives the next token.
    assert tree_speculative_accept(np.array([0, 1]), np.array([-1, -1]), p_draft, p_target, FixedUniforms(0.4, 0.3)) == ([0], 2)
    # A node its own law gives no mass cannot have been drawn from it: skipped, never accepted.
    off = np.array([[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0]])
    assert tree_speculative_accept(np.array([0, 1]), np.array([-1, -1]), off, np.array([one_hot(0)] * 3),
                                   FixedUniforms(0.0, 0.0)) == ([], 0)


def test_a_chain_shaped_tree_is_speculative_sampling():
    from specdec.runtime.acceptance import tree_speculative_accept

    # Same uniforms, same decisions: a chain is the tree whose nodes have one child each.
    p_draft = np.array([[0.1, 0.5, 0.1, 0.3], [0.4, 0.2, 0.2, 0.2]])
    p_target = np.array([[0.4, 0.1, 0.3, 0.2], [0.1, 0.1, 0.1, 0.7], [0.25] * 4])
    for u in ([0.1, 0.1, 0.5], [0.1, 0.9, 0.5], [0.9, 0.5, 0.5]):
        tree = tree_speculative_accept(np.array([1, 0]), np.array([-1, 0]), p_draft, p_target, FixedUniforms(*u))
        chain = speculative_accept(np.array([1, 0]), p_draft, p_target, FixedUniformsArray(*u))
        assert (len(tree[0]), tree[1]) == chain


class FixedUniformsArray(FixedUniforms):
    """speculative_accept draws its k uniforms at once (random(k)), then one per sample()."""

    def random(self, size=None):
        if size is None:
            return self.values.pop(0)
        out, self.values = np.array(self.values[:size]), self.values[size:]
        return out


# Tree of the statistical test: three siblings at depth 1; two children under the first, one under the second.
TREE_PARENTS = np.array([-1, -1, -1, 0, 0, 1])


def first_two_emitted_from_trees(pair: MarkovPair, rng: np.random.Generator, rows_without_removal: bool = False,
                                 rounds: int = ROUNDS):
    """`rounds` tree rounds over the Markov pair. Siblings are drawn without replacement (sample_distinct);
    `rows_without_removal` reports the undepleted law for every sibling (a wrong p_draft the test must catch)."""
    from specdec.runtime.acceptance import tree_speculative_accept
    from specdec.runtime.sampling import sample_distinct

    first = np.empty(rounds, dtype=np.int64)
    second = np.empty(rounds, dtype=np.int64)
    for r in range(rounds):
        top, top_rows = sample_distinct(pair.q0, 3, rng)
        under0, under0_rows = sample_distinct(pair.Q[top[0]], 2, rng)
        under1, under1_rows = sample_distinct(pair.Q[top[1]], 1, rng)
        tokens = np.array(top + under0 + under1)  # [n]
        p_draft = np.concatenate([top_rows, under0_rows, under1_rows])  # [n, vocab]
        if rows_without_removal:
            p_draft = np.concatenate([[pair.q0] * 3, [pair.Q[top[0]]] * 2, [pair.Q[top[1]]]])
        p_target = np.concatenate([pair.p0[None], pair.T[tokens]])  # [n+1, vocab]
        path, token = tree_speculative_accept(tokens, TREE_PARENTS, p_draft, p_target, rng)
        emitted = [int(t) for t in tokens[path]] + [token]
        if len(emitted) == 1:  # the target decodes the second token plainly
            emitted.append(int(draw_rows(pair.T[emitted[:1]], rng)[0]))
        first[r], second[r] = emitted[:2]
    return first, second


def test_tree_speculative_sampling_is_lossless(pair):
    first, second = first_two_emitted_from_trees(pair, np.random.default_rng(21))
    assert marginal_pvalue(pair.p0, first) > 1e-4
    assert joint_pvalue(pair, first, second) > 1e-4


def test_the_tree_check_rejects_a_wrong_rule(pair, monkeypatch):
    # Siblings judged against the untouched target row (no residual between them) over-emit drafted tokens:
    # a gross error, caught with a fifth of the rounds.
    with monkeypatch.context() as m:
        m.setattr(acceptance, "residual", lambda p_target_row, p_draft_row: p_target_row)
        first, second = first_two_emitted_from_trees(pair, np.random.default_rng(21), rounds=ROUNDS // 5)
    assert joint_pvalue(pair, first, second) < 1e-6
    # Siblings drawn without replacement but reported with the undepleted law: subtler, it needs every round.
    first, _ = first_two_emitted_from_trees(pair, np.random.default_rng(21), rows_without_removal=True)
    assert marginal_pvalue(pair.p0, first) < 1e-6


def test_a_lookup_branch_beside_sampled_siblings_stays_lossless(pair):
    """hybrid-tree's shape: a deterministic lookup chain (one-hot rows, tokens set by the round number) first
    under the root, then siblings drawn from q0 that do not avoid the lookup's token, then one child under the
    first sampled sibling. Every node's row is the law it was drawn from, so the output is the target's."""
    from specdec.runtime.acceptance import tree_speculative_accept
    from specdec.runtime.sampling import sample_distinct

    rng = np.random.default_rng(23)
    eye = np.eye(VOCAB)
    parents = np.array([-1, 0, -1, -1, 3])
    rounds = ROUNDS // 2
    first = np.empty(rounds, dtype=np.int64)
    second = np.empty(rounds, dtype=np.int64)
    for r in range(rounds):
        lookup = [r % VOCAB, (r // VOCAB) % VOCAB]  # any deterministic choice
        top, top_rows = sample_distinct(pair.q0, 2, rng)
        under, under_rows = sample_distinct(pair.Q[top[0]], 1, rng)
        tokens = np.array(lookup + top + under)  # [5]
        p_draft = np.concatenate([eye[lookup], top_rows, under_rows])  # [5, vocab]
        p_target = np.concatenate([pair.p0[None], pair.T[tokens]])  # [6, vocab]
        path, token = tree_speculative_accept(tokens, parents, p_draft, p_target, rng)
        emitted = [int(t) for t in tokens[path]] + [token]
        if len(emitted) == 1:
            emitted.append(int(draw_rows(pair.T[emitted[:1]], rng)[0]))
        first[r], second[r] = emitted[:2]
    assert marginal_pvalue(pair.p0, first) > 1e-4
    assert joint_pvalue(pair, first, second) > 1e-4


@settings(max_examples=100, deadline=None)
@given(p=distributions, m=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_sample_distinct_draws_each_token_from_the_depleted_law(p, m, seed):
    from specdec.runtime.sampling import sample_distinct

    tokens, rows = sample_distinct(p, m, np.random.default_rng(seed))
    assert len(set(tokens)) == len(tokens) == min(m, int((p > 0).sum()))
    np.testing.assert_allclose(rows.sum(axis=1), 1.0)
    for i, t in enumerate(tokens):
        assert rows[i, t] > 0 and (rows[i, tokens[:i]] == 0).all()
        kept = np.where(np.isin(np.arange(len(p)), tokens[:i]), 0.0, p)  # p without the earlier draws
        np.testing.assert_allclose(rows[i], kept / kept.sum())


def test_sample_never_returns_a_token_past_the_vocabulary_when_the_mass_is_subnormal():
    """A row depleted to a subnormal total (hypothesis found [1, 5e-324, 0, ...] minus its first draw) makes
    u * total round up to the total itself; the draw must still be the token that holds the mass."""
    from specdec.runtime.sampling import sample

    probs = np.array([0.0, 5e-324, 0.0, 0.0])
    assert all(sample(probs, np.random.default_rng(seed)) == 1 for seed in range(64))


def test_greedy_rules_on_the_target_choices_match_the_rules_on_logits():
    """greedy_accept(_choices) and tree_greedy_accept(_choices) agree; the choices forms check their length."""
    from specdec.runtime.acceptance import greedy_accept_choices, tree_greedy_accept, tree_greedy_accept_choices

    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(0, 5))
        logits = rng.normal(size=(k + 1, 6))
        draft = np.where(rng.random(k) < 0.7, np.argmax(logits, axis=-1)[:k], rng.integers(0, 6, k))
        assert greedy_accept(draft, logits) == greedy_accept_choices(draft, np.argmax(logits, axis=-1))
        parents = np.array([-1, -1, 0, 2, 1])[:k] if k else np.zeros(0, dtype=np.int64)
        assert tree_greedy_accept(draft, parents, logits) == \
            tree_greedy_accept_choices(draft, parents, np.argmax(logits, axis=-1))
    assert greedy_accept_choices(np.array([4, 2]), np.array([4, 2, 9])) == (2, 9)  # all kept, bonus 9
    assert greedy_accept_choices(np.array([4, 2]), np.array([4, 3, 9])) == (1, 3)  # correction 3
    with pytest.raises(ValueError, match="3 positions"):
        greedy_accept_choices(np.array([4, 2]), np.array([4, 2]))


# ---- malformed drafter output: one clear error, never a silently biased rule


@pytest.mark.parametrize("p_draft, message", [
    (np.full((1, 4), 0.25), "shape"),  # one row for two drafts
    (np.full((2, 3), 1 / 3), "shape"),  # another vocabulary
    (np.array([[0.5, 0.6, -0.1, 0.0]] * 2), "smallest entry -0.1"),
    (np.array([[0.4, 0.4, 0.1, 0.0]] * 2), "row sums 0.9"),
    (np.array([[1.0, 2.0, 0.5, 0.0]] * 2), "row sums 3.5"),  # logits, not probabilities
    (np.array([[np.nan, 0.5, 0.5, 0.0]] * 2), "not distributions"),
])
def test_a_malformed_p_draft_is_one_clear_error(p_draft, message):
    from specdec.errors import SpecdecError
    from specdec.runtime.acceptance import tree_speculative_accept

    p_target = np.full((3, 4), 0.25)
    with pytest.raises(SpecdecError, match=message):
        speculative_accept(np.array([0, 1]), p_draft, p_target, np.random.default_rng(0))
    with pytest.raises(SpecdecError, match=message):
        tree_speculative_accept(np.array([0, 1]), np.array([-1, -1]), p_draft, p_target, np.random.default_rng(0))


def test_float32_rows_of_a_large_vocabulary_pass_the_p_draft_check():
    from specdec.runtime.acceptance import check_p_draft

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 150_000)) * 3
    rows = (np.exp(logits - logits.max(axis=1, keepdims=True)))
    rows = (rows / rows.sum(axis=1, keepdims=True)).astype(np.float32)  # [4, vocab]
    assert check_p_draft(rows, 4, 150_000) is rows
