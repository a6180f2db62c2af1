"""Two EAGLE heads for the same target side by side in one `specdec bench` run: every config once with BUNDLE's
head and once with OTHER's (suffix "-B"), on the same target session, prompt by prompt, so that load on the
machine hits both alike. Greedy, so each run is also compared token for token with plain decoding.

    .venv/bin/python bench/experiments/heads_ab.py BUNDLE OTHER --limit 2 \\
        --configs eagle:4,eagle-tree:auto,hybrid-tree:auto --out bench/results/heads_ab.json

OTHER must be an export of the same target (`specdec export --drafter eagle --heads FILE`); only its head graph
and draft vocabulary are read.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import specdec
from specdec.benchmark import BenchConfig, render_table, run_bench
from specdec.runtime.decoder import Decoder
from specdec.runtime.drafters.eagle import EagleHead
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import read_manifest
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

OTHER = "-B"  # suffix of the configs that draft with OTHER's head


def other_head(engine, other: Path) -> EagleHead:
    m = read_manifest(other)
    if m.drafter.kind != "eagle":
        raise SystemExit(f"{other} has no EAGLE head")
    if m.model != engine.manifest.model:
        raise SystemExit(f"{other} was exported from another target")
    g = m.graphs[m.drafter.graph]
    kv = KVCache.for_graph(g, 1, engine.max_len, device=engine.runtime.device, device_id=engine.runtime.device_id)
    return EagleHead(Decoder(other / g.file, g, g.model, kv, engine.runtime), np.load(other / m.drafter.draft_vocab))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("other", type=Path)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--limit", type=int, default=2, help="questions per category")
    ap.add_argument("--configs", default="eagle:4,eagle-tree:auto,hybrid-tree:auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    engine = specdec.load(args.bundle)
    head_b = other_head(engine, args.other)
    configs = []
    for text in args.configs.split(","):
        cfg = BenchConfig.parse(text)
        engine.use_drafter(cfg.drafter)  # builds (and keeps) the drafter with the bundle's own head
        own, engine._eagle_head = engine._eagle_head, head_b
        engine._drafters[cfg.drafter + OTHER] = engine._make_drafter(cfg.drafter)
        engine._eagle_head = own
        configs += [cfg, BenchConfig(cfg.drafter + OTHER, cfg.draft_len)]
    prompts = load_spec_bench(args.questions, limit_per_category=args.limit or None)
    result = run_bench(engine, prompts, configs, args.max_new_tokens)
    result["heads"] = {"A": str(args.bundle), "B": str(args.other)}
    from rich.console import Console
    Console().print(render_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
