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

    from specdec.benchmark import BenchConfig
    from specdec.runtime.engine import Engine, default_drafter
    from specdec.runtime.tuned import write_tuned
    from specdec.tune import (DROP_BELOW, MARGIN, SAMPLED, candidate_configs, default_prompts, engine_measure, plot, read_prompts,
                              render_table, run_tune)
    from specdec.runtime.sampling import SamplingConfig

    prompts = read_prompts(prompts_path) if prompts_path else default_prompts()
    runtime, max_len, _ = device_runtime(device, bundle, None, max_len, threads, drafter="model")
    engine = Engine(bundle, max_len=max_len, runtime=runtime, drafter="none")
    configs = candidate_configs(engine.manifest)
    m = engine.manifest
    incumbent = BenchConfig(default_drafter(m), m.drafter.draft_len if default_drafter(m) != "none" else 0)
    if incumbent not in configs:  # the bundle's own default races too, at its own draft length
        configs.append(incumbent)
    sampling = SAMPLED if sampled else SamplingConfig()
    click.echo(f"- {len(configs)} configurations ({', '.join(c.name for c in configs)}), up to {len(prompts)} "
               f"prompts, {minutes:g} min", err=True)
    with Progress("{task.description}", BarColumn(), "{task.completed}/{task.total} prompts", TimeElapsedColumn(),
                  TimeRemainingColumn(), disable=not sys.stderr.isatty(), console=Console(stderr=True)) as progress:
        task = progress.add_task("tuning", total=len(prompts))
        result = run_tune(configs, prompts, engine_measure(engine, new_tokens, sampling), 60 * minutes,
                          greedy=sampling.greedy, on_prompt=lambda done, total: progress.update(task, completed=done),
                          incumbent=incumbent)
    mode = "sampled" if sampled else "greedy"
    Console().print(render_table(result, f"specdec tune ({mode}, {new_tokens} new tokens, {result.prompts} prompts, "
                                         f"{result.seconds:.0f} s; dropped below {DROP_BELOW:.0%} of the best; the bundle's "
                                         f"default {incumbent.name} kept unless beaten by {MARGIN:.0%})"))
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


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--drafters", default="all", show_default=True,
              help="Drafters to check: all (every one the bundle can run) or a comma-separated list.")
@click.option("--prompts", "n_prompts", default=8, show_default=True, type=click.IntRange(min=1),
              help="Prompts (specdec's own) for the greedy identity check.")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=4),
              help="New tokens per greedy answer.")
@click.option("--samples", default=600, show_default=True, type=click.IntRange(min=0),
              help="Seeded answers per drafter for the sampled check (0 skips it).")
@click.option("--temperature", default=0.6, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Sampling temperature of the sampled check (a flatter law needs more --samples).")
@click.option("--device", default=None, metavar="PROFILE", help="Device profile (`specdec devices`).")
@click.option("--threads", default=0, show_default=True, help="Intra-op threads (0 = all cores).")
@click.option("--max-len", type=int, default=None, help="KV buffer length (default: the bundle's).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the report as JSON.")
@friendly
def verify(bundle, drafters, n_prompts, new_tokens, samples, temperature, device, threads, max_len, json_path):
    """Check on this device that BUNDLE's speculation is lossless; exit 1 on any failure."""
    import time

    from rich.console import Console
    from rich.table import Table

    from specdec.errors import SpecdecError
    from specdec.runtime.engine import Engine, GenerationConfig
    from specdec.runtime.sampling import SamplingConfig
    from specdec.tune import default_prompts
    from specdec.verify import (default_widths, greedy_identity, runnable_drafters, sampled_lossless,
                                t_invariance)

    t0 = time.perf_counter()
    runtime, max_len, _ = device_runtime(device, bundle, None, max_len, threads, drafter="model")
    engine = Engine(bundle, max_len=max_len, runtime=runtime, drafter="none")
    can = runnable_drafters(engine)
    if drafters == "all":
        chosen = can
    else:
        chosen = [d.strip() for d in drafters.split(",") if d.strip()]
        cannot = [d for d in chosen if d not in can]
        if cannot:
            raise SpecdecError(f"bundle {bundle} cannot run drafter{'s' if len(cannot) > 1 else ''} "
                               f"{', '.join(cannot)}", f"it can run: {', '.join(can) or 'none'}")
    prompts = default_prompts(n_prompts, seed=1)
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    echo(f"- greedy identity: {len(chosen)} drafters x {n_prompts} prompts x {new_tokens} tokens")
    checks = greedy_identity(engine, chosen, prompts, new_tokens)
    engine.use_drafter("none")
    engine.reset()
    context = engine.encode(prompts[0])
    context += [t for chunk in engine.stream_ids(context, GenerationConfig(max_new_tokens=24, draft_len=0))
                for t in chunk]
    echo(f"- T-invariance: step widths {default_widths()[0]}..{default_widths()[-1]}")
    checks += t_invariance(engine, context[: engine.max_len - 1], default_widths())
    if samples:
        echo(f"- sampled: {samples} seeded answers per drafter at temperature {temperature:g} against the target's "
             "exact law")
        checks += sampled_lossless(engine, chosen, samples, SamplingConfig(temperature=temperature))
    table = Table(title=f"specdec verify {bundle} ({runtime.provider}, {time.perf_counter() - t0:.0f} s)")
    for col in ("check", "subject", "result", "detail"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.kind, c.subject, "pass" if c.passed else "FAIL", c.detail)
    Console().print(table)
    failed = [c for c in checks if not c.passed]
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"bundle": str(bundle), "provider": runtime.provider,
                                         "seconds": round(time.perf_counter() - t0, 1), "passed": not failed,
                                         "checks": [c.to_dict() for c in checks]}, indent=1))
    if failed:
        click.echo(f"error: {len(failed)} check{'s' if len(failed) > 1 else ''} failed: "
                   + "; ".join(f"{c.kind} {c.subject}" for c in failed), err=True)
        sys.exit(1)
    click.echo(f"all {len(checks)} checks passed")


COMMANDS = [tune, verify]
