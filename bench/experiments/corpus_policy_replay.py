"""Replay the target's greedy answers through the runtime's own corpus drafter and draft-length policies, without
the target: tau, and a speed-up modelled with step costs measured inside the decode loop. Used in session 10 to
choose how corpus drafts are scored and cut, and to drop what did not pay (corpus trees, choosing among matched
lengths, choosing lookup vs corpus by expected tokens).

    .venv/bin/python bench/experiments/corpus_policy_replay.py BUNDLE ANSWERS.json [--make-answers 4] \\
        --out bench/results/corpus_policy_replay.json

--make-answers N first writes ANSWERS.json: BUNDLE's greedy answers (192 tokens) to N Spec-Bench questions per
category (seed 7; N = 4: 52 answers, 7,770 tokens, ~3 min). The replay is exact for greedy decoding: a draft token is accepted iff it equals the answer's.
On 9 of the answers the replayed tau matched real runs (1.63 both). Modelled speed-up = tokens x cost(T=1) / sum
of each round's cost(T) (+ OVERHEAD_MS), against plain decoding at cost(T=1) per token.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specdec.runtime.draft_len import AdaptiveDraftLen, FixedDraftLen
from specdec.runtime.drafters.base import Draft
from specdec.runtime.drafters.corpus import CONFIDENCE_WEIGHTS, LOOKUP_PRIOR, MAX_OCCURRENCES, Corpus, CorpusDrafter
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.sampling import SamplingConfig

# ms per target step by width T, medians inside the decode loop (Decoder._run timed over 9 Spec-Bench answers,
# 2-core EPYC, session 10); widths between are interpolated. int4: the fast-kernel bundle (T=1 runs as 2).
STEP_MS = {"fp32": {1: 16.6, 2: 19.3, 3: 20.7, 4: 21.4, 5: 22.7, 6: 23.0, 8: 26.8, 9: 28.1, 12: 31.5, 16: 37.5},
           "int4": {1: 8.4, 2: 8.4, 3: 10.2, 4: 11.1, 5: 13.0, 6: 14.2, 7: 15.5, 8: 16.8, 9: 18.4, 12: 22.5, 16: 28.0}}
OVERHEAD_MS = 0.3  # per round outside the forward (the profiled loop spent ~3% outside onnxruntime)
K_MAX = 8


def step_costs(kind: str, n: int = 17) -> list[float]:
    widths = sorted(STEP_MS[kind])
    return [float(c) for c in np.interp(np.arange(1, n + 1), widths, [STEP_MS[kind][w] for w in widths])]


def make_answers(bundle: Path, per_category: int, out: Path) -> None:
    import specdec
    from specdec.spec_bench import DEFAULT_QUESTIONS, load_spec_bench

    engine = specdec.load(bundle, drafter="corpus")
    rows = []
    for q in load_spec_bench(DEFAULT_QUESTIONS, per_category, seed=7):
        ids = engine.encode(q.messages, True)
        cfg = specdec.GenerationConfig(max_new_tokens=192, draft_len="auto")
        rows.append({"category": q.category, "prompt": ids,
                     "answer": [t for ts in engine.stream_ids(ids, cfg) for t in ts]})
    out.write_text(json.dumps(rows))


def accepted_on_path(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Greedy acceptance of a token tree: the longest root path whose tokens are the answer's."""
    depth_ok = {-1: 0}
    best = 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if p in depth_ok and depth_ok[p] < len(truth) and truth[depth_ok[p]] == t:
            depth_ok[i] = depth_ok[p] + 1
            best = max(best, depth_ok[i])
    return best


