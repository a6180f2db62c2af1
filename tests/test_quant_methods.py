"""int4 algorithms (round-to-nearest, HQQ, GPTQ) and sensitivity-chosen 8-bit weights, on the tiny model."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")  # onnxruntime's HQQ quantizer runs on torch

import specdec  # noqa: E402
from specdec import GenerationConfig  # noqa: E402
from specdec.quant.bundle import quantize_bundle  # noqa: E402
from specdec.quant.calibration import CalibrationConfig, calibration_sequences, decoder_feeds, matmul_input_grams  # noqa: E402
from specdec.quant.report import quant_report, t_invariance  # noqa: E402
from specdec.quant.weight_only import WeightQuantConfig, gptq, quantizable_weights, sensitive_weights  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world, this is", "a small model proposes"]
CALIB = CalibrationConfig(prompts=6, new_tokens=24)


@pytest.fixture(scope="module")
def methods(tiny_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    out = {m: quantize_bundle(tiny_bundle, root / m, "int4", method=m, calibration=CALIB) for m in ("rtn", "hqq", "gptq")}
    out["rtn+8bit"] = quantize_bundle(tiny_bundle, root / "mixed", "int4", method="rtn", sensitive=0.5,
                                      calibration=CALIB)
    out["gptq+act-order"] = quantize_bundle(tiny_bundle, root / "gptq-ao", "int4", method="gptq", act_order=True,
                                            calibration=CALIB)
    return out


def _nbits(bundle) -> list[int]:
    """Bits of each quantized weight (siblings such as gate and up share one MatMulNBits node; the quantizer
    records every weight's choice, e.g. [('4bit_sym_rtn', 9), ('8bit_sym_rtn', 3)])."""
    import ast

    m = onnx.load(str(bundle / "target.onnx"), load_external_data=False)
    record = next((p.value for p in m.metadata_props if p.key == "specdec.nbits_choices"), None)
    if record is None:  # onnxruntime's quantizer (rtn, hqq): one node per weight
        return [next(a.i for a in n.attribute if a.name == "bits") for n in m.graph.node if n.op_type == "MatMulNBits"]
    return [int(key.split("bit")[0]) for key, n in ast.literal_eval(record) for _ in range(n)]


@pytest.mark.parametrize("method", ["rtn", "hqq", "gptq", "rtn+8bit", "gptq+act-order"])
def test_every_method_decodes_losslessly_with_t_invariant_kernels(methods, method):
    e = specdec.load(methods[method], drafter="ngram")
    assert e.manifest.graphs["target"].quant["method"] == f"matmul_nbits_{method.split('+')[0]}"
    for prompt in PROMPTS[:2]:
        plain = e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=0))
        assert e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=4)).token_ids == plain.token_ids
    assert t_invariance(e.target, e.encode(PROMPTS[0]) + [5, 6, 7, 8, 9]) < 1e-4
    assert _nbits(methods[method])


def test_gptq_and_8bit_weights_are_closer_to_fp32_than_round_to_nearest(tiny_bundle, methods):
    """GPTQ rounds to cancel each layer's output error on calibration text; 8-bit weights where 4-bit rounding
    hurts most cut the error further. Measured on prompts that are not the calibration's."""
    kl = {m: quant_report(tiny_bundle, methods[m], PROMPTS, max_new_tokens=24, draft_prompts=0)["mean_kl_a_b"]
          for m in ("rtn", "gptq", "rtn+8bit")}
    assert kl["gptq"] < kl["rtn"] and kl["rtn+8bit"] < kl["rtn"], kl


def test_sensitive_weights_are_the_ones_rounding_hurts_most(tiny_bundle):
    model = onnx.load(str(tiny_bundle / "target.onnx"))
    seqs = calibration_sequences(tiny_bundle, CalibrationConfig(prompts=2, new_tokens=8))
    grams = matmul_input_grams(model, seqs, quantizable_weights(model, WeightQuantConfig()))
    everything = sensitive_weights(model, WeightQuantConfig(bits=4, sensitive=1.0), grams)
    half = sensitive_weights(model, WeightQuantConfig(bits=4, sensitive=0.5), grams)
    assert len(half) == round(len(everything) / 2)
    assert list(half) == list(everything)[: len(half)]  # both ranked by the same error, largest first
    # The mixed bundle holds exactly that many 8-bit weights.
    mixed = quantize_bundle(tiny_bundle, tiny_bundle.parent / "mixed-check", "int4", method="minmax",
                            sensitive=0.5, calibration=CalibrationConfig(prompts=2, new_tokens=8))
    bits = _nbits(mixed)
    assert bits.count(8) == len(half) and bits.count(4) == len(bits) - len(half)


