"""`specdec quantize`: an int8/int4 or fp16 copy of an fp32 bundle (target graph; tokenizer and drafter copied)."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import onnx

from specdec.errors import SpecdecError
from specdec.export.bundle import SPLIT_TOLERANCE
from specdec.export.writer import bundle_files, staged_folder
from specdec.export.exact_argmax import strip_exact_argmax
from specdec.export.graph import save_graph, save_graph_sharing
from specdec.export.verify import check_against_graph, measure_min_step_tokens
from specdec.quant.calibration import CalibrationConfig, calibration_sequences
from specdec.quant.weight_only import (FAST_TARGET_PRESETS, TARGET_PRESETS, gather_from_codes, head_codes,
                                        quantize_weights)
from specdec.runtime.manifest import ARGMAX_ROWS, MANIFEST_NAME, SPLIT_GRAPHS, read_manifest


QUANTIZE_PRECISIONS = ("fp16", *TARGET_PRESETS)
def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float tensor of an fp32 specdec graph as fp16: weights, activations, KV buffers, logits.

    onnxruntime's converter with keep_io_types=False, so the KV inputs/outputs and logits become fp16 too
    (the runtime binds fp16 KV buffers; ids, positions and lengths are ints and stay so). Shape inference is
    off: onnx refuses it on protos over 2 GB (a 1B model in fp32), and no node of a specdec graph needs
    inferred types, since every one takes the graph's single float type. Weights beyond fp16's range are
    clamped to +-65504 rather than becoming inf.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)


def _load_with_weights(graph: Path) -> onnx.ModelProto:
    """onnx.load with the external weights, its refusals as one line (e.g. a weight file with several hard links,
    which onnx takes for an attack: a bundle copied with `cp -l`)."""
    from onnx.checker import ValidationError

    try:
        return onnx.load(str(graph))
    except (ValidationError, OSError) as e:
        raise SpecdecError(f"cannot read graph {graph} with its weights ({e})",
                           "copy the bundle with plain `cp -r` (no hard links), or re-export it") from None


def _reads_data_file(graph: Path, data_file: str) -> bool:
    """Whether a graph keeps any of its weights in `data_file` (by offset, see save_graph_sharing)."""
    from onnx import external_data_helper

    model = onnx.load(str(graph), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL and
               external_data_helper.ExternalDataInfo(t).location == data_file for t in model.graph.initializer)


def quantize_bundle(src: Path, dst: Path, precision: str, force: bool = False, fast_kernels: bool = False,
                    block_size: int | None = None, *, method: str | None = None, sensitive: float = 0.0,
                    sensitive_block: int | None = None, act_order: bool = False,
                    symmetric: bool | None = None, awq: bool = False,
                    calibration: CalibrationConfig = CalibrationConfig(),
                    step: Callable[[str], object] | None = None) -> Path:
    """`fast_kernels`: int8-activation kernels (FAST_TARGET_PRESETS), faster; lossless with min_step_tokens 2 (measured).
    `block_size`, `method`, `sensitive`, `act_order`, `symmetric` and `awq` override the preset's (int8/int4 only; see
    WeightQuantConfig).
    GPTQ, AWQ and sensitive calibrate on the source bundle's own answers to specdec's prompts (`calibration`).
    `step(description)` is called as each stage starts (progress)."""
    step = step or (lambda _desc: None)
    if precision not in QUANTIZE_PRECISIONS:
        raise SpecdecError(f"unknown precision {precision!r} for quantize",
                           f"choose one of {', '.join(QUANTIZE_PRECISIONS)}")
    m = read_manifest(src)
    g = m.graphs["target"]
    if g.precision == "fp16":  # rounding fp16 weights again would stack a second rounding on the first
        raise SpecdecError(f"bundle {src} is fp16; specdec quantize converts fp32 bundles only",
                           f"quantize the fp32 bundle it came from, or export with --precision {precision}")
    if (block_size is not None or method is not None or sensitive or sensitive_block or act_order
            or symmetric is not None or awq) \
            and precision not in TARGET_PRESETS:
        raise SpecdecError(f"--block-size, --method, --sensitive, --awq and --symmetric/--asymmetric apply to "
                           f"{' and '.join(TARGET_PRESETS)} only, not {precision}")
    if fast_kernels and precision not in FAST_TARGET_PRESETS:
        raise SpecdecError(f"--fast-kernels applies to {' and '.join(FAST_TARGET_PRESETS)} only, not {precision}")
    if g.precision != "fp32":
        raise SpecdecError(f"bundle {src} is already quantized ({g.precision})", "quantize an fp32 bundle")
    if dst.exists() and not force:
        raise SpecdecError(f"output folder {dst} already exists", "pass --force to replace it")
    cfg = None
    if precision != "fp16":
        cfg = (FAST_TARGET_PRESETS if fast_kernels else TARGET_PRESETS)[precision]
        overrides = {"block_size": block_size, "method": method, "sensitive": sensitive or None,
                     "sensitive_block": sensitive_block, "act_order": act_order or None, "awq": awq or None}
        # A method given without a grid takes that method's own (WeightQuantConfig resolves symmetric=None).
        grid = {"symmetric": symmetric} if symmetric is not None or method is not None else {}
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None}, **grid)  # validated there
        if cfg.needs_calibration and m.split_target:  # slices would need the very same choices as the whole
            raise SpecdecError(f"bundle {src} is a layerskip bundle: its split cannot be quantized with "
                               f"{cfg.method}{' and --sensitive' if cfg.sensitive else ''}"
                               f"{' and --awq' if cfg.awq else ''}",
                               "use --method minmax, rtn or hqq without --sensitive or --awq")

    sequences = None
    if cfg is not None and cfg.needs_calibration:
        step(f"calibration text: the bundle answers {calibration.prompts} of specdec's prompts")
        sequences = calibration_sequences(src, calibration)

    def convert(model: onnx.ModelProto) -> onnx.ModelProto:
        """The target, or a slice of it (LayerSkip exit / tail), at `precision`: slices come out byte for byte
        as the target's weights do, so they keep sharing its weight file."""
        if cfg is None:
            return to_fp16(model)
        return quantize_weights(model, cfg, sequences)

    data_file = g.file + ".data"
    # Graphs that read the target's weight file by offset (a LayerSkip split's exit and tail, an EAGLE head)
    # are rewritten against the new target's file; every other file is reused as is.
    sharing = {name: spec for name, spec in m.graphs.items()
               if name != "target" and _reads_data_file(src / spec.file, data_file)}
    sharing_files = {spec.file for spec in sharing.values()}
    with staged_folder(dst) as partial:
        for rel in m.files:
            if rel == g.file or rel.startswith(g.file + ".") or rel in sharing_files or \
                    any(rel.startswith(f + ".") for f in sharing_files):
                continue
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, partial / rel)
        step(f"writing target graph ({precision}{', ' + cfg.method if cfg else ''}"
             f"{', searching AWQ scales first (~2 min for 135M parameters)' if cfg and cfg.awq else ''})")
        # The exact-argmax path gathers the fp32 head's columns: a target whose head is quantized (or fp16) takes
        # its argmax from its own logits again; one whose head stays fp32 keeps the path.
        keeps_argmax_path = cfg is not None and not cfg.quantizes_head
        target_model = _load_with_weights(src / g.file)
        target_model = convert(target_model if keeps_argmax_path else strip_exact_argmax(target_model))
        # A target that gathers its embedding from its head's codes: the graphs reading its weights do too, so the
        # tied matrix is stored once for all of them (else each would keep an fp32 copy of its own).
        codes = head_codes(target_model) if any(n.op_type == "GatherBlockQuantized"
                                                  for n in target_model.graph.node) else None
        save_graph(target_model, partial / g.file)
        del target_model
        target = replace(g, precision=precision, quant=cfg.to_dict() if cfg else {}, checks={},
                         inputs=tuple(i for i in g.inputs if keeps_argmax_path or i != ARGMAX_ROWS))
        if cfg is not None and not cfg.t_invariant:
            step("measuring the fast kernels' step-width invariance")
            min_step_tokens, checks = measure_min_step_tokens(partial / g.file, target)
            target = replace(target, min_step_tokens=min_step_tokens, checks=checks)
        if cfg is None:
            check = check_against_graph(src / g.file, g, partial / g.file, target)
            if not check.passes("fp16"):
                raise SpecdecError(f"the fp16 graph disagrees with the fp32 one: max |logit diff| "
                                   f"{check.max_abs_diff:.2e} > {check.tolerance('fp16'):.1e}",
                                   "this model may not fit fp16's range; keep fp32, or quantize --to int8")
            target = replace(target, checks=check.to_checks("fp16"))
        graphs = {**m.graphs, "target": target}
        for name, spec in sharing.items():
            step(f"rewriting graph {name!r} against the new target's weights")
            model = _load_with_weights(src / spec.file)  # read from the source bundle
            if m.split_target and name in SPLIT_GRAPHS:
                graphs[name] = replace(spec, precision=precision, quant=target.quant,
                                       min_step_tokens=target.min_step_tokens)
                model = convert(model)
            elif cfg is None and spec.precision != "fp16":  # an fp16 target hands the head fp16 states
                graphs[name] = replace(spec, precision="fp16" if spec.precision == "fp32" else spec.precision,
                                       activations="fp16")
                model = to_fp16(model)
            if codes is not None:
                model = gather_from_codes(model, codes)
            save_graph_sharing(model, partial / spec.file, partial / g.file)
        if m.split_target:
            from specdec.export.layerskip import check_split

            diff = check_split(partial, graphs, g.model.vocab_size)
            if not diff <= SPLIT_TOLERANCE[precision]:
                raise SpecdecError(f"the quantized layerskip split disagrees with the quantized target: max |logit "
                                   f"diff| {diff:.2e}", "please report this model")
            graphs["tail"] = replace(graphs["tail"], checks={"max_abs_logit_diff_vs_target_graph": diff})
        manifest = replace(m, graphs=graphs, files=bundle_files(partial))
        (partial / MANIFEST_NAME).write_text(manifest.to_json())
    return dst
