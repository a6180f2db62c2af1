"""The `specdec` command line. Bad input ends with one line saying what is wrong and what to do."""
from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import click

from specdec.errors import SpecdecError
from specdec.runtime.drafters import DRAFTER_CHOICES
from specdec.spec_bench import DEFAULT_QUESTIONS


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def friendly(fn):
    """Turn input errors and Ctrl-C into one line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecdecError as e:
            _fail(str(e))
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except MemoryError:
            _fail("out of memory: try a smaller --max-len or a quantized bundle")

    return wrapper


def _build(cls, **kwargs):
    """Construct a validated config; its ValueError is the user's input error."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise SpecdecError(str(e)) from None


class _OneLineErrorGroup(click.Group):
    """Click's own usage errors (bad flag values, unknown options, missing arguments) as one `error:` line too."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `specdec`: the help is the answer
                e.show()
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            _fail(e.format_message() + (f" (see `{ctx.command_path} --help`)" if ctx is not None else ""), e.exit_code)
        except click.Abort:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)  # an int here is the code of click's Exit (--help, --version)


@click.group(cls=_OneLineErrorGroup)
@click.version_option(package_name="specdec")
def main() -> None:
    """Speculative decoding for LLMs on laptops and edge devices."""


def _parse_draft_len(ctx, param, value):
    if value is None or value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise click.BadParameter("must be an integer >= 0 or 'auto'") from None
    if k < 0:
        raise click.BadParameter("must be >= 0 (0 = no speculation)")
    return k


@main.command()
@click.argument("model", required=False)
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Bundle folder to write.")
@click.option("--drafter", default="ngram", show_default=True,
              help="none | ngram | self-int8 | self-int4 | layerskip | eagle | medusa | model:PATH (another specdec bundle, "
                   "or a GGUF file exported into this bundle).")
@click.option("--precision", default="auto", show_default=True,
              help="Target precision: gguf (a quantized GGUF's own codes, streamed) | fp32 | fp16 (for GPUs) | int8 | "
                   "int4. auto: gguf for a quantized GGUF with drafter none, ngram or model:PATH, else fp32.")
@click.option("--max-len", default=2048, show_default=True, help="Default KV buffer length (tokens).")
@click.option("--draft-len", callback=_parse_draft_len, default=None,
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
@friendly
def export(model, out_dir, drafter, precision, max_len, draft_len, force, exit_layer, exit_adapter, calib_prompts, heads,
           heads_precision, corpus, fast_kernels):
    """Export MODEL (HF checkpoint folder or .gguf; default: SmolLM2-135M-Instruct) into a bundle."""
    from specdec.export.bundle import ExportConfig, export_bundle
    from specdec.export.layerskip import LayerSkipConfig

    if exit_layer != "auto" and not exit_layer.isdigit():
        raise SpecdecError(f"--exit-layer must be a layer number or 'auto', got {exit_layer!r}")
    layerskip = LayerSkipConfig(exit_layer=None if exit_layer == "auto" else int(exit_layer), adapter=exit_adapter,
                                prompts=calib_prompts)
    cfg = ExportConfig(drafter=drafter, precision=precision, max_len=max_len, draft_len=draft_len, force=force,
                       layerskip=layerskip, heads=heads, heads_precision=heads_precision, corpus=corpus,
                       fast_kernels=fast_kernels)
    t0 = time.perf_counter()
    with _stage_progress() as step:
        manifest = export_bundle(model, out_dir, cfg, step=step)
    if manifest.drafter.kind == "layerskip":
        _print_layerskip_calibration(manifest.drafter)
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    corpus_note = ", with the shipped corpus" if manifest.drafter.corpus else ""
    target = manifest.graphs["target"]
    precision = target.precision
    if target.quant.get("method") == "gguf":  # the file's own codes: say which formats
        formats = ", ".join(f"{k} x{v}" for k, v in target.quant.get("formats", {}).items())
        precision = f"the GGUF's own codes ({formats})"
    click.echo(f"wrote {out_dir} ({size / 1e6:.0f} MB, target {precision}, "
               f"drafter {cfg.drafter}{corpus_note}) in {time.perf_counter() - t0:.0f} s")
    _note_int8_weight_only(manifest.graphs["target"].precision, fast_kernels)


# onnxruntime has no fast CPU kernel for 8-bit weights with fp32 activations (MatMulNBits dequantizes them every
# step): a 1-token step of the default model took 388 ms against 33 ms in fp32 on an AVX2 host, 202-267
# ms against 21 ms on AVX-512 hosts (bench/results/quant/). Said where such a bundle is written, not found later.
INT8_WEIGHT_ONLY_NOTE = ("note: int8 weights with fp32 activations have no fast CPU kernel in onnxruntime (a step "
                         "runs ~10x slower than fp32 on a CPU); for a CPU, use --fast-kernels (int8 activations, "
                         "lossless under speculation), or keep this bundle for a GPU")


def _note_int8_weight_only(precision: str, fast_kernels: bool) -> None:
    if precision == "int8" and not fast_kernels:
        click.echo(INT8_WEIGHT_ONLY_NOTE, err=True)


@contextlib.contextmanager
def _stage_progress():
    """A spinner line per stage of a long job; yields `step(description)`, called as each stage starts, whose
    `step.progress(done, total)` fills the current stage's bar (layers written) with an ETA. Without a terminal
    each stage is one '- description' line on stderr instead, and progress a line per quarter."""
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    tty = sys.stderr.isatty()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24), TaskProgressColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=False, disable=not tty, console=None) as bar:
        current = []
        quarters = []

        def step(desc: str) -> None:
            if current:
                bar.update(current[-1], completed=1, total=1)
            current.append(bar.add_task(desc, total=None))
            quarters.clear()
            if not tty:
                click.echo(f"- {desc}", err=True)

        def progress(done: int, total: int) -> None:
            if current:
                bar.update(current[-1], completed=done, total=total)
            q = 4 * done // max(total, 1)
            if not tty and 0 < q < 4 and q not in quarters:
                quarters.append(q)
                click.echo(f"-   {done}/{total}", err=True)

        step.progress = progress
        yield step
        if current:
            bar.update(current[-1], completed=1, total=1)


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


@main.command("train-drafter")
@click.argument("model", required=False)
@click.option("-o", "--out", "out_path", type=click.Path(path_type=Path), required=True,
              help="draft-model: the draft bundle folder to write; eagle: the heads file (.npz) to write.")
@click.option("--kind", type=click.Choice(["draft-model", "eagle", "medusa"]), required=True,
              help="draft-model: a few of the target's layers, trained on its own answers (KL to its distribution); "
                   "eagle: a one-layer head over the target's hidden states; medusa: K heads guessing K tokens ahead "
                   "(both trained on `specdec distill-data` output).")
@click.option("--medusa-heads", default=4, show_default=True, help="medusa: number of heads (tokens drafted per round).")
@click.option("--data", type=click.Path(path_type=Path), multiple=True,
              help="eagle / medusa: a distill-data folder (repeat the option to train on several).")
@click.option("--layers", default=4, show_default=True, help="draft-model: layers (copied from the target's).")
@click.option("--intermediate-size", type=int, default=None,
              help="draft-model: MLP width (default: the target's).")
@click.option("--prompts", default=400, show_default=True, help="draft-model: prompts (specdec's own) the target answers.")
@click.option("--new-tokens", default=128, show_default=True, help="draft-model: answer tokens per prompt.")
@click.option("--epochs", default=2, show_default=True, help="Passes over the answers.")
@click.option("--unroll", default=3, show_default=True, help="eagle: drafting steps trained per position.")
@click.option("--max-tokens", type=int, default=None, help="eagle/medusa: use at most this many tokens of the data.")
@click.option("--init-heads", type=click.Path(path_type=Path), default=None,
              help="eagle: continue training from this heads file (more epochs on the same or new data).")
@click.option("--force", is_flag=True, help="draft-model: replace an existing output folder.")
@friendly
def train_drafter(model, out_path, kind, medusa_heads, data, layers, intermediate_size, prompts, new_tokens, epochs,
                  unroll, max_tokens, init_heads, force):
    """Train a drafter for MODEL (HF checkpoint folder or .gguf; default: SmolLM2-135M-Instruct)."""
    t0 = time.perf_counter()
    if kind in ("eagle", "medusa"):
        _train_heads(model, kind, out_path, data, epochs, unroll, medusa_heads, max_tokens, init_heads)
        return
    from specdec.export.distill import REPORT_NAME, DistillConfig, train_draft_model

    out_dir = out_path
    cfg = DistillConfig(n_layers=layers, intermediate_size=intermediate_size, prompts=prompts, new_tokens=new_tokens,
                        epochs=epochs, force=force)
    with _stage_progress() as step:
        r = train_draft_model(model, out_dir, cfg, step=step)
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    click.echo(f"wrote {out_dir} ({size / 1e6:.0f} MB, {kind}: {r['n_layers']} of {r['target_layers']} layers, "
               f"{r['student_params'] / 1e6:.1f}M of {r['target_params'] / 1e6:.1f}M parameters) "
               f"in {time.perf_counter() - t0:.0f} s")
    click.echo(f"{r['answer_tokens']} answer tokens (generation {r['generation_s']:.0f} s, training "
               f"{r['training_s']:.0f} s); KL to the target {r['first_epoch_kl']:.3f} -> {r['last_epoch_kl']:.3f} "
               f"(first -> last epoch); held-out top-1 agreement {r['held_out_agreement_before']:.3f} -> "
               f"{r['held_out_agreement_after']:.3f}; report in {out_dir / REPORT_NAME}")
    click.echo(f"use it: specdec export {model + ' ' if model else ''}-o DIR --drafter model:{out_dir}")


def _train_heads(model, kind: str, out_path: Path, data: tuple[Path, ...], epochs: int, unroll: int, n_heads: int,
                 max_tokens: int | None, init: Path | None) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not data:
        raise SpecdecError(f"--kind {kind} needs --data DIR", "make it with `specdec distill-data -o DIR`")
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                  TimeRemainingColumn(), disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(f"{kind} heads", total=None, loss="-")

        def step(desc: str) -> None:
            progress.update(task, description=desc)
            if not sys.stderr.isatty():
                click.echo(f"- {desc}", err=True)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, loss=f"{loss:.3f}")

        if kind == "eagle":
            from specdec.export.eagle import EagleConfig, train_eagle

            r = train_eagle(model, data, out_path, EagleConfig(epochs=epochs, unroll=unroll, max_tokens=max_tokens),
                            step=step, progress=on_step, init=init)
            before, after = r["held_out_before"]["agreement_by_step"], r["held_out_after"]["agreement_by_step"]
            extra = (f"; draft vocabulary covers {r['vocab_coverage']:.1%}; expected tokens per verification at k=4: "
                     f"{r['held_out_after']['expected_tau_k4']}")
        else:
            from specdec.export.medusa import MedusaConfig, train_medusa

            r = train_medusa(model, data, out_path, MedusaConfig(n_heads=n_heads, epochs=epochs, max_tokens=max_tokens),
                             step=step, progress=on_step)
            before, after, extra = r["held_out_agreement_before"], r["held_out_agreement_after"], ""
    click.echo(f"wrote {out_path} ({out_path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.0f} s: "
               f"{r['steps']} training steps ({r['training_s']:.0f} s), loss {r['first_loss']} -> {r['last_loss']}")
    click.echo(f"held-out agreement by draft step {before} -> {after}{extra}")
    click.echo(f"use it: specdec export {model + ' ' if model else ''}-o DIR --drafter {kind} --heads {out_path}")


@main.command("corpus")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), multiple=True, required=True,
              help="A distill-data folder whose answers go into the corpus (repeat for several).")
@click.option("--keep", is_flag=True, help="Keep the bundle's corpus (e.g. the shipped one) and add the data to it.")
@friendly
def corpus_cmd(bundle, data, keep):
    """Add a corpus of the target's own answers to BUNDLE: the "corpus" drafter (its default where the bundle's
    drafter is ngram) continues the context as those answers did wherever prompt lookup finds nothing."""
    from specdec.export.corpus import add_corpus

    t0 = time.perf_counter()
    r = add_corpus(bundle, list(data), keep=keep)
    click.echo(f"{bundle}: corpus of {r['tokens']} tokens ({r['texts']} answers, {r['bytes'] / 1e6:.1f} MB, "
               f"matches up to {r['max_ngram']} tokens) in {time.perf_counter() - t0:.0f} s; "
               f"use it: specdec generate {bundle} --drafter corpus \"...\"")


@main.command("distill-data")
@click.argument("model", required=False)
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Folder of shards.")
@click.option("--prompts-file", type=click.Path(path_type=Path), default=None,
              help="Extra prompts, JSONL with 'prompt' or 'messages' (answered before the built-in ones); "
                   "'messages' ending in an assistant turn keep that answer (recorded, not generated).")
@click.option("--n", "n_prompts", default=8000, show_default=True, type=click.IntRange(min=0),
              help="Built-in instruction prompts (0: only the prompts file).")
@click.option("--new-tokens", default=192, show_default=True, help="Answer tokens per prompt (at most).")
@click.option("--batch", default=32, show_default=True, help="Prompts per generation batch (= per shard).")
@click.option("--seed", default=0, show_default=True)
@click.option("--questions", type=click.Path(path_type=Path), default=None,
              help="Benchmark questions to keep out of the data (default: Spec-Bench's, shipped with specdec).")
@click.option("--prompt-set", type=click.Choice(["broad", "basic"]), default="broad", show_default=True,
              help="Built-in prompts: broad (many task families) or basic (the first, narrow set).")
@click.option("--documents", type=click.Path(path_type=Path), default=None,
              help="A distill-data folder whose answers become documents for reading tasks (summaries, passages).")
@click.option("--force", is_flag=True, help="Start over in a folder made with other settings.")
@friendly
def distill_data(model, out_dir, prompts_file, n_prompts, new_tokens, batch, seed, questions, prompt_set, documents,
                 force):
    """Record the target's answers and hidden states for training drafters; rerun the same command to resume."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specdec.export.distill_data import (DistillDataConfig, answers_as_documents, benchmark_texts,
                                             load_prompt_file, plan_prompts, write_distill_data)
    from specdec.export.source import load_source

    cfg = DistillDataConfig(n_prompts=n_prompts, new_tokens=new_tokens, batch=batch, seed=seed, prompt_set=prompt_set)
    extra = load_prompt_file(prompts_file) if prompts_file else []
    source = load_source(model)
    docs = answers_as_documents(documents, source.tokenizer) if documents else []
    prompts = plan_prompts(cfg, extra, benchmark_texts(questions or DEFAULT_QUESTIONS), docs)
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tok_s]:.0f} answer tok/s"), TextColumn("ETA"), TimeRemainingColumn(),
                  console=Console(stderr=True), disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("target answering", total=len(prompts), tok_s=0.0)

        def report(done: int, total: int, tokens: int) -> None:
            progress.update(task, completed=done, tok_s=tokens / max(time.perf_counter() - t0, 1e-9))

        r = write_distill_data(source.model, source.tokenizer, out_dir, cfg, prompts, str(source.path), force=force,
                               progress=report)
    click.echo(f"{out_dir}: {r['shards']} shards for {r['prompts']} prompts; this run wrote "
               f"{r['answer_tokens_this_run']} answer tokens in {r['seconds']:.0f} s")


