"""What the commands share: one-line errors, validated configs, progress lines, the generation options and
loading an engine from them. Imports nothing heavy at module level: `specdec --help` stays fast."""
from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import click

from specdec.errors import SpecdecError
from specdec.runtime.drafters import DRAFTER_CHOICES


def fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def friendly(fn):
    """Turn input errors and Ctrl-C into one line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecdecError as e:
            fail(str(e))
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except MemoryError:
            fail("out of memory: try a smaller --max-len or a quantized bundle")

    return wrapper


def build_config(cls, **kwargs):
    """Construct a validated config; its ValueError is the user's input error."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise SpecdecError(str(e)) from None


def parse_draft_len(ctx, param, value):
    if value is None or value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise click.BadParameter("must be an integer >= 0 or 'auto'") from None
    if k < 0:
        raise click.BadParameter("must be >= 0 (0 = no speculation)")
    return k


# onnxruntime has no fast CPU kernel for 8-bit weights with fp32 activations (MatMulNBits dequantizes them every
# step): a 1-token step of the default model took 424 ms against 19 ms in fp32 (bench/results/quant/int8.json).
# Said where such a bundle is written, not found later.
INT8_WEIGHT_ONLY_NOTE = ("note: int8 weights with fp32 activations have no fast CPU kernel in onnxruntime (a step "
                         "runs ~10x slower than fp32 on a CPU); for a CPU, use --fast-kernels (int8 activations, "
                         "lossless under speculation), or keep this bundle for a GPU")


def note_int8_weight_only(precision: str, fast_kernels: bool) -> None:
    if precision == "int8" and not fast_kernels:
        click.echo(INT8_WEIGHT_ONLY_NOTE, err=True)


@contextlib.contextmanager
def stage_progress():
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


def runtime_options(provider: str, threads: int, bundle: Path | None = None):
    from specdec.runtime.session import RuntimeOptions

    trt_cache = None
    if provider == "tensorrt" and bundle is not None:  # engines live in the bundle, as with a --device profile
        from specdec.devices.setup import TRT_CACHE

        trt_cache = str(Path(bundle) / TRT_CACHE)
    return build_config(RuntimeOptions, provider=provider, threads=threads, trt_cache_dir=trt_cache)


def generation_config(max_new_tokens, temperature, top_k, top_p, seed, draft_len, stop, chat=True):
    from specdec import GenerationConfig, SamplingConfig

    sampling = build_config(SamplingConfig, temperature=temperature, top_k=top_k, top_p=top_p)
    return build_config(GenerationConfig, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                  draft_len=draft_len, stop=tuple(stop), chat=chat)


def generation_options(fn):
    opts = [
        click.option("--max-new-tokens", default=256, show_default=True),
        click.option("--temperature", default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, help="1.0 = off."),
        click.option("--seed", type=int, default=None, help="Seed for sampling."),
        click.option("--draft-len", callback=parse_draft_len, default=None,
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


def device_runtime(device, bundle, provider, max_len, threads, drafter=None, cfg=None):
    """--device PROFILE: (runtime options, KV length, cfg with the profile's draft length); explicit flags win."""
    if device is None:
        return runtime_options(provider or "cpu", threads, bundle), max_len, cfg
    import dataclasses

    from specdec.devices.setup import device_setup

    s = device_setup(device, bundle, provider=provider, max_len=max_len, threads=threads, drafter=drafter)
    if cfg is not None and cfg.draft_len is None:
        cfg = dataclasses.replace(cfg, draft_len=s.draft_len)
    click.echo(f"- {s.describe()}", err=True)
    return s.runtime, s.max_len, cfg


def load_engine(bundle, drafter, max_len, runtime):
    import specdec

    engine = specdec.load(bundle, drafter=drafter, max_len=max_len, runtime=runtime)
    if engine.drafter is not None and not engine.manifest.graphs["target"].t_invariant:
        click.echo(f"note: {bundle}'s target uses fast kernels whose multi-token steps round differently: "
                   "speculative output may differ from its plain decoding (--draft-len 0 for plain)", err=True)
    return engine


def stats_line(stats) -> str:
    s = stats.to_dict()
    pos = " ".join(f"{a:.2f}" for a in s["acceptance_by_position"] if a is not None)
    return (f"[{s['new_tokens']} tokens | {s['decode_tok_s']:.1f} tok/s | ttft {1000 * s['ttft_s']:.0f} ms | "
            f"tau {s['tau']:.2f} | accepted {s['accepted']}/{s['drafted']}" + (f" | by position {pos}" if pos else "")
            + "]")
