"""How far lookup + corpus drafting can go on a target, whatever decides the draft lengths.

Replays the target's greedy answers (a `specdec batch` output: greedy answers do not depend on the drafter)
through the drafter the runtime uses (prompt lookup, else the bundle's corpus), drafting DRAFT tokens every round,
and prices each round with the target's measured step costs (`bench/step_curve.py`: a step of T tokens against a
1-token step). Reports, against plain decoding of the same bundle (decode only, prefill excluded):
- `fixed_L`: every round verifies min(L, drafted) tokens;
- `auto`: the runtime's own policy (draft_len.AdaptiveDraftLen with the curve as its step costs and free drafts),
  cutting each draft by its tokens' confidences as `--draft-len auto` does;
- `auto_refit` (with --refit-on): the same policy with the corpus confidence model refitted on this target
  (corpus_confidence.py's fit; a third of the corpus's answers replayed against a corpus of the other two thirds);
- `ceiling`: every round verifies exactly the tokens the target will accept (a length policy that knew the future),
  the most any draft-length policy can give with this drafter;
- tokens per target pass at L = 4 and 8 with the first 1/3, 2/3 and all of the corpus's texts (what a bigger
  corpus of the target's own answers buys).
Answers are re-tokenized from their text, which may split a few tokens differently from the generation.

    .venv/bin/python bench/experiments/corpus_ceiling.py BUNDLE --steps STEP_CURVE.json \
        --set specbench:IN.jsonl:OUT.jsonl --set own:IN2.jsonl:OUT2.jsonl [--refit-on PROMPTS.jsonl:ANSWERS.jsonl] \
        --out RESULT.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from corpus_confidence import collect, fit_logistic

from specdec.runtime.drafters import corpus as corpus_module
from specdec.runtime.draft_len import AdaptiveDraftLen
from specdec.runtime.drafters.corpus import Corpus, CorpusDrafter
from specdec.runtime.drafters.hybrid import LOOKUP_MIN_NGRAM
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.manifest import read_manifest
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.tokenizer import TextCodec

DRAFT = 8  # tokens drafted per round: the widest verification the runtime's lookup drafters use here


def read_answers(codec: TextCodec, inputs: Path, outputs: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) for every output line, the prompt rendered as the runtime renders it."""
    requests = {r["id"]: r for r in map(json.loads, inputs.read_text().splitlines())}
    pairs = []
    for line in outputs.read_text().splitlines():
        out = json.loads(line)
        req = requests[out["id"]]
        prompt = (codec.apply_chat_template(req["messages"]) if "messages" in req else codec.encode(req["prompt"]))
        pairs.append((prompt, codec.encode(out["text"])))
    return pairs


def replay(pairs, corpus: Corpus, max_ngram: int, verify_len: int | str | None,
           step_cost: dict[int, float] | None = None) -> tuple[int, list[tuple[int, int]]]:
    """Decode every answer with DRAFT-token drafts; each round verifies min(verify_len, drafted) tokens; with
    verify_len None, exactly those the target accepts; with "auto", what the runtime's policy keeps (priced by
    step_cost). Returns (answer tokens, [(verified, accepted)] per round)."""
    n_tokens, rounds = 0, []
    for prompt, answer in pairs:
        drafter = CorpusDrafter(NgramDrafter(max_ngram=max_ngram, min_ngram=LOOKUP_MIN_NGRAM), corpus)
        drafter.begin(prompt, SamplingConfig(), np.random.default_rng(0))
        policy = (AdaptiveDraftLen(verify_s=[step_cost[t] for t in range(1, DRAFT + 2)], draft_s=0.0)
                  if verify_len == "auto" else None)
        context, i = list(prompt), 0
        while i < len(answer):
            source = drafter.source(context)
            draft = drafter.propose(context, policy.next_k(DRAFT, source) if policy else DRAFT)
            if policy:
                draft = policy.cut(draft, source)
            drafted = [int(t) for t in draft.tokens]
            n_right = next((j for j, t in enumerate(drafted) if i + j >= len(answer) or t != answer[i + j]),
                           len(drafted))
            verified = (n_right if verify_len is None else len(drafted) if policy
                        else min(verify_len, len(drafted)))
            n_accepted = min(n_right, verified)
            step = answer[i:i + n_accepted + 1]  # the accepted drafts and the target's own next token
            drafter.accept(len(step) - 1, step[-1])
            if policy:
                policy.update(verified, len(step) - 1, source=source, width=verified)
            context += step
            i += len(step)
            rounds.append((verified, len(step) - 1))
        n_tokens += len(answer)
    return n_tokens, rounds