def _runtime_options(provider: str, threads: int, bundle: Path | None = None):
    from specdec.runtime.session import RuntimeOptions

    trt_cache = None
    if provider == "tensorrt" and bundle is not None:  # engines live in the bundle, as with a --device profile
        from specdec.devices.setup import TRT_CACHE

        trt_cache = str(Path(bundle) / TRT_CACHE)
    return _build(RuntimeOptions, provider=provider, threads=threads, trt_cache_dir=trt_cache)


def _gen_config(max_new_tokens, temperature, top_k, top_p, seed, draft_len, stop, chat=True):
    from specdec import GenerationConfig, SamplingConfig

    sampling = _build(SamplingConfig, temperature=temperature, top_k=top_k, top_p=top_p)
    return _build(GenerationConfig, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                  draft_len=draft_len, stop=tuple(stop), chat=chat)


def generation_options(fn):
    opts = [
        click.option("--max-new-tokens", default=256, show_default=True),
        click.option("--temperature", default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, help="1.0 = off."),
        click.option("--seed", type=int, default=None, help="Seed for sampling."),
        click.option("--draft-len", callback=_parse_draft_len, default=None,
                     help="Drafted tokens per round: K, 'auto', or 0 for plain decoding (default: the bundle's)."),
        click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default=None,
                     help="Override the bundle's drafter (corpus = prompt lookup, then the bundle's corpus of the "
                          "target's own answers; hybrid = lookup (with EAGLE/Medusa heads: the corpus drafter's where the "
                          "bundle has a corpus) where it drafts, the draft model or heads elsewhere; hybrid-tree = "
                          "both as branches of one tree)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--max-len", type=int, default=None, help="KV buffer length in tokens (default: the bundle's)."),
        click.option("--provider", type=click.Choice(["cpu", "cuda", "tensorrt"]), default=None,
                     help="Execution provider (default: cpu, or the --device profile's)."),
        click.option("--device", default=None, metavar="PROFILE",
                     help="Device profile (`specdec devices`): provider, KV length and draft length; "
                          "--provider, --max-len and --draft-len still win."),
        click.option("--threads", default=0, show_default=True, help="Intra-op threads (0 = all cores)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _device_setup(device, bundle, provider, max_len, threads, drafter=None, cfg=None):
    """--device PROFILE: (runtime options, KV length, cfg with the profile's draft length); explicit flags win."""
    if device is None:
        return _runtime_options(provider or "cpu", threads, bundle), max_len, cfg
    import dataclasses

    from specdec.devices.setup import device_setup

    s = device_setup(device, bundle, provider=provider, max_len=max_len, threads=threads, drafter=drafter)
    if cfg is not None and cfg.draft_len is None:
        cfg = dataclasses.replace(cfg, draft_len=s.draft_len)
    click.echo(f"- {s.describe()}", err=True)
    return s.runtime, s.max_len, cfg


def _engine(bundle, drafter, max_len, runtime):
    import specdec

    engine = specdec.load(bundle, drafter=drafter, max_len=max_len, runtime=runtime)
    if engine.drafter is not None and not engine.manifest.graphs["target"].t_invariant:
        click.echo(f"note: {bundle}'s target uses fast kernels whose multi-token steps round differently: "
                   "speculative output may differ from its plain decoding (--draft-len 0 for plain)", err=True)
    return engine


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback by default; another one needs --api-key to be safe).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--max-batch", default=4, show_default=True, type=click.IntRange(min=1),
              help="Requests generated at once (rows of the batched target; a finished row is refilled at once).")