def corpus_tree(corpus: Corpus, context: list[int], depth: int) -> tuple[list[int], list[int], list[float]]:
    """Every continuation of the longest matched tail as a trie (nodes whose path probability, by the confidence
    model on each node's vote, is at least 0.02), parents before children."""
    w = CONFIDENCE_WEIGHTS
    for n in range(min(corpus.max_ngram, len(context)), 0, -1):
        lo, hi = corpus._range(context[len(context) - n:])
        if hi <= lo:
            continue
        picks = np.linspace(lo, hi - 1, num=min(hi - lo, MAX_OCCURRENCES)).astype(np.int64)
        at = corpus.order[picks] + n
        V = corpus.vocab_size + 1
        group, alive = np.zeros(len(at), np.int64), np.ones(len(at), bool)
        node_of, count_of, reach_of = np.array([-1]), np.array([len(at)]), np.array([1.0])
        tokens, parents, reach = [], [], []
        for d in range(depth):
            tok = corpus.tokens[np.minimum(at + d, len(corpus.tokens) - 1)]
            alive &= tok != corpus.sep
            if not alive.any():
                break
            keys, inv, cnt = np.unique(group[alive] * V + tok[alive], return_inverse=True, return_counts=True)
            up = keys // V
            share = cnt / count_of[up]
            best = np.zeros(len(count_of))
            np.maximum.at(best, up, share)
            second = np.zeros(len(count_of))
            np.maximum.at(second, up, np.where(share < best[up], share, 0.0))
            runner = np.where(share >= best[up], second[up], best[up])
            z = (w["bias"] + w["share"] * share + w["log_voters"] * np.log1p(count_of[up]) + w["depth"] * d
                 + w["runner_up"] * runner + w["matched"][min(n, len(w["matched"])) - 1])
            p = reach_of[up] / (1 + np.exp(-z))
            keep = p >= 0.02
            ids = np.full(len(keys), -1)
            ids[keep] = len(tokens) + np.arange(keep.sum())
            for u in np.flatnonzero(keep):
                tokens.append(int(keys[u] % V))
                parents.append(int(node_of[up[u]]))
                reach.append(float(p[u]))
            live = np.flatnonzero(alive)
            group[live] = inv
            alive[live[~keep[inv]]] = False
            node_of, count_of, reach_of = ids, cnt, np.where(keep, p, 0.0)
        return tokens, parents, reach
    return [], [], []


def replay(answers: list[dict], corpus: Corpus, costs: list[float], policy: str, k: int) -> dict:
    """policy: fixed (k, the 0.3 stop) | auto (the runtime's AdaptiveDraftLen) | oracle (the chain cut where the
    target would reject) | tree (corpus trie, the most probable nodes that pay, lookup chain where it matches) |
    all-n (auto, drafting from the matched length with the most expected tokens) | best-of (auto, the lookup's or
    the corpus's draft by expected tokens)."""
    lookup = NgramDrafter(max_ngram=3, min_ngram=2)
    drafter = (BestOfDrafter(lookup, corpus) if policy == "best-of" else
               CorpusDrafter(lookup, AllLengthsCorpus(corpus) if policy == "all-n" else corpus))
    adaptive = AdaptiveDraftLen(verify_s=costs[:K_MAX + 1], draft_s=0.0)
    rounds = tokens = 0
    ms = 0.0
    for a in answers:
        context, answer, j = list(a["prompt"]), a["answer"], 0
        drafter.begin(context, SamplingConfig(), np.random.default_rng(0))
        while j < len(answer):
            truth = answer[j:]
            source = drafter.source(context)
            want = min(adaptive.next_k(K_MAX, source) if policy in ("auto", "all-n", "best-of") else k, len(truth))
            if policy == "tree" and source == "corpus":
                nodes, parents, reach = corpus_tree(corpus, context, want)
                order = np.argsort(-np.asarray(reach), kind="stable")[:16]
                gain = 1 + np.concatenate([[0.0], np.cumsum(np.asarray(reach)[order])])
                keep = sorted(order[:int(np.argmax(gain / np.asarray(costs[:len(gain)])))].tolist())
                where = {-1: -1}
                t_nodes, t_parents = [], []
                for i in keep:
                    if parents[i] in where:
                        where[i] = len(t_nodes)
                        t_nodes.append(nodes[i])
                        t_parents.append(where[parents[i]])
                n_ok, width = accepted_on_path(t_nodes, t_parents, truth), len(t_nodes)
            else:
                draft = drafter.propose(context, want)
                n_ok = 0
                while n_ok < draft.k and draft.tokens[n_ok] == truth[n_ok]:
                    n_ok += 1
                if policy == "oracle":
                    draft = draft.head(n_ok)
                elif policy == "fixed":
                    draft = FixedDraftLen(k).cut(draft)
                else:
                    draft = adaptive.cut(draft, source)
                n_ok, width = min(n_ok, draft.k), draft.k
                drafter.accept(n_ok, truth[n_ok] if n_ok < len(truth) else -1)
                adaptive.update(width, n_ok, source=source)
            step = min(n_ok + 1, len(truth))
            context += truth[:step]
            j += step
            rounds += 1
            tokens += step
            ms += costs[width] + OVERHEAD_MS
    return {"policy": policy, "k": k, "tau": round(tokens / rounds, 3),
            "modelled_speedup": round(tokens * (costs[0] + OVERHEAD_MS) / ms, 3)}


