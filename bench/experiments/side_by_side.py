"""What the A/B experiments share: each bench config runs once as the bundle has it and once as a variant drafter
(registered on the same engine under a suffix), prompt by prompt in one `specdec bench` run, so that load on the
machine hits both alike; greedy runs are also compared token for token with plain decoding."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from specdec.benchmark import BenchConfig, render_table, run_bench
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench


def bench_arguments(ap: argparse.ArgumentParser, configs: str) -> None:
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--limit", type=int, default=2, help="questions per category (0: all)")
    ap.add_argument("--configs", default=configs)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)


def run_side_by_side(engine, args: argparse.Namespace, suffix: str,
                     variant: Callable[[str], object]) -> tuple[dict, list[BenchConfig]]:
    """`variant(drafter_kind)`: the other drafter of that kind, registered as kind + suffix. Returns the bench
    result and the configs run (each as the bundle has it, then its variant)."""
    configs = []
    for text in args.configs.split(","):
        cfg = BenchConfig.parse(text)
        engine.use_drafter(cfg.drafter)  # builds (and keeps) the drafter as the bundle has it
        engine._drafters[cfg.drafter + suffix] = variant(cfg.drafter)
        configs += [cfg, BenchConfig(cfg.drafter + suffix, cfg.draft_len)]
    prompts = load_spec_bench(args.questions, limit_per_category=args.limit or None)
    return run_bench(engine, prompts, configs, args.max_new_tokens), configs


def report(result: dict, out: Path | None) -> None:
    from rich.console import Console

    Console().print(render_table(result))
    if out:
        out.write_text(json.dumps(result, indent=1))
