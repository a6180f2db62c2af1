"""Prefill time (= time to the first token) of the same weights in two target graphs: one computing logits for
every prompt position (bundles exported before `logits_rows`), one for each chunk's last row only.

    .venv/bin/python bench/experiments/prefill_logits_rows.py OLD_BUNDLE NEW_BUNDLE \\
        --out bench/results/prefill_logits_rows.json

Random prompt ids of 64 / 256 / 768 tokens, the two graphs interleaved, median of 7 prefills from an empty cache.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import specdec

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("old_bundle")
    ap.add_argument("new_bundle")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engines = {"all rows": specdec.load(args.old_bundle, drafter="none"),
               "last row": specdec.load(args.new_bundle, drafter="none")}
    if engines["all rows"].target.spec.has_logits_rows or not engines["last row"].target.spec.has_logits_rows:
        raise SystemExit("OLD_BUNDLE must be a graph without logits_rows, NEW_BUNDLE one with it")
    rng = np.random.default_rng(0)
    rows = []
    for n in (64, 256, 768):
        prompt = rng.integers(100, 40000, size=(1, n)).astype(np.int64)
        times: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(7):
            for name, engine in engines.items():
                engine.target.kv.reset()
                t0 = time.perf_counter()
                engine.target.prefill(prompt)
                times[name].append(time.perf_counter() - t0)
        row = {"prompt_tokens": n, **{f"{k} ms": round(float(np.median(v)) * 1e3, 1) for k, v in times.items()}}
        rows.append(row)
        print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"old": args.old_bundle, "new": args.new_bundle, "rows": rows}, indent=1) + "\n")
