"""`specdec quantize`: a quantized copy of an fp32 bundle (target graph; tokenizer and drafter copied)."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from specdec.errors import SpecdecError
from specdec.export.graph import save_graph
from specdec.quant.weight_only import TARGET_PRESETS, quantize_weights
from specdec.runtime.manifest import MANIFEST_NAME, read_manifest, sha256_file


def untie_embedding(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give the embedding Gather its own copy of a weight it shares with the LM head MatMul.

    The tied fp32 graph stores the matrix once and gathers embeddings as its columns; a weight-only
    quantizer replaces the MatMul's weight, so the Gather must keep an fp32 copy to read.
    """
    inits = {i.name: i for i in model.graph.initializer}
    matmul_weights = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0] in matmul_weights and node.input[0] in inits:
            copy = numpy_helper.from_array(np.array(numpy_helper.to_array(inits[node.input[0]])), "embed.cols")
            model.graph.initializer.append(copy)
            node.input[0] = copy.name
    return model


def quantize_bundle(src: Path, dst: Path, precision: str, force: bool = False) -> Path:
    if precision not in TARGET_PRESETS:
        raise SpecdecError(f"unknown precision {precision!r} for quantize",
                           f"choose one of {', '.join(TARGET_PRESETS)} (fp16 is a GPU precision: export it with a GPU profile)")
    m = read_manifest(src)
    g = m.graphs["target"]
    if g.precision != "fp32":
        raise SpecdecError(f"bundle {src} is already quantized ({g.precision})", "quantize an fp32 bundle")
    if dst.exists() and not force:
        raise SpecdecError(f"output folder {dst} already exists", "pass --force to replace it")
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        for rel in m.files:  # everything but the target graph is reused as is
            if rel == g.file or rel.startswith(g.file + "."):
                continue
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, partial / rel)
        cfg = TARGET_PRESETS[precision]
        model = untie_embedding(onnx.load(str(src / g.file)))
        save_graph(quantize_weights(model, cfg), partial / g.file)
        files = {p.relative_to(partial).as_posix(): sha256_file(p) for p in sorted(partial.rglob("*")) if p.is_file()}
        graphs = {**m.graphs, "target": replace(g, precision=precision, quant=cfg.to_dict(), checks={})}
        manifest = replace(m, graphs=graphs, files=files)
        (partial / MANIFEST_NAME).write_text(manifest.to_json())
        if dst.exists():
            shutil.rmtree(dst)
        partial.rename(dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return dst
