"""A target with the exact-argmax path (export/exact_argmax.py) against the same target without it, side by side in
one process: step times by width, greedy generation tok/s (plain and a drafter), and whether every output is
identical.

    .venv/bin/python bench/experiments/exact_argmax.py BUNDLE [--limit 1] [--drafter corpus] \\
        --out bench/results/exact_argmax_fp32.json

BUNDLE's target must have the path (an fp32 export, or `quantize --to int4` of one); its twin without it is written
to a temporary folder by strip_exact_argmax, the same transformation `specdec quantize` applies to a quantized head.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

import specdec
from specdec.export.writer import bundle_files
from specdec.export.exact_argmax import strip_exact_argmax
from specdec.export.graph import save_graph
from specdec.runtime.manifest import ARGMAX_ROWS, MANIFEST_NAME, read_manifest
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

WIDTHS = (1, 2, 3, 5)
PAST = 300  # tokens in the cache while steps are timed
ROUNDS = 40


def without_path(src: Path, dst: Path) -> None:
    m = read_manifest(src)
    g = m.graphs["target"]
    if not g.has_argmax_rows:
        raise SystemExit(f"{src}'s target has no exact-argmax path")
    for f in src.iterdir():
        if not f.name.startswith(g.file):
            shutil.copy2(f, dst / f.name)
    save_graph(strip_exact_argmax(onnx.load(str(src / g.file))), dst / g.file)
    g = replace(g, inputs=tuple(i for i in g.inputs if i != ARGMAX_ROWS))
    m = replace(m, graphs={**m.graphs, "target": g})
    (dst / MANIFEST_NAME).write_text(replace(m, files=bundle_files(dst)).to_json())


def step_ms(engines: dict) -> dict:
    targets = {name: e.target for name, e in engines.items()}
    for t in targets.values():
        t.prefill(np.arange(PAST, dtype=np.int64)[None] + 1000)
    times: dict = {}
    for _ in range(ROUNDS):  # interleaved: both see the same machine
        for w in WIDTHS:
            for name, t in targets.items():
                step = np.full((1, w), 1234, dtype=np.int64)
                t0 = time.perf_counter()
                t.forward_choices(step)
                times.setdefault(name, {}).setdefault(w, []).append(time.perf_counter() - t0)
    for e in engines.values():
        e.reset()
        e.target.kv.reset()
    return {name: {w: round(1e3 * float(np.median(v)), 3) for w, v in by_w.items()} for name, by_w in times.items()}


def generations(engines: dict, drafter: str, limit: int) -> dict:
    seconds: dict = {}
    tokens: dict = {}
    texts: dict = {}
    for e in engines.values():
        e.use_drafter(drafter)
        e.generate("Hello", specdec.GenerationConfig(max_new_tokens=8, draft_len="auto"))  # costs measured once
    for q in load_spec_bench(DEFAULT_QUESTIONS, limit, seed=5):
        for mode in (0, "auto"):
            for name, e in engines.items():
                t0 = time.perf_counter()
                g = e.generate(q.messages, specdec.GenerationConfig(max_new_tokens=128, draft_len=mode))
                key = f"{name} {'plain' if mode == 0 else drafter + ':auto'}"
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
                tokens[key] = tokens.get(key, 0) + g.stats.new_tokens
                texts.setdefault(q.id, set()).add(g.text)
    return {"tok_s": {k: round(tokens[k] / seconds[k], 2) for k in seconds},
            "prompts": len(texts), "identical": sum(len(v) == 1 for v in texts.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--drafter", default="corpus")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        without_path(args.bundle, Path(tmp))
        engines = {"fp32 head": specdec.load(tmp, drafter="none", verify_checksums=False),
                   "exact argmax": specdec.load(args.bundle, drafter="none")}
        steps = step_ms(engines)
        gens = generations(engines, args.drafter, args.limit)
    tok_s = gens["tok_s"]
    ratios = {mode: round(tok_s[f"exact argmax {mode}"] / tok_s[f"fp32 head {mode}"], 3)
              for mode in ("plain", f"{args.drafter}:auto")}
    result = {"bundle": str(args.bundle), "machine": platform.processor() or platform.machine(),
              "step_ms_by_width": steps, **gens, "exact_over_fp32_head": ratios}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
