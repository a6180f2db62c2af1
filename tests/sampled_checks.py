"""Shared pieces of the sampled-losslessness tests: a drafter that is often wrong, the engines' answers checked
against the target's own law, and the acceptance rules broken on purpose that the check must catch."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.runtime import acceptance
from specdec.runtime.drafters.base import Draft
from specdec.runtime.sampling import sample
from specdec.verify_stats import (Answers, LawCheck, TargetLaw, answers_from_batch, answers_from_engine,
                                  continuation_check)

# An exact engine passes above this p-value; a broken rule must fall below MUTANT_P. The seeds are fixed, so
# each p-value is one number, not a draw: the gap between the two is the margin for platform rounding.
PASS_P = 1e-3
MUTANT_P = 1e-6


class ModeDrafter:
    """A deterministic drafter (p_draft None, as n-gram and corpus drafts are) proposing the target's most likely
    tokens, read from `law`. A sampled target draws its top token only sometimes, so its drafts are accepted
    often and rejected often: both branches of the acceptance rule run in most answers."""

    def __init__(self, law: TargetLaw) -> None:
        self.law = law

    def begin(self, prompt_ids: Sequence[int], sampling, rng) -> None:
        pass

    def source(self, context: Sequence[int]) -> str:
        return "lookup"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        context, tokens = list(context), []
        for _ in range(k):
            tokens.append(int(np.argmax(self.law(context))))
            context.append(tokens[-1])
        return Draft(tokens=np.asarray(tokens, dtype=np.int64))

    def accept(self, n_accepted: int, next_token: int) -> None:
        pass


def check_engine(engine, law: TargetLaw, prompt_ids: Sequence[int], cfg, n: int,
                 depth: int = 2) -> tuple[LawCheck, Answers]:
    """`n` seeded answers of an Engine to one prompt, checked against `law`."""
    return _checked(answers_from_engine(engine, prompt_ids, cfg, range(n)), engine, law, depth)


def check_batch(engine, law: TargetLaw, prompts: Sequence[Sequence[int]], cfg, n: int,
                depth: int = 2) -> tuple[LawCheck, Answers]:
    """`n` seeded answers of a BatchedEngine, cycling through `prompts`, checked against `law`."""
    return _checked(answers_from_batch(engine, prompts, cfg, range(n)), engine, law, depth)


def _checked(answers: Answers, engine, law: TargetLaw, depth: int) -> tuple[LawCheck, Answers]:
    check = continuation_check(answers.by_prompt, law, depth, stop=engine.manifest.tokenizer.eos_token_ids)
    print(f"{check}; {answers.accepted} of {answers.drafted} drafts accepted")  # shown by pytest -s, and on failure
    return check, answers


def assert_lossless(check: LawCheck, answers: Answers) -> None:
    assert 0 < answers.accepted < answers.drafted, (answers.drafted, answers.accepted)  # both outcomes happened
    assert check.pvalue > PASS_P, str(check)


# ---- acceptance rules broken on purpose (monkeypatched where the engines look them up)

def accept_every_draft(draft_tokens, p_draft, p_target, rng):
    """Keeps every draft and draws the bonus token: what an engine skipping the acceptance test emits."""
    k = len(draft_tokens)
    return k, sample(p_target[k], rng)


def bonus_from_the_last_draft_row(draft_tokens, p_draft, p_target, rng):
    """The right rule, except that a fully accepted round's bonus token is drawn from the row before the bonus
    row (an off-by-one in which row follows the last draft)."""
    n_accepted, token = acceptance.speculative_accept(draft_tokens, p_draft, p_target, rng)
    k = len(draft_tokens)
    if k and n_accepted == k:
        token = sample(p_target[k - 1], rng)
    return n_accepted, token


def correction_from_the_target(p_target_row, p_draft_row):
    """In place of acceptance.residual: the correction drawn from the target row itself, which counts again the
    mass the rejected draft already had its chance at."""
    return np.asarray(p_target_row, dtype=np.float64)


def first_branch_whole(draft_tokens, parents, p_draft, p_target, rng):
    """A tree verifier that takes each node's first child without testing it, then draws after the last."""
    parents = np.asarray(parents)
    path: list[int] = []
    row = 0
    while True:
        children = np.flatnonzero(parents == row - 1)
        if children.size == 0:
            return path, sample(p_target[row], rng)
        path.append(int(children[0]))
        row = path[-1] + 1
