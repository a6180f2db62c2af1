"""The conversations behind answers of the shipped corpus, as a `specdec distill-data --prompts-file` (answered
conversations are recorded as given, so the target's hidden states come back in one teacher-forced pass instead
of being generated again).

The corpus (specdec/export/heads/*.corpus.npz) keeps only the target's answers, in the order of the distill-data
runs that wrote them (specdec/export/heads/README.md); the prompts of a run come back from its settings, because
`plan_prompts` is deterministic. Two runs are rebuilt here, the ones the EAGLE head had not trained on before
its last two epochs: the broad set with seed 1 (1,312 answers after the first 4,896) and with seed 2
(896 answers after those, reading tasks over the seed-1 answers). Each pairing is checked: the target's greedy
choices, teacher-forced along prompt + answer, must equal the answer (`--check N` sequences of each run).

    .venv/bin/python bench/experiments/corpus_conversations.py --out DATA/conversations.jsonl --check 8
    .venv/bin/specdec distill-data --prompts-file DATA/conversations.jsonl --n 0 -o DATA/conversations
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specdec.export.distill_data import DOCUMENT_MIN_TOKENS, DistillDataConfig, benchmark_texts, plan_prompts
from specdec.export.source import load_source
from specdec.spec_bench import DEFAULT_QUESTIONS

CORPUS = Path(__file__).resolve().parents[2] / "specdec/export/heads/smollm2-135m-instruct.corpus.npz"
HELD_OUT = Path(__file__).resolve().parents[1] / "results/own_heldout_broad.jsonl"
# (seed, first answer in the corpus, answers, n_prompts of the run's plan: any n whose last length-sorted window
# covers the answers gives the same order)
RUNS = ((1, 4896, 1312, 1600), (2, 6208, 896, 2000))


def corpus_answers(path: Path) -> list[np.ndarray]:
    with np.load(path) as d:
        tokens, sep = d["tokens"].astype(np.int64), int(d["vocab_size"])
    return [t[:-1] for t in np.split(tokens, np.flatnonzero(tokens == sep) + 1)[:-1]]  # texts end in a separator


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--check", type=int, default=8, help="sequences of each run checked by teacher forcing")
    args = ap.parse_args()

    import torch

    source = load_source(None)
    tok, model = source.tokenizer, source.model
    answers = corpus_answers(CORPUS)
    exclude = benchmark_texts(DEFAULT_QUESTIONS) | benchmark_texts(HELD_OUT)
    eos = int(tok.eos_token_id)
    rng = np.random.default_rng(0)
    documents: tuple = ()
    with open(args.out, "w") as f:
        for seed, first, count, n_plan in RUNS:
            cfg = DistillDataConfig(n_prompts=n_plan, seed=seed, prompt_set="broad")
            prompts = plan_prompts(cfg, [], exclude, documents)[:count]
            run = answers[first:first + count]
            for i in rng.choice(count, size=min(args.check, count), replace=False):
                text = tok.apply_chat_template(prompts[i], tokenize=False, add_generation_prompt=True)
                p = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
                ids = np.concatenate([p, run[i]])
                with torch.no_grad():
                    choices = model(torch.from_numpy(ids)[None]).logits[0].argmax(-1).numpy()  # [n]
                agree = float((choices[len(p) - 1:-1] == run[i]).mean())
                if agree < 0.99:
                    raise SystemExit(f"seed {seed} answer {i}: prompt and answer do not pair ({agree:.2f})")
            for conversation, answer in zip(prompts, run):
                body = answer[:-1] if len(answer) and answer[-1] == eos else answer
                reply = {"role": "assistant", "content": tok.decode(body.tolist())}
                f.write(json.dumps({"messages": conversation + [reply]}) + "\n")
            # the next run's reading tasks quote this run's answers, as `distill-data --documents` did
            documents = tuple(tok.decode(a.tolist(), skip_special_tokens=True).strip() for a in run
                              if len(a) >= DOCUMENT_MIN_TOKENS)
            print(f"seed {seed}: {count} conversations, {args.check} checked")


if __name__ == "__main__":
    main()
