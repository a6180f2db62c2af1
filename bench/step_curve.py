#!/usr/bin/env python
"""Where a speculative round's time goes on this device: the target's step cost against its width, and the draft
model's (or EAGLE head's) cost per drafted token.

ms per forward (median, IOBinding, in-place KV with a past of 200 tokens) of the bundle's target at T = 1..16
tokens, as a multiple of one 1-token step; and, when the bundle has a draft graph, its 1-token step. A graph whose
steps run at least 2 positions (min_step_tokens, int8-activation kernels) pads T=1 to 2, as the runtime does.

    .venv/bin/python bench/step_curve.py /tmp/bundles/q15-pair --out bench/results/qwen/step_curve_1.5b.json
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode import PAST, median_ms  # noqa: E402
from report import emit  # noqa: E402

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def curve(dec, widths, reps: int) -> dict:
    ids = np.random.default_rng(0).integers(0, dec.model.vocab_size, size=(1, PAST + max(widths)))
    dec.prefill(ids[:, :PAST])  # the KV holds PAST tokens; the steps below write past it and are never kept
    return {t: median_ms(lambda t=t: dec.forward(ids[:, PAST:PAST + t]), reps) for t in widths}


def head_step_ms(head, reps: int) -> float:
    """An EAGLE head's 1-token drafting step (one decoder layer and its draft-vocabulary head) after PAST entries."""
    from specdec.runtime.decoder import MAX_STEP

    rng = np.random.default_rng(0)
    ids = rng.integers(0, head.model.vocab_size, size=(1, PAST + 1))
    feats = rng.standard_normal((1, PAST + 1, head.model.hidden_size)).astype(np.float32)
    for lo in range(0, PAST, MAX_STEP):
        hi = min(lo + MAX_STEP, PAST)
        head.forward(ids[:, lo:hi], features=feats[:, lo:hi])
        head.kv.advance(hi - lo)
    return median_ms(lambda: head.forward(ids[:, PAST:], features=feats[:, PAST:]), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import specdec

    opts = specdec.RuntimeOptions(threads=args.threads)
    engine = specdec.load(args.bundle, drafter="none", runtime=opts)
    target = curve(engine.target, WIDTHS, args.reps)
    result = {"bundle": str(args.bundle), "host": platform.processor() or platform.machine(), "threads": args.threads,
              "past": PAST, "target_ms": target, "target_x_one_step": {t: round(v / target[1], 2) for t, v in target.items()}}
    del engine
    m = specdec.load(args.bundle, drafter="none", runtime=opts).manifest
    if "draft" in m.graphs:
        drafting = specdec.load(args.bundle, drafter="model", runtime=opts)
        d = curve(drafting.drafter.decoder, (1,), args.reps)
        result["draft_ms_per_token"] = d[1]
        result["draft_over_target_step"] = round(d[1] / target[1], 3)
    if m.drafter.kind == "eagle":
        head = specdec.load(args.bundle, drafter="eagle", runtime=opts).drafter.head
        e = head_step_ms(head, args.reps)
        result["eagle_ms_per_token"] = e
        result["eagle_over_target_step"] = round(e / target[1], 3)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
