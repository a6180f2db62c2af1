"""The target's greedy choices always from the graph's exact-argmax path, against the per-shape choice of the faster
path timed on this device (specdec/runtime/greedy_path.py), in one process, prompt by prompt, so that load on the
machine hits both alike. Every pair of runs is compared token for token.

    .venv/bin/python bench/experiments/greedy_paths_ab.py BUNDLE --limit 2 \\
        --configs none:0,corpus:auto,hybrid-tree:auto --out bench/results/greedy_paths_ab.json

BUNDLE: an fp32 export (its target has the exact-argmax path); hybrid-tree needs `--drafter eagle`.
"""
from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

from side_by_side import bench_arguments

import specdec
from specdec.runtime.engine import GenerationConfig
from specdec.runtime.greedy_path import GRAPH, GreedyPaths, OnePath
from specdec.spec_bench import load_spec_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    bench_arguments(ap, configs="none:0,corpus:auto,hybrid-tree:auto")
    args = ap.parse_args()

    engine = specdec.load(args.bundle)
    if engine.target.greedy_paths is None:
        raise SystemExit(f"{args.bundle}'s target has one greedy path only (no exact-argmax path)")
    prompts = load_spec_bench(args.questions, limit_per_category=args.limit or None)
    timed = GreedyPaths()
    choosers = {"graph only": OnePath(GRAPH), "timed": timed}  # the graph's path: what ran before the timing
    rows = []
    for text in args.configs.split(","):
        drafter, _, length = text.partition(":")
        draft_len = 0 if drafter == "none" else (length if length == "auto" else int(length))
        engine.use_drafter(drafter)
        totals = {name: {"decode_s": 0.0, "tokens": 0, "forwards": 0} for name in choosers}
        identical = 0
        for chooser in choosers.values():  # untimed warm-up of each
            engine.target.greedy_paths = chooser
            engine.generate(prompts[0].messages, GenerationConfig(max_new_tokens=16, draft_len=draft_len))
        for prompt in prompts:
            outputs = []
            for name, chooser in choosers.items():
                engine.target.greedy_paths = chooser
                g = engine.generate(prompt.messages, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                      draft_len=draft_len))
                t = totals[name]
                t["decode_s"] += g.stats.decode_s
                t["tokens"] += g.stats.new_tokens - 1  # the first token comes from prefill
                t["forwards"] += g.stats.target_forwards
                outputs.append(g.token_ids)
            identical += outputs[0] == outputs[1]
        row = {"config": text, "prompts": len(prompts), "identical": identical}
        for name, t in totals.items():
            row[name] = {"decode_tok_s": round(t["tokens"] / t["decode_s"], 2),
                         "tau": round(t["tokens"] / max(t["forwards"], 1), 3)}
        row["speedup_timed_vs_graph_only"] = round(row["timed"]["decode_tok_s"] / row["graph only"]["decode_tok_s"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"bundle": str(args.bundle), "max_new_tokens": args.max_new_tokens, "rows": rows,
              "chosen": {f"{b}x{t}": timed.best((b, t)) for b, t in sorted(timed.fastest_seconds())},
              "min_ms": {f"{b}x{t}": {p: round(1000 * v, 2) for p, v in d.items()}
                         for (b, t), d in sorted(timed.fastest_seconds().items())},
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    print(json.dumps({k: result[k] for k in ("chosen", "min_ms", "peak_rss_mb")}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
