"""Fit corpus.CONFIDENCE_WEIGHTS: a logistic model of P(a corpus draft token is the target's greedy token | the
tokens before it in the draft were), from how the corpus voted for it.

Why: on 2 CPU cores a 2-token verification costs 1.16x a 1-token step (fp32 SmolLM2, in the decode loop: 16.6 /
19.3 / 20.7 / 22.7 ms at T = 1 / 2 / 3 / 5), so whether a round drafts at all, and how far, decides most of the
speed-up; replaying Spec-Bench answers, a cut that knew which tokens will be accepted would be 1.78x against 1.60x
for the cut by raw shares. The model only needs the votes, so it is fitted once for the method, on greedy answers
of the target to specdec's own prompts (broad set, seed 4242, none among the distillation prompts; never
Spec-Bench), replayed through the drafter the runtime uses, with the corpus of the shipped bundle.

    .venv/bin/python bench/experiments/corpus_confidence.py BUNDLE ANSWERS.json --make-answers 160 \
        --out bench/results/corpus_confidence.json

--make-answers N first writes ANSWERS.json ([{"prompt": [ids], "answer": [ids]}, ...]): the target's greedy
answers (192 tokens) to N single-turn prompts of the broad set (seed 4242), leaving out any whose answer begins
like a corpus text (24 tokens: a prompt the corpus already answered). 160 prompts: 139 kept, 20,800 tokens, ~9 min.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specdec.runtime.drafters.corpus import Continuation, Corpus
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.manifest import read_manifest
from specdec.runtime.sampling import SamplingConfig

DRAFT = 8  # tokens drafted per round while collecting: every position the runtime may draft
MATCHED = 4  # matched-context lengths told apart (longer ones count as 4)
L2 = 1e-2


def features(found: Continuation, n_reached: int) -> np.ndarray:
    """Rows [n_reached, 5 + MATCHED - 1]: bias, share, log(1 + voters), depth, runner-up share, matched = 2..4."""
    rows = []
    for i in range(n_reached):
        onehot = [float(min(found.n, MATCHED) == m) for m in range(2, MATCHED + 1)]
        rows.append([1.0, found.shares[i], np.log1p(found.voters[i]), float(i), found.runner_up[i], *onehot])
    return np.asarray(rows).reshape(n_reached, 4 + MATCHED)


def collect(corpus: Corpus, answers: list[dict], max_ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Replay each answer: where prompt lookup has no match, draft DRAFT corpus tokens; a row for every token up to
    and including the first wrong one (the ones a verification would have judged)."""
    lookup = NgramDrafter(max_ngram=max_ngram, min_ngram=2)
    xs, ys = [], []
    for a in answers:
        context, answer, j = list(a["prompt"]), a["answer"], 0
        lookup.begin(context, SamplingConfig(), np.random.default_rng(0))
        while j < len(answer):
            drafted, _ = lookup.lookup(context, DRAFT)
            found = None
            if not drafted:
                found = corpus.draft(context, DRAFT)
                drafted = found.tokens
            truth = answer[j:]
            n_ok = 0
            while n_ok < min(len(drafted), len(truth)) and drafted[n_ok] == truth[n_ok]:
                n_ok += 1
            if found is not None:
                reached = min(n_ok + 1, len(drafted), len(truth))
                xs.append(features(found, reached))
                ys.append((np.arange(reached) < n_ok).astype(float))
            step = min(n_ok + 1, len(truth))
            context += truth[:step]
            j += step
    return np.concatenate(xs), np.concatenate(ys)


def make_answers(bundle: Path, corpus: Corpus, n: int, out: Path) -> None:
    import specdec
    from specdec.export.prompt_families import broad_prompts

    engine = specdec.load(bundle, drafter="corpus")
    answers = []
    for prompt in broad_prompts(20 * n, seed=4242):
        if len(prompt) != 1:
            continue
        ids = engine.encode(prompt, True)
        cfg = specdec.GenerationConfig(max_new_tokens=192, draft_len="auto")
        answers.append({"prompt": ids, "answer": [t for ts in engine.stream_ids(ids, cfg) for t in ts]})
        if len(answers) == n:
            break
    kept = [a for a in answers if not in_corpus(corpus, a["answer"][:24])]
    out.write_text(json.dumps(kept))
    print(f"{len(kept)} of {len(answers)} answers kept, {sum(len(a['answer']) for a in kept)} tokens")


def in_corpus(corpus: Corpus, tokens: list[int]) -> bool:
    lo, hi = corpus._range(tokens[:corpus.max_ngram])
    return any(corpus.tokens[i:i + len(tokens)].tolist() == tokens for i in corpus.order[lo:hi])


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = L2, iters: int = 50) -> np.ndarray:
    """Newton's method on the L2-penalised log-loss."""
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-x @ w))
        grad = x.T @ (p - y) + l2 * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + l2 * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    return w


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def replay_args() -> tuple[argparse.Namespace, Corpus, int]:
    """The command line of the corpus replays (BUNDLE ANSWERS.json [--make-answers N] [--out PATH]), BUNDLE's
    corpus and its lookup's max n-gram."""
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("answers", type=Path)
    ap.add_argument("--make-answers", type=int, metavar="N")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    m = read_manifest(args.bundle)
    corpus = Corpus.load(args.bundle / m.drafter.corpus, m.model.vocab_size, m.tokenizer.vocab_digest)
    return args, corpus, m.drafter.max_ngram


if __name__ == "__main__":
    args, corpus, max_ngram = replay_args()
    if args.make_answers:
        make_answers(args.bundle, corpus, args.make_answers, args.answers)
    answers = json.loads(args.answers.read_text())
    x, y = collect(corpus, answers, max_ngram)
    half = len(answers) // 2  # fit on the first half's rows, report the loss on the second's too
    x_fit, y_fit = collect(corpus, answers[:half], max_ngram)
    x_val, y_val = collect(corpus, answers[half:], max_ngram)
    w_half = fit_logistic(x_fit, y_fit)
    w = fit_logistic(x, y)
    share_only = fit_logistic(x_val[:, :2], y_val)
    report = {
        "answers": len(answers), "rows": len(y), "accepted": round(float(y.mean()), 4),
        "weights": dict(zip(["bias", "share", "log_voters", "depth", "runner_up",
                             *[f"matched_{n}" for n in range(2, MATCHED + 1)]], np.round(w, 3).tolist())),
        "held_out_log_loss": round(log_loss(1 / (1 + np.exp(-x_val @ w_half)), y_val), 4),
        "held_out_log_loss_share_only_refit": round(log_loss(1 / (1 + np.exp(-x_val[:, :2] @ share_only)), y_val), 4),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
