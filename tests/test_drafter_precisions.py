"""Every drafter graph at every target precision: EAGLE, Medusa and LayerSkip bundles exported at fp16 / int8 / int4
and quantized from fp32 load, share the target's weight file instead of copying it, and draft losslessly."""
from __future__ import annotations

import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")

import specdec  # noqa: E402
from specdec.export.bundle import ExportConfig, export_bundle  # noqa: E402
from specdec.export.eagle import EagleConfig, train_eagle  # noqa: E402
from specdec.export.layerskip import LayerSkipConfig  # noqa: E402
from specdec.export.medusa import MedusaConfig, train_medusa  # noqa: E402
from specdec.quant.bundle import quantize_bundle  # noqa: E402
from specdec.runtime.engine import GenerationConfig  # noqa: E402
from specdec.runtime.manifest import read_manifest  # noqa: E402
from specdec.runtime.session import RuntimeOptions  # noqa: E402

CPU_FP16 = RuntimeOptions(allow_cpu_fp16=True)  # ORT's CPU kernels take fp16: the tests' way to run it
PRECISIONS = ("fp16", "int8", "int4")
# drafter kind -> the runtime drafters that bundle offers
DRAFTERS = {"eagle": ("eagle", "eagle-tree"), "medusa": ("medusa-tree",), "layerskip": ("layerskip",)}
PROMPTS = ("the quick brown fox", "hello world, this is")


@pytest.fixture(autouse=True)
def verify_every_drafted_token(monkeypatch):
    """Heads trained for seconds on a random model are rarely sure of a token, and a fixed draft length drops a
    scored chain's tokens below MIN_CONFIDENCE; these tests check that whatever is drafted is verified losslessly
    at every precision, so nothing is dropped."""
    monkeypatch.setattr("specdec.runtime.draft_len.MIN_CONFIDENCE", 0.0)


@pytest.fixture(scope="module")
def heads(tiny_checkpoint, tiny_distill_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    train_eagle(tiny_checkpoint, tiny_distill_data, root / "eagle.npz",
                EagleConfig(epochs=2, batch_tokens=512, unroll=2, draft_vocab=200))
    train_medusa(tiny_checkpoint, tiny_distill_data, root / "medusa.npz",
                 MedusaConfig(n_heads=3, epochs=2, batch_tokens=64, draft_vocab=200))
    return root


def _config(kind: str, heads, precision: str) -> ExportConfig:
    extra = {"heads": heads / f"{kind}.npz"} if kind in ("eagle", "medusa") else \
        {"layerskip": LayerSkipConfig(exit_layer=1, prompts=8, new_tokens=16, epochs=1, draft_vocab=200)}
    return ExportConfig(drafter=kind, precision=precision, max_len=256, **extra)


@pytest.fixture(scope="module")
def fp32_bundles(tiny_checkpoint, heads, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp32")
    for kind in DRAFTERS:
        export_bundle(tiny_checkpoint, root / kind, _config(kind, heads, "fp32"))
    return root


def _check(bundle, kind: str, precision: str, drafters: tuple[str, ...] | None = None) -> None:
    m = read_manifest(bundle)
    assert m.graphs["target"].precision == precision
    target = {numpy_helper.to_array(t).tobytes() for t in onnx.load(str(bundle / "target.onnx")).graph.initializer}
    for name, g in m.graphs.items():  # graphs that read the target's weights point into its file, never copy them
        if name == "target":
            continue
        own = onnx.load(str(bundle / g.file), load_external_data=False).graph.initializer
        pointing = [t.name for t in own if any(e.key == "location" and e.value == "target.onnx.data" for e in t.external_data)]
        assert pointing, name
        copies = [t.name for t in onnx.load(str(bundle / g.file)).graph.initializer
                  if t.name not in pointing and numpy_helper.to_array(t).nbytes >= 1024  # smaller ones live inline in each graph
                  and numpy_helper.to_array(t).tobytes() in target]
        assert not copies, (name, copies)
    runtime = CPU_FP16 if precision == "fp16" else None
    for drafter in drafters or DRAFTERS[kind]:
        eng = specdec.load(bundle, drafter=drafter, runtime=runtime)
        for prompt in PROMPTS:
            plain = eng.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=0))
            spec = eng.generate(prompt, GenerationConfig(max_new_tokens=32, draft_len=3))
            assert spec.token_ids == plain.token_ids, (kind, precision, drafter, prompt)
            assert spec.stats.drafted > 0


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_exported_drafter_bundles_at_every_precision(tiny_checkpoint, heads, tmp_path, kind, precision):
    export_bundle(tiny_checkpoint, tmp_path / "b", _config(kind, heads, precision))
    drafters = None
    if kind == "eagle" and precision in ("int8", "int4"):
        # streamed and rounded as read: a target at its own codes pads its narrow steps and verifies chains
        assert not read_manifest(tmp_path / "b").graphs["target"].has_tree_bias
        drafters = ("eagle",)
    _check(tmp_path / "b", kind, precision, drafters)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_quantized_drafter_bundles_at_every_precision(fp32_bundles, tmp_path, kind, precision):
    quantize_bundle(fp32_bundles / kind, tmp_path / "q", precision)
    _check(tmp_path / "q", kind, precision)
    assert not (fp32_bundles / kind / "specdec.json").read_text() == (tmp_path / "q" / "specdec.json").read_text()
    specdec.load(fp32_bundles / kind, drafter=DRAFTERS[kind][0])  # the source bundle is untouched


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_fast_kernel_drafter_bundles_pad_every_graph_of_the_target(fp32_bundles, tmp_path, kind):
    """`quantize --fast-kernels` on EAGLE, Medusa and LayerSkip bundles: the target (and a LayerSkip split's exit
    and tail, which run its arithmetic) take 2-token steps, and every drafter stays token-identical."""
    quantize_bundle(fp32_bundles / kind, tmp_path / "q", "int4", fast_kernels=True)
    m = read_manifest(tmp_path / "q")
    split = ("exit", "tail") if kind == "layerskip" else ()
    assert {n: g.min_step_tokens for n, g in m.graphs.items() if n in ("target",) + split} == \
        {n: 2 for n in ("target",) + split}
    _check(tmp_path / "q", kind, "int4")
