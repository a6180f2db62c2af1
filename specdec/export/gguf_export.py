"""A GGUF target (or draft model) streamed into a bundle graph with bounded memory; the same for a Hugging Face
safetensors checkpoint (export/hf_source.py), which is read through the same interface (export/streamed.py).

The graph is written from tensor references: each layer is read from the memory-mapped file, converted, and its
initializers appended to the graph's weight file before the next layer is read (export/external.py). With
precision "gguf" the file's quantized weights are carried as their own codes (export/gguf_blocks.py): no second
rounding. The check compares the written graph's logits with a numpy forward of the same weights
(streamed.reference_logits), one layer resident at a time; the graph's session is closed before the reference
runs, so the two never hold the model at once.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.external import ExternalData, save_streamed
from specdec.export.gguf_source import GGUFSource
from specdec.export.streamed import fingerprint, reference_logits
from specdec.export.graph import CONTROL_INPUTS, build_decoder_graph, kv_input_names, kv_output_names
from specdec.runtime.manifest import ARGMAX_ROWS, ATTENTION_BIAS, LOGITS_ROWS, GraphSpec

# The kernels a carried GGUF graph runs: int8 activations (accuracy_level 4), as llama.cpp's own CPU matmuls
# quantize activations to 8 bits; the fp32-activation kernels are ~7x slower at one token (FACTS). Steps of >= 2
# tokens keep speculation token-identical (GraphSpec.min_step_tokens, measured at export).
GGUF_ACCURACY_LEVEL = 4
CHECK_TOKENS = 48
# fp32 graphs (and carried codes run with fp32 activations) reproduce the reference forward's logits to this, per
# 30 of the largest |logit| (summation order differs; measured 1.6e-4 / 3.7e-4 on SmolLM2-135M's Q4_1 file).
FP32_TOLERANCE = 1e-3
# fp16 graphs: near-every next-token choice of the reference (fp16 rounding moves near-ties).
MIN_FP16_AGREEMENT = 0.9


@dataclass(frozen=True)
class GraphCheck:
    max_abs_diff: float
    max_abs_logit: float
    top1_agreement: float
    tolerance: float | None
    fast_top1_agreement: float | None = None  # carried codes: the int8-activation kernels' agreement

    @property
    def passes(self) -> bool:
        if self.tolerance is not None:
            return bool(self.max_abs_diff <= self.tolerance)  # False for NaN
        return bool(self.top1_agreement >= MIN_FP16_AGREEMENT)

    def to_checks(self) -> dict:
        out = {"max_abs_logit_diff_vs_reference_forward": self.max_abs_diff,
               "max_abs_logit_reference_forward": self.max_abs_logit,
               "top1_agreement_vs_reference_forward": self.top1_agreement}
        if self.tolerance is not None:
            out["tolerance"] = self.tolerance
        if self.fast_top1_agreement is not None:
            out["top1_agreement_fast_kernels_vs_reference_forward"] = self.fast_top1_agreement
        return out


def gguf_graph_spec(file: str, src: GGUFSource, precision: str, min_step_tokens: int = 1,
                    taps: tuple[int, ...] = (), tree: bool = False) -> GraphSpec:
    """`taps`: residual-stream outputs `hidden.{t}` (an EAGLE head reads hidden.{n_layers}); `tree`: the
    `attention_bias` input of token-tree verification."""
    cfg = src.config
    carried = precision == "gguf"
    # "method": where the codes come from: "gguf", a checkpoint's "awq" / "gptq" (export/hf_quant.py), or
    # specdec's own rounding of float weights (export/rounded.py, whose quant() also names its preset)
    quant = {}
    if carried:
        quant = src.quant() if hasattr(src, "quant") else \
            {"method": src.quant_method, "accuracy_level": GGUF_ACCURACY_LEVEL, "formats": src.formats()}
    exact = precision == "fp32"
    return GraphSpec(file=file, model=cfg, precision=getattr(src, "precision", "int4") if carried else precision,
                     n_layers=cfg.n_layers,
                     inputs=CONTROL_INPUTS + ((ATTENTION_BIAS,) if tree else ()) + (LOGITS_ROWS,)
                     + ((ARGMAX_ROWS,) if exact else ()) + tuple(kv_input_names(cfg.n_layers)),
                     outputs=("logits", "argmax", *kv_output_names(cfg.n_layers), *(f"hidden.{t}" for t in taps)),
                     hidden_layers=taps, quant=quant, min_step_tokens=min_step_tokens, pads_attention_only=carried)


def accuracy_level(src) -> int:
    """The MatMulNBits kernels of a carried graph: the source's preset (export/rounded.py), else int8 activations."""
    return getattr(src, "accuracy_level", GGUF_ACCURACY_LEVEL)


