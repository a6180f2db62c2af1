#!/usr/bin/env python
"""Where a target step's time goes, by onnxruntime op type: a prefill of N tokens (N > 16) or a step of N tokens
after a 200-token past, from onnxruntime's own profiler (node kernel times summed over the repeats).

    .venv/bin/python bench/profile_step.py BUNDLE --tokens 256 --out bench/results/qwen/profile_prefill_1.5b.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from report import emit  # noqa: E402

PAST = 200


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import specdec
    from specdec.runtime import session

    prefix = tempfile.mkdtemp(prefix="specdec-profile-") + "/ort"
    pooled = session.pooled_session_options

    def profiled(threads=None):
        so = pooled(threads)
        so.enable_profiling = True
        so.profile_file_prefix = prefix
        return so

    session.pooled_session_options = profiled
    dec = specdec.load(args.bundle, drafter="none", runtime=specdec.RuntimeOptions(threads=args.threads)).target
    ids = np.random.default_rng(0).integers(0, dec.model.vocab_size, size=(1, PAST + max(args.tokens, 16)))
    wall = []
    for _ in range(args.repeats):
        dec.kv.reset()
        if args.tokens > 16:
            t0 = time.perf_counter()
            dec.prefill(ids[:, :args.tokens])
        else:
            dec.prefill(ids[:, :PAST])
            t0 = time.perf_counter()
            dec.forward(ids[:, PAST:PAST + args.tokens])
        wall.append(time.perf_counter() - t0)
    events = json.loads(Path(dec.session.end_profiling()).read_text())
    by_op: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"].get("op_name")] += e["dur"]
    total = sum(by_op.values())
    what = f"prefill of {args.tokens} tokens" if args.tokens > 16 else f"step of {args.tokens} after {PAST}"
    result = {
        "bundle": str(args.bundle), "what": what, "threads": args.threads, "repeats": args.repeats,
        "ms": round(1000 * float(np.median(wall)), 1),
        "tok_s": round(args.tokens / float(np.median(wall)), 1) if args.tokens > 16 else None,
        "share_by_op": {op: round(d / total, 3) for op, d in by_op.most_common()},
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
