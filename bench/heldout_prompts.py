"""Write bench/results/own_heldout_broad.jsonl: 26 prompts of specdec's broad set that no training data holds.

Drawn with another seed than distill-data's (single-turn, no reading tasks), and checked against every prompt
the shipped heads were trained on: the basic set's 8,000 (seed 0) and the broad set's 8,000 (seed 0, with as
many documents as /work-style data gives; its non-reading prompts depend only on how many documents there are).

    .venv/bin/python bench/heldout_prompts.py --documents-from DATA0 [--out bench/results/own_heldout_broad.jsonl]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specdec.export.distill_data import DOCUMENT_MIN_TOKENS, MAX_DOCUMENTS, DistillDataConfig
from specdec.export.prompt_families import broad_prompts
from specdec.export.prompts import instruction_prompts

N_HELD_OUT = 26
SEED = 777


def document_count(folder: Path) -> int:
    n = 0
    for path in sorted(folder.glob("shard-*.npz")):
        with np.load(path) as d:
            answer = d["starts"][1:] - d["starts"][:-1] - d["prompt_len"]
        n += int((answer >= DOCUMENT_MIN_TOKENS).sum())
    return min(n, MAX_DOCUMENTS)


def user_text(conversation) -> str:
    return "\n".join(m["content"] for m in conversation if m["role"] == "user").strip()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--documents-from", type=Path, required=True, help="the --documents folder of the broad data")
    ap.add_argument("--out", type=Path, default=Path("bench/results/own_heldout_broad.jsonl"))
    args = ap.parse_args()
    n_train = DistillDataConfig().n_prompts
    placeholders = ["document"] * document_count(args.documents_from)
    seen = {user_text(p) for p in instruction_prompts(n_train, seed=0)}
    seen |= {user_text(p) for p in broad_prompts(n_train, seed=0, documents=placeholders)}
    rows = []
    for p in broad_prompts(20 * N_HELD_OUT, seed=SEED):
        if len(p) == 1 and user_text(p) not in seen and all(user_text(p) != r["turns"][0] for r in rows):
            rows.append({"question_id": f"broad-{len(rows)}", "category": "own_broad", "turns": [p[0]["content"]]})
        if len(rows) == N_HELD_OUT:
            break
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.out}: {len(rows)} prompts, none among {len(seen)} training prompts")