@click.option("--queue", "queue_size", default=64, show_default=True, type=click.IntRange(min=1),
              help="Requests that may wait for a row; beyond that the server answers 429.")
@click.option("--api-key", default=None, envvar="SPECDEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (or set SPECDEC_API_KEY).")
@click.option("--drafter", type=click.Choice(["none", "ngram", "corpus", "model"]), default=None,
              help="The drafter every request uses (default: the bundle's).")
@click.option("--draft-len", callback=_parse_draft_len, default="auto", show_default=True,
              help="Drafted tokens per round: K, 'auto' (one width per round for the whole batch), or 0.")
@click.option("--max-len", type=int, default=None, help="KV buffer length per row (default: the bundle's).")
@click.option("--threads", default=0, show_default=True, help="Intra-op threads (0 = all cores).")
@click.option("--provider", type=click.Choice(["cpu", "cuda", "tensorrt"]), default="cpu", show_default=True)
@click.option("--model-name", default=None, help="The model id clients see (default: the bundle folder's name).")
@friendly
def serve(bundle, host, port, max_batch, queue_size, api_key, drafter, draft_len, max_len, threads, provider,
          model_name):
    """Serve BUNDLE over HTTP: OpenAI's /v1/chat/completions and /v1/completions, a chat page at /."""
    try:
        from specdec.server.app import ServerOptions, serve_bundle
    except ImportError as e:
        raise SpecdecError(f"the server needs its extra ({e.name} is missing)",
                           "pip install 'specdec[serve]'") from None
    options = _build(ServerOptions, model_name=model_name or Path(bundle).resolve().name, queue_size=queue_size,
                     api_key=api_key, draft_len=draft_len)
    serve_bundle(bundle, host, port, max_batch, options, max_len, drafter, _runtime_options(provider, threads, bundle),
                 echo=lambda line: click.echo(line, err=True))


