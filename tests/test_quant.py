"""Quantized bundles and the quant report, on the tiny model."""
from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig, SpecdecError
from specdec.quant.report import compare_logits, quant_report, t_invariance
from specdec.runtime.session import RuntimeOptions

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
    r8 = quant_report(tiny_bundle, quantized["int8"], PROMPTS, max_new_tokens=20, draft_prompts=1)
    r4 = quant_report(tiny_bundle, quantized["int4"], PROMPTS, max_new_tokens=20)
    assert r8["b_drafting_for_a"]["prompts"] == 1 and r4["b_drafting_for_a"]["prompts"] == len(PROMPTS)
    assert r8["mean_kl_a_b"] < r4["mean_kl_a_b"]
    assert r8["b"]["size_mb"] < r8["a"]["size_mb"]


def test_quantize_errors(tiny_bundle, quantized, tmp_path):
    from specdec.quant.bundle import quantize_bundle

    with pytest.raises(SpecdecError, match="already quantized"):
        quantize_bundle(quantized["int8"], tmp_path / "x", "int4")
    with pytest.raises(SpecdecError, match="unknown precision"):
        quantize_bundle(tiny_bundle, tmp_path / "y", "bf16")
    with pytest.raises(SpecdecError, match="already exists"):
        quantize_bundle(tiny_bundle, quantized["int8"], "int8")
    # A bundle copied with hard links: onnx refuses its weight file; one line, and no output folder left behind.
    # (Linked to a copy: links to the session's tiny bundle would make every later test refuse it too.)
    import shutil

    own = shutil.copytree(tiny_bundle, tmp_path / "own")
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in own.iterdir():
        if f.is_file():
            (linked / f.name).hardlink_to(f)
    with pytest.raises(SpecdecError, match="hard links"):
        quantize_bundle(linked, tmp_path / "z", "int4")
    assert not (tmp_path / "z").exists()


# ----------------------------------------------------------------------------------------------- fp16

CPU_FP16 = RuntimeOptions(allow_cpu_fp16=True)  # ORT's CPU kernels take fp16: the tests' way to run it


@pytest.fixture(scope="module")
def fp16(tiny_checkpoint, tiny_bundle, tmp_path_factory):
    """The tiny model's fp16 bundle both ways: exported from the checkpoint, and converted from the fp32 bundle."""
    from specdec.export.bundle import ExportConfig, export_bundle
    from specdec.quant.bundle import quantize_bundle

    root = tmp_path_factory.mktemp("fp16")
    export_bundle(tiny_checkpoint, root / "exported", ExportConfig(drafter="self-int8", precision="fp16", max_len=256))
    return {"exported": root / "exported", "quantized": quantize_bundle(tiny_bundle, root / "quantized", "fp16")}


def _teacher_forced_logits(engine, prompt: str, tokens: list[int]) -> np.ndarray:
    """The target's logits [1 + len(tokens), vocab] (float32) after the prompt and after each forced token."""
    dec = engine.target
    dec.kv.reset()
    engine.cached_ids = []
    rows = [dec.prefill(np.asarray([engine.encode(prompt)], dtype=np.int64))[0].astype(np.float32)]
    for t in tokens:
        rows.append(dec.forward(np.asarray([[t]], dtype=np.int64))[0, -1].astype(np.float32))
        dec.kv.advance(1)
    return np.stack(rows)


@pytest.mark.parametrize("how", ["exported", "quantized"])
def test_fp16_bundle_records_precision_and_its_check(fp16, how):
    from specdec.export.verify import FP16_RELATIVE_TOLERANCE
    from specdec.runtime.manifest import read_manifest

    g = read_manifest(fp16[how]).graphs["target"]
    assert g.precision == "fp16" and g.kv_dtype == np.float16 and g.quant == {}
    ref = "transformers" if how == "exported" else "fp32_graph"
    diff, scale = g.checks[f"max_abs_logit_diff_vs_{ref}"], g.checks[f"max_abs_logit_{ref}"]
    assert g.checks["tolerance"] == pytest.approx(FP16_RELATIVE_TOLERANCE * max(1.0, scale))
    assert 0 < diff < 0.01 * scale  # fp16 rounding (measured ~4e-3 of the scale), far inside the tolerance


