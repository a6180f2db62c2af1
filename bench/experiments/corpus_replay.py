"""Replay greedy Spec-Bench answers through prompt lookup and corpus drafting, without the target: tau, and a
speed-up modelled with this CPU's step costs (a step of T tokens costs STEP_MS + PER_TOKEN_MS * (T - 1); fp32
SmolLM2 measured 20 / 28 / 35 ms at T = 1 / 5 / 9). Used to choose corpus.MIN_SHARE before building it into the
runtime; `specdec bench` measures the real thing.

    .venv/bin/python bench/experiments/corpus_replay.py BUNDLE DATA [DATA ...] --limit 3 --out bench/results/corpus_replay.json

The answers come from BUNDLE's target (greedy, 128 tokens, 3 questions per category); the corpus from DATA's
answers (distill-data folders: specdec's own prompts, never Spec-Bench's).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import specdec
from specdec.export.corpus import answers_of
from specdec.runtime.drafters.corpus import Corpus
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

STEP_MS, PER_TOKEN_MS = 20.0, 2.0


def prompt_lookup(ctx: list[int], k: int, min_n: int, max_n: int = 3) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        tail = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k]
    return []


def replay(answers, draft, K: int) -> dict:
    steps = tokens = 0
    cost = 0.0
    for prompt, out in answers:
        ctx, j = list(prompt), 0
        while j < len(out):
            d = draft(ctx, min(K, len(out) - j))
            a = 0
            while a < len(d) and d[a] == out[j + a]:
                a += 1
            n = min(a + 1, len(out) - j)
            ctx += out[j:j + n]
            j += n
            steps += 1
            tokens += n
            cost += STEP_MS + PER_TOKEN_MS * len(d)
    return {"tau": round(tokens / steps, 3), "modelled_speedup": round(tokens * STEP_MS / cost, 3)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("data", nargs="+")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = specdec.load(args.bundle, drafter="ngram")
    answers = []
    for q in load_spec_bench(DEFAULT_QUESTIONS, args.limit, seed=7):
        ids = engine.encode(q.messages, True)
        g = engine.generate(q.messages, specdec.GenerationConfig(max_new_tokens=128, draft_len=4))
        answers.append((list(map(int, ids)), g.token_ids))
    vocab = engine.manifest.model.vocab_size
    corpus = Corpus.from_texts(answers_of([Path(d) for d in args.data], vocab), vocab)
    rows = []
    for K in (2, 3, 4, 6):
        rows.append({"k": K, "drafter": "prompt lookup", **replay(answers, lambda c, k: prompt_lookup(c, k, 1), K)})
        for share in (0.0, 0.2, 0.3, 0.4, 0.5):
            def draft(c, k, share=share):
                return prompt_lookup(c, k, 2) or corpus.continuation(c, k, min_share=share)[0]
            rows.append({"k": K, "drafter": f"corpus min_share {share}", **replay(answers, draft, K)})
        for r in rows[-6:]:
            print(r, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"questions": len(answers), "corpus_tokens": len(corpus),
                                              "data": args.data, "rows": rows}, indent=1) + "\n")
