"""EAGLE drafts with and without the online calibration of the head's scores (drafters/eagle.py), side by side in one
`specdec bench` run: every config once as shipped and once with the calibration frozen at rate 1 (the confidences
are then the head's raw softmax probabilities, as before the calibration). Greedy, so each run is also compared
token for token with plain decoding.

    .venv/bin/python bench/experiments/eagle_calibration.py BUNDLE --limit 2 \\
        --configs eagle-tree:auto,hybrid-tree:auto --out bench/results/eagle_calibration.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import specdec
from specdec.benchmark import BenchConfig, render_table, run_bench
from specdec.runtime.drafters.base import Reliability
from specdec.runtime.drafters.eagle import EagleDrafter
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

RAW = "-raw"  # suffix of the drafters whose calibration stays frozen


class Frozen(Reliability):
    """A rate that stays at its prior: the head's scores are used as they are."""

    def learn(self, hit: bool, score: float) -> None:
        pass


def eagle_of(drafter) -> EagleDrafter:
    """The EAGLE drafter inside a bench drafter (itself, or a hybrid's model side)."""
    return drafter if isinstance(drafter, EagleDrafter) else drafter.model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--limit", type=int, default=2, help="questions per category")
    ap.add_argument("--configs", default="eagle-tree:auto,hybrid-tree:auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    engine = specdec.load(args.bundle)
    configs = []
    for text in args.configs.split(","):
        cfg = BenchConfig.parse(text)
        engine.use_drafter(cfg.drafter)
        raw = engine._make_drafter(cfg.drafter)
        eagle_of(raw).calibration = {kind: Frozen(1.0) for kind in eagle_of(raw).calibration}
        engine._drafters[cfg.drafter + RAW] = raw
        configs += [cfg, BenchConfig(cfg.drafter + RAW, cfg.draft_len)]
    prompts = load_spec_bench(args.questions, limit_per_category=args.limit or None)
    result = run_bench(engine, prompts, configs, args.max_new_tokens)
    result["calibration"] = {c.name: {kind: round(r.rate, 3) for kind, r in eagle_of(engine._drafters[c.drafter])
                                      .calibration.items()} for c in configs}
    from rich.console import Console
    Console().print(render_table(result))
    print(json.dumps(result["calibration"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
