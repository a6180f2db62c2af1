"""Activation-aware scaling before rounding (quant/awq.py), on the tiny model."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

pytest.importorskip("torch")  # the tiny model is built with transformers

import specdec  # noqa: E402
from specdec import GenerationConfig  # noqa: E402
from specdec.quant.awq import fold_scale, scale_for_rounding, scale_sites  # noqa: E402
from specdec.quant.bundle import quantize_bundle  # noqa: E402
from specdec.quant.calibration import CalibrationConfig, calibration_sequences, decoder_feeds, matmul_input_grams  # noqa: E402
from specdec.quant.weight_only import WeightQuantConfig, quantizable_weights, quantize_weights  # noqa: E402

CALIB = CalibrationConfig(prompts=6, new_tokens=24)


def _logits(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from specdec.runtime.session import pooled_session_options

    sess = ort.InferenceSession(model.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
    return sess.run(["logits"], decoder_feeds(model, ids))[0][0]  # [n, vocab]


def _with_outlier_channels(model: onnx.ModelProto, factor: float = 20.0) -> onnx.ModelProto:
    """Every norm's gamma with a few channels `factor` times larger: the activation outliers AWQ is for."""
    for t in model.graph.initializer:
        if t.name.endswith("_norm") and len(t.dims) == 1:
            g = numpy_helper.to_array(t).copy()
            g[[3, 17, 40]] *= factor
            t.CopyFrom(numpy_helper.from_array(g, t.name))
    return model


@pytest.fixture(scope="module")
def calibration(tiny_bundle):
    return calibration_sequences(tiny_bundle, CALIB)


def test_every_site_is_found_and_any_scales_leave_the_fp32_graph_unchanged(tiny_bundle, calibration):
    """Random scales at every site (q/k/v and gate/up behind their norms, down behind up, o_proj behind the value
    columns shared by grouped query heads) fold into the graph without changing its logits."""
    model = onnx.load(str(tiny_bundle / "target.onnx"))
    ids = calibration[0]
    before = _logits(model, ids)
    sites = scale_sites(model, set(quantizable_weights(model, WeightQuantConfig())))
    layers = sum(1 for n in model.graph.node if n.op_type == "GroupQueryAttention")
    kinds = sorted(w.split(".")[-2] for site in sites for w in site.weights)
    assert kinds == sorted(["qkv", "o_proj", "gate", "up", "down"] * layers), kinds
    rng = np.random.default_rng(0)
    for site in sites:
        per_source = rng.uniform(0.25, 4.0, int(site.source_index.max()) + 1)
        fold_scale(model, site, per_source[site.source_index])
    np.testing.assert_allclose(_logits(model, ids), before, atol=2e-4)


def test_searched_scales_cut_the_rounding_error_where_activations_have_outliers(tiny_bundle, calibration):
    model = _with_outlier_channels(onnx.load(str(tiny_bundle / "target.onnx")))
    cfg = WeightQuantConfig(bits=4, block_size=32, method="rtn")
    grams = matmul_input_grams(model, calibration, quantizable_weights(model, cfg))
    before = _logits(model, calibration[0])
    model, new_grams, record = scale_for_rounding(model, grams, cfg.bits, cfg.block_size, cfg.symmetric)
    # fp32 rounding only: the outlier channels make logits and their rounding ~10x the plain model's
    np.testing.assert_allclose(_logits(model, calibration[0]), before, atol=1e-4 * np.abs(before).max())
    norm_sites = [k for k in record if ".qkv." in k or ".gate." in k]
    assert len(norm_sites) == 2 * sum(1 for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert all(alpha > 0 and ratio < 0.9 for alpha, ratio in (record[k] for k in norm_sites)), record
    assert all(ratio <= 1.0 for _, ratio in record.values())
    # the Gram matrices handed on are those of the scaled inputs: re-measured, they agree
    measured = matmul_input_grams(model, calibration, list(new_grams))
    for w, H in new_grams.items():
        np.testing.assert_allclose(measured[w], H, rtol=1e-3, atol=1e-3 * np.abs(H).max())


def test_awq_brings_the_quantized_graph_closer_to_fp32(tiny_bundle, calibration):
    """End to end through quantize_weights, on a sequence that is not calibration text."""
    from specdec.quant.report import log_softmax

    ref = _with_outlier_channels(onnx.load(str(tiny_bundle / "target.onnx")))
    ids = np.asarray(specdec.load(tiny_bundle).encode("a held-out sentence about rivers and their deltas"))
    lp_ref = log_softmax(_logits(ref, ids))
    kl = {}
    for awq in (False, True):
        model = _with_outlier_channels(onnx.load(str(tiny_bundle / "target.onnx")))
        q = quantize_weights(model, WeightQuantConfig(bits=4, block_size=32, method="rtn", awq=awq), calibration)
        lp = log_softmax(_logits(q, ids))
        kl[awq] = float((np.exp(lp_ref) * (lp_ref - lp)).sum(-1).mean())
    assert kl[True] < 0.7 * kl[False], kl


def test_an_awq_bundle_records_it_and_speculates_losslessly(tiny_bundle, tmp_path):
    from test_cli import run_cli

    out = tmp_path / "awq"
    code, stdout, stderr = run_cli("quantize", tiny_bundle, "--to", "int4", "--method", "gptq", "--awq",
                                   "--calib-prompts", "4", "-o", out)
    assert code == 0, stdout + stderr
    e = specdec.load(out, drafter="ngram")
    assert e.manifest.graphs["target"].quant["awq"] is True
    meta = {p.key for p in onnx.load(str(out / "target.onnx"), load_external_data=False).metadata_props}
    assert "specdec.awq" in meta
    for prompt in ("the quick brown fox", "hello world, this is"):
        plain = e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=0))
        assert e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=4)).token_ids == plain.token_ids


def test_awq_refusals(tiny_bundle, tmp_path):
    from specdec import SpecdecError

    with pytest.raises(ValueError, match="awq scales weights off the grids"):
        WeightQuantConfig(method="minmax", awq=True)
    with pytest.raises(SpecdecError, match="--awq"):
        quantize_bundle(tiny_bundle, tmp_path / "x", "fp16", awq=True)


def test_frozen_weights_keep_their_rows_and_their_sites_are_skipped(tiny_bundle, calibration):
    """A weight kept in finer blocks (sensitive_block) may lie on a GGUF's grid: its rows are not scaled, so the
    sites holding it are skipped; the other sites still scale."""
    model = _with_outlier_channels(onnx.load(str(tiny_bundle / "target.onnx")))
    cfg = WeightQuantConfig(bits=4, block_size=32, method="rtn")
    grams = matmul_input_grams(model, calibration, quantizable_weights(model, cfg))
    frozen = frozenset({"layers.0.gate.weight"})
    before = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "layers.0.gate.weight")).copy()
    model, _, record = scale_for_rounding(model, grams, 4, 32, True, frozen)
    after = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "layers.0.gate.weight"))
    np.testing.assert_array_equal(after, before)
    assert not any("layers.0.gate.weight" in k for k in record)
    assert "layers.1.gate.weight+layers.1.up.weight" in record