@pytest.mark.parametrize("how", ["exported", "quantized"])
def test_fp16_bundle_decodes_on_cpu_with_the_override_close_to_fp32(tiny_bundle, fp16, how):
    e32 = specdec.load(tiny_bundle, drafter="none")
    e16 = specdec.load(fp16[how], drafter="none", runtime=CPU_FP16)
    assert e16.target.kv.dtype == np.float16
    for prompt in PROMPTS:
        greedy = e32.generate(prompt, GenerationConfig(max_new_tokens=12, draft_len=0)).token_ids
        l32 = _teacher_forced_logits(e32, prompt, greedy)
        l16 = _teacher_forced_logits(e16, prompt, greedy)
        scale = np.abs(l32).max()
        # fp16 rounds every op to 2**-11 relative: measured < 5e-3 of the largest logit on this model.
        assert np.abs(l16 - l32).max() < 0.01 * scale
        # Top-1 agrees wherever fp32's lead is beyond that error (a closer race may go either way).
        top2 = np.sort(l32, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * 0.01 * scale
        assert clear.sum() >= len(greedy) // 2
        assert (l16.argmax(-1) == l32.argmax(-1))[clear].all()


def test_fp16_speculation_stays_within_fp16_rounding(fp16):
    """A T-token fp16 step rounds a little differently from T single steps (one fp16 ulp, FACTS-style
    measurement: <= 2e-3 on this model), unlike fp32 (~1e-6). Greedy speculation is therefore identical to
    plain greedy except where the top two fp16 logits are within an ulp: the self-draft must still verify."""
    e = specdec.load(fp16["exported"], drafter="model", runtime=CPU_FP16)
    ids = e.encode(PROMPTS[0]) + [5, 6, 7, 8, 9]
    assert t_invariance(e.target, ids) < 5e-3
    e.use_drafter("none")
    e.reset()
    plain = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, draft_len=0))
    e.use_drafter("model")
    e.reset()
    spec = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, draft_len=4))
    assert spec.stats.target_forwards < plain.stats.target_forwards and spec.stats.accepted > 0
    i = next((i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b), None)
    if i is not None:  # a divergence is only allowed at a tie within fp16 rounding
        logits = _teacher_forced_logits(e, PROMPTS[0], plain.token_ids[:i])[-1]
        assert abs(logits[plain.token_ids[i]] - logits[spec.token_ids[i]]) <= 5e-3, (i, plain.token_ids, spec.token_ids)


def test_fp16_bundle_on_the_cpu_provider_is_one_clear_error(fp16):
    with pytest.raises(SpecdecError) as e:
        specdec.load(fp16["exported"])
    assert "fp16 is a GPU precision" in str(e.value) and "--provider cuda" in str(e.value)
    assert "--precision fp32|int8|int4" in str(e.value)


def test_quantize_refuses_fp16_and_quantized_sources(fp16, quantized, tmp_path):
    from specdec.quant.bundle import quantize_bundle

    for to in ("int8", "int4", "fp16"):
        with pytest.raises(SpecdecError, match="is fp16; specdec quantize converts fp32 bundles only"):
            quantize_bundle(fp16["exported"], tmp_path / to, to)
    with pytest.raises(SpecdecError, match=r"already quantized \(int8\)"):
        quantize_bundle(quantized["int8"], tmp_path / "x", "fp16")
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.fixture(scope="module")
def fast_int4(tiny_bundle, tmp_path_factory):
    from specdec.quant.bundle import quantize_bundle

    return quantize_bundle(tiny_bundle, tmp_path_factory.mktemp("fast") / "int4f", "int4", fast_kernels=True)


def test_fast_kernels_are_opt_in_measured_and_padded_to_two_tokens(tiny_bundle, fast_int4, tmp_path):
    """int8-activation kernels compute a 1-row step on another path than wider steps; quantize measures it and
    records min_step_tokens 2, which makes the bundle T-invariant as the runtime runs it."""
    from dataclasses import replace

    from specdec.errors import SpecdecError
    from specdec.quant.bundle import quantize_bundle
    from specdec.runtime.manifest import read_manifest

    exact = read_manifest(quantize_bundle(tiny_bundle, tmp_path / "exact", "int4")).graphs["target"]
    fast = read_manifest(fast_int4).graphs["target"]
    assert exact.t_invariant and exact.min_step_tokens == 1 and not exact.checks
    assert fast.quant["accuracy_level"] == 4
    assert fast.checks["max_logit_diff_T_step_vs_1_token_steps"] > 0.0  # GQA's 1-row path rounds apart
    assert fast.checks["max_logit_diff_T_step_vs_2_token_steps"] == 0.0
    assert fast.min_step_tokens == 2 and fast.t_invariant
    assert not replace(fast, min_step_tokens=1).t_invariant
    with pytest.raises(SpecdecError, match="fast-kernels"):
        quantize_bundle(tiny_bundle, tmp_path / "fp16", "fp16", fast_kernels=True)


