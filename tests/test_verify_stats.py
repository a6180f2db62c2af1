"""specdec.verify_stats.continuation_check on a synthetic law: what the engines' sampled tests rely on."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.verify_stats import continuation_check

VOCAB = 6
EOS = 5
PROMPT = (0, 1)


@pytest.fixture(scope="module")
def chain():
    """A Markov law: the next token depends on the last one only (rows Dirichlet, a few zeros)."""
    rng = np.random.default_rng(3)
    T = rng.dirichlet(np.full(VOCAB, 1.5), size=VOCAB)  # [vocab, vocab]
    T[:, 4] = 0.0  # token 4 never follows anything
    T /= T.sum(axis=1, keepdims=True)
    return T


def answers(T, n, rng, second_row=lambda seq: seq[-1], eos=None):
    """n answers of 3 tokens: the first uniform (the prefill's, taken as given), then two drawn from T."""
    out = []
    for _ in range(n):
        seq = [int(rng.integers(0, 4))]
        for _ in range(2):
            if eos is not None and seq[-1] == eos:
                break
            seq.append(int(rng.choice(VOCAB, p=T[second_row(seq)])))
        out.append(seq)
    return {PROMPT: out}


def law_of(T, calls=None):
    def law(context):
        if calls is not None:
            calls.append(tuple(context))
        assert tuple(context[:2]) == PROMPT
        return T[context[-1]]
    return law


def test_answers_drawn_from_the_law_pass(chain):
    for seed in range(5):
        check = continuation_check(answers(chain, 3000, np.random.default_rng(seed)), law_of(chain), depth=2)
        assert check.pvalue > 1e-3 and check.impossible == 0 and check.n == 3000, str(check)


def test_a_token_from_the_wrong_row_fails(chain):
    # The third token drawn after the first instead of the second: the bonus-row mistake in miniature.
    wrong = answers(chain, 3000, np.random.default_rng(0), second_row=lambda seq: seq[0])
    check = continuation_check(wrong, law_of(chain), depth=2)
    assert check.pvalue < 1e-6, str(check)


def test_a_token_the_law_rules_out_fails_outright(chain):
    got = answers(chain, 500, np.random.default_rng(0))
    got[PROMPT][0][1] = 4  # a second token the law gives no mass
    check = continuation_check(got, law_of(chain), depth=2)
    assert check.pvalue == 0.0 and check.impossible == 1


def test_answers_ending_at_a_stop_token_are_complete(chain):
    got = answers(chain, 3000, np.random.default_rng(1), eos=EOS)
    assert any(len(a) < 3 for a in got[PROMPT])
    check = continuation_check(got, law_of(chain), depth=2, stop={EOS})
    assert check.pvalue > 1e-3, str(check)
    with pytest.raises(ValueError, match="stop token"):
        continuation_check(got, law_of(chain), depth=2)


def test_the_law_is_read_only_where_cells_are_split(chain):
    calls = []
    continuation_check(answers(chain, 40, np.random.default_rng(0)), law_of(chain, calls), depth=2)
    # 40 answers over 4 first tokens: ~10 per group, so only a few second tokens expect 5 or more.
    assert 4 <= len(calls) < 4 * VOCAB
    assert len(set(calls)) == len(calls)