def test_decoder_feeds_prefill_matches_the_runtime(tiny_bundle):
    """Calibration runs the graph without IOBinding; its logits must be the runtime's for the same ids."""
    import onnxruntime as ort

    from specdec.runtime.session import pooled_session_options

    model = onnx.load(str(tiny_bundle / "target.onnx"))
    ids = np.array(specdec.load(tiny_bundle).encode(PROMPTS[0]), dtype=np.int64)
    session = ort.InferenceSession(model.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], decoder_feeds(model, ids))[0]
    e = specdec.load(tiny_bundle)
    np.testing.assert_allclose(logits[0, -1], e.target.prefill(ids[None, :])[0], atol=1e-4)  # prefill: the last row


def test_bad_method_requests(tiny_bundle, tmp_path):
    from specdec import SpecdecError

    with pytest.raises(ValueError, match="4 bits only"):
        WeightQuantConfig(bits=8, method="gptq")
    with pytest.raises(ValueError, match="sensitive"):
        WeightQuantConfig(bits=4, sensitive=1.5)
    with pytest.raises(ValueError, match="needs calibration"):
        from specdec.quant.weight_only import quantize_weights

        quantize_weights(onnx.load(str(tiny_bundle / "target.onnx")), WeightQuantConfig(method="gptq"))
    with pytest.raises(SpecdecError, match="apply to int8 and int4 only"):
        quantize_bundle(tiny_bundle, tmp_path / "x", "fp16", method="hqq")


def test_gptq_is_round_to_nearest_for_uncorrelated_inputs_and_beats_it_otherwise():
    """With H = identity no column's error can be absorbed by others: GPTQ is plain rounding (on the
    same fitted grid). With correlated
    inputs it must lower the layer's output error ||X (W - Q)||, the quantity it minimises."""
    from specdec.quant.grid import _blocks, _dequantize, _fit_grid

    rng = np.random.default_rng(0)
    K, N, bs = 64, 24, 32
    W = rng.standard_normal((K, N))
    for symmetric in (True, False):
        q, scale, offset = gptq(W, np.eye(K) * 1e6, 4, bs, symmetric)  # damping negligible next to 1e6
        q_rtn, scale_rtn, offset_rtn = _fit_grid(_blocks(W, bs), 4, symmetric)
        np.testing.assert_array_equal(q, q_rtn)
        np.testing.assert_allclose(scale, scale_rtn, rtol=1e-6)
        mixing = rng.standard_normal((K, K)) * 0.3 + np.eye(K)
        X = rng.standard_normal((512, K)) @ mixing  # correlated inputs
        err = {}
        for name, (qq, ss, oo) in {"gptq": gptq(W, X.T @ X, 4, bs, symmetric),
                                   "rtn": _fit_grid(_blocks(W, bs), 4, symmetric)}.items():
            err[name] = np.square(X @ (W - _dequantize(qq, ss, oo, 4, W.shape))).sum()
        assert err["gptq"] < 0.8 * err["rtn"], err


def test_act_order_rounds_high_energy_channels_first_and_lowers_the_error():
    """Inputs whose channels differ in energy (as LLM activations do): walking the loud channels first leaves the
    quiet ones to absorb their error, so the output error drops well below GPTQ's in plain order. With H
    diagonal no error moves, and act-order's static block scales make it round-to-nearest exactly."""
    from specdec.quant.grid import _blocks, _dequantize, _fit_grid

    rng = np.random.default_rng(3)
    K, N, bs = 128, 32, 32
    W = rng.standard_normal((K, N))
    X = (rng.standard_normal((1024, K)) @ (rng.standard_normal((K, K)) * 0.3 + np.eye(K))) * np.exp(rng.standard_normal(K))
    for symmetric in (True, False):
        q_rtn, scale_rtn, offset_rtn = _fit_grid(_blocks(W, bs), 4, symmetric)
        q, scale, offset = gptq(W, np.diag(rng.uniform(1, 100, K)) * 1e6, 4, bs, symmetric, act_order=True)
        np.testing.assert_array_equal(q, q_rtn)
        np.testing.assert_allclose(scale, scale_rtn, rtol=1e-6)
        err = {order: np.square(X @ (W - _dequantize(*gptq(W, X.T @ X, 4, bs, symmetric, act_order=order), 4, W.shape))).sum()
               for order in (False, True)}
        assert err[True] < 0.7 * err[False], err


