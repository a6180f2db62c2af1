"""Running a bundle: `generate`, `chat`, `bench` (Spec-Bench speed-up) and `batch` (JSONL in, JSONL out)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specdec.cli.common import (build_config, device_runtime, friendly, generation_config, generation_options, load_engine,
                                parse_draft_len, runtime_options, stats_line)
from specdec.errors import SpecdecError
from specdec.spec_bench import DEFAULT_QUESTIONS, questions_as_prompts


@click.command()
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
    cfg = generation_config(max_new_tokens, temperature, top_k, top_p, seed, draft_len, stop, chat=not raw)
    runtime, max_len, cfg = device_runtime(device, bundle, provider, max_len, threads, drafter, cfg)
    engine = load_engine(bundle, drafter, max_len, runtime)
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
        click.echo(stats_line(engine.last_stats), err=True)


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


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@generation_options
@click.option("--system", default=None, help="System prompt.")
@friendly
def chat(bundle, max_new_tokens, temperature, top_k, top_p, seed, draft_len, drafter, stop, max_len, provider,
         device, threads, system):
    """Chat with the bundle. /reset clears the conversation, /exit quits; Ctrl-C stops an answer; \"\"\" starts
    and ends a message of several lines. A conversation that outgrows the KV buffer loses its earliest exchanges
    (the system prompt stays)."""
    cfg = generation_config(max_new_tokens, temperature, top_k, top_p, seed, draft_len, stop)
    runtime, max_len, cfg = device_runtime(device, bundle, provider, max_len, threads, drafter, cfg)
    engine = load_engine(bundle, drafter, max_len, runtime)
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
        click.echo(stats_line(engine.last_stats), err=True)
        messages.append({"role": "assistant", "content": reply})


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--questions", type=click.Path(path_type=Path), default=None,
              help="Spec-Bench questions JSONL (default: the copy shipped with specdec).")
@click.option("--limit", type=click.IntRange(min=0), default=2, show_default=True, help="Questions per category (0 = all).")
@click.option("--configs", default="ngram:4,corpus:auto,model:4,tuned", show_default=True,
              help="Comma-separated DRAFTER:K runs beside plain decoding (K an integer or auto); `tuned` is what "
                   "`specdec tune` recorded for this machine. Those the bundle cannot run are skipped with a note.")
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

    from specdec.benchmark import BenchConfig, plot, render_table, run_bench, runnable_configs
    from specdec.runtime.tuned import read_tuned
    from specdec.runtime.sampling import SamplingConfig

    sampling = build_config(SamplingConfig, temperature=temperature, top_k=top_k, top_p=top_p)
    questions = questions or DEFAULT_QUESTIONS
    prompts = questions_as_prompts(questions, limit)
    runtime, max_len, _ = device_runtime(device, bundle, None, max_len, threads, drafter="model")
    engine = specdec.load(bundle, max_len=max_len, runtime=runtime)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    if "tuned" in names:  # the tuned choice under its own name, once
        tuned = engine.tuned or read_tuned(engine.path, engine.manifest, engine.runtime)
        if tuned is None:
            click.echo("note: no `specdec tune` record for this machine; skipping tuned", err=True)
        names = [(f"{tuned.drafter}:{tuned.draft_len}" if tuned.drafter != "none" else "plain") if n == "tuned"
                 else n for n in names if n != "tuned" or tuned is not None]
    wanted = list(dict.fromkeys(BenchConfig.parse(n) for n in names))
    wanted, skipped = runnable_configs(engine.manifest.drafter, wanted)
    if skipped:
        kind = engine.manifest.drafter.kind
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


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("input_path", metavar="IN", type=click.Path(path_type=Path))
@click.argument("output", metavar="OUT", type=click.Path(path_type=Path))
@click.option("--errors", "errors_path", type=click.Path(path_type=Path), default=None,
              help="Where bad lines are reported (default: OUT.errors.jsonl; rewritten by every run).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Sequences decoded at once; 1 = one request after another (default: 8, measured on a 2-core CPU).")
@click.option("--draft-len", callback=parse_draft_len, default=None,
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
        ray_opts = build_config(RayOptions, address=ray_address, workers=workers)
    job = BatchJob(bundle, input_path, output, errors_path, batch_size=batch_size or DEFAULT_BATCH_SIZE,
                   drafter=drafter, draft_len=DEFAULT_DRAFT_LEN if draft_len is None else draft_len,
                   max_new_tokens=max_new_tokens, max_len=max_len,
                   runtime=runtime_options("cpu", threads), force=force, ray=ray_opts)
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


COMMANDS = (generate, chat, bench, batch)