def _stats_line(stats) -> str:
    s = stats.to_dict()
    pos = " ".join(f"{a:.2f}" for a in s["acceptance_by_position"] if a is not None)
    return (f"[{s['new_tokens']} tokens | {s['decode_tok_s']:.1f} tok/s | ttft {1000 * s['ttft_s']:.0f} ms | "
            f"tau {s['tau']:.2f} | accepted {s['accepted']}/{s['drafted']}" + (f" | by position {pos}" if pos else "")
            + "]")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("prompt")
@generation_options
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--system", default=None, help="System prompt.")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Print a stats line after the text.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, finish reason, stats).")
@friendly
def generate(bundle, prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_len, drafter, stop, max_len,
             provider, device, threads, raw, system, stats, as_json):
    """Generate a reply to PROMPT with the bundle, streaming it. PROMPT "-" reads it from stdin."""
    if prompt == "-":
        prompt = sys.stdin.read()
    if system is not None and raw:
        raise SpecdecError("--system goes into the chat template, which --raw turns off", "drop one of them")
    cfg = _gen_config(max_new_tokens, temperature, top_k, top_p, seed, draft_len, stop, chat=not raw)
    runtime, max_len, cfg = _device_setup(device, bundle, provider, max_len, threads, drafter, cfg)
    engine = _engine(bundle, drafter, max_len, runtime)
    if system is not None:
        if not prompt.strip():
            raise SpecdecError("the prompt is empty", "pass some text")
        prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    if as_json:
        g = engine.generate(prompt, cfg)
        click.echo(json.dumps({"text": g.text, "finish_reason": g.finish_reason, "stats": g.stats.to_dict()}))
        return
    for piece in engine.stream(prompt, cfg):
        click.echo(piece, nl=False)
    click.echo()
    if stats:
        click.echo(_stats_line(engine.last_stats), err=True)


