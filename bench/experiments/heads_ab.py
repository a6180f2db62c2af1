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
from pathlib import Path

import numpy as np
from side_by_side import bench_arguments, report, run_side_by_side

import specdec
from specdec.runtime.decoder import Decoder
from specdec.runtime.drafters.eagle import EagleHead
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import read_manifest

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
    bench_arguments(ap, configs="eagle:4,eagle-tree:auto,hybrid-tree:auto")
    args = ap.parse_args()

    engine = specdec.load(args.bundle)
    head_b = other_head(engine, args.other)

    def with_head_b(kind: str):
        own, engine._eagle_head = engine._eagle_head, head_b
        try:
            return engine._make_drafter(kind)
        finally:
            engine._eagle_head = own

    result, _ = run_side_by_side(engine, args, OTHER, with_head_b)
    result["heads"] = {"A": str(args.bundle), "B": str(args.other)}
    report(result, args.out)


if __name__ == "__main__":
    main()
