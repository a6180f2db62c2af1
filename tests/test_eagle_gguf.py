"""An EAGLE head on a quantized GGUF target: streamed into the bundle at the file's own codes, sharing its
embedding codes, drafting chains that keep plain greedy's tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import specdec  # noqa: E402
from gguf_models import write_gguf  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from specdec.export import eagle as eagle_mod  # noqa: E402
from specdec.export.bundle import ExportConfig, export_bundle  # noqa: E402
from specdec.export.gguf_export import gguf_fingerprint  # noqa: E402
from specdec.export.gguf_source import GGUFSource  # noqa: E402
from specdec.export.streamed import LazyWeights  # noqa: E402
from specdec.runtime.engine import GenerationConfig  # noqa: E402

PROMPTS = ("the quick brown fox", "hello world, this is", "a small model proposes")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from conftest import make_tokenizer

    # an untied head of other codes than the embedding: the head's rows and the embedding come from two tensors
    return write_gguf(tmp_path_factory.mktemp("gguf") / "t.gguf", make_tokenizer(), n_layers=2, seed=3)


@pytest.fixture(scope="module")
def heads_file(gguf_file, tmp_path_factory):
    """A head as training starts it (the target's last layer, features passed through): no training needed to
    test what the export writes. Its draft vocabulary is every other token, so rows are picked, not copied."""
    src = GGUFSource(gguf_file)
    cfg, w = src.config, LazyWeights(src, carry_codes=False)
    vocab = np.arange(0, cfg.vocab_size, 2)
    head, _ = eagle_mod._module(cfg, w, vocab)
    out = tmp_path_factory.mktemp("heads") / "heads.npz"
    eagle_mod.save_heads(out, head, vocab, cfg, gguf_fingerprint(src), {"kind": "eagle"})
    return out


@pytest.fixture(scope="module")
def bundle(gguf_file, heads_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "b"
    export_bundle(gguf_file, out, ExportConfig(drafter="eagle", heads=heads_file, max_len=256, heads_precision="fp32"))
    return out


def test_the_target_stays_at_the_files_codes_and_the_head_shares_its_embedding(bundle):
    import onnx

    m = json.loads((bundle / "specdec.json").read_text())
    target = m["graphs"]["target"]
    assert target["quant"]["method"] == "gguf" and m["drafter"]["kind"] == "eagle"
    assert "hidden.2" in target["outputs"] and "attention_bias" not in target["inputs"]
    head = onnx.load_model(str(bundle / "eagle.onnx"), load_external_data=False)
    gather = next(n for n in head.graph.node if n.op_type == "GatherBlockQuantized")
    where = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in head.graph.initializer}
    assert where[gather.input[0]] == "target.onnx.data"  # the embedding's codes are the target's, not a copy
    assert not any(n.op_type == "MatMulNBits" for n in head.graph.node)  # the draft head is float rows
    # every file as readable as the manifest (onnx writes weight files owner-only unless told otherwise)
    mode = (bundle / "specdec.json").stat().st_mode & 0o777
    assert {f.name: f.stat().st_mode & 0o777 for f in bundle.iterdir()} == {f.name: mode for f in bundle.iterdir()}


def test_the_head_graph_computes_the_torch_heads_features_and_logits(gguf_file, heads_file, bundle):
    """Same features in: the ONNX head (embedding gathered from the GGUF's codes, head rows read alone) and the
    torch module of the same heads file (float weights) agree."""
    src = GGUFSource(gguf_file)
    cfg, w = src.config, LazyWeights(src, carry_codes=False)
    heads = eagle_mod.load_heads(heads_file, cfg, gguf_fingerprint(src))
    module, _ = eagle_mod.module_from_heads(cfg, w, heads)

    eng = specdec.load(bundle, drafter="eagle")
    target, head_graph = eng.target, eng.drafter.head
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=24)
    target.kv.reset()
    target.prefill(tokens[None])
    feats = target.kept_tap(cfg.n_layers, 0, 24).copy()  # [24, D]
    with torch.no_grad():
        want = eagle_mod.unrolled(module, torch.from_numpy(feats)[None], torch.from_numpy(np.roll(tokens, -1))[None], 1)
        want_logits = module.readout(want[0]).numpy()[0]  # [24, N]
    head_graph.kv.reset()
    logits = head_graph.forward(tokens[None, 1:], features=feats[None, :23]).astype(np.float32)[0]  # [23, N]
    got = head_graph.hidden(1, 23)[0]
    np.testing.assert_allclose(got, want[0][0, :23].numpy(), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(logits, want_logits[:23], atol=2e-3, rtol=1e-3)


def test_eagle_chains_on_the_codes_keep_plain_greedy(bundle, monkeypatch):
    # the untrained head is unsure of everything: verify all it drafts, rejections and all
    monkeypatch.setattr("specdec.runtime.draft_len.MIN_CONFIDENCE", 0.0)
    eng = specdec.load(bundle, drafter="eagle")
    for prompt in PROMPTS:
        plain = eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=0))
        spec = eng.generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=3))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted >= 20  # 3 per round while the answer lasts


def test_trees_are_refused_in_one_line_saying_what_verifies(bundle):
    with pytest.raises(SpecdecError, match="cannot verify token trees") as e:
        specdec.load(bundle, drafter="eagle-tree")
    assert "--drafter eagle" in e.value.hint and "--precision fp32" in e.value.hint


def test_heads_of_another_gguf_are_refused_before_anything_is_written(heads_file, tmp_path):
    from conftest import make_tokenizer

    other = write_gguf(tmp_path / "other.gguf", make_tokenizer(), n_layers=2, seed=4)
    with pytest.raises(SpecdecError, match="another target"):
        export_bundle(other, tmp_path / "b", ExportConfig(drafter="eagle", heads=heads_file, max_len=256))
    assert not (tmp_path / "b").exists()