BLOCK_MARK = '"""'  # around a chat message of several lines (a pasted document), as ollama's CLI takes them


def _read_block(first: str) -> str:
    """The lines of a chat message from after its opening mark (`first`: the rest of that line) to its closing one."""
    lines = []
    line = first
    while not line.rstrip().endswith(BLOCK_MARK):
        lines.append(line)
        line = input("... ")
    lines.append(line.rstrip()[:-len(BLOCK_MARK)])
    return "\n".join(lines).strip("\n")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@generation_options
@click.option("--system", default=None, help="System prompt.")
@friendly
def chat(bundle, max_new_tokens, temperature, top_k, top_p, seed, draft_len, drafter, stop, max_len, provider,
         device, threads, system):
    """Chat with the bundle. /reset clears the conversation, /exit quits; Ctrl-C stops an answer; \"\"\" starts
    and ends a message of several lines. A conversation that outgrows the KV buffer loses its earliest exchanges
    (the system prompt stays)."""
    cfg = _gen_config(max_new_tokens, temperature, top_k, top_p, seed, draft_len, stop)
    runtime, max_len, cfg = _device_setup(device, bundle, provider, max_len, threads, drafter, cfg)
    engine = _engine(bundle, drafter, max_len, runtime)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    click.echo('specdec chat: /reset clears the conversation, /exit quits, Ctrl-C stops an answer; """ starts and '
               'ends a message of several lines.', err=True)
    while True:
        try:
            line = input("> ")
            if line.lstrip().startswith(BLOCK_MARK):
                line = _read_block(line.lstrip()[len(BLOCK_MARK):])
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = list(base)
            engine.reset()
            click.echo("(conversation cleared)", err=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        try:
            messages, dropped = engine.fit_conversation(messages, cfg.max_new_tokens)
            if dropped:
                which = "earliest exchange" if dropped == 1 else f"{dropped} earliest exchanges"
                click.echo(f"(the {which} left the conversation: it outgrew the {engine.max_len}-token KV buffer; "
                           "--max-len raises it)", err=True)
            for piece in engine.stream(messages, cfg):
                reply += piece
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            click.echo(" [stopped]", nl=False)
        except SpecdecError as e:  # e.g. the conversation outgrew the KV buffer: keep the session
            messages.pop()
            click.echo(f"\nerror: {e}", err=True)
            continue
        click.echo()
        click.echo(_stats_line(engine.last_stats), err=True)
        messages.append({"role": "assistant", "content": reply})


@main.command()
@click.option("--bundle", type=click.Path(path_type=Path), default=None,
              help="Also show the memory arithmetic (weights + KV + workspace) for this bundle on every profile.")
@click.option("--notes", is_flag=True, help="Also print the reason behind each profile's numbers.")
@friendly
def devices(bundle, notes):
    """List device profiles, detect this machine and suggest one."""
    from specdec.devices.report import render

    click.echo(render(bundle, notes=notes))


@main.command()
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
        with _stage_progress() as step:
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
    _note_int8_weight_only(precision, fast_kernels)


@main.command("build-engines")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--device", default=None, metavar="PROFILE",
              help="GPU profile: TensorRT options and KV length (default: the one `specdec devices` suggests).")
