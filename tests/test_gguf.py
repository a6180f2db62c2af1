"""GGUF files streamed into bundles: block formats carried exactly, bounded memory, checks that refuse."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import SpecdecError
from specdec.export.bundle import ExportConfig, export_bundle
from specdec.export.gguf_blocks import CARRIED, carry

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import random_blocks, write_gguf  # noqa: E402


@pytest.mark.parametrize("fmt", sorted(CARRIED))
def test_block_format_decodes_as_gguf_does(fmt):
    """Random codes and scales of every carried format: codes x scales (+ offsets) == gguf's own dequantization,
    bit for bit, and the codes fit the grid's bits."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    raw = random_blocks(fmt, rows=5, K=512, rng=rng, scale=0.1)
    c = carry(fmt, raw, 512)
    want = dequantize(raw, GGMLQuantizationType[fmt]).reshape(5, 512)
    assert np.array_equal(c.dequantize(), want)
    assert c.q.max() < 2 ** c.bits and c.block_size == CARRIED[fmt][1]


def test_q4_k_block_by_hand():
    """One Q4_K super-block written by hand: d=0.5, dmin=0.25, sub-block j has scale j+1 and min 2j, codes 0..15
    repeated: value = 0.5*(j+1)*q - 0.25*2j."""
    d, dmin = np.float16(0.5), np.float16(0.25)
    sc, mn = np.arange(1, 9, dtype=np.uint8), 2 * np.arange(8, dtype=np.uint8)  # 6-bit each
    packed = np.zeros(12, dtype=np.uint8)
    packed[0:4], packed[4:8] = sc[:4], mn[:4]  # low 6 bits of sub-blocks 0-3 (high bits 0)
    packed[8:12] = (sc[4:] & 0x0F) | ((mn[4:] & 0x0F) << 4)  # sub-blocks 4-7: low nibbles of scale and min
    packed[0:4] |= (sc[4:] >> 4) << 6
    packed[4:8] |= (mn[4:] >> 4) << 6
    q = np.tile(np.arange(16), 16).reshape(8, 32)  # [sub-block, 32]
    qs = np.zeros((4, 32), dtype=np.uint8)
    for j in range(4):  # 32 bytes per pair of sub-blocks: low nibble = sub-block 2j, high = 2j+1
        qs[j] = q[2 * j] | (q[2 * j + 1] << 4)
    block = np.concatenate([np.array([d]).view(np.uint8), np.array([dmin]).view(np.uint8), packed, qs.ravel()])
    got = carry("Q4_K", block[None, :], 256).dequantize()[0].reshape(8, 32)
    want = 0.5 * sc[:, None] * q - 0.25 * mn[:, None]
    assert np.array_equal(got, want.astype(np.float32))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from conftest import make_tokenizer

    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_k_m.gguf", make_tokenizer(), n_layers=2)


@pytest.fixture(scope="module")
def tiny_gguf_bundle(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-bundle") / "b"
    export_bundle(tiny_gguf, out, ExportConfig(drafter="ngram", max_len=256))
    return out


def test_quantized_gguf_exports_its_own_codes(tiny_gguf, tiny_gguf_bundle):
    """Default precision of a quantized GGUF: its codes, checked exactly (fp32-activation kernels) against a
    reference forward of the file's weights; no float copy of any matrix in the bundle."""
    import onnx

    m = json.loads((tiny_gguf_bundle / "specdec.json").read_text())
    target = m["graphs"]["target"]
    assert target["quant"]["method"] == "gguf" and target["quant"]["accuracy_level"] == 4
    assert target["checks"]["max_abs_logit_diff_vs_reference_forward"] <= target["checks"]["tolerance"]
    assert target["checks"]["top1_agreement_vs_reference_forward"] == 1.0
    assert target["min_step_tokens"] == 2
    g = onnx.load_model(str(tiny_gguf_bundle / "target.onnx"), load_external_data=False)
    ops = {n.op_type for n in g.graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops
    big_float = [t.name for t in g.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                 and np.prod(t.dims) >= 256 * 256]
    assert big_float == [], big_float  # only block scales/offsets and rotary tables are float
    data = (tiny_gguf_bundle / "target.onnx.data").stat().st_size
    assert data < 1.6 * tiny_gguf.stat().st_size  # ~1.4x: 4-bit codes + per-32 scale and offset, Q6_K/Q5_0 in 8 bits


def test_gguf_bundle_speculates_losslessly(tiny_gguf_bundle):
    plain = specdec.load(tiny_gguf_bundle, drafter="none")
    spec = specdec.load(tiny_gguf_bundle, drafter="ngram")
    for prompt in ["the quick brown fox", "hello world, this is"]:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
        got = spec.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=3))
        assert got.token_ids == want