class AllLengthsCorpus(Corpus):
    """Drafts from the matched length (1..max) whose continuation has the most expected tokens, not the longest."""

    def __init__(self, base: Corpus) -> None:  # shares the base's arrays, no re-indexing
        self.__dict__.update(base.__dict__)

    def draft(self, context, k, min_ngram=1):
        found = [Corpus.draft(self, context[len(context) - n:], k, min_ngram=n)
                 for n in range(max(min_ngram, 1), min(self.max_ngram, len(context)) + 1)]
        found = [f for f in found if f.tokens]
        if not found:
            return Corpus.draft(self, context, k, min_ngram)
        return max(found, key=lambda f: float(np.cumprod(f.confidence()).sum()))


class BestOfDrafter(CorpusDrafter):
    """The lookup's or the corpus's draft, whichever has more expected tokens (not the lookup first)."""

    def propose(self, context, k):
        self._last = None
        if k <= 0:
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        options = []
        tokens, n = self.lookup.lookup(context, k)
        if tokens:
            options.append((("lookup", min(n, max(LOOKUP_PRIOR))), list(tokens), np.ones(len(tokens))))
        found = self.corpus.draft(context, k)
        if found.tokens:
            options.append((("corpus", min(found.n, 4)), found.tokens, found.confidence()))
        best = None
        for kind, toks, scores in options:
            confidence = np.minimum(scores * self.reliability[kind].rate, 1.0)
            if best is None or np.cumprod(confidence).sum() > np.cumprod(best[3]).sum():
                best = (kind, toks, scores, confidence)
        if best is None:
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        self._last = (best[0], list(best[1]), list(best[2]))
        return Draft(tokens=np.asarray(best[1], dtype=np.int64), confidence=best[3])


if __name__ == "__main__":
    from corpus_confidence import replay_args  # noqa: E402  (the scripts run from bench/experiments/)

    args, corpus, _ = replay_args()
    if args.make_answers:
        make_answers(args.bundle, args.make_answers, args.answers)
    answers = json.loads(args.answers.read_text())
    rows = []
    for kind in ("fp32", "int4"):
        costs = step_costs(kind)
        for policy, k in (("fixed", 4), ("auto", 0), ("oracle", 4), ("oracle", 8), ("tree", 6), ("all-n", 0),
                          ("best-of", 0)):
            rows.append({"costs": kind, **replay(answers, corpus, costs, policy, k)})
            print(rows[-1], flush=True)
    if args.out:
        args.out.write_text(json.dumps({"answers": len(answers), "answer_tokens": sum(len(a["answer"]) for a in answers),
                                        "corpus_tokens": len(corpus), "step_ms": STEP_MS, "rows": rows}, indent=1) + "\n")
