"""How far can training-free drafting go on this CPU? Replay the target's greedy answers through prompt lookup and
the corpus drafter, without the target, and model the speed-up with step costs measured here.

For every position of every answer the script records what each drafter would propose (prompt lookup: the tokens
and the match length; the corpus: up to K tokens with the share of occurrences that agreed on each, and the
matched length). Policies are then replayed over those proposals: rounds advance by the accepted tokens + 1, and a
round of width T costs the measured target step `cost_ms[T-1]` (timed here at the start, interleaved widths, past
length 300). Printed and saved: tau and the modelled speed-up over plain decoding for

  lookup:K         prompt lookup alone (match 2..3 tokens)
  corpus:K         the shipped drafter with a fixed length (lookup first, else corpus tokens while share >= 0.5)
  corpus-cut:K     the same drafts cut by `--draft-len auto`'s rule: keep the d tokens that maximise expected
                   tokens per verification second, with the drafter's confidences (its priors: no learning here)
  oracle-cut:K     the cut made knowing which tokens the target accepts (an upper bound for any cutting rule)
  corpus-tree:N    lookup first, else a best-first token tree of N nodes over the corpus's top-3 continuations

    .venv/bin/python bench/experiments/draft_policy_replay.py bundles/smollm2 \\
        --out bench/results/draft_policy_replay.json

Answers: 26 of specdec's own held-out prompts (bench/results/own_heldout_broad.jsonl) and 39 Spec-Bench questions
(3 per category, seed 7), 128 tokens each. The modelled figures leave out per-round Python overhead, which is the
same at every width: real speed-ups come out a few percent above them.
"""
from __future__ import annotations

import argparse
import heapq
import json
import time
from pathlib import Path

import numpy as np

import specdec
from specdec.runtime.drafters.corpus import LOOKUP_PRIOR, MAX_OCCURRENCES, Corpus
from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

# The corpus drafter's scoring when this replay was run (session 8): a corpus token scored by its raw share, with
# these priors per match length and a stop below this share. The runtime now scores by corpus.CONFIDENCE_WEIGHTS.
CORPUS_PRIOR = {1: 0.51, 2: 0.56, 3: 0.6, 4: 0.85}
MIN_SHARE = 0.5

K_MAX = 8


def step_costs_ms(engine, widths: int = K_MAX + 1, reps: int = 30) -> list[float]:
    target = engine.target
    target.kv.reset()
    target.prefill(np.arange(300, dtype=np.int64)[None] + 1000)
    steps = {t: np.full((1, t), 1234, dtype=np.int64) for t in range(1, widths + 1)}
    times: dict[int, list[float]] = {t: [] for t in steps}
    for _ in range(reps):  # interleaved: a busy moment falls on every width alike
        for t, x in steps.items():
            t0 = time.perf_counter()
            target.forward(x)
            times[t].append(time.perf_counter() - t0)
    target.kv.reset()
    return [float(np.median(times[t]) * 1e3) for t in steps]


def lookup(ctx: list[int], k: int, min_n: int = 2, max_n: int = 3) -> tuple[list[int], int]:
    for n in range(max_n, min_n - 1, -1):
        tail = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k], n
    return [], 0


def occurrences(corpus: Corpus, ctx: list[int]) -> tuple[np.ndarray | None, int]:
    for n in range(min(corpus.max_ngram, len(ctx)), 0, -1):
        lo, hi = corpus._range(ctx[len(ctx) - n:])
        if hi > lo:
            picks = np.linspace(lo, hi - 1, num=min(hi - lo, MAX_OCCURRENCES)).astype(np.int64)
            return corpus.order[picks] + n, n
    return None, 0


def corpus_tree(corpus: Corpus, ctx: list[int], budget: int, branch: int = 3) -> list[tuple[int, int]]:
    """(token, parent) nodes, best first by the product of shares along the path."""
    at, n = occurrences(corpus, ctx)
    heap: list = []
    count = 0

    def push_children(at: np.ndarray, parent: int, q: float) -> None:
        nonlocal count
        following = corpus.tokens[at]
        real = following != corpus.sep
        if not real.any():
            return
        counts = np.bincount(following[real])
        for t in np.argsort(-counts)[:branch]:
            if counts[t]:
                heapq.heappush(heap, (-q * counts[t] / real.sum(), count, int(t), parent, at[following == t] + 1))
                count += 1

    if at is not None:
        push_children(at, -1, 1.0)
    nodes: list[tuple[int, int]] = []
    while heap and len(nodes) < budget:
        negq, _, t, parent, nat = heapq.heappop(heap)
        nodes.append((t, parent))
        push_children(nat, len(nodes) - 1, -negq)
    return nodes


def tree_accepted(nodes: list[tuple[int, int]], truth: list[int]) -> int:
    depth: dict[int, int] = {}
    ok: dict[int, bool] = {}
    best = 0
    for i, (t, p) in enumerate(nodes):
        d = 0 if p == -1 else depth[p] + 1
        depth[i] = d
        ok[i] = (p == -1 or ok[p]) and d < len(truth) and truth[d] == t
        best = max(best, d + 1) if ok[i] else best
    return best


