"""`specdec export`: a model (and its drafter) into a bundle."""
from __future__ import annotations

import time
from pathlib import Path

import click

from specdec.cli.common import friendly, note_int8_weight_only, parse_draft_len, stage_progress
from specdec.errors import SpecdecError


@click.command()
@click.argument("model", required=False)
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Bundle folder to write.")
@click.option("--drafter", default="ngram", show_default=True,
              help="none | ngram | self-int8 | self-int4 | layerskip | eagle | medusa | model:PATH (another specdec bundle, "
                   "or a GGUF file exported into this bundle).")
@click.option("--precision", default="auto", show_default=True,
              help="Target precision: gguf (the own codes of a quantized GGUF or AWQ/GPTQ checkpoint, streamed) | fp32 | "
                   "fp16 (for GPUs) | int8 | int4. auto: gguf for a quantized GGUF or AWQ/GPTQ checkpoint with "
                   "drafter none, ngram or model:PATH, else fp32.")
@click.option("--max-len", default=2048, show_default=True, help="Default KV buffer length (tokens).")
@click.option("--draft-len", callback=parse_draft_len, default=None,
              help="Default drafted tokens per round, or auto (default: auto for ngram, else 4).")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--exit-layer", default="auto", show_default=True,
              help="layerskip: draft from the first E layers; auto = chosen by a calibration on the target's answers.")
@click.option("--exit-adapter/--no-exit-adapter", default=True, show_default=True,
              help="layerskip: train a low-rank exit adapter (kept only if it raises held-out agreement).")
@click.option("--calib-prompts", default=160, show_default=True,
              help="layerskip: prompts the target answers for the calibration and the adapter.")
@click.option("--heads", type=click.Path(path_type=Path), default=None,
              help="eagle / medusa: a heads file from `specdec train-drafter --kind eagle|medusa` (eagle's default: the "
                   "one shipped for this target).")
@click.option("--heads-precision", type=click.Choice(["fp32", "int8"]), default="int8", show_default=True,
              help="eagle / medusa: weights of the heads' graph (int8: smaller and faster drafts; output unchanged).")
@click.option("--corpus/--no-corpus", default=True, show_default=True,
              help="Copy the corpus of the target's own answers that specdec ships for it, if any (drafter 'corpus').")
@click.option("--fast-kernels", is_flag=True,
              help="int8/int4: int8-activation kernels, the fastest CPU bundle; every step runs >= 2 tokens so "
                   "speculation stays token-identical (see `specdec quantize --help`).")
@click.option("--block-size", type=int, default=None,
              help="int8/int4: weights per quantization scale (power of two >= 16; default 32). Larger: a smaller "
                   "bundle and faster steps, less exact rounding: for a bundle meant as a draft model, whose rounding "
                   "never changes the output (a GGUF given as --drafter model:PATH gets blocks of up to 128).")
@click.option("--draft-precision", type=click.Choice(["int4", "int8", "own"]), default="int4", show_default=True,
              help="model:PATH with a GGUF file or checkpoint folder: round the draft model to int4/int8 with the "
                   "fastest CPU kernels (its rounding never changes the output, only how often its drafts are "
                   "accepted), or keep its own precision. A draft bundle is copied as it is.")
@friendly
def export(model, out_dir, drafter, precision, max_len, draft_len, force, exit_layer, exit_adapter, calib_prompts, heads,
           heads_precision, corpus, fast_kernels, block_size, draft_precision):
    """Export MODEL (HF checkpoint folder or .gguf; default: SmolLM2-135M-Instruct) into a bundle."""
    from specdec.export.bundle import ExportConfig, export_bundle
    from specdec.export.layerskip import LayerSkipConfig

    if exit_layer != "auto" and not exit_layer.isdigit():
        raise SpecdecError(f"--exit-layer must be a layer number or 'auto', got {exit_layer!r}")
    layerskip = LayerSkipConfig(exit_layer=None if exit_layer == "auto" else int(exit_layer), adapter=exit_adapter,
                                prompts=calib_prompts)
    cfg = ExportConfig(drafter=drafter, precision=precision, max_len=max_len, draft_len=draft_len, force=force,
                       layerskip=layerskip, heads=heads, heads_precision=heads_precision, corpus=corpus,
                       fast_kernels=fast_kernels, block_size=block_size, draft_precision=draft_precision)
    t0 = time.perf_counter()
    with stage_progress() as step:
        manifest = export_bundle(model, out_dir, cfg, step=step)
    if manifest.drafter.kind == "layerskip":
        _print_layerskip_calibration(manifest.drafter)
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    corpus_note = ", with the shipped corpus" if manifest.drafter.corpus else ""
    target = manifest.graphs["target"]
    precision = target.precision
    method = target.quant.get("method")
    if method in ("gguf", "awq", "gptq"):  # the source's own codes: say which formats
        formats = ", ".join(f"{k} x{v}" for k, v in target.quant.get("formats", {}).items())
        precision = f"the {'GGUF' if method == 'gguf' else 'checkpoint'}'s own codes ({formats})"
    click.echo(f"wrote {out_dir} ({size / 1e6:.0f} MB, target {precision}, "
               f"drafter {cfg.drafter}{corpus_note}) in {time.perf_counter() - t0:.0f} s")
    note_int8_weight_only(manifest.graphs["target"].precision, fast_kernels)


def _print_layerskip_calibration(spec) -> None:
    from rich.console import Console
    from rich.table import Table

    cal = spec.calibration
    t = Table(title=f"layerskip calibration: {cal['answer_tokens']} answer tokens, draft vocabulary {cal['draft_vocab']} "
                    f"(covers {cal['draft_vocab_coverage']:.1%} of held-out answer tokens)")
    for col in ("exit layer", "draft cost", "agreement", "best k", "speed-up", "with adapter", "best k", "speed-up"):
        t.add_column(col, justify="right")
    for c in cal["curve"]:
        mark = " <" if c["exit_layer"] == spec.exit_layer else ""
        adapted = [f"{c['agreement_adapter']:.3f}", str(c["best_k_adapter"]), f"{c['predicted_speedup_adapter']:.2f}x"] \
            if "agreement_adapter" in c else ["", "", ""]
        t.add_row(f"{c['exit_layer']}{mark}", f"{c['draft_cost']:.3f}", f"{c['agreement']:.3f}", str(c["best_k"]),
                  f"{c['predicted_speedup']:.2f}x", *adapted)
    Console(stderr=True).print(t)
    a = cal.get("adapter")
    kept = "adapter kept" if a and a["kept"] else "no adapter"
    click.echo(f"exit layer {spec.exit_layer} ({cal['exit_layer_chosen_by']}), {kept}: predicted speed-up "
               f"{cal['predicted_speedup']:.2f}x (draft cost in bytes read; `specdec bench` measures)", err=True)
    if cal["predicted_speedup"] <= 1.0:
        click.echo("note: no exit layer is predicted to pay on this model (it was not trained for early exit); "
                   "with --draft-len auto the runtime drafts only when measured acceptance pays", err=True)


COMMANDS = (export,)