@click.option("--max-len", type=int, default=None, help="KV buffer length in tokens (default: the profile's).")
@click.option("--rebuild", is_flag=True, help="Delete BUNDLE/trt_cache first (engines of another GPU or TensorRT).")
@friendly
def build_engines_cmd(bundle, device, max_len, rebuild):
    """Build BUNDLE's TensorRT engines on this GPU into BUNDLE/trt_cache and record what built them.

    Engines are tied to one GPU model and TensorRT version: build them on the device that runs the bundle.
    Without this, the first TensorRT run builds them (minutes).
    """
    from specdec.devices.setup import TRT_CACHE, build_engines

    t0 = time.perf_counter()
    record = build_engines(bundle, device=device, max_len=max_len, rebuild=rebuild)
    click.echo(f"TensorRT engines for {', '.join(record.graphs)} in {Path(bundle) / TRT_CACHE} "
               f"({record.builder.describe()}) in {time.perf_counter() - t0:.0f} s")


def _spec_bench_prompts(questions: Path | None, limit: int) -> list:
    """The questions of a Spec-Bench JSONL (default: the copy shipped with specdec), `limit` per category (0: all)."""
    from specdec.spec_bench import load_spec_bench

    questions = questions or DEFAULT_QUESTIONS
    if not questions.is_file():
        raise SpecdecError(f"questions file {questions} not found", "pass --questions PATH")
    try:
        prompts = load_spec_bench(questions, limit_per_category=limit or None)
    except ValueError as e:
        raise SpecdecError(str(e), "pass a Spec-Bench question.jsonl") from None
    if not prompts:
        raise SpecdecError(f"{questions} holds no questions", "pass a Spec-Bench question.jsonl")
    return prompts


