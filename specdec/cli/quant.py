"""Quantizing a bundle's target (`quantize`) and measuring what it costs (`quant-report`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specdec.cli.common import friendly, note_int8_weight_only, stage_progress
from specdec.errors import SpecdecError
from specdec.spec_bench import questions_as_prompts


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--to", "precision", required=True,
              help="fp16 (for GPUs) | int8 | int4 (weight-only, T-invariant kernels; int8 runs slowly on CPUs "
                   "without --fast-kernels).")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--fast-kernels", is_flag=True,
              help="int8/int4 with int8-activation kernels: much faster on CPUs. They amplify a 1-token step's "
                   "rounding, so the bundle runs every step with >= 2 tokens (measured at quantize: speculation then "
                   "stays token-identical to its plain decoding, which pays ~10-15% for the padding token).")
@click.option("--block-size", type=int, default=None,
              help="Weights per quantization scale (power of two >= 16; default 32). Larger: smaller and faster, less exact.")
@click.option("--method", type=click.Choice(["minmax", "rtn", "hqq", "gptq"]), default=None,
              help="int4 default minmax (exact for a GGUF's own 4-bit weights, else round-to-nearest); rtn, hqq "
                   "(onnxruntime's, no data) or gptq (calibrated on this bundle's answers to specdec's prompts).")
@click.option("--sensitive", type=float, default=0.0, show_default=True,
              help="int4: quantize this fraction of the weights finer, those whose 4-bit rounding changes their "
                   "layer's output most on calibration text: at 8 bits, or see --sensitive-block.")
@click.option("--sensitive-block", type=int, default=None,
              help="With --sensitive: 4 bits in blocks of this size instead of 8 bits (CPUs without fast 8-bit "
                   "kernels, e.g. AVX2).")
@click.option("--calib-prompts", type=int, default=96, show_default=True,
              help="gptq / --awq / --sensitive: how many of specdec's prompts the bundle answers for calibration text.")
@click.option("--act-order", is_flag=True,
              help="gptq: round the input channels with the most energy first (block scales fixed beforehand).")
@click.option("--awq", is_flag=True,
              help="int4/int8 with rtn, hqq or gptq: scale each layer's input channels by their activation energy "
                   "before rounding (AWQ; calibrated like gptq), folded into the graph so fp32 math is unchanged.")
@click.option("--symmetric/--asymmetric", default=None,
              help="Blocks centred on zero (no offsets to add: ~10% faster per step) or with an offset each. "
                   "Default: asymmetric for gptq, symmetric otherwise (the better of the two for each, measured).")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@friendly
def quantize(bundle, precision, out_dir, fast_kernels, block_size, method, sensitive, sensitive_block, calib_prompts,
             act_order, awq, symmetric, force):
    """Write a copy of an fp32 BUNDLE with its target quantized (or converted to fp16)."""
    from specdec.quant.bundle import quantize_bundle
    from specdec.quant.calibration import CalibrationConfig

    try:
        with stage_progress() as step:
            quantize_bundle(bundle, out_dir, precision, force=force, fast_kernels=fast_kernels, block_size=block_size,
                            method=method, sensitive=sensitive, sensitive_block=sensitive_block,
                            act_order=act_order, symmetric=symmetric, awq=awq, step=step,
                            calibration=CalibrationConfig(prompts=calib_prompts))
    except ValueError as e:  # a WeightQuantConfig that does not validate, e.g. --block-size 48
        raise SpecdecError(str(e), "see specdec quantize --help") from None
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    note = ""
    if fast_kernels:
        from specdec.runtime.manifest import read_manifest

        note = ", fast kernels: " + ("steps padded to 2 tokens, speculation token-identical"
                                     if read_manifest(out_dir).graphs["target"].t_invariant
                                     else "speculative output may differ from plain decoding")
    click.echo(f"wrote {out_dir} ({size / 1e6:.0f} MB, target {precision}{note})")
    note_int8_weight_only(precision, fast_kernels)


@click.command("quant-report")
@click.argument("reference", type=click.Path(path_type=Path))
@click.argument("candidates", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--questions", type=click.Path(path_type=Path), default=None,
              help="Spec-Bench questions JSONL (default: the copy shipped with specdec).")
@click.option("--limit", type=click.IntRange(min=0), default=1, show_default=True,
              help="Questions per category (0 = all).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--draft-prompts", type=click.IntRange(min=0), default=None,
              help="Measure CANDIDATE drafting for REFERENCE on the first N prompts only (default all; 0 skips): "
                   "a graph with slow single-token kernels drafts one slow step per token.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the report as JSON.")
@friendly
def quant_report_cmd(reference, candidates, questions, limit, max_new_tokens, draft_prompts, out):
    """Quality and speed of each CANDIDATE's target against REFERENCE's, teacher-forced on REFERENCE's answers:
    one table, one column per candidate."""
    from rich.console import Console

    from specdec.quant.report import quant_report, render

    prompts = [p.messages for p in questions_as_prompts(questions, limit)]
    reports = []
    for candidate in candidates:
        reports.append(quant_report(reference, candidate, prompts, max_new_tokens=max_new_tokens,
                                    draft_prompts=draft_prompts))
        if out:  # after each candidate: a long run that is stopped keeps what it measured
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(reports[0] if len(candidates) == 1 else {"reports": reports}, indent=1))
    # a file or pipe gets every column whole (rich would squeeze them into 80 characters)
    Console(width=None if sys.stdout.isatty() else 60 + 26 * len(reports)).print(render(reports))
    if out:
        click.echo(f"wrote {out}")


COMMANDS = (quantize, quant_report_cmd)