def features(answers: list[dict], corpus: Corpus) -> list[list[dict]]:
    out = []
    for row in answers:
        prompt, answer = row["prompt"], row["answer"]
        per_position = []
        for j in range(len(answer)):
            ctx = prompt + answer[:j]
            tokens, n = lookup(ctx, K_MAX)
            found = corpus.draft(ctx, K_MAX)
            c_tokens, shares, cn = found.tokens, found.shares, found.n
            per_position.append({"lookup": tokens, "lookup_n": n, "corpus": c_tokens, "shares": shares,
                                 "corpus_n": cn, "ctx": ctx})
        out.append(per_position)
    return out


def replay(answers: list[dict], feats: list[list[dict]], draft, cost_ms: list[float]) -> dict:
    """draft(position features, k_room, truth) -> (node count, accepted)."""
    rounds = tokens = 0
    cost = 0.0
    for row, per_position in zip(answers, feats):
        answer, j = row["answer"], 0
        while j < len(answer):
            width, accepted = draft(per_position[j], len(answer) - j, answer[j:])
            n = min(accepted + 1, len(answer) - j)
            j += n
            rounds += 1
            tokens += n
            cost += cost_ms[width]
    return {"tau": round(tokens / rounds, 3), "modelled_speedup": round(tokens * cost_ms[0] / cost, 3)}


def n_right(tokens: list[int], truth: list[int]) -> int:
    a = 0
    while a < len(tokens) and a < len(truth) and tokens[a] == truth[a]:
        a += 1
    return a


def fixed(k: int):
    def draft(f, room, truth):
        tokens = f["lookup"][:k]
        if not tokens:
            tokens = []
            for t, s in zip(f["corpus"][:k], f["shares"][:k]):
                if s < MIN_SHARE:
                    break
                tokens.append(t)
        tokens = tokens[:room]
        return len(tokens), n_right(tokens, truth)
    return draft


def lookup_only(k: int):
    def draft(f, room, truth):
        tokens = f["lookup"][:min(k, room)]
        return len(tokens), n_right(tokens, truth)
    return draft


def cut(k: int, cost_ms: list[float], oracle: bool = False):
    cost = np.maximum.accumulate(np.asarray(cost_ms))

    def draft(f, room, truth):
        width, _ = fixed(k)(f, room, truth)
        tokens = (f["lookup"] or f["corpus"])[:width]
        if f["lookup"]:
            conf = [LOOKUP_PRIOR[min(f["lookup_n"], max(LOOKUP_PRIOR))]] * width
        else:
            conf = [s * CORPUS_PRIOR[min(f["corpus_n"], max(CORPUS_PRIOR))] for s in f["shares"][:width]]
        if oracle:  # what a perfect confidence would keep: exactly the tokens the target accepts
            conf = [1.0 if i < n_right(tokens, truth) else 0.0 for i in range(width)]
        reach = np.cumprod(conf) if width else np.zeros(0)
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach)])
        d = int(np.argmax(expected / cost[:len(expected)]))
        return d, n_right(tokens[:d], truth)
    return draft


def tree(budget: int, corpus: Corpus):
    def draft(f, room, truth):
        if f["lookup"]:
            tokens = f["lookup"][:min(budget, room)]
            return len(tokens), n_right(tokens, truth)
        nodes = corpus_tree(corpus, f["ctx"], min(budget, room))
        return len(nodes), tree_accepted(nodes, truth)
    return draft


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = specdec.load(args.bundle, drafter="corpus")
    cost_ms = step_costs_ms(engine)
    print("step ms by width:", [round(c, 1) for c in cost_ms], flush=True)
    m = engine.manifest
    corpus = Corpus.load(Path(args.bundle) / m.drafter.corpus, m.model.vocab_size, m.tokenizer.vocab_digest)
    sets = {"own_heldout_broad": load_spec_bench(Path("bench/results/own_heldout_broad.jsonl"), None),
            "spec_bench": load_spec_bench(DEFAULT_QUESTIONS, 3, seed=7)}
    results = {"bundle": args.bundle, "corpus_tokens": len(corpus), "step_ms": [round(c, 2) for c in cost_ms], "sets": {}}
    for name, questions in sets.items():
        answers = []
        for q in questions:
            ids = engine.encode(q.messages, True)
            g = engine.generate(q.messages, specdec.GenerationConfig(max_new_tokens=128, draft_len=4))
            answers.append({"prompt": list(map(int, ids)), "answer": list(g.token_ids)})
        feats = features(answers, corpus)
        rows = []
        for k in (2, 3, 4, 6, 8):
            rows.append({"policy": f"lookup:{k}", **replay(answers, feats, lookup_only(k), cost_ms)})
            rows.append({"policy": f"corpus:{k}", **replay(answers, feats, fixed(k), cost_ms)})
            rows.append({"policy": f"corpus-cut:{k}", **replay(answers, feats, cut(k, cost_ms), cost_ms)})
            rows.append({"policy": f"oracle-cut:{k}", **replay(answers, feats, cut(k, cost_ms, oracle=True), cost_ms)})
        for n in (3, 4, 6):
            rows.append({"policy": f"corpus-tree:{n}", **replay(answers, feats, tree(n, corpus), cost_ms)})
        for r in rows:
            print(name, r, flush=True)
        results["sets"][name] = {"questions": len(answers), "answer_tokens": sum(len(a["answer"]) for a in answers),
                                 "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
