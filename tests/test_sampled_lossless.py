"""Sampled speculative decoding through Engine and BatchedEngine emits exactly the target's distribution.

Each test decodes the same prompt under many seeds and compares the two tokens after the first (the first comes
from the prompt's prefill, before anything is drafted) with the exact law read from the tiny target itself
(specdec.verify_stats.continuation_check: a chi-square test, cells pooled to >= 5 expected answers). The
drafters are often wrong, so acceptance, rejection, the correction and the bonus token all occur; each test
asserts that drafts were both accepted and rejected.

Power: with N = 800 answers over ~40-55 cells, a bias moving 5% of the answers from one cell expecting 10% to
another is caught at PASS_P = 1e-3 about half the time (noncentral chi-square, noncentrality 40), a 3% move
rarely: the check is for broken rules, not for rounding. The rules broken on purpose below (every draft
accepted, the bonus from the wrong row, the correction from the target instead of the residual) move the
answers' law by a total variation of 0.2-0.7 and must fall below MUTANT_P = 1e-6 on the same answer count,
while the real rule passes above PASS_P. Tree verifiers are checked the same way in tests/test_eagle.py and
tests/test_medusa.py, LayerSkip in tests/test_layerskip.py; the seeds are fixed, so every p-value is one number.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig, SamplingConfig
from specdec.runtime import acceptance, batched, speculative
from specdec.runtime.batched import BatchedEngine
from specdec.verify_stats import TargetLaw

from sampled_checks import (MUTANT_P, PASS_P, ModeDrafter, accept_every_draft, assert_lossless,
                            bonus_from_the_last_draft_row, check_batch, check_engine, correction_from_the_target)

N = 800  # answers per check: ~2 s through the tiny engine
COLD = SamplingConfig(temperature=0.3)  # the target's top token ~1/3 of the mass: drafts of it often fail
TOP_K = SamplingConfig(temperature=0.5, top_k=5)
WARM_TOP_P = SamplingConfig(temperature=0.8, top_p=0.8)


@pytest.fixture(scope="module")
def cousin_bundle(tiny_checkpoint, tmp_path_factory):
    """The tiny target with, as its draft model, a copy whose weights carry 10% noise: a sampling drafter that
    gets a third to a half of its tokens accepted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("cousin")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.1 * p.std())
    model.save_pretrained(root / "ckpt")
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(root / "ckpt")
    export_bundle(root / "ckpt", root / "draft", ExportConfig(drafter="none", max_len=256))
    export_bundle(tiny_checkpoint, root / "bundle", ExportConfig(drafter=f"model:{root / 'draft'}", max_len=256))
    return root / "bundle"


@pytest.fixture(scope="module")
def plain(tiny_bundle):
    """The laws' source: TargetLaw owns its target's KV, so this engine never generates."""
    return specdec.load(tiny_bundle, drafter="none")


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.encode("the quick brown fox", chat=False),
            plain.encode("a small model proposes and a large model decides", chat=False)]


def mode_engine(bundle, law: TargetLaw) -> specdec.Engine:
    """An Engine drafting with ModeDrafter, registered as use_drafter's kinds are, so the engine's own chain path
    (speculative.verify_chain) verifies its drafts."""
    engine = specdec.load(bundle, drafter="none")
    engine._drafters["mode"] = ModeDrafter(law)
    engine.use_drafter("mode")
    return engine


def cfg(sampling: SamplingConfig, k: int) -> GenerationConfig:
    # the first token and the two checked; and a budget that leaves the first round room for all k drafts
    return GenerationConfig(max_new_tokens=max(3, 2 + k), sampling=sampling, draft_len=k, chat=False)


# ---- Engine


@pytest.mark.parametrize("sampling", [COLD, TOP_K], ids=["t0.3", "t0.5-topk5"])
@pytest.mark.parametrize("k", [1, 2])
def test_deterministic_chain_is_lossless_through_the_engine(tiny_bundle, plain, prompts, sampling, k):
    law = TargetLaw(plain.target, sampling)
    assert_lossless(*check_engine(mode_engine(tiny_bundle, law), law, prompts[0], cfg(sampling, k), N))


def test_ngram_chain_is_lossless_through_the_engine(tiny_bundle, plain, prompts):
    """The real n-gram drafter. A random tiny model does not repeat its context, so the lookups are nearly always
    wrong; a prompt that holds its own greedy continuation twice gets a few of them accepted."""
    law = TargetLaw(plain.target, COLD)
    engine = specdec.load(tiny_bundle, drafter="ngram")
    greedy = engine.generate("the quick brown fox", GenerationConfig(max_new_tokens=40, draft_len=0, chat=False))
    prompt = prompts[0] + greedy.token_ids + prompts[0] + greedy.token_ids[:5]
    assert_lossless(*check_engine(engine, law, prompt, cfg(COLD, 2), N))


@pytest.mark.parametrize("drafter, sampling", [("model", WARM_TOP_P), ("model", TOP_K), ("hybrid", WARM_TOP_P)],
                         ids=["model-t0.8-topp0.8", "model-t0.5-topk5", "hybrid-t0.8-topp0.8"])
