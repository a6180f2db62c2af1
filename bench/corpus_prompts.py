#!/usr/bin/env python
"""specdec's own prompts (export/prompt_families.py, never Spec-Bench questions) as `specdec batch` input: the
bundle answers them, and `specdec corpus --answers` turns the answers into its corpus.

    .venv/bin/python bench/corpus_prompts.py --n 400 --seed 7 --out bench/results/qwen/corpus_prompts.jsonl
    specdec batch BUNDLE bench/results/qwen/corpus_prompts.jsonl answers.jsonl --batch-size 8
    specdec corpus BUNDLE --answers answers.jsonl
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
    args = ap.parse_args()

    from specdec.export.distill_data import benchmark_texts
    from specdec.export.prompt_families import broad_prompts

    benchmark = benchmark_texts(None)  # Spec-Bench's questions: measured on, never drafted from
    lines = [json.dumps({"id": i, "messages": m, "max_new_tokens": args.new_tokens}, ensure_ascii=False)
             for i, m in enumerate(broad_prompts(args.n, seed=args.seed))
             if not any(turn["content"] in benchmark for turn in m)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