def speedup(n_tokens: int, rounds: list[tuple[int, int]], step_cost: dict[int, float]) -> float:
    """Plain decoding's cost (a 1-token step per token) over the rounds' cost (a (verified + 1)-token step each)."""
    return n_tokens / sum(step_cost[v + 1] for v, _ in rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--steps", type=Path, required=True, help="bench/step_curve.py output (target_x_one_step)")
    ap.add_argument("--set", action="append", required=True, metavar="NAME:IN.jsonl:OUT.jsonl",
                    help="a `specdec batch` input and its greedy output (repeat for several prompt sets)")
    ap.add_argument("--refit-on", metavar="IN.jsonl:OUT.jsonl",
                    help="the requests and answers the bundle's corpus was made from (`specdec corpus --answers`)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    m = read_manifest(args.bundle, verify_checksums=False)
    codec = TextCodec(args.bundle / m.tokenizer.file, m.tokenizer.chat_template, m.tokenizer.bos_token_id,
                      m.tokenizer.eos_token_ids)
    corpus = Corpus.load(args.bundle / m.drafter.corpus, m.model.vocab_size, m.tokenizer.vocab_digest)
    measured = {int(t): float(x) for t, x in json.loads(args.steps.read_text())["target_x_one_step"].items()}
    widths = sorted(measured)
    # Widths the curve skips: linear between its neighbours.
    step_cost = {t: float(np.interp(t, widths, [measured[w] for w in widths])) for t in range(1, DRAFT + 2)}
    texts = np.split(corpus.tokens, np.flatnonzero(corpus.tokens == corpus.sep) + 1)
    texts = [t[:-1] for t in texts if len(t) > 1]  # each text without its separator

    refit = None
    if args.refit_on:
        inputs, outputs = map(Path, args.refit_on.split(":"))
        answers = [{"prompt": p, "answer": a} for p, a in read_answers(codec, inputs, outputs)]
        rest = Corpus.from_texts([a["answer"] for i, a in enumerate(answers) if i % 3], m.model.vocab_size)
        w = fit_logistic(*collect(rest, answers[::3], m.drafter.max_ngram))  # bias, share, voters, depth, runner-up,
        refit = {**dict(zip(["bias", "share", "log_voters", "depth", "runner_up"], w[:5].round(3).tolist())),
                 "matched": (0.0, *w[5:].round(3).tolist())}  # matched 2..4 (1 is the baseline)

    result = {"bundle": str(args.bundle), "refit_weights": refit, "corpus_texts": len(texts), "corpus_tokens": int(sum(map(len, texts))),
              "draft": DRAFT, "step_cost": {str(t): round(c, 3) for t, c in step_cost.items()}, "sets": {}}
    for spec in args.set:
        name, inputs, outputs = spec.split(":")
        pairs = read_answers(codec, Path(inputs), Path(outputs))
        row = {"answers": len(pairs), "answer_tokens": sum(len(a) for _, a in pairs)}
        for verify_len in [*range(1, DRAFT + 1), "auto", None]:
            n_tokens, rounds = replay(pairs, corpus, m.drafter.max_ngram, verify_len, step_cost)
            key = ("ceiling" if verify_len is None else "auto" if verify_len == "auto" else f"fixed_{verify_len}")
            row[key] = {"speedup": round(speedup(n_tokens, rounds, step_cost), 3),
                        "tokens_per_pass": round(n_tokens / len(rounds), 3)}
        if refit is not None:
            shipped = dict(corpus_module.CONFIDENCE_WEIGHTS)
            corpus_module.CONFIDENCE_WEIGHTS.update(refit)  # read at each draft's confidence()
            try:
                n_tokens, rounds = replay(pairs, corpus, m.drafter.max_ngram, "auto", step_cost)
            finally:
                corpus_module.CONFIDENCE_WEIGHTS.update(shipped)
            row["auto_refit"] = {"speedup": round(speedup(n_tokens, rounds, step_cost), 3),
                                 "tokens_per_pass": round(n_tokens / len(rounds), 3)}
        row["corpus_size"] = {}
        for share in (1 / 3, 2 / 3, 1.0):
            part = Corpus.from_texts(texts[:round(share * len(texts))], m.model.vocab_size)
            row["corpus_size"][f"{share:.2f}"] = {
                "tokens": len(part) - round(share * len(texts)),
                **{f"tokens_per_pass_fixed_{k}": round(n / len(r), 3)
                   for k in (4, 8) for n, r in [replay(pairs, part, m.drafter.max_ngram, k)]}}
        result["sets"][name] = row
        print(name, json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
