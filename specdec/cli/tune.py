"""This device's choices and guarantees: `tune` (the fastest lossless drafter, kept in the bundle) and `verify`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specdec.cli.common import device_runtime, friendly


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path), default=None,
              help="JSONL of your own prompts ({\"prompt\": ...} or {\"messages\": [...]} per line); "
                   "default: specdec's own prompt families (never benchmark questions).")
@click.option("--minutes", default=3.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Time budget; the race stops between prompts when the next one would not fit.")
@click.option("--new-tokens", default=96, show_default=True, type=click.IntRange(min=8),
              help="New tokens per prompt.")
@click.option("--sampled", is_flag=True, help="Tune for sampled generation (temperature 0.7, top-p 0.95).")
@click.option("--dry-run", is_flag=True, help="Measure and print, record nothing.")
@click.option("--device", default=None, metavar="PROFILE", help="Device profile (`specdec devices`).")
@click.option("--threads", default=0, show_default=True, help="Intra-op threads (0 = all cores).")
@click.option("--max-len", type=int, default=None, help="KV buffer length (default: the bundle's).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Also write the measurements as JSON (and a PNG beside it when matplotlib is installed).")
@friendly
def tune(bundle, prompts_path, minutes, new_tokens, sampled, dry_run, device, threads, max_len, out):
    """Find the fastest lossless drafter for BUNDLE on this device and make it the bundle's default here."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    from specdec.runtime.engine import Engine
    from specdec.runtime.tuned import write_tuned
    from specdec.tune import (DROP_BELOW, SAMPLED, candidate_configs, default_prompts, engine_measure, plot, read_prompts,
                              render_table, run_tune)
    from specdec.runtime.sampling import SamplingConfig

    prompts = read_prompts(prompts_path) if prompts_path else default_prompts()
    runtime, max_len, _ = device_runtime(device, bundle, None, max_len, threads, drafter="model")
    engine = Engine(bundle, max_len=max_len, runtime=runtime, drafter="none")
    configs = candidate_configs(engine.manifest)
    sampling = SAMPLED if sampled else SamplingConfig()
    click.echo(f"- {len(configs)} configurations ({', '.join(c.name for c in configs)}), up to {len(prompts)} "
               f"prompts, {minutes:g} min", err=True)
    with Progress("{task.description}", BarColumn(), "{task.completed}/{task.total} prompts", TimeElapsedColumn(),
                  TimeRemainingColumn(), disable=not sys.stderr.isatty(), console=Console(stderr=True)) as progress:
        task = progress.add_task("tuning", total=len(prompts))
        result = run_tune(configs, prompts, engine_measure(engine, new_tokens, sampling), 60 * minutes,
                          greedy=sampling.greedy, on_prompt=lambda done, total: progress.update(task, completed=done))
    mode = "sampled" if sampled else "greedy"
    Console().print(render_table(result, f"specdec tune ({mode}, {new_tokens} new tokens, {result.prompts} prompts, "
                                         f"{result.seconds:.0f} s; dropped below {DROP_BELOW:.0%} of the best)"))
    choice = result.choice(sampled)
    if dry_run:
        click.echo(f"winner: {result.winner.config.name} ({choice.speedup:.2f}x plain); --dry-run: nothing recorded")
    else:
        path = write_tuned(bundle, engine.manifest, runtime, choice)
        click.echo(f"winner: {result.winner.config.name} ({choice.speedup:.2f}x plain), recorded in {path} as this "
                   "machine's default (generate, chat, batch, bench and serve use it when no drafter is named)")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"bundle": str(bundle), "mode": mode, "new_tokens": new_tokens,
                                   **result.to_dict()}, indent=1))
        png = out.with_suffix(".png")
        click.echo(f"wrote {out}" + (f" and {png}" if plot(result, png) else " (no plot: matplotlib missing)"))


COMMANDS = [tune]