def write_gguf_graph(src: GGUFSource, path: Path, precision: str,
                     progress: Callable[[int, int], None] | None = None, taps: tuple[int, ...] = (),
                     tree: bool = False) -> GraphSpec:
    """Write `src` as a decoder graph at `path` (weights in `path`.data) and return its spec (unchecked).
    `precision`: "gguf" (the file's own codes), "fp32" or "fp16" (dequantized). `taps`, `tree`: gguf_graph_spec's;
    a carried graph pads narrow steps (pads_attention_only) and takes no tree."""
    if precision not in ("gguf", "fp32", "fp16"):
        raise ValueError(f"precision {precision!r}")
    carried = precision == "gguf"
    if carried and tree:
        raise ValueError("a carried graph pads its narrow steps and verifies no token trees")
    if carried:
        bad = src.not_carried()
        if bad:
            name, fmt = bad[0]
            raise SpecdecError(f"tensor {name} is {fmt} ({len(bad)} tensors of types specdec cannot carry exactly into "
                               f"onnxruntime's kernels)", "export with --precision fp32 to dequantize them")
    weights = src.weights(carried)
    if progress is not None:
        weights.layers.on_read = lambda i: progress(i, src.config.n_layers)
    path = Path(path)
    with ExternalData(path.with_name(path.name + ".data")) as sink:
        model = build_decoder_graph(src.config, weights, dtype=np.float16 if precision == "fp16" else np.float32,
                                    argmax=True, logits_rows=True, exact_argmax=precision == "fp32", sink=sink,
                                    accuracy_level=accuracy_level(src), pad_attention=carried, hidden_layers=taps,
                                    tree=tree)
    save_streamed(model, path)
    src.release()
    if progress is not None:
        progress(src.config.n_layers, src.config.n_layers)
    return gguf_graph_spec(path.name, src, precision, taps=taps, tree=tree)


def check_gguf_graph(src: GGUFSource, path: Path, spec: GraphSpec, precision: str, seed: int = 0) -> GraphCheck:
    """The written graph against the numpy reference forward of the same weights on CHECK_TOKENS random tokens.

    A carried graph is checked through a copy of its proto whose MatMulNBits run fp32 activations (accuracy_level
    0, exact to float rounding), pointing into the same weight file: the check sees the stored codes, scales and
    offsets themselves, held to the fp32 tolerance. The int8-activation kernels' own agreement is recorded beside
    (top1_agreement_fast_kernels)."""
    import onnx

    from specdec.export.verify import graph_logits

    ids = np.random.default_rng(seed).integers(0, spec.model.vocab_size, size=(1, CHECK_TOKENS))
    fast = None
    check_path = path
    if precision == "gguf":
        fast = graph_logits(path, spec, ids)[0].argmax(-1)  # [n]
        model = onnx.load_model(str(path), load_external_data=False)
        for node in model.graph.node:
            for a in node.attribute:
                if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                    a.i = 0
        check_path = path.with_name("check." + path.name)
        save_streamed(model, check_path)
        del model
    try:
        got = graph_logits(check_path, spec, ids)[0]  # [n, V]; its session is gone when this returns
    finally:
        if check_path != path:
            check_path.unlink(missing_ok=True)
    gc.collect()
    ref = reference_logits(src, ids[0])  # [n, V]
    top = ref.argmax(-1)
    check = GraphCheck(float(np.max(np.abs(got - ref))), float(np.abs(ref).max()), float(np.mean(got.argmax(-1) == top)),
                       None if precision == "fp16" else FP32_TOLERANCE * max(1.0, float(np.abs(ref).max()) / 30.0))
    return check if fast is None else replace(check, fast_top1_agreement=float(np.mean(fast == top)))


def export_gguf_graph(src: GGUFSource, path: Path, precision: str, step: Callable, what: str = "target",
                      taps: tuple[int, ...] = (), tree: bool = False, invariance: bool = True) -> GraphSpec:
    """Write, check and (carried codes, `invariance`) measure the step-width invariance of one graph; the spec with
    its checks."""
    from specdec.export.verify import measure_min_step_tokens

    t0 = time.perf_counter()
    spec = write_gguf_graph(src, path, precision, progress=getattr(step, "progress", None), taps=taps, tree=tree)
    step(f"checking the {what} graph against a reference forward of the file's weights")
    check = check_gguf_graph(src, path, spec, precision)
    if not check.passes:
        bound = f"> {check.tolerance:.1e}" if check.tolerance is not None else \
            f"and top-1 agreement {check.top1_agreement:.2f} < {MIN_FP16_AGREEMENT}"
        raise SpecdecError(f"the exported {what} graph disagrees with the reference forward of {src.path.name}: "
                           f"max |logit diff| {check.max_abs_diff:.2e} {bound}", "please report this model")
    checks = {**check.to_checks(), "export_seconds": round(time.perf_counter() - t0, 1)}
    spec = replace(spec, checks=checks)
    if invariance and precision == "gguf" and accuracy_level(src) == 4:  # fp32-activation kernels are T-invariant
        step(f"measuring the {what} graph's step-width invariance")
        min_step, step_checks = measure_min_step_tokens(path, spec)
        spec = replace(spec, min_step_tokens=min_step, checks={**spec.checks, **step_checks})
    return spec


def gguf_fingerprint(src) -> str:
    """export/eagle.py's target_fingerprint of a streamed source's weights (export/streamed.py's fingerprint)."""
    return fingerprint(src)