def test_sampling_drafter_chain_is_lossless_through_the_engine(cousin_bundle, plain, prompts, drafter, sampling,
                                                               monkeypatch):
    """The draft model's sampled chains (p_draft rows); the hybrid's lookups (one-hot) where the prompt repeats."""
    law = TargetLaw(plain.target, sampling)
    engine = specdec.load(cousin_bundle, drafter=drafter)
    model = engine._drafters["model"]  # the hybrid shares it
    monkeypatch.setattr(model, "confidence_stop", 0.0)  # draft all k: a tiny random model is never sure
    prompt = prompts[1] if drafter == "model" else prompts[1] + prompts[1]
    assert_lossless(*check_engine(engine, law, prompt, cfg(sampling, 2), N))


# ---- BatchedEngine: ragged rows, two prompts of different lengths side by side


def test_deterministic_chain_is_lossless_through_the_batched_engine(tiny_bundle, plain, prompts, monkeypatch):
    law = TargetLaw(plain.target, COLD)
    monkeypatch.setattr(batched, "NgramDrafter", lambda **_: ModeDrafter(law))  # each row's lookup drafter
    engine = BatchedEngine(tiny_bundle, batch_size=3, drafter="ngram")
    assert_lossless(*check_batch(engine, law, prompts, cfg(COLD, 2), N))


def test_sampling_drafter_chain_is_lossless_through_the_batched_engine(cousin_bundle, plain, prompts):
    law = TargetLaw(plain.target, WARM_TOP_P)
    engine = BatchedEngine(cousin_bundle, batch_size=3, drafter="model")
    engine.draft_model.confidence_stop = 0.0
    assert_lossless(*check_batch(engine, law, prompts, cfg(WARM_TOP_P, 2), N))


# ---- the same check fails when the rule is broken


def test_an_engine_accepting_every_draft_fails_the_check(tiny_bundle, plain, prompts, monkeypatch):
    law = TargetLaw(plain.target, COLD)
    monkeypatch.setattr(speculative, "speculative_accept", accept_every_draft)
    check, answers = check_engine(mode_engine(tiny_bundle, law), law, prompts[0], cfg(COLD, 2), N)
    assert answers.accepted == answers.drafted > 0
    assert check.pvalue < MUTANT_P, str(check)


def test_a_batched_engine_accepting_every_draft_fails_the_check(tiny_bundle, plain, prompts, monkeypatch):
    law = TargetLaw(plain.target, COLD)
    monkeypatch.setattr(batched, "NgramDrafter", lambda **_: ModeDrafter(law))
    monkeypatch.setattr(batched, "speculative_accept", accept_every_draft)
    engine = BatchedEngine(tiny_bundle, batch_size=3, drafter="ngram")
    check, answers = check_batch(engine, law, prompts, cfg(COLD, 2), N)
    assert answers.accepted == answers.drafted > 0
    assert check.pvalue < MUTANT_P, str(check)


def test_a_bonus_token_from_the_wrong_row_fails_the_check(tiny_bundle, plain, prompts, monkeypatch):
    # k = 1: the second token checked is the bonus whenever the draft is accepted
    law = TargetLaw(plain.target, COLD)
    monkeypatch.setattr(speculative, "speculative_accept", bonus_from_the_last_draft_row)
    check, _ = check_engine(mode_engine(tiny_bundle, law), law, prompts[0], cfg(COLD, 1), N)
    assert check.pvalue < MUTANT_P, str(check)


def test_a_correction_from_the_target_instead_of_the_residual_fails_the_check(tiny_bundle, plain, prompts,
                                                                             monkeypatch):
    law = TargetLaw(plain.target, COLD)
    monkeypatch.setattr(acceptance, "residual", correction_from_the_target)
    check, _ = check_engine(mode_engine(tiny_bundle, law), law, prompts[0], cfg(COLD, 2), N)
    assert check.pvalue < MUTANT_P, str(check)


def test_the_check_passes_plain_sampling_and_fails_a_wrong_temperature(tiny_bundle, plain, prompts):
    """Without drafts the engine samples the law itself; the law of another temperature is told apart."""
    engine = specdec.load(tiny_bundle, drafter="none")
    right = TargetLaw(plain.target, COLD)
    wrong = TargetLaw(plain.target, replace(COLD, temperature=0.4))
    check, answers = check_engine(engine, right, prompts[0], cfg(COLD, 0), N)
    assert answers.drafted == 0 and check.pvalue > PASS_P, str(check)
    check, _ = check_engine(engine, wrong, prompts[0], cfg(COLD, 0), N)
    assert check.pvalue < MUTANT_P, str(check)


@pytest.mark.parametrize("malform", [lambda rows: rows * 0.5, lambda rows: rows - 0.01, lambda rows: rows[:, :-1]],
                         ids=["unnormalised", "negative", "short-rows"])
def test_a_drafter_giving_a_malformed_p_draft_is_one_clear_error(tiny_bundle, plain, prompts, malform):
    from specdec.errors import SpecdecError
    from specdec.runtime.drafters.base import Draft

    law = TargetLaw(plain.target, COLD)

    class Malformed(ModeDrafter):
        def propose(self, context, k):
            draft = super().propose(context, k)
            rows = np.stack([law(list(context) + list(draft.tokens[:i])) for i in range(k)])  # [k, vocab]
            return Draft(tokens=draft.tokens, p_draft=malform(rows))

    engine = specdec.load(tiny_bundle, drafter="none")
    engine._drafters["malformed"] = Malformed(law)
    engine.use_drafter("malformed")
    with pytest.raises(SpecdecError, match="the drafter's p_draft"):
        list(engine.stream_ids(prompts[0], cfg(COLD, 2)))