@main.command("quant-report")
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

    prompts = [p.messages for p in _spec_bench_prompts(questions, limit)]
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


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--questions", type=click.Path(path_type=Path), default=None,
              help="Spec-Bench questions JSONL (default: the copy shipped with specdec).")
@click.option("--limit", type=click.IntRange(min=0), default=2, show_default=True, help="Questions per category (0 = all).")
@click.option("--configs", default="ngram:4,corpus:auto,model:4", show_default=True,
              help="Comma-separated DRAFTER:K runs beside plain decoding (K an integer or auto); those the bundle "
                   "cannot run are skipped with a note.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--max-len", type=int, default=None, help="KV buffer length in tokens.")
@click.option("--device", default=None, metavar="PROFILE", help="Device profile (`specdec devices`): provider and KV length.")
@click.option("--threads", default=0, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy (outputs compared token for token).")
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Sampling seed, the same for every config.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write results as JSON (and a PNG beside it).")
@friendly
def bench(bundle, questions, limit, configs, max_new_tokens, max_len, device, threads, temperature, top_k, top_p, seed,
          out):
    """Speed-up of speculative over plain decoding on Spec-Bench, measured side by side."""
    import specdec
    from rich.console import Console
    from rich.progress import Progress

    from specdec.benchmark import BenchConfig, plot, render_table, run_bench
    from specdec.runtime.sampling import SamplingConfig

    sampling = _build(SamplingConfig, temperature=temperature, top_k=top_k, top_p=top_p)
    questions = questions or DEFAULT_QUESTIONS
    prompts = _spec_bench_prompts(questions, limit)
    runtime, max_len, _ = _device_setup(device, bundle, None, max_len, threads, drafter="model")
    engine = specdec.load(bundle, max_len=max_len, runtime=runtime)
    wanted = [BenchConfig.parse(c.strip()) for c in configs.split(",") if c.strip()]
    kind = engine.manifest.drafter.kind
    unusable = {"model": kind != "model", "hybrid": kind not in ("model", "eagle", "medusa"),
                "hybrid-tree": kind not in ("eagle", "medusa"), "eagle": kind != "eagle",
                "eagle-tree": kind != "eagle", "medusa": kind != "medusa", "medusa-tree": kind != "medusa",
                "layerskip": kind != "layerskip", "corpus": engine.manifest.drafter.corpus is None}
    skipped = [c.name for c in wanted if unusable.get(c.drafter, False)]
    wanted = [c for c in wanted if not unusable.get(c.drafter, False)]
    if skipped:
        click.echo(f"note: bundle's drafter is {kind}" + (", without a corpus" if engine.manifest.drafter.corpus is None
                                                           else "") + f"; skipping {', '.join(skipped)}", err=True)
    with Progress(disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("benchmarking", total=len(prompts) * (len(wanted) + 1))
        result = run_bench(engine, prompts, wanted, max_new_tokens, on_step=lambda: progress.advance(task),
                           sampling=sampling, seed=seed)
    result["settings"] = {"bundle": str(bundle), "questions": str(questions), "limit_per_category": limit,
                          "max_new_tokens": max_new_tokens, "threads": threads or None, "seed": seed}
    Console().print(render_table(result))
    click.echo(f"peak RSS {result['peak_rss_mb']:.0f} MB")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        png = out.with_suffix(".png")
        click.echo(f"wrote {out}" + (f" and {png}" if plot(result, str(png)) else " (no plot: matplotlib missing)"))


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("input_path", metavar="IN", type=click.Path(path_type=Path))
@click.argument("output", metavar="OUT", type=click.Path(path_type=Path))
@click.option("--errors", "errors_path", type=click.Path(path_type=Path), default=None,
              help="Where bad lines are reported (default: OUT.errors.jsonl; rewritten by every run).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Sequences decoded at once; 1 = one request after another (default: 8, measured on a 2-core CPU).")
@click.option("--draft-len", callback=_parse_draft_len, default=None,
              help="Drafted tokens per round: K, 'auto' (default: one width per round from measured step costs), "
                   "or 0 for plain decoding.")
@click.option("--drafter", type=click.Choice(["none", "ngram", "corpus", "model", "hybrid"]), default=None,
              help="Override the bundle's drafter (batch size > 1: none, ngram, corpus or model).")
@click.option("--max-new-tokens", default=256, show_default=True, help="Default for lines that do not set it.")
@click.option("--max-len", type=int, default=None, help="KV buffer length in tokens (default: the bundle's).")
@click.option("--threads", default=0, show_default=True,
              help="Intra-op threads (0 = all cores; with --ray: per worker, and the CPUs each worker takes, 0 = 1).")
@click.option("--force", is_flag=True, help="Add to an output written with another bundle or other settings.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Generate on a Ray cluster (one worker per CPU slot); needs pip install 'specdec[ray]'.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="Ray cluster to join (auto, or HEAD_IP:6379); default: $RAY_ADDRESS, else a new local cluster.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Ray workers (default: one per CPU slot of the cluster, CPUs // --threads).")
@friendly
def batch(bundle, input_path, output, errors_path, batch_size, draft_len, drafter, max_new_tokens, max_len, threads,
          force, use_ray, ray_address, workers):
    """Generate for every line of IN (JSONL: id + prompt or messages) into OUT; rerun to resume.

    Each output line is {"id", "text", "finish_reason", "stats"}, appended whole as each request finishes.
    Ids already in OUT are skipped, so rerunning the same command after a crash or Ctrl-C resumes it. Bad
    lines go to the errors file and the job goes on; once every good line is written it exits 1, naming the
    first bad line. With --ray the
    generation runs on Ray workers (the bundle must be at the same path on every node); this process still
    reads the input and writes every line, so the output and resuming are the same as without it.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specdec.batch import DEFAULT_BATCH_SIZE, DEFAULT_DRAFT_LEN, BatchJob

    if (ray_address is not None or workers is not None) and not use_ray:
        raise SpecdecError("--ray-address and --workers apply to Ray runs only", "add --ray")
    ray_opts = None
    if use_ray:
        from specdec.scaleout import RayOptions, import_ray

        import_ray()  # a missing Ray is one line now, not after the input has been read
        ray_opts = _build(RayOptions, address=ray_address, workers=workers)
    job = BatchJob(bundle, input_path, output, errors_path, batch_size=batch_size or DEFAULT_BATCH_SIZE,
                   drafter=drafter, draft_len=DEFAULT_DRAFT_LEN if draft_len is None else draft_len,
                   max_new_tokens=max_new_tokens, max_len=max_len,
                   runtime=_runtime_options("cpu", threads), force=force, ray=ray_opts)
    c = job.counts
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tok_s]:.1f} tok/s"), TextColumn("ETA"), TimeRemainingColumn(),
                  console=Console(stderr=True), disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("generating", total=None, tok_s=0.0)
        try:
            job.run(on_start=lambda n: progress.update(task, total=n),
                    on_record=lambda rec, c: progress.update(task, advance=1, tok_s=c.tokens / max(c.elapsed_s, 1e-9)))
        except KeyboardInterrupt:
            progress.stop()
            click.echo(f"\ninterrupted: {c.done} of {c.total} requests done ({c.written} this run), nothing half "
                       f"written; rerun the same command to resume", err=True)
            sys.exit(130)
    note = f"; dropped a partial last line ({c.cut_partial} bytes) and redid it" if c.cut_partial else ""
    errors = f"; {c.errors} error{'s' if c.errors != 1 else ''} (see {job.errors_path})" if c.errors else "; 0 errors"
    click.echo(f"done: {c.done} of {c.total} requests in {output} ({c.written} this run, {c.done_before} already "
               f"there), {c.tokens} tokens in {c.elapsed_s:.1f} s ({c.tokens / max(c.elapsed_s, 1e-9):.1f} tok/s)"
               f"{errors}{note}")
    if c.errors:
        more = f" and {c.errors - 1} more" if c.errors > 1 else ""
        click.echo(f"error: {c.first_error}{more} (all in {job.errors_path}); fix them in {input_path} and rerun "
                   f"the same command: finished ids are skipped", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