def test_wide_head_is_written_in_vocabulary_slices(tiny_gguf, tiny_gguf_bundle, tmp_path, monkeypatch):
    """An untied carried head wider than HEAD_PART_BYTES becomes slices whose logits are concatenated (a smaller
    transient at load): the same logits as the one-node head, and the export's exact check passes."""
    import onnx

    from specdec.export import graph

    monkeypatch.setattr(graph, "HEAD_PART_BYTES", 40 * 256)  # 40 rows of 256 8-bit codes a slice
    out = tmp_path / "b"
    export_bundle(tiny_gguf, out, ExportConfig(drafter="none", max_len=256))
    g = onnx.load_model(str(out / "target.onnx"), load_external_data=False)
    heads = [n for n in g.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("lm_head.")]
    V = json.loads((out / "specdec.json").read_text())["graphs"]["target"]["model"]["vocab_size"]
    assert len(heads) == -(-V // 40) > 1
    checks = json.loads((out / "specdec.json").read_text())["graphs"]["target"]["checks"]
    assert checks["top1_agreement_vs_reference_forward"] == 1.0
    ids = np.array([[5, 17, 99, 3, 42]])
    sliced, whole = specdec.load(out, drafter="none"), specdec.load(tiny_gguf_bundle, drafter="none")
    np.testing.assert_array_equal(sliced.target.prefill(ids), whole.target.prefill(ids))


def test_fp32_export_of_a_gguf_matches_the_reference(tiny_gguf, tmp_path):
    out = tmp_path / "fp32"
    m = export_bundle(tiny_gguf, out, ExportConfig(drafter="none", precision="fp32", max_len=128))
    checks = m.graphs["target"].checks
    assert m.graphs["target"].precision == "fp32"
    assert checks["max_abs_logit_diff_vs_reference_forward"] <= checks["tolerance"]


def test_llama_gguf_rows_are_unpermuted(tmp_path):
    """A Llama GGUF stores Q/K rows permuted for llama.cpp's rotary; the export undoes it: the graph agrees with the
    transformers model loaded from the same file."""
    import torch
    from conftest import make_tokenizer
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "llama.gguf", make_tokenizer(), arch="llama", formats={"embed": "Q8_0"}, tied=True,
                      n_layers=2)
    m = export_bundle(path, tmp_path / "b", ExportConfig(drafter="none", precision="fp32", max_len=64))
    ids = np.arange(3, 19)[None]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)(
            torch.tensor(ids)).logits.numpy()
    from specdec.export.verify import graph_logits

    got = graph_logits(tmp_path / "b" / "target.onnx", m.graphs["target"], np.concatenate([ids, ids], 1))[:, :16]
    assert np.abs(got - ref).max() < 1e-3


def test_format_not_carried_is_one_error(tmp_path):
    from conftest import make_tokenizer

    path = write_gguf(tmp_path / "q2.gguf", make_tokenizer(), formats={"gate": "Q2_K"})
    with pytest.raises(SpecdecError) as e:
        export_bundle(path, tmp_path / "b", ExportConfig(drafter="none", precision="gguf", max_len=64))
    assert "blk.0.ffn_gate.weight is Q2_K" in str(e.value) and "--precision fp32" in e.value.hint
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
    m = export_bundle(path, tmp_path / "b", ExportConfig(drafter="none", precision="fp32", max_len=64))
    assert m.graphs["target"].checks["max_abs_logit_diff_vs_reference_forward"] <= 1e-3


