"""Making drafters: `train-drafter`, `distill-data` (the target's answers to train on) and `corpus`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from specdec.cli.common import friendly, stage_progress
from specdec.errors import SpecdecError
from specdec.spec_bench import DEFAULT_QUESTIONS


@click.command("train-drafter")
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
    with stage_progress() as step:
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


@click.command("corpus")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), multiple=True,
              help="A distill-data folder whose answers go into the corpus (repeat for several).")
@click.option("--answers", type=click.Path(path_type=Path), multiple=True,
              help="An output file of `specdec batch` run on this bundle: its answers go into the corpus (repeat for "
                   "several).")
@click.option("--keep", is_flag=True, help="Keep the bundle's corpus (e.g. the shipped one) and add the data to it.")
@friendly
def corpus_cmd(bundle, data, answers, keep):
    """Add a corpus of the target's own answers to BUNDLE: the "corpus" drafter (its default where the bundle's
    drafter is ngram) continues the context as those answers did wherever prompt lookup finds nothing."""
    from specdec.export.corpus import add_corpus

    if not data and not answers:
        raise click.UsageError("give the answers: --answers OUT.jsonl (from `specdec batch`) or --data DIR "
                               "(from `specdec distill-data`)")
    t0 = time.perf_counter()
    r = add_corpus(bundle, list(data), keep=keep, answers=list(answers))
    click.echo(f"{bundle}: corpus of {r['tokens']} tokens ({r['texts']} answers, {r['bytes'] / 1e6:.1f} MB, "
               f"matches up to {r['max_ngram']} tokens) in {time.perf_counter() - t0:.0f} s; "
               f"use it: specdec generate {bundle} --drafter corpus \"...\"")


@click.command("distill-data")
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


COMMANDS = (train_drafter, corpus_cmd, distill_data)
