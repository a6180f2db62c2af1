#!/usr/bin/env python
"""specdec's own prompts (export/prompt_families.py, never Spec-Bench questions) as `specdec batch` input: the
bundle answers them, and `specdec corpus --answers` turns the answers into its corpus.

    .venv/bin/python bench/corpus_prompts.py --n 400 --seed 7 --out bench/results/qwen/corpus_prompts.jsonl
    specdec batch BUNDLE bench/results/qwen/corpus_prompts.jsonl answers.jsonl --batch-size 8
    specdec corpus BUNDLE --answers answers.jsonl

`--held-out FAMILY=N,...` writes instead N prompts of each family (export/prompt_families.py: code, open, ...)
that neither Spec-Bench nor the `--exclude` files (a corpus's prompts) hold, as Spec-Bench question lines
(category `own_FAMILY`) for `bench/peers.py --questions`:

    .venv/bin/python bench/corpus_prompts.py --held-out code=6,open=6 --seed 11 \
        --exclude bench/results/qwen/corpus_prompts.jsonl --out bench/results/qwen/own_heldout_code_chat.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--held-out", default=None, help="FAMILY=N,...: Spec-Bench question lines of those families")
    ap.add_argument("--exclude", type=Path, action="append", default=[], help="prompts (JSONL) the held-out set avoids")
    args = ap.parse_args()

    from specdec.export.distill_data import benchmark_texts
    from specdec.export.prompt_families import broad_prompts

    benchmark = benchmark_texts(None)  # Spec-Bench's questions: measured on, never drafted from
    if args.held_out:
        return held_out(args, benchmark)
    lines = [json.dumps({"id": i, "messages": m, "max_new_tokens": args.new_tokens}, ensure_ascii=False)
             for i, m in enumerate(broad_prompts(args.n, seed=args.seed))
             if not any(turn["content"] in benchmark for turn in m)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {args.out}", file=sys.stderr)
    return 0


def held_out(args, benchmark: set[str]) -> int:
    import numpy as np

    from specdec.export.prompt_families import FAMILY_WEIGHTS, _one

    seen = set(benchmark)
    for path in args.exclude:
        for line in path.read_text(encoding="utf-8").splitlines():
            seen.update(turn["content"] for turn in json.loads(line)["messages"])
    rng = np.random.default_rng(args.seed)
    lines = []
    for spec in args.held_out.split(","):
        family, n = spec.split("=")
        if family not in FAMILY_WEIGHTS or family == "reading":
            raise SystemExit(f"unknown family {family!r}: one of {', '.join(f for f in FAMILY_WEIGHTS if f != 'reading')}")
        for _ in range(int(n)):
            text = _one(rng, family, [])
            while text in seen:  # drawn again until new: a prompt the corpus or the benchmark holds is not held out
                text = _one(rng, family, [])
            seen.add(text)
            lines.append(json.dumps({"question_id": f"{family}-{len(lines)}", "category": f"own_{family}",
                                     "turns": [text]}, ensure_ascii=False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} held-out prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