def test_truncated_gguf_is_one_error(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(SpecdecError) as e:
        export_bundle(cut, tmp_path / "b", ExportConfig(drafter="none", max_len=64))
    assert "truncated or corrupt" in str(e.value) + (e.value.hint or "")


def test_export_check_refuses_a_wrong_graph(tiny_gguf, tmp_path, monkeypatch):
    """One weight perturbed between writing and checking: the export refuses, and leaves no bundle behind."""
    from conftest import break_streamed_graphs

    break_streamed_graphs(monkeypatch)
    with pytest.raises(SpecdecError) as e:
        export_bundle(tiny_gguf, tmp_path / "b", ExportConfig(drafter="none", max_len=64))
    assert "disagrees with the reference forward" in str(e.value)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


@pytest.mark.parametrize("draft_precision, bits", [("int4", 4), ("own", None)])
def test_gguf_draft_model_in_one_command(tiny_gguf, tmp_path, draft_precision, bits):
    """`--drafter model:DRAFT.gguf`: the draft is streamed into the same bundle, by default rounded to int4 in the
    largest block up to 128 that its widths fill (256 wide: 128), else at the file's own codes; its steps are never
    padded (only the target's must be step-width invariant); drafting is lossless."""
    import onnx

    from conftest import make_tokenizer

    draft = write_gguf(tmp_path / "draft.gguf", make_tokenizer(), n_layers=1, seed=3)
    out = tmp_path / "b"
    m = export_bundle(tiny_gguf, out, ExportConfig(drafter=f"model:{draft}", max_len=128,
                                                   draft_precision=draft_precision))
    g = m.graphs["draft"]
    assert g.file == "draft/target.onnx" and m.drafter.kind == "model" and g.min_step_tokens == 1
    assert g.checks["max_abs_logit_diff_vs_reference_forward"] <= g.checks["tolerance"]
    assert g.quant.get("bits") == bits and g.quant.get("block_size") == (128 if bits else None)
    nodes = onnx.load(out / g.file, load_external_data=False).graph.node
    blocks = {a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
    assert blocks == ({128} if bits else {16, 32})  # own codes: Q4_K in 32s, Q6_K in 16s
    plain = specdec.load(out, drafter="none")
    spec = specdec.load(out, drafter="model")
    want = plain.generate("the quick brown", GenerationConfig(max_new_tokens=16, draft_len=0)).token_ids
    assert spec.generate("the quick brown", GenerationConfig(max_new_tokens=16, draft_len=3)).token_ids == want


def test_gguf_draft_of_another_vocabulary_is_refused(tiny_gguf, tmp_path):
    from conftest import make_tokenizer

    draft = write_gguf(tmp_path / "other.gguf", make_tokenizer(vocab_size=300), n_layers=1)
    with pytest.raises(SpecdecError) as e:
        export_bundle(tiny_gguf, tmp_path / "b", ExportConfig(drafter=f"model:{draft}", max_len=64))
    assert "different vocabulary" in str(e.value)
    assert not (tmp_path / "b").exists()


PEAK_RSS_SCRIPT = """
import sys
from specdec.export import gguf_export
from specdec.export.bundle import ExportConfig, export_bundle

def hwm():  # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's size at fork
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM")) * 1024

written = []
check = gguf_export.check_gguf_graph
def peak_then_check(*a, **k):
    written.append(hwm())  # the peak of writing the graph, before the check loads it into onnxruntime
    return check(*a, **k)
gguf_export.check_gguf_graph = peak_then_check
export_bundle(sys.argv[1], sys.argv[2], ExportConfig(drafter="none", max_len=64))
print(written[0], hwm())
"""


@pytest.mark.slow
def test_export_memory_is_flat_in_depth(tmp_path):
    """Peak RSS of exporting 2, 8 and 32 layers of one width: writing holds one layer, so its peak is flat in depth;
    what grows with depth is only onnxruntime's load of the finished graph for its check (about the bundle's size)."""
    from conftest import make_tokenizer

    tok = make_tokenizer()
    writing, peaks, sizes = {}, {}, {}
    for n in (2, 8, 32):
        path = write_gguf(tmp_path / f"d{n}.gguf", tok, n_layers=n, hidden=1024, heads=16, kv_heads=4, ffn=4096)
        out = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(path), str(tmp_path / f"b{n}")],
                             capture_output=True, text=True, check=True)
        writing[n], peaks[n] = (int(v) for v in out.stdout.split()[-2:])
        sizes[n] = (tmp_path / f"b{n}" / "target.onnx.data").stat().st_size
        path.unlink()
    print("writing peak", writing, "whole export peak", peaks, "bundle data", sizes)
    # 32 layers hold 16x the weights of 2 (~250 MB more of bundle), yet writing them peaks within 15% of 2 layers.
    assert max(writing.values()) <= 1.15 * min(writing.values()), (writing, sizes)
    # The check's int8-activation session prepacks the finished graph (~1.5x its file, as at run time), and that is
    # all the whole export's peak may grow by.
    fp32_model = 32 * (4 * 1024 * 1024 + 3 * 1024 * 4096) * 4
    assert peaks[32] - peaks[2] <= 1.6 * (sizes[32] - sizes[2]), (peaks, sizes)
    assert peaks[32] - peaks[2] < fp32_model / 3, (peaks, fp32_model)


