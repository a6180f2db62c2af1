"""AWQ and GPTQ checkpoints exported at their own codes (export/hf_quant.py): packing read exactly, the bundle's
MatMulNBits holding the same weights, speculation lossless, the checks that refuse."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import SpecdecError
from specdec.export.bundle import ExportConfig, export_bundle
from specdec.export.hf_quant import QuantScheme, carried, dequantize
from specdec.export.verify import graph_logits

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_checkpoint  # noqa: E402

IDS = np.random.default_rng(3).integers(0, 320, size=(1, 32))


# ---------------------------------------------------------------------------------------------- packers
# Written from the formats' definitions (AutoAWQ's and AutoGPTQ's pack()), one value at a time: an oracle
# independent of the vectorised unpacking under test.

def pack_gptq_k(q: np.ndarray, bits: int) -> np.ndarray:
    """q [K, N] -> int32 [K*bits/32, N]: value j of word i holds input row i*(32/bits) + j at bits j*bits."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint32)
    for i in range(out.shape[0]):
        for j in range(per):
            out[i] |= q[i * per + j].astype(np.uint32) << np.uint32(j * bits)
    return out.view(np.int32)


def pack_along_n(v: np.ndarray, bits: int, order=None) -> np.ndarray:
    """v [R, N] -> int32 [R, N*bits/32]: value j of word i holds column i*(32/bits) + order[j]."""
    per = 32 // bits
    order = list(range(per)) if order is None else order
    out = np.zeros((v.shape[0], v.shape[1] // per), dtype=np.uint32)
    for i in range(out.shape[1]):
        for j in range(per):
            out[:, i] |= v[:, i * per + order[j]].astype(np.uint32) << np.uint32(j * bits)
    return out.view(np.int32)


def quantize_rtn(w: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A float weight [N out, K in] -> asymmetric round-to-nearest (q [K, N], z [G, N], s [G, N] float16)."""
    N, K = w.shape
    g = K if group <= 0 else group
    wt = w.T.reshape(K // g, g, N)  # [G, g, N]
    lo, hi = wt.min(1), wt.max(1)  # [G, N]
    top = (1 << bits) - 1
    s = np.maximum((hi - lo) / top, 1e-4).astype(np.float16)
    z = np.clip(np.round(-lo / s.astype(np.float32)), 0, top).astype(np.uint8)
    q = np.clip(np.round(wt / s.astype(np.float32)[:, None]) + z[:, None], 0, top).astype(np.uint8)
    return q.reshape(K, N), z, s


def packed_layer(method: str, q, z, s, bits: int, v1: bool = True) -> dict[str, np.ndarray]:
    if method == "awq":
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        return {"qweight": pack_along_n(q, 4, order), "qzeros": pack_along_n(z, 4, order), "scales": s}
    stored = (z.astype(np.int16) - 1) & ((1 << bits) - 1) if v1 else z
    return {"qweight": pack_gptq_k(q, bits), "qzeros": pack_along_n(stored.astype(np.uint8), bits), "scales": s}


def quantized_checkpoint(src: Path, dst: Path, method: str, bits: int = 4, group: int = 32, v1: bool = True,
                         act_order: bool = False) -> tuple[Path, Path]:
    """`src` with its linear layers quantized (round to nearest) and packed as `method` stores them, and beside it
    the fp32 checkpoint of exactly the weights those codes decode to (the oracle)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    quant, plain = {}, {}
    rng = np.random.default_rng(0)
    for name, w in tensors.items():
        if ".layers." not in name or not name.endswith("proj.weight"):
            quant[name] = plain[name] = w
            continue
        base = name[: -len(".weight")]
        q, z, s = quantize_rtn(w.astype(np.float32), bits, group)
        K = w.shape[1]
        g_idx = np.arange(K, dtype=np.int32) // (K if group <= 0 else group)
        if act_order:  # scattered groups: rows permuted
            g_idx = g_idx[rng.permutation(K)]
            q = np.clip(np.round(w.T.astype(np.float32) / s.astype(np.float32)[g_idx]) + z[g_idx], 0,
                        (1 << bits) - 1).astype(np.uint8)
        for k, v in packed_layer(method, q, z, s, bits, v1).items():
            quant[f"{base}.{k}"] = v
        if method == "gptq":
            quant[f"{base}.g_idx"] = g_idx
        deq = s.astype(np.float32)[g_idx] * (q.astype(np.float32) - z[g_idx].astype(np.float32))  # [K, N]
        plain[name] = np.ascontiguousarray(deq.T)
    for folder, ts, qc in ((dst, quant, True), (dst.with_name(dst.name + "-dequantized"), plain, False)):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
        # safetensors' numpy writer copies an array's buffer as it lies: every tensor C-ordered first
        save_file({k: np.ascontiguousarray(v) for k, v in ts.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.loads((folder / "config.json").read_text())
        if qc:
            cfg["quantization_config"] = (
                {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
                if method == "awq" else
                {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
                 "checkpoint_format": "gptq" if v1 else "gptq_v2"})
        (folder / "config.json").write_text(json.dumps(cfg))
    return dst, dst.with_name(dst.name + "-dequantized")


# ---------------------------------------------------------------------------------------------- unit
@pytest.mark.parametrize("method,bits,group,v1", [("awq", 4, 32, True), ("awq", 4, -1, True), ("gptq", 4, 32, True),
                                                  ("gptq", 4, 64, False), ("gptq", 8, 32, True),
                                                  ("gptq", 4, 256, True)])
def test_packed_codes_decode_to_the_formats_arithmetic(method, bits, group, v1):
    """Hand-packed words (one value at a time, from the format's definition) unpack to the same codes, zero points
    and scales: the carried grid and the float path both give s * (q - z) exactly."""
    rng = np.random.default_rng(bits + max(group, 0))
    N, K = 48, 512
    g = K if group <= 0 else group
    top = (1 << bits) - 1
    q = rng.integers(0, top + 1, size=(K, N)).astype(np.uint8)
    z = rng.integers(0, top + 1, size=(K // g, N)).astype(np.uint8)
    s = rng.uniform(0.001, 0.05, size=(K // g, N)).astype(np.float16)
    p = packed_layer(method, q, z, s, bits, v1)
    scheme = QuantScheme(method, bits, group, 1 if (method == "gptq" and v1) else 0)
    want = (np.repeat(s.astype(np.float32), g, axis=0) * (q.astype(np.float32) - np.repeat(z, g, axis=0))).T  # [N, K]
    c = carried(scheme, p["qweight"], p["qzeros"], p["scales"])
    assert c.block_size == min(g, 32) and c.zero_point is not None
    np.testing.assert_array_equal(c.dequantize(), want)
    np.testing.assert_array_equal(dequantize(scheme, p["qweight"], p["qzeros"], p["scales"]), want)
    if method == "awq":  # AWQ's interleaved nibbles read in plain order do not decode to the same weights
        import specdec.export.hf_quant as hq

        order, hq.AWQ_ORDER = hq.AWQ_ORDER, np.arange(8)
        try:
            assert not np.array_equal(carried(scheme, p["qweight"], p["qzeros"], p["scales"]).dequantize(), want)
        finally:
            hq.AWQ_ORDER = order


def test_act_order_codes_decode_to_the_formats_arithmetic():
    """Scattered groups (g_idx a permutation of k // 32): the carried grid, read in its input order, decodes to
    s[g_idx[k]] * (q - z[g_idx[k]]), as the float path does."""
    rng = np.random.default_rng(5)
    N, K, g = 16, 128, 32
    q = rng.integers(0, 16, size=(K, N)).astype(np.uint8)
    z = rng.integers(0, 16, size=(K // g, N)).astype(np.uint8)
    s = rng.uniform(0.001, 0.05, size=(K // g, N)).astype(np.float16)
    g_idx = (np.arange(K) // g)[rng.permutation(K)].astype(np.int32)
    p = packed_layer("gptq", q, z, s, 4)
    scheme = QuantScheme("gptq", 4, g, 1)
    want = (s.astype(np.float32)[g_idx] * (q.astype(np.float32) - z[g_idx])).T  # [N, K]
    c = carried(scheme, p["qweight"], p["qzeros"], p["scales"], g_idx)
    assert c.input_order is not None and np.array_equal(np.sort(c.input_order), np.arange(K))
    np.testing.assert_array_equal(c.dequantize(), want)
    np.testing.assert_array_equal(dequantize(scheme, p["qweight"], p["qzeros"], p["scales"], g_idx), want)


def test_carried_zero_points_run_in_matmulnbits():
    """The carried codes with their uint8 zero points (4 and 8 bits, odd block counts) through onnxruntime's
    MatMulNBits at fp32 activations: the float weights' product within fp32 rounding."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specdec.quant.weight_only import emit_nbits
    from specdec.runtime.session import pooled_session_options

    rng = np.random.default_rng(1)
    for bits, K in ((4, 96), (8, 96), (4, 128)):
        N, top = 24, (1 << bits) - 1
        q, z = rng.integers(0, top + 1, size=(K, N)).astype(np.uint8), rng.integers(0, top + 1, (K // 32, N)).astype(np.uint8)
        s = rng.uniform(0.01, 0.1, size=(K // 32, N)).astype(np.float16)
        c = carried(QuantScheme("gptq", bits, 32, 0), pack_gptq_k(q, bits), pack_along_n(z, bits), s)
        nodes, inits = emit_nbits("x", "y", "w", (c.q, c.scale, c.offset, c.zero_point), bits, c.block_size, K, 0)
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        x = rng.standard_normal((3, K)).astype(np.float32)
        y = ort.InferenceSession(m.SerializeToString(), pooled_session_options(),
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(y, x @ c.dequantize().T, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hfq") / "qwen2", seed=4, model_type="qwen2",
                           tokenizer=tiny_tokenizer, tied=False)


@pytest.mark.parametrize("method,bits,group,v1", [("awq", 4, 32, True), ("gptq", 4, 64, True),
                                                  ("gptq", 8, 32, False)])
def test_quantized_checkpoint_exports_its_own_codes(base_checkpoint, tmp_path, method, bits, group, v1):
    """`specdec export` of an AWQ/GPTQ folder: MatMulNBits with the checkpoint's codes and zero points (no float
    weights left in the layers), the export's own check passed, and the graph (fp32 activations) equal to the fp32
    graph of the weights the codes decode to, computed by the test from the format's definition."""
    import onnx

    qdir, plain = quantized_checkpoint(base_checkpoint, tmp_path / "q", method, bits, group, v1)
    m = export_bundle(qdir, tmp_path / "b", ExportConfig(drafter="none", max_len=128))
    spec = m.graphs["target"]
    assert spec.quant["method"] == method and spec.precision == "int4"
    assert set(spec.quant["formats"]) == {f"{method.upper()} {bits}-bit g{group}", "F32"}
    assert spec.checks["max_abs_logit_diff_vs_reference_forward"] <= spec.checks["tolerance"]
    g = onnx.load_model(str(tmp_path / "b" / "target.onnx"), load_external_data=False)
    ops = [n.op_type for n in g.graph.node]
    assert ops.count("MatMulNBits") == 2 * 5  # per layer: q/k/v fused, o, gate, up, down
    float_weights = [i for n in g.graph.node if n.op_type == "MatMul" for i in n.input if i.startswith("layers.")]
    assert float_weights == []
    ref = export_bundle(plain, tmp_path / "ref", ExportConfig(drafter="none", max_len=128))
    want = graph_logits(tmp_path / "ref" / "target.onnx", ref.graphs["target"], IDS)
    # the carried graph at fp32 activations, as the export checks it
    for node in g.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    onnx.save_model(g, str(tmp_path / "b" / "acc0.onnx"))
    got = graph_logits(tmp_path / "b" / "acc0.onnx", spec, IDS)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    q_size = sum(f.stat().st_size for f in (tmp_path / "b").glob("target.onnx*"))
    assert q_size < 0.75 * sum(f.stat().st_size for f in (tmp_path / "ref").glob("target.onnx*"))


def test_quantized_checkpoint_speculates_losslessly(base_checkpoint, tmp_path):
    """The carried bundle (int8-activation kernels) with prompt lookup: token-identical to its own plain decoding."""
    qdir, _ = quantized_checkpoint(base_checkpoint, tmp_path / "q", "gptq", 4, 32)
    export_bundle(qdir, tmp_path / "b", ExportConfig(drafter="ngram", max_len=256))
    plain_engine = specdec.load(tmp_path / "b", drafter="none")
    spec_engine = specdec.load(tmp_path / "b", drafter="ngram")
    drafted = 0
    for prompt in ["the quick brown fox the quick brown fox", "hello world, this is hello world, this is"]:
        plain = plain_engine.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=0)).token_ids
        got = spec_engine.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=4))
        assert got.token_ids == plain and len(plain) > 0
        drafted += got.stats.drafted
    assert drafted > 0


def test_groups_of_128_keep_steps_token_identical(tiny_tokenizer, tmp_path):
    """Groups of 128 (the usual GPTQ/AWQ setting) are written as blocks of 32 sharing their scale and zero point:
    the export measures 2-token steps computing exactly what wider steps do (min_step_tokens 2), and speculation is
    token-identical to plain decoding. Blocks of 128 (injected) are not step-width invariant."""
    import specdec.export.hf_quant as hq

    base = make_checkpoint(tmp_path / "wide", seed=6, model_type="qwen2", tokenizer=tiny_tokenizer, hidden=256,
                           heads=4, kv_heads=2, tied=False)
    qdir, _ = quantized_checkpoint(base, tmp_path / "q", "gptq", 4, 128)
    m = export_bundle(qdir, tmp_path / "b", ExportConfig(drafter="ngram", max_len=256))
    t = m.graphs["target"]
    assert t.min_step_tokens == 2 and t.checks["max_logit_diff_T_step_vs_2_token_steps"] == 0.0
    plain = specdec.load(tmp_path / "b", drafter="none")
    spec = specdec.load(tmp_path / "b", drafter="ngram")
    for prompt in ["the quick brown fox the quick brown fox", "hello world, this is hello world"]:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=0)).token_ids
        assert spec.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=4)).token_ids == want
    wide, hq.MAX_BLOCK = hq.MAX_BLOCK, 128
    try:
        m128 = export_bundle(qdir, tmp_path / "b128", ExportConfig(drafter="none", max_len=256))
    finally:
        hq.MAX_BLOCK = wide
    assert m128.graphs["target"].checks["max_logit_diff_T_step_vs_2_token_steps"] > 0.0, m128.graphs["target"].checks


def test_act_order_is_carried_by_permuting_the_inputs(base_checkpoint, tmp_path):
    """GPTQ act-order (each group a scattered set of inputs): the bundle permutes the weight's inputs so groups are
    contiguous and gathers the activations in that order; its logits equal the fp32 graph of the weights the test
    decodes, as does --precision fp32 (dequantized). A wrong permutation (injected: inputs left in order) fails."""
    import onnx

    import specdec.export.hf_quant as hq

    qdir, plain = quantized_checkpoint(base_checkpoint, tmp_path / "q", "gptq", 4, 32, act_order=True)
    ref = export_bundle(plain, tmp_path / "ref", ExportConfig(drafter="none", max_len=128))
    want = graph_logits(tmp_path / "ref" / "target.onnx", ref.graphs["target"], IDS)

    def fp32_activations_logits(folder: Path) -> np.ndarray:
        m = export_bundle(qdir, folder, ExportConfig(drafter="none", max_len=128))
        assert m.graphs["target"].quant["method"] == "gptq"
        g = onnx.load_model(str(folder / "target.onnx"), load_external_data=False)
        assert sum(n.op_type == "Gather" and "reorder" in n.name for n in g.graph.node) >= 2
        for node in g.graph.node:
            for a in node.attribute:
                if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                    a.i = 0
        onnx.save_model(g, str(folder / "acc0.onnx"))
        return graph_logits(folder / "acc0.onnx", m.graphs["target"], IDS)

    bound = 1e-4 * max(1.0, np.abs(want).max())
    assert np.abs(fp32_activations_logits(tmp_path / "b") - want).max() < bound
    m = export_bundle(qdir, tmp_path / "f", ExportConfig(drafter="none", max_len=128, precision="fp32"))
    got = graph_logits(tmp_path / "f" / "target.onnx", m.graphs["target"], IDS)
    assert np.abs(got - want).max() < bound
    original = hq.act_order
    hq.act_order = lambda g_idx, group, G: np.arange(len(g_idx))
    try:
        with pytest.raises(SpecdecError, match="disagrees with the reference forward"):
            fp32_activations_logits(tmp_path / "wrong")
    finally:
        hq.act_order = original


def test_uneven_act_order_groups_are_one_error(base_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    qdir, _ = quantized_checkpoint(base_checkpoint, tmp_path / "q", "gptq", 4, 32, act_order=True)
    tensors = load_file(str(qdir / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("q_proj.g_idx"))
    tensors[name] = np.zeros_like(tensors[name])  # every input in group 0
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(SpecdecError, match="unevenly") as e:
        export_bundle(qdir, tmp_path / "b", ExportConfig(drafter="none", max_len=128))
    assert "--precision fp32" in e.value.hint and not (tmp_path / "b").exists()


@pytest.mark.parametrize("qc,match", [({"quant_method": "bitsandbytes"}, "bitsandbytes"),
                                      ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
                                      ({"quant_method": "gptq", "bits": 3}, "3-bit")])
def test_unread_quantization_is_one_error(base_checkpoint, tmp_path, qc, match):
    qdir, _ = quantized_checkpoint(base_checkpoint, tmp_path / "q", "gptq", 4, 32)
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdecError, match=match):
        export_bundle(qdir, tmp_path / "b", ExportConfig(drafter="none", max_len=128))
    assert not (tmp_path / "b").exists()


def test_quantized_checkpoint_with_a_torch_only_drafter_is_one_error(base_checkpoint, tmp_path):
    qdir, _ = quantized_checkpoint(base_checkpoint, tmp_path / "q", "awq", 4, 32)
    with pytest.raises(SpecdecError, match="AWQ/GPTQ checkpoint"):
        export_bundle(qdir, tmp_path / "b", ExportConfig(drafter="self-int8", max_len=128))


def test_cli_export_names_the_checkpoints_codes_and_refuses_another_method_in_one_line(base_checkpoint, tmp_path):
    from click.testing import CliRunner

    from specdec.cli import main

    qdir, _ = quantized_checkpoint(base_checkpoint, tmp_path / "q", "gptq", 4, 32)
    ok = CliRunner().invoke(main, ["export", str(qdir), "-o", str(tmp_path / "b"), "--drafter", "none", "--max-len", "128"])
    assert ok.exit_code == 0, ok.output
    assert "the checkpoint's own codes (" in ok.output and "GPTQ 4-bit g32 x" in ok.output
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (qdir / "config.json").write_text(json.dumps(cfg))
    bad = CliRunner().invoke(main, ["export", str(qdir), "-o", str(tmp_path / "c"), "--drafter", "none",
                                    "--max-len", "128"])
    assert bad.exit_code != 0 and isinstance(bad.exception, SystemExit) and "Traceback" not in bad.output
    assert "bitsandbytes" in bad.output and len(bad.output.strip().splitlines()) <= 3
    assert not (tmp_path / "c").exists()