def test_fast_kernel_bundle_speculates_identically_to_its_plain_decoding(fast_int4):
    e = specdec.load(fast_int4, drafter="ngram")
    ids = e.encode(PROMPTS[0]) + [5, 6, 7, 8, 9]
    assert t_invariance(e.target, ids) == 0.0  # single steps run padded to 2 rows
    for prompt in PROMPTS:
        e.use_drafter("none")
        plain = e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=0))
        for drafter, k in (("ngram", 4), ("model", 2), ("model", 5), ("ngram", "auto")):
            e.use_drafter(drafter)
            assert e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=k)).token_ids == plain.token_ids


def test_padded_single_step_fits_at_the_end_of_the_buffer(fast_int4):
    """The padding row of a step at the last free position goes to the cache's slack, not out of bounds."""
    from specdec.runtime.decoder import Decoder
    from specdec.runtime.kv import KVCache
    from specdec.runtime.manifest import read_manifest

    g = read_manifest(fast_int4).graphs["target"]
    n = 12
    kv = KVCache.for_graph(g, 1, n)
    assert kv.capacity == n + 1 and kv.max_len == n
    dec = Decoder(fast_int4 / g.file, g, g.model, kv, RuntimeOptions())
    ids = np.arange(3, 3 + n, dtype=np.int64)[None]  # [1, n]
    wide = dec.prefill(ids[:, :n - 1]).copy()  # [1, vocab] logits after n-1 tokens, from a wide step
    dec.kv.truncate(n - 2)
    single = dec.forward(ids[:, n - 2:n - 1])[0, 0]  # [vocab] the same position as a padded 1-row step
    np.testing.assert_array_equal(single, wide[0])
    dec.kv.advance(1)
    assert dec.forward(ids[:, n - 1:n]).shape == (1, 1, g.model.vocab_size)  # the last slot: the pad needs slack
    with pytest.raises(SpecdecError, match="does not fit the KV buffer"):
        dec.forward(ids[:, :2])


