"""Quantized bundles and the quant report, on the tiny model."""
from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig, SpecdecError
from specdec.quant.report import compare_logits, quant_report, t_invariance

PROMPTS = ["the quick brown fox", "hello world, this is"]


@pytest.fixture(scope="module")
def quantized(tiny_bundle, tmp_path_factory):
    from specdec.quant.bundle import quantize_bundle

    root = tmp_path_factory.mktemp("quant")
    return {p: quantize_bundle(tiny_bundle, root / p, p) for p in ("int8", "int4")}


def test_compare_logits_known_answer():
    a = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    b = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    m = compare_logits(a, b, np.array([0, 1]))
    assert m["kl_sum"] == pytest.approx(0.5 * np.log(2) + 0.25 * np.log(0.5))  # row 2 contributes 0
    assert m["agree"] == 1 and m["n"] == 2
    assert m["nll_a"] == pytest.approx(-np.log(0.5) - np.log(0.8))
    assert m["nll_b"] == pytest.approx(-np.log(0.25) - np.log(0.8))


def test_identical_bundles_report_zero_divergence(tiny_bundle):
    r = quant_report(tiny_bundle, tiny_bundle, PROMPTS, max_new_tokens=20)
    assert r["tokens"] > 0
    assert r["mean_kl_a_b"] == pytest.approx(0.0, abs=1e-9)
    assert r["top1_agreement"] == 1.0
    assert r["a"]["perplexity"] == pytest.approx(r["b"]["perplexity"])
    assert r["b_drafting_for_a"]["acceptance_rate"] == 1.0


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_targets_decode_and_stay_lossless(quantized, precision):
    bundle = quantized[precision]
    e = specdec.load(bundle, drafter="ngram")
    assert e.manifest.graphs["target"].precision == precision
    assert e.manifest.graphs["target"].quant["accuracy_level"] == 0
    for prompt in PROMPTS:
        e.use_drafter("none")
        plain = e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=0))
        for drafter in ("ngram", "model"):
            e.use_drafter(drafter)
            assert e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=4)).token_ids == plain.token_ids
    ids = e.encode(PROMPTS[0]) + [5, 6, 7, 8, 9]
    assert t_invariance(e.target, ids) < 1e-4  # accuracy_level 0 kernels: a T-step equals T single steps


def test_int8_is_closer_to_fp32_than_int4(tiny_bundle, quantized):
    r8 = quant_report(tiny_bundle, quantized["int8"], PROMPTS, max_new_tokens=20)
    r4 = quant_report(tiny_bundle, quantized["int4"], PROMPTS, max_new_tokens=20)
    assert r8["mean_kl_a_b"] < r4["mean_kl_a_b"]
    assert r8["b"]["size_mb"] < r8["a"]["size_mb"]


def test_quantize_errors(tiny_bundle, quantized, tmp_path):
    from specdec.quant.bundle import quantize_bundle

    with pytest.raises(SpecdecError, match="already quantized"):
        quantize_bundle(quantized["int8"], tmp_path / "x", "int4")
    with pytest.raises(SpecdecError, match="unknown precision"):
        quantize_bundle(tiny_bundle, tmp_path / "y", "fp16")
    with pytest.raises(SpecdecError, match="already exists"):
        quantize_bundle(tiny_bundle, quantized["int8"], "int8")
