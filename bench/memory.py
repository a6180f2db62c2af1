#!/usr/bin/env python
"""Peak RSS of each (bundle, drafter) configuration, each in its own process, beside the target alone.

Each configuration loads its bundle, generates for a few Spec-Bench prompts, and reports its peak resident set
(ru_maxrss: weights paged in, K/V, buffers) and what of it was the loaded-and-used state: everything after the
imports. One process per configuration, so no configuration inherits another's peak.

    .venv/bin/python bench/memory.py --max-len 2048 \
        --config bundles/smollm2:none --config bundles/smollm2-ls29:layerskip --out bench/results/memory.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys
import specdec
from specdec import GenerationConfig
bundle, drafter, max_len, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.stdin.read())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = specdec.load(bundle, drafter=drafter, max_len=max_len)
tokens = 0
for p in prompts:
    g = engine.generate(p, GenerationConfig(max_new_tokens=n_tokens, draft_len=0 if drafter == "none" else "auto"))
    tokens += len(g.token_ids)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_rss_mb": round(peak / 1024, 1), "after_imports_mb": round(base / 1024, 1),
                  "engine_mb": round((peak - base) / 1024, 1), "tokens": tokens}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", required=True, metavar="BUNDLE:DRAFTER")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prompts import DEFAULT_QUESTIONS, load_spec_bench

    prompts = [p.messages for p in load_spec_bench(DEFAULT_QUESTIONS, 1)][: args.prompts]
    rows = []
    for spec in args.config:
        bundle, _, drafter = spec.rpartition(":")
        proc = subprocess.run([sys.executable, "-c", CHILD, bundle, drafter, str(args.max_len), str(args.max_new_tokens)],
                              input=json.dumps(prompts), capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"bundle": bundle, "drafter": drafter, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append({"bundle": bundle, "drafter": drafter, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(rows[-1], flush=True)
    base = next((r for r in rows if "error" not in r), None)
    print(f"{'bundle:drafter':40s} {'peak RSS MB':>12s} {'engine MB':>10s} {'vs first':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['bundle'] + ':' + r['drafter']:40s} error: {r['error']}")
            continue
        r["engine_vs_first"] = round(r["engine_mb"] / base["engine_mb"], 3)
        print(f"{r['bundle'] + ':' + r['drafter']:40s} {r['peak_rss_mb']:12.0f} {r['engine_mb']:10.0f} {r['engine_vs_first']:8.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"max_len": args.max_len, "max_new_tokens": args.max_new_tokens,
                                        "prompts": len(prompts), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
