"""Would a corpus that grows with the session's own answers draft better? Greedy answers to Spec-Bench questions,
replayed in order through the corpus drafter (k <= 8, cut at MIN_CONFIDENCE): the bundle's corpus as shipped
against the same plus every earlier answer of the session; and, as for a model without a shipped corpus, prompt
lookup alone against a corpus of the session's earlier answers only. Answers are generated once and kept in
ANSWERS (a JSON file) so that the replay can be rerun. Checked in session 18 and not built (bench/README.md).

    .venv/bin/python bench/experiments/corpus_memory_replay.py BUNDLE --limit 4 --answers /tmp/answers.json \
        --out bench/results/corpus_memory_replay.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import specdec
from specdec.runtime.drafters.base import MIN_CONFIDENCE
from specdec.runtime.drafters.corpus import Corpus, CorpusDrafter
from specdec.runtime.drafters.hybrid import LOOKUP_MIN_NGRAM
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.sampling import SamplingConfig
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

STEP_MS, PER_TOKEN_MS = 28.0, 4.0  # AVX2 host: T=1 ~28 ms, +~4 ms a token (session 16's table)


def replay(answers, make_drafter, K=8):
    steps = tokens = 0
    cost = 0.0
    per = []
    rng = np.random.default_rng(0)
    for i, (prompt, out) in enumerate(answers):
        drafter = make_drafter(i)
        drafter.begin(prompt, SamplingConfig(), rng)
        ctx, j = list(prompt), 0
        s0, t0 = steps, tokens
        while j < len(out):
            d = drafter.propose(ctx, min(K, len(out) - j)).sure(MIN_CONFIDENCE)
            d = [int(t) for t in d.tokens]
            a = 0
            while a < len(d) and d[a] == out[j + a]:
                a += 1
            n = min(a + 1, len(out) - j)
            drafter.accept(a, out[j + a] if j + a < len(out) else -1)
            ctx += out[j:j + n]
            j += n
            steps += 1
            tokens += n
            cost += STEP_MS + PER_TOKEN_MS * len(d)
        per.append(round((tokens - t0) / max(steps - s0, 1), 3))
    return {"tau": round(tokens / steps, 3), "modelled_speedup": round(tokens * STEP_MS / cost, 3), "per_answer": per}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    ap.add_argument("--answers", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shuffle", type=int, default=None, help="replay in a random order (this seed)")
    args = ap.parse_args()
    engine = specdec.load(args.bundle, drafter="corpus")
    path = Path(args.answers)
    if path.exists():
        answers = [tuple(a) for a in json.loads(path.read_text())]
    else:
        answers = []
        qs = load_spec_bench(Path(args.questions), args.limit or None)
        t = time.time()
        for q in qs:
            ids = engine.encode(q.messages, True)
            g = engine.generate(q.messages, specdec.GenerationConfig(max_new_tokens=args.max_new_tokens, draft_len="auto"))
            answers.append((list(map(int, ids)), list(map(int, g.token_ids)), q.category))
            print(len(answers), q.category, len(g.token_ids), round(time.time() - t), flush=True)
        path.write_text(json.dumps(answers))
    if args.shuffle is not None:
        order = np.random.default_rng(args.shuffle).permutation(len(answers))
        answers = [answers[i] for i in order]
    m = engine.manifest
    vocab = m.model.vocab_size
    shipped = Corpus.load(Path(args.bundle) / m.drafter.corpus, vocab, m.tokenizer.vocab_digest)
    print("answers", len(answers), "tokens", sum(len(a[1]) for a in answers), "shipped corpus", len(shipped))

    def lookup():
        return NgramDrafter(max_ngram=m.drafter.max_ngram, min_ngram=LOOKUP_MIN_NGRAM)

    pairs = [(p, o) for p, o, _ in answers]
    rel_static, rel_grow, rel_sess = {}, {}, {}

    def static(i):
        d = CorpusDrafter(lookup(), shipped, rel_static.get("r"))
        rel_static["r"] = d.reliability
        return d

    def grown(i):
        c = Corpus(np.concatenate([shipped.tokens] + [np.append(o, vocab) for _, o in pairs[:i]]), vocab)
        d = CorpusDrafter(lookup(), c, rel_grow.get("r"))
        rel_grow["r"] = d.reliability
        return d

    def session_only(i):
        c = Corpus.from_texts([o for _, o in pairs[:i]], vocab)
        d = CorpusDrafter(lookup(), c, rel_sess.get("r"))
        rel_sess["r"] = d.reliability
        return d

    def lookup_only(i):
        return CorpusDrafter(lookup(), Corpus(np.zeros(0, dtype=np.int64), vocab))

    rows = {}
    for name, make in (("static", static), ("grown", grown), ("session_only", session_only), ("lookup_only", lookup_only)):
        rows[name] = replay(pairs, make)
        print(name, {k: v for k, v in rows[name].items() if k != "per_answer"}, flush=True)
    cats = [c for _, _, c in answers]
    for name in rows:
        by = {}
        for c, t in zip(cats, rows[name]["per_answer"]):
            by.setdefault(c, []).append(t)
        print(name, {c: round(float(np.mean(v)), 2) for c, v in by.items()})
    if args.out:
        Path(args.out).write_text(json.dumps({"answers": len(answers), "rows": rows, "categories": cats}, indent=1))


if __name__ == "__main__":
    main()