def _matmul_model(W):
    from onnx import TensorProto, helper, numpy_helper

    K, N = W.shape
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="lm_head")], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, None, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None, N])],
                          initializer=[numpy_helper.from_array(W, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m


def _q4_1(rng, K, N, bs=32):
    """A [K, N] weight on a Q4_1 grid (4-bit codes, fp16 scale and block minimum)."""
    d = rng.uniform(0.01, 0.05, size=(N, K // bs, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.4, -0.2, size=(N, K // bs, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, size=(N, K // bs, bs))
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 blocks span their whole range
    return np.ascontiguousarray((d * q + m).reshape(N, K).T).astype(np.float32)


def test_weights_reading_one_input_share_a_kernel_and_its_block_sums():
    """gate and up (one input): one MatMulNBits over both weights' columns, one block-sum chain, a Split; x, y
    and z = y @ W3 come out as the float weights give them."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec.quant.weight_only import WeightQuantConfig, quantize_nbits

    rng = np.random.default_rng(1)
    K, N1, N2 = 64, 96, 128
    W1, W2, W3 = _q4_1(rng, K, N1), _q4_1(rng, K, N2), _q4_1(rng, N1, K)
    nodes = [helper.make_node("MatMul", ["A", "W1"], ["Y1"], name="gate"),
             helper.make_node("MatMul", ["A", "W2"], ["Y2"], name="up"),
             helper.make_node("MatMul", ["Y1", "W3"], ["Z"], name="down")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y1", "Y2", "Z")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, None, K])], outs,
                          initializer=[numpy_helper.from_array(w, n) for w, n in ((W1, "W1"), (W2, "W2"), (W3, "W3"))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    q = quantize_nbits(model, WeightQuantConfig(bits=4, method="minmax"))
    ops = [n.op_type for n in q.graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("ReduceSum") == 2 and ops.count("Split") == 1
    assert "('4bit_asym_exact', 3)" in q.metadata_props[-1].value  # every weight recorded
    from specdec.runtime.session import pooled_session_options

    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    session = ort.InferenceSession(q.SerializeToString(), pooled_session_options(), providers=["CPUExecutionProvider"])
    y1, y2, z = session.run(None, {"A": x})
    for got, want in ((y1, x @ W1), (y2, x @ W2), (z, (x @ W1) @ W3)):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("grid", ["q4_1", "q4_0", "q8_0", "none"])
def test_minmax_reencodes_gguf_grids_exactly_and_rounds_the_rest(grid):
    """Weights that lie on a Q4_1 (4-bit, offset), Q4_0 (4-bit symmetric: the block's largest-magnitude value on
    code -8, either sign) or Q8_0 (8-bit symmetric) block grid come back exactly; others are rounded (here the
    'head' to head_bits=8), within a half step."""
    import onnxruntime as ort

    from specdec.quant.weight_only import WeightQuantConfig, quantize_nbits

    rng = np.random.default_rng(0)
    K, N, bs = 64, 48, 32
    d = rng.uniform(0.01, 0.05, size=(N, K // bs, 1)).astype(np.float16).astype(np.float32)
    if grid == "q4_1":
        m = rng.uniform(-0.4, -0.2, size=(N, K // bs, 1)).astype(np.float16).astype(np.float32)
        q = rng.integers(0, 16, size=(N, K // bs, bs))
        q[..., 0], q[..., 1] = 0, 15  # Q4_1 blocks span their whole range
        blocks = d * q + m
    elif grid == "q4_0":
        q = rng.integers(-8, 8, size=(N, K // bs, bs))
        q[..., 0], q[..., 1] = -8, 7  # the block's extreme, whose sign d carries; spanning all codes, it fits an
        # offset grid as well, and the symmetric one (no offsets to add) must win
        blocks = d * rng.choice([-1.0, 1.0], size=d.shape).astype(np.float32) * q
    elif grid == "q8_0":
        q = rng.integers(-127, 128, size=(N, K // bs, bs))
        q[..., 0] = 127
        blocks = d * q
    else:
        blocks = rng.standard_normal((N, K // bs, bs)).astype(np.float32) * 0.05
    W = np.ascontiguousarray(blocks.reshape(N, K).T).astype(np.float32)  # [K, N]
    model = quantize_nbits(_matmul_model(W), WeightQuantConfig(bits=4, method="minmax", head_bits=8))
    choice = model.metadata_props[-1].value
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    so = ort.SessionOptions()
    so.use_per_session_threads = False  # other tests in this process set up specdec's global pool
    y = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"A": x})[0]
    err = np.abs(y - x @ W).max() / np.abs(x @ W).max()
    if grid == "q4_1":
        assert "4bit_asym_exact" in choice and err < 1e-5
    elif grid == "q4_0":
        assert "4bit_sym_exact" in choice and "asym" not in choice and err < 1e-5
    elif grid == "q8_0":
        assert "8bit_sym_exact" in choice and err < 1e-5
    else:
        assert "8bit_sym_rtn" in choice and 1e-5 < err < 2e-2  # the head's fallback: 8 bits, not 4


@pytest.mark.parametrize("stream", [True, False])
def test_export_builds_the_fast_kernel_target_in_one_step(tiny_checkpoint, tmp_path, stream):
    """`specdec export --precision int4 --fast-kernels`: the same measurement and 2-token steps as quantize, whether
    the checkpoint streams (each layer rounded as it is read, checked against a reference forward of the rounded
    weights) or goes through the torch model (checked against transformers)."""
    from specdec.export.bundle import ExportConfig, export_bundle

    m = export_bundle(tiny_checkpoint, tmp_path / "b", ExportConfig(drafter="ngram", precision="int4",
                                                                      fast_kernels=True, max_len=64, stream=stream))
    g = m.graphs["target"]
    assert g.quant["accuracy_level"] == 4 and g.min_step_tokens == 2 and g.t_invariant
    check = "max_abs_logit_diff_vs_reference_forward" if stream else "max_abs_logit_diff_vs_transformers"
    assert g.checks["max_logit_diff_T_step_vs_2_token_steps"] == 0.0 and check in g.checks
    e = specdec.load(tmp_path / "b", drafter="ngram")
    plain = e.generate(PROMPTS[1], GenerationConfig(max_new_tokens=24, draft_len=0))
    assert e.generate(PROMPTS[1], GenerationConfig(max_new_tokens=24, draft_len=3)).token_ids == plain.token_ids
    for bad, match in ((dict(precision="fp32"), "applies to --precision int8 or int4"),
                       (dict(precision="int4", drafter="layerskip"), "not built into a layerskip export")):
        with pytest.raises(SpecdecError, match=match):
            ExportConfig(fast_kernels=True, **bad)