def test_not_enough_memory_for_the_kv_length_is_said_before_loading(tiny_gguf_bundle, monkeypatch):
    """A KV length that cannot fit the memory available: one error naming the length that fits, before any
    session or KV buffer exists."""
    from test_cli import assert_one_error, run_cli

    from specdec.runtime import memcheck

    monkeypatch.setattr(memcheck, "available_bytes", lambda: 100 << 10)
    line = assert_one_error(run_cli("generate", tiny_gguf_bundle, "hello", "--max-len", "256"), "not enough memory",
                            "--max-len 256")
    assert "GiB available" in line
    monkeypatch.setattr(memcheck, "available_bytes", lambda: 1 << 40)
    code, out, err = run_cli("generate", tiny_gguf_bundle, "hello", "--max-len", "256", "--max-new-tokens", "4")
    assert code == 0, err


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_pages_are_paged_out_while_the_block_runs(tmp_path):
    """session.paging_out pages a mapped file out while its block still runs (a session's load: onnxruntime
    releases the GIL), not only at its end; a pager that never runs (injected) leaves the pages resident."""
    import time

    from specdec.runtime import session

    data = tmp_path / "w.data"
    data.write_bytes(np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes())
    mapped = np.memmap(data, dtype=np.uint8, mode="r")

    def touched_then_waited(pager_every: float) -> int:
        with session.paging_out(data):
            int(mapped[::4096].sum())  # every page resident
            touched = session.resident_bytes(data)
            time.sleep(3 * pager_every)
            during = session.resident_bytes(data)
        assert touched >= 15 << 20
        return during

    assert touched_then_waited(session.PAGE_OUT_EVERY_S) < 1 << 20
    every = session.PAGE_OUT_EVERY_S
    session.PAGE_OUT_EVERY_S = 3600.0
    try:
        assert touched_then_waited(0.1) >= 15 << 20
    finally:
        session.PAGE_OUT_EVERY_S = every


def test_loading_leaves_no_weight_file_pages_resident(tiny_gguf_bundle, tmp_path, monkeypatch):
    """onnxruntime keeps the weight file mapped after prepacking its weights into its own memory; the pages it read
    stay counted in RSS unless paged out after loading, and paging them out changes no output."""
    import shutil

    from specdec.runtime import session
    from specdec.runtime.session import resident_bytes as _resident_bytes

    # A copy no other session of this test process maps: pages mapped twice are not paged out.
    bundle = shutil.copytree(tiny_gguf_bundle, tmp_path / "b")
    graph, data = bundle / "target.onnx", bundle / "target.onnx.data"
    opts = session.RuntimeOptions()
    with monkeypatch.context() as m:
        m.setattr(session, "release_mapped_pages", lambda path: 0)
        kept = session.make_session(graph, opts)
        before = _resident_bytes(data)
    del kept
    released = session.make_session(graph, opts)
    # What stays: page-cache folios that straddle two tensors' mappings (mapped twice, so not paged out); a tiny
    # model's tensors are a few KB, so that is much of it here. tests/test_real_gguf.py checks a real bundle.
    after = _resident_bytes(data)
    assert before > 0 and after < before, (before, after)
    del released
    engine = specdec.load(bundle, drafter="none")
    got = engine.generate("the quick brown fox", GenerationConfig(max_new_tokens=16, draft_len=0)).token_ids
    with monkeypatch.context() as m:
        m.setattr(session, "release_mapped_pages", lambda path: 0)
        want = specdec.load(bundle, drafter="none").generate(
            "the quick brown fox", GenerationConfig(max_new_tokens=16, draft_len=0)).token_ids
    assert got == want


