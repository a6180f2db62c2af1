"""The greedy argmax of fp32 targets from 8-bit scores and a proven bound (export/exact_argmax.py)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specdec.export.exact_argmax import PREFIX, add_exact_argmax, int8_columns
from specdec.export.graph import _Builder
from specdec.runtime.manifest import ARGMAX_ROWS, read_manifest
from specdec.runtime.greedy_path import GRAPH, OnePath
from specdec.runtime.session import pooled_session_options



def _head_session(head: np.ndarray) -> ort.InferenceSession:
    """A graph of the head alone: normed [B,T,D] -> argmax [B,A] (exact path) and logits [B,T,V] (MatMul)."""
    D, V = head.shape
    b = _Builder(np.float32)
    name = b.init("lm_head.weight", head)
    add_exact_argmax(b, "normed", name, head)
    b.op("MatMul", ["normed", name], outputs=["logits"], name="lm_head")
    g = helper.make_graph(b.nodes, "head", [helper.make_tensor_value_info("normed", TensorProto.FLOAT, ["B", "T", D]),
                                            helper.make_tensor_value_info(ARGMAX_ROWS, TensorProto.INT64, ["A"])],
                          [helper.make_tensor_value_info("argmax", TensorProto.INT64, ["B", "A"]),
                           helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", V])], b.inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), sess_options=pooled_session_options(),
                                providers=["CPUExecutionProvider"])


def _near_ties(rng, D=48, V=400, pairs=60):
    """A head whose columns come in pairs a hair apart, and hidden states aimed between them: the 8-bit scores
    then often rank a pair the wrong way round, and only the exact stage can tell them apart."""
    head = rng.standard_normal((D, V)).astype(np.float32) * np.exp(rng.uniform(-1, 1, V)).astype(np.float32)
    twins = rng.choice(V, size=(pairs, 2), replace=False)
    head[:, twins[:, 1]] = head[:, twins[:, 0]] + rng.standard_normal((D, pairs)).astype(np.float32) * 1e-3
    aims = head[:, twins[:, 0]].T * 3 + rng.standard_normal((pairs, D)).astype(np.float32) * 0.1  # [pairs, D]
    return head, aims


def test_int8_columns_round_each_column_within_half_a_step():
    head = np.random.default_rng(0).standard_normal((32, 50)).astype(np.float32)
    head[:, 7] = 0.0  # an all-zero column keeps a finite scale
    codes, scales, col_l1 = int8_columns(head)
    assert codes.dtype == np.int8 and np.abs(codes.astype(int)).max() <= 127 and np.isfinite(scales).all()
    assert np.all(np.abs(codes * scales - head) <= scales / 2 + 1e-7)
    np.testing.assert_allclose(col_l1, np.abs(head).sum(0), rtol=1e-6)


def test_argmax_equals_the_full_logits_argmax_where_8_bit_scores_alone_would_not():
    rng = np.random.default_rng(1)
    head, aims = _near_ties(rng)
    sess = _head_session(head)
    codes, scales, _ = int8_columns(head)
    wrong_by_scores = mismatches = 0
    for batch in (1, 2):
        for start in range(0, len(aims) - 5, 5):
            T = 1 + start % 5
            normed = np.stack([aims[start:start + T] * (1 + b) for b in range(batch)]).astype(np.float32)  # [B,T,D]
            rows = np.arange(T, dtype=np.int64)
            argmax, logits = sess.run(None, {"normed": normed, ARGMAX_ROWS: rows})
            assert argmax.shape == (batch, T)
            mismatches += int((argmax != logits.argmax(-1)).sum())
            wrong_by_scores += int(((normed @ (codes * scales)).argmax(-1) != logits.argmax(-1)).sum())
    assert mismatches == 0
    assert wrong_by_scores > 0  # the data does exercise the exact stage


def test_sums_are_exact_where_u8_s8_pairs_would_saturate_an_int16():
    """The worst case for CPUs without VNNI (their u8 x s8 kernel adds pairs of products into a saturating int16):
    every activation and weight code at its largest. Column 0 is all 1.0 and the true argmax for all-positive rows;
    column 1 is 0.6 but for one 1.0 entry (so its codes are smaller); 8-bit activations saturated column 0's pairs
    and picked column 1 on such CPUs, the 7-bit ones keep every sum exact."""
    D = 64
    head = np.full((D, 3), 0.6, dtype=np.float32)
    head[:, 0] = 1.0
    head[0, 1] = head[0, 2] = 1.0
    head[:, 2] *= -1
    sess = _head_session(head)
    for value in (1.0, 3.0, 1e-3):
        normed = np.full((1, 2, D), value, dtype=np.float32)  # [B,T,D]
        argmax, logits = sess.run(None, {"normed": normed, ARGMAX_ROWS: np.arange(2, dtype=np.int64)})
        np.testing.assert_array_equal(logits.argmax(-1), [[0, 0]])
        np.testing.assert_array_equal(argmax, [[0, 0]])


def test_any_subset_of_rows_and_none():
    rng = np.random.default_rng(2)
    head = rng.standard_normal((16, 90)).astype(np.float32)
    sess = _head_session(head)
    normed = rng.standard_normal((2, 5, 16)).astype(np.float32)
    argmax, logits = sess.run(None, {"normed": normed, ARGMAX_ROWS: np.array([4, 1], dtype=np.int64)})
    np.testing.assert_array_equal(argmax, logits.argmax(-1)[:, [4, 1]])
    argmax, _ = sess.run(None, {"normed": normed, ARGMAX_ROWS: np.zeros(0, dtype=np.int64)})
    assert argmax.shape == (2, 0)
    zeros = np.zeros((1, 3, 16), dtype=np.float32)  # all-zero rows: every logit ties at 0, numpy picks token 0
    argmax, _ = sess.run(None, {"normed": zeros, ARGMAX_ROWS: np.arange(3, dtype=np.int64)})
    np.testing.assert_array_equal(argmax, [[0, 0, 0]])


def test_fp32_target_takes_greedy_choices_from_the_exact_path(tiny_bundle):
    """The exported fp32 target has the path; its choices equal its logits' argmax at every step width, and a
    greedy step asks for no logits row."""
    import specdec

    spec = read_manifest(tiny_bundle).graphs["target"]
    assert spec.has_argmax_rows
    engine = specdec.load(tiny_bundle, drafter="none")
    target = engine.target
    target.greedy_paths = OnePath(GRAPH)  # the path under test, not the per-width choice
    ids = np.random.default_rng(3).integers(0, spec.model.vocab_size, size=(1, 12))
    target.prefill(ids)
    for T in (1, 2, 3, 5):
        step = np.random.default_rng(T).integers(0, spec.model.vocab_size, size=(1, T))
        choices = target.forward_choices(step).copy()
        assert target._outputs_for(T, 0, T)[0][1].shape[1] == 0  # no logits row was computed
        np.testing.assert_array_equal(choices, target.forward(step).argmax(-1))


@pytest.mark.parametrize("precision,keeps", [("int8", False), ("int4", True), ("fp16", False)])
def test_quantize_keeps_the_path_only_while_the_head_stays_fp32(tiny_bundle, tmp_path, monkeypatch, precision, keeps):
    """int8 quantizes the head (and fp16 rounds it): their argmax comes from their own logits again. The default
    int4 (the GGUF's 4-bit layers exactly) keeps an fp32 head, and the path, whose choices still match its logits."""
    import specdec
    from specdec.quant.bundle import quantize_bundle

    monkeypatch.setenv("SPECDEC_ALLOW_CPU_FP16", "1")
    out = quantize_bundle(tiny_bundle, tmp_path / precision, precision)
    spec = read_manifest(out).graphs["target"]
    assert spec.has_argmax_rows == keeps and spec.has_argmax
    model = onnx.load(str(out / spec.file), load_external_data=False)
    assert any(n.name.startswith(PREFIX) for n in model.graph.node) == keeps
    assert any(t.name.startswith(PREFIX) for t in model.graph.initializer) == keeps
    target = specdec.load(out, drafter="none").target
    if keeps:
        target.greedy_paths = OnePath(GRAPH)
    target.prefill(np.arange(1, 9, dtype=np.int64)[None])
    step = np.array([[5, 9, 2]], dtype=np.int64)
    choices = target.forward_choices(step).copy()
    np.testing.assert_array_equal(choices, target.forward(step).argmax(-1))


@pytest.mark.parametrize("bad", ["no_logits_rows", "no_argmax"])
def test_manifest_refuses_argmax_rows_without_what_they_need(tiny_bundle, bad):
    from dataclasses import replace

    spec = read_manifest(tiny_bundle).graphs["target"]
    drop = "logits_rows" if bad == "no_logits_rows" else None
    with pytest.raises(ValueError, match="argmax_rows"):
        replace(spec, inputs=tuple(i for i in spec.inputs if i != drop),
                outputs=tuple(o for o in spec.outputs if o != ("argmax" if bad == "no_argmax" else None)))


def test_batched_greedy_rows_read_choices_not_logits(tiny_bundle):
    """All-greedy batch steps ask the target for choices: equal to its logits' argmax, one row or ragged rows."""
    from specdec.runtime.batched import BatchedEngine

    dec = BatchedEngine(tiny_bundle, 3, drafter="none").target
    assert dec.decoder.spec.has_argmax_rows
    rng = np.random.default_rng(4)
    for row in range(3):
        dec.prefill_row(row, rng.integers(3, 200, size=5 + row).tolist())
    for inputs in ({1: [7, 8, 9]}, {0: [5], 2: [6, 7, 8, 9]}):
        choices = {r: c.copy() for r, c in dec.forward_rows(inputs, choices_only=True).items()}
        logits = dec.forward_rows(inputs)
        for r in inputs:
            np.testing.assert_array_equal(choices[r], logits[r].argmax(-1))


def test_new_bundles_are_format_3_and_older_bundles_with_the_8_bit_path_are_refused(tiny_bundle, tmp_path):
    """A runtime that knows only format 1 would not feed argmax_rows, and format 2's path overflows on CPUs without
    VNNI: new bundles say 3; a format-2 target with the path is one clear error, one without it still loads."""
    import json
    import shutil

    from specdec.errors import SpecdecError

    assert read_manifest(tiny_bundle).version == 3
    old = tmp_path / "old"
    shutil.copytree(tiny_bundle, old)
    m = json.loads((old / "specdec.json").read_text())
    m["version"] = 2
    (old / "specdec.json").write_text(json.dumps(m))
    with pytest.raises(SpecdecError, match="overflow on CPUs without VNNI.*re-export"):
        read_manifest(old)
    target = m["graphs"]["target"]
    target["inputs"].remove(ARGMAX_ROWS)  # a format-2 bundle of a quantized head: no path, still readable
    (old / "specdec.json").write_text(json.dumps(m))
    assert read_manifest(old).version == 2
    m["version"] = 4
    (old / "specdec.json").write_text(json.dumps(m))
    with pytest.raises(SpecdecError, match="reads versions 1, 2, 3"):
        read_manifest(old)


def test_a_manifest_that_omits_a_graph_input_is_one_clear_error(tiny_bundle, tmp_path):
    """The runtime feeds what the manifest lists: a graph input it does not list (here argmax_rows, dropped from a
    copied manifest) is refused at load, in one line, not as an onnxruntime failure mid-generation."""
    import json
    import shutil

    from test_cli import assert_one_error, run_cli

    bad = tmp_path / "bad"
    shutil.copytree(tiny_bundle, bad)
    m = json.loads((bad / "specdec.json").read_text())
    m["graphs"]["target"]["inputs"].remove("argmax_rows")
    (bad / "specdec.json").write_text(json.dumps(m))
    assert_one_error(run_cli("generate", bad, "hello", "--max-new-tokens", 4), "argmax_rows", "manifest")
