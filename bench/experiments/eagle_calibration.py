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

from side_by_side import bench_arguments, report, run_side_by_side

import specdec
from specdec.runtime.drafters.base import Reliability
from specdec.runtime.drafters.eagle import EagleDrafter

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
    bench_arguments(ap, configs="eagle-tree:auto,hybrid-tree:auto")
    args = ap.parse_args()

    engine = specdec.load(args.bundle)

    def frozen(kind: str):
        raw = engine._make_drafter(kind)
        eagle_of(raw).calibration = {part: Frozen(1.0) for part in eagle_of(raw).calibration}
        return raw

    result, configs = run_side_by_side(engine, args, RAW, frozen)
    result["calibration"] = {c.name: {part: round(r.rate, 3) for part, r in eagle_of(engine._drafters[c.drafter])
                                      .calibration.items()} for c in configs}
    report(result, args.out)
    print(json.dumps(result["calibration"]))


if __name__ == "__main__":
    main()