def test_block_size_sets_the_rounding_of_an_int4_export(tiny_gguf, tmp_path):
    """`--block-size 256`: one scale per 256 weights in every MatMulNBits (head included), recorded in the manifest,
    a smaller weight file than blocks of 32, the graph still checked against its reference forward, and
    speculation still token-identical to plain decoding."""
    import onnx

    sizes = {}
    for bs in (None, 256):
        out = tmp_path / f"b{bs}"
        m = export_bundle(tiny_gguf, out, ExportConfig(drafter="ngram", precision="int4", fast_kernels=True,
                                                        max_len=128, block_size=bs))
        t = m.graphs["target"]
        assert t.quant["block_size"] == (bs or 32)
        assert t.checks["max_abs_logit_diff_vs_reference_forward"] <= t.checks["tolerance"]
        graph = onnx.load(out / "target.onnx", load_external_data=False).graph
        blocks = {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
        assert blocks == {bs or 32}
        sizes[bs] = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("target"))
    assert sizes[256] < sizes[None]
    plain = specdec.load(tmp_path / "b256", drafter="none")
    spec = specdec.load(tmp_path / "b256", drafter="ngram")
    prompt = "the quick brown fox the quick brown fox"
    want = plain.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
    assert spec.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=3)).token_ids == want


@pytest.mark.parametrize("kwargs, says", [({"precision": "fp32", "block_size": 64}, "--block-size applies to"),
                                          ({"precision": "int4", "block_size": 48}, "power of two >= 16")])
def test_block_size_refusals(kwargs, says):
    with pytest.raises(SpecdecError, match=says):
        ExportConfig(drafter="none", **kwargs)


def test_int4_of_a_gguf_streams_rounding_each_layer(tiny_gguf, tmp_path):
    """`--precision int4 --fast-kernels` of a GGUF streams (export/rounded.py: no torch model): each layer is read
    as floats and rounded to 4-bit blocks of 32 (a weight already on such a grid would be re-encoded exactly), the
    head to 8 bits; the untied embedding keeps the file's own codes (gathered a few rows a step: rounding it again
    saves no time, float32 would quadruple it). The graph matches a reference forward of the rounded weights, every
    step runs >= 2 positions, and speculation is token-identical to plain decoding."""
    import onnx

    m = export_bundle(tiny_gguf, tmp_path / "b", ExportConfig(drafter="ngram", precision="int4", fast_kernels=True,
                                                               max_len=128))
    t = m.graphs["target"]
    assert t.precision == "int4" and t.quant["method"] == "matmul_nbits_minmax" and t.min_step_tokens == 2
    # 5 matrices a layer, the head, the embedding
    assert t.quant["formats"] == {"4bit_sym_rtn": 2 * 5, "8bit_sym_rtn": 1, "Q5_0": 1}
    graph = onnx.load(tmp_path / "b" / "target.onnx", load_external_data=False).graph
    assert "GatherBlockQuantized" in {n.op_type for n in graph.node}
    assert not any(i.name == "embed.weight" for i in graph.initializer)
    assert t.checks["max_abs_logit_diff_vs_reference_forward"] <= t.checks["tolerance"]
    plain = specdec.load(tmp_path / "b", drafter="none")
    spec = specdec.load(tmp_path / "b", drafter="ngram")
    for prompt in ["the quick brown fox the quick brown fox", "hello world"]:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
        assert spec.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=3)).token_ids == want
