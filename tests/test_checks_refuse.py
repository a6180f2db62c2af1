"""The logit checks of `specdec export` and `specdec quantize` refuse a graph that disagrees with its reference:
one weight is perturbed between writing the graph and checking it, and the command must fail with one error
line, a non-zero exit, and no bundle (nor its staging folder) left behind. (tests/test_gguf.py does the same for
a GGUF source through export_bundle; the same commands unperturbed succeed in tests/test_cli.py and in every
bundle fixture.)"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from test_cli import assert_one_error, run_cli


def perturb_a_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """Scale the first 8 entries of the second layer's post-attention norm by 1.5: every logit moves."""
    norm = next(t for t in model.graph.initializer if t.name == "layers.1.post_norm")
    weights = numpy_helper.to_array(norm).copy()  # [hidden]
    weights[:8] *= np.asarray(1.5, dtype=weights.dtype)
    norm.CopyFrom(numpy_helper.from_array(weights, norm.name))
    return model


def assert_no_bundle(out):
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_export_refuses_a_target_graph_that_disagrees_with_transformers(tiny_checkpoint, tmp_path, monkeypatch):
    from specdec.export import bundle

    save_graph = bundle.save_graph

    def save_perturbed(model, path, *args, **kwargs):
        if path.name == "target.onnx":
            model = perturb_a_norm(model)
        return save_graph(model, path, *args, **kwargs)

    monkeypatch.setattr(bundle, "save_graph", save_perturbed)
    out = tmp_path / "b"
    # drafter self-int8: an export the torch path writes (with none or ngram the checkpoint is streamed and checked
    # against a reference forward instead: tests/test_hf_stream.py perturbs that one)
    assert_one_error(run_cli("export", tiny_checkpoint, "-o", out, "--drafter", "self-int8", "--max-len", "64"),
                     "fp32 graph disagrees with transformers")
    assert_no_bundle(out)


def test_quantize_refuses_a_graph_that_disagrees_with_the_source_bundle(tiny_bundle, tmp_path, monkeypatch):
    from specdec.quant import bundle

    to_fp16 = bundle.to_fp16
    monkeypatch.setattr(bundle, "to_fp16", lambda model: perturb_a_norm(to_fp16(model)))
    out = tmp_path / "q16"
    assert_one_error(run_cli("quantize", tiny_bundle, "--to", "fp16", "-o", out), "fp16 graph disagrees")
    assert_no_bundle(out)