def test_act_order_is_a_gptq_option():
    with pytest.raises(ValueError, match="act_order"):
        WeightQuantConfig(method="rtn", act_order=True)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("method", ["minmax", "gptq"])
def test_a_k_that_is_not_a_multiple_of_the_block_is_padded(method, symmetric):
    """K = 96 with blocks of 64: the last block holds 32 weights and 32 zeros; the graph computes x @ Q(W). An
    asymmetric grid adds its offsets through the block sums of x padded with zeros."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec.quant.weight_only import quantize_nbits

    rng = np.random.default_rng(1)
    K, N = 96, 40
    W = rng.standard_normal((K, N)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="proj")], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, None, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, None, N])],
                          initializer=[numpy_helper.from_array(W, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    X = rng.standard_normal((200, K)).astype(np.float32)
    cfg = WeightQuantConfig(bits=4, block_size=64, method=method, symmetric=symmetric)
    q = quantize_nbits(m, cfg, grams={"W": X.T.astype(np.float64) @ X})
    ops = [n.op_type for n in q.graph.node]
    assert ops == (["MatMulNBits"] if symmetric else ["MatMulNBits", "Pad", "Reshape", "ReduceSum", "MatMul", "Add"])
    from specdec.runtime.session import pooled_session_options

    sess = ort.InferenceSession(q.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
    Y = sess.run(None, {"A": X[None]})[0][0]
    rel = np.square(Y - X @ W).sum() / np.square(X @ W).sum()
    assert 1e-5 < rel < 0.05, rel  # quantized (not exact), and close


def test_fitted_clipping_lowers_the_squared_error_of_4_bit_blocks():
    """_fit_grid's clipping search never does worse than the min/max grid (a shrink of 1 is among its choices)
    and does better on Gaussian blocks, whose extremes are rare; 8 bits keep the min/max grid."""
    from specdec.quant.grid import _blocks, _dequantize, _fit_grid, _grid

    W = np.random.default_rng(2).standard_normal((256, 48)).astype(np.float32)
    for symmetric in (True, False):
        minmax = np.square(W - _dequantize(*_grid(_blocks(W, 128), 4, symmetric)[:3], 4, W.shape)).sum()
        fitted = np.square(W - _dequantize(*_fit_grid(_blocks(W, 128), 4, symmetric), 4, W.shape)).sum()
        assert fitted < 0.9 * minmax, (symmetric, fitted, minmax)
        q8, q8_minmax = _fit_grid(_blocks(W, 128), 8, symmetric), _grid(_blocks(W, 128), 8, symmetric)[:3]
        assert all(a is b or np.array_equal(a, b) for a, b in zip(q8, q8_minmax))


def test_quant_report_cli_compares_several_candidates_in_one_table(tiny_bundle, methods, tmp_path):
    import json

    from click.testing import CliRunner

    from specdec.cli import main

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                                   enumerate([("a", "the quick brown fox"), ("b", "hello world, this is")])))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["quant-report", str(tiny_bundle), str(methods["rtn"]), str(methods["gptq"]),
                                  "--questions", str(questions), "--max-new-tokens", "12", "--draft-prompts", "0",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    reports = json.loads(out.read_text())["reports"]
    assert [rep["b"]["quant"]["method"] for rep in reports] == ["matmul_nbits_rtn", "matmul_nbits_gptq"]
    assert "B1" in r.output and "B2" in r.output, r.output


@pytest.mark.parametrize("K", [128, 96])
def test_hqq_float_zero_points_become_fast_integer_codes_and_offsets(K):
    """HQQ writes float zero points, which only a slow dequantizing kernel reads on CPUs: the rewrite computes
    the same product through integer codes + block offsets."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    from specdec.quant.weight_only import float_zero_points_as_offsets
    from specdec.runtime.session import pooled_session_options

    rng = np.random.default_rng(2)
    N = 48
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="proj")], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, None, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, None, N])],
                          initializer=[numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    q = mnq.MatMulNBitsQuantizer(m, algo_config=mnq.HQQWeightOnlyQuantConfig(block_size=64, bits=4))
    q.process()
    hqq = q.model.model
    assert any(t.data_type == TensorProto.FLOAT and "zero" in t.name for t in hqq.graph.initializer)
    fast = float_zero_points_as_offsets(onnx.load_from_string(hqq.SerializeToString()))
    nbits = [n for n in fast.graph.node if n.op_type == "MatMulNBits"]
    zps = {t.name: t.data_type for t in fast.graph.initializer}
    assert len(nbits) == 1 and zps[nbits[0].input[3]] == TensorProto.UINT8
    X = rng.standard_normal((1, 5, K)).astype(np.float32)
    run = lambda model: ort.InferenceSession(model.SerializeToString(), pooled_session_options(),  # noqa: E731
                                             providers=["CPUExecutionProvider"]).run(None, {"A": X})[0]
    np.testing.assert_allclose(run(fast), run(hqq), rtol=1e-4, atol=1e-4)


def _tied_graph(E: np.ndarray):
    """input_ids -> embedding (columns of the tied [D, V] head, as specdec's graphs gather them) -> logits."""
    from onnx import TensorProto, helper, numpy_helper

    D, V = E.shape
    nodes = [helper.make_node("Gather", ["lm_head.weight", "input_ids"], ["cols"], name="embed", axis=1),  # [D,B,T]
             helper.make_node("Transpose", ["cols"], ["x"], name="embed.transpose", perm=[1, 2, 0]),  # [B,T,D]
             helper.make_node("MatMul", ["x", "lm_head.weight"], ["logits"], name="lm_head")]  # [B,T,V]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, None, V])],
                          initializer=[numpy_helper.from_array(E, "lm_head.weight")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


# minmax (self-int4's head) re-encodes a head on an 8-bit grid exactly; onnxruntime's round-to-nearest (self-int8)
# spends the full [-128, 127] range with a negative scale, which rounds such a head again.
@pytest.mark.parametrize("preset, exact_on_grid", [("self-int4", True), ("self-int8", False)])
def test_an_exactly_quantized_tied_head_also_serves_as_the_embedding(preset, exact_on_grid):
    """A head on an 8-bit grid (a GGUF's Q8_0) that comes back exact: the embedding is then gathered from the
    head's codes, and no fp32 copy of the tied matrix remains. A head that rounding changes keeps its fp32
    embedding (a rounded embedding would change the model)."""
    import onnxruntime as ort
    from onnx import numpy_helper

    from specdec.quant.weight_only import SELF_DRAFT_PRESETS, quantize_weights
    from specdec.runtime.session import pooled_session_options

    rng = np.random.default_rng(3)
    D, V = 64, 40
    step = np.abs(rng.standard_normal((V, D // 32, 1))) * 0.01 + 0.001  # per block of 32 along D, like Q8_0
    codes = rng.integers(-127, 128, size=(V, D // 32, 32))
    codes[..., 0] = 127  # Q8_0 sets each block's scale to max|w| / 127
    on_grid = (codes * step).reshape(V, D).T.astype(np.float32)  # [D, V]
    ids = np.array([[1, 7, 39, 7]])

    def run(model):
        s = ort.InferenceSession(model.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
        return s.run(None, {"input_ids": ids})[0]

    for E, shared in ((on_grid, exact_on_grid), (rng.standard_normal((D, V)).astype(np.float32), False)):
        reference = run(_tied_graph(E))
        q = quantize_weights(_tied_graph(E), SELF_DRAFT_PRESETS[preset])
        ops = [n.op_type for n in q.graph.node]
        fp32_tables = [t.name for t in q.graph.initializer if numpy_helper.to_array(t).size == D * V
                       and t.data_type == onnx.TensorProto.FLOAT]
        assert ("GatherBlockQuantized" in ops) == shared and (not fp32_tables) == shared, (ops, fp32_tables)
        if shared:  # same embedding exactly; the head's int8-activation kernel rounds its input a little
            np.testing.assert_allclose(run(q), reference, rtol=0.05, atol=0.05 * np.abs(reference).max())


def test_graphs_reading_the_target_gather_from_its_head_codes_too(tmp_path):
    """An EAGLE head or LayerSkip exit graph gathers the embedding of a target whose embedding now comes from its
    head's codes: it is rewritten to gather from the same codes (same output), and saved beside the target it
    keeps no tensor of its own the size of the tied matrix."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec.export.graph import save_graph, save_graph_sharing
    from specdec.quant.weight_only import SELF_DRAFT_PRESETS, gather_from_codes, head_codes, quantize_weights
    from specdec.runtime.session import pooled_session_options

    rng = np.random.default_rng(4)
    D, V = 64, 512
    step = np.abs(rng.standard_normal((V, D // 32, 1))) * 0.01 + 0.001
    codes = rng.integers(-127, 128, size=(V, D // 32, 32))
    codes[..., 0] = 127
    E = (codes * step).reshape(V, D).T.astype(np.float32)  # [D, V] on a Q8_0 grid
    target = quantize_weights(_tied_graph(E), SELF_DRAFT_PRESETS["self-int4"])
    assert "GatherBlockQuantized" in [n.op_type for n in target.graph.node]
    # The drafter: the tied embedding (columns of the [D, V] matrix), then a small matmul of its own.
    nodes = [helper.make_node("Gather", ["lm_head.weight", "input_ids"], ["cols"], name="embed", axis=1),
             helper.make_node("Transpose", ["cols"], ["x"], name="embed.transpose", perm=[1, 2, 0]),
             helper.make_node("MatMul", ["x", "proj"], ["y"], name="proj")]
    g = helper.make_graph(nodes, "d", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, 8])],
                          initializer=[numpy_helper.from_array(E, "lm_head.weight"),
                                       numpy_helper.from_array(rng.standard_normal((D, 8)).astype(np.float32), "proj")])
    drafter = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    drafter.ir_version = 10
    ids = np.array([[3, 300, 511, 3]])

    def run(model):
        sess = ort.InferenceSession(model.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
        return sess.run(None, {"input_ids": ids})[0]

    before = run(drafter)
    code = head_codes(target)
    save_graph(target, tmp_path / "target.onnx")  # saving first: the codes taken above must not depend on it
    rewritten = gather_from_codes(drafter, code)
    assert "GatherBlockQuantized" in [n.op_type for n in rewritten.graph.node]
    np.testing.assert_allclose(run(rewritten), before, rtol=1e-6, atol=1e-5)  # the same embedding (fp32 rounding)
    save_graph_sharing(rewritten, tmp_path / "drafter.onnx", tmp_path / "target.onnx")
    own = sum(f.stat().st_size for f in tmp_path.glob("drafter.onnx*"))
    assert own < D * V, own  # neither the fp32 table (4*D*V bytes) nor a copy of the codes (D*V)
    # A table the codes do not stand for stays as it is.
    other = gather_from_codes(_tied_graph(E + 1.0), code)
    assert "GatherBlockQuantized" not in [n.op_type for n in other.graph.node]


@pytest.mark.parametrize("method", ["minmax", "hqq"])
def test_sensitive_weights_can_take_smaller_4bit_blocks_instead_of_8_bits(tiny_bundle, tmp_path, method):
    """Where 8-bit kernels are slow (AVX2), the sensitive weights keep 4 bits in finer blocks; every weight is
    quantized exactly once (HQQ's offset MatMuls are not taken for weights by the second pass)."""
    model = onnx.load(str(tiny_bundle / "target.onnx"))
    n_weights = len(quantizable_weights(model, WeightQuantConfig(block_size=64)))
    calib = CalibrationConfig(prompts=2, new_tokens=8)
    out = quantize_bundle(tiny_bundle, tmp_path / "q", "int4", method=method, block_size=64, sensitive=0.5,
                          sensitive_block=32, calibration=calib)
    q = onnx.load(str(out / "target.onnx"), load_external_data=False)
    record = next((p.value for p in q.metadata_props if p.key == "specdec.nbits_choices"), None)
    if record is None:  # onnxruntime's quantizer: one node per weight
        blocks = [next(a.i for a in n.attribute if a.name == "block_size") for n in q.graph.node
                  if n.op_type == "MatMulNBits"]
    else:  # specdec's: a weight quantized in other blocks than the configured 64 says so, e.g. 4bit_sym_rtn_b32
        import ast

        blocks = [int(key.rsplit("_b", 1)[1]) if "_b" in key else 64 for key, n in ast.literal_eval(record)
                  for _ in range(n)]
    assert len(blocks) == n_weights and _nbits(out) == [4] * n_weights
    assert blocks.count(32) == round(n_weights / 2) and blocks.count(64) == n_weights - round(n_weights / 2)
    e = specdec.load(out, drafter="ngram")
    plain = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, draft_len=0))
    assert e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, draft_len=4)).token_ids == plain.token_ids
    with pytest.raises(ValueError, match="sensitive_block"):
        WeightQuantConfig(block_size=32, sensitive=0.5, sensitive_block=32)


def test_bad_quantize_options_get_one_line(tiny_bundle, tmp_path):
    from test_cli import assert_one_error, run_cli

    q = ("quantize", tiny_bundle, "--to", "int4", "-o", tmp_path / "q")
    assert_one_error(run_cli(*q, "--method", "gptq", "--calib-prompts", "0"), "calibration needs >= 1 prompt")
    assert_one_error(run_cli(*q, "--sensitive", "1.5"), "sensitive must be in [0, 1]")
    assert_one_error(run_cli(*q, "--act-order"), "act_order is a GPTQ option")
    assert_one_error(run_cli(*q, "--awq"), "awq scales weights off the grids minmax re-encodes")
    assert_one_error(run_cli(*q, "--sensitive", "0.2", "--sensitive-block", "48"), "sensitive_block")
    assert_one_error(run_cli("quantize", tiny_bundle, "--to", "fp16", "-o", tmp_path / "h", "--method", "hqq"),
                     "apply to int8 and int4 only")
    assert not (tmp_path / "q").exists() and not (tmp_path / "h").exists()


def test_a_sensitive_weight_on_a_4bit_grid_of_finer_blocks_comes_back_exactly():
    """A GGUF's Q4_1 weights (4-bit blocks of 32) quantized into blocks of 128: the ones chosen as sensitive, with
    sensitive_block 32, are re-encoded bit for bit on their own grid, not rounded a second time; the others round."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec.quant.weight_only import quantize_nbits
    from specdec.runtime.session import pooled_session_options

    rng = np.random.default_rng(4)
    K, N, bs = 256, 24, 32
    codes = rng.integers(0, 16, (N, K // bs, bs))
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 takes each block's min and max as its ends
    step, low = rng.uniform(0.01, 0.05, (N, K // bs, 1)), rng.uniform(-0.4, -0.1, (N, K // bs, 1))
    W = (codes * step + low).reshape(N, K).T.astype(np.float32)  # [K, N] on a Q4_1 grid of blocks of 32
    names = ("a", "b")
    g = helper.make_graph([helper.make_node("MatMul", ["x", n], [f"y_{n}"], name=n) for n in names], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, K])],
                          [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, [1, None, N]) for n in names],
                          initializer=[numpy_helper.from_array(W, n) for n in names])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    cfg = WeightQuantConfig(bits=4, block_size=128, method="minmax", symmetric=False, sensitive=0.5,
                            sensitive_block=32)
    q = quantize_nbits(m, cfg, finer={"a"})
    assert q.metadata_props[-1].value == str(sorted({"4bit_asym_exact_b32": 1, "4bit_asym_rtn": 1}.items()))
    X = rng.standard_normal((1, 5, K)).astype(np.float32)
    sess = ort.InferenceSession(q.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
    y_a, y_b = sess.run(["y_a", "y_b"], {"x": X})
    np.testing.assert_allclose(y_a, X @ W, rtol=1e-5, atol=1e-5)  # exact (up to fp32 summation order)
    assert np.abs(y_b - X @ W).max() > 1e-3  # rounded into blocks of 128


def test_quantize_cli_grids_default_by_method_and_follow_the_flag(tiny_bundle, tmp_path):
    """int4 weights off any grid (a random tiny model): round-to-nearest takes centred blocks by default, GPTQ offset
    blocks; --asymmetric / --symmetric override either; the manifest records the grid used."""
    import ast

    from click.testing import CliRunner

    from specdec.cli import main
    from specdec.runtime.manifest import read_manifest

    cases = (([], "4bit_sym_rtn"), (["--asymmetric"], "4bit_asym_rtn"),
             (["--method", "gptq", "--calib-prompts", "2"], "4bit_asym_gptq"),
             (["--method", "gptq", "--calib-prompts", "2", "--symmetric"], "4bit_sym_gptq"))
    for i, (flags, expected) in enumerate(cases):
        out = tmp_path / f"q{i}"
        r = CliRunner().invoke(main, ["quantize", str(tiny_bundle), "--to", "int4", "-o", str(out), *flags])
        assert r.exit_code == 0, r.output
        q = onnx.load(str(out / "target.onnx"), load_external_data=False)
        record = dict(ast.literal_eval(next(p.value for p in q.metadata_props if p.key == "specdec.nbits_choices")))
        assert expected in record, (flags, record)
        assert read_manifest(out).graphs["target"].quant["symmetric"] is ("_sym_" in expected)
    r = CliRunner().invoke(main, ["quantize", str(tiny_bundle), "--to", "fp16", "--symmetric", "-o", str(tmp_path / "h")])
    assert r.exit_code != 0 and "--symmetric" in r.output
