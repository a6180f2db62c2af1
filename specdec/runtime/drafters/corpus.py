"""Corpus lookup (retrieval drafting, after REST): continue the context's tail the way the target's own earlier
answers continued it.

Prompt lookup only finds text that repeats inside one conversation. A corpus of the target's own answers to many
other prompts (`specdec distill-data` output, or any token file) knows the target's habits: after "In" it writes
" conclusion", after "Here are" it writes " some". The drafter tries the prompt first (a match of
LOOKUP_MIN_NGRAM tokens or more is specific to this conversation), then the corpus: the longest suffix of the
context (up to `max_ngram` tokens) found in the corpus, continued token by token with the continuation most
occurrences agree on. No model, no randomness: drafts are deterministic, like prompt lookup's. Each corpus token
carries the probability that the target agrees, from how the occurrences voted (CONFIDENCE_WEIGHTS): the draft
length policy cuts the draft where verifying more stops paying.

The corpus keeps its tokens only; its index (every position's next `max_ngram` tokens packed into one uint64 key,
sorted) is built on load, so a lookup is two binary searches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.errors import SpecdecError
from specdec.runtime.drafters.base import Draft, Reliability
from specdec.runtime.drafters.hybrid import LOOKUP_MIN_NGRAM
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.sampling import SamplingConfig

CORPUS_FORMAT = "specdec-corpus"
CORPUS_VERSION = 1
# Occurrences a continuation is counted over: a one-token suffix can occur 10^4 times; a few hundred spread over
# the corpus give the same majority at a fraction of the cost per round.
MAX_OCCURRENCES = 512
# P(accepted | the draft before it was) of a corpus token, as a logistic function of how the corpus voted for it:
# the share of the occurrences agreeing on it, log(1 + how many occurrences voted), its depth in the draft, the
# runner-up's share, and the matched context's length (1, 2, 3, 4+). Fitted by bench/experiments/
# corpus_confidence.py (bench/results/corpus_confidence.json) on greedy answers to specdec's own held-out prompts.
CONFIDENCE_WEIGHTS = {"bias": -5.381, "share": 4.456, "log_voters": 0.433, "depth": 0.191, "runner_up": 0.526,
                      "matched": (0.0, 0.313, 0.456, 1.017)}


class Corpus:
    """The target's own text, indexed by every n-gram up to `max_ngram` tokens (n-grams never span two texts)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.sep = vocab_size  # ends every text; no context token equals it, so no n-gram spans two texts
        self.bits = int(vocab_size).bit_length()  # enough for every id and sep
        self.max_ngram = 64 // self.bits
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [M] ids, sep between texts
        if self.tokens.ndim != 1 or (len(self.tokens) and (self.tokens.min() < 0 or self.tokens.max() > self.sep)):
            raise ValueError("corpus tokens must be a 1-D array of ids in [0, vocab_size]")
        padded = np.concatenate([self.tokens, np.full(self.max_ngram, self.sep, dtype=np.int64)])
        keys = np.zeros(len(self.tokens), dtype=np.uint64)  # [M] tokens[i:i+max_ngram] packed, first one highest
        for j in range(self.max_ngram):
            keys = (keys << np.uint64(self.bits)) | padded[j:j + len(self.tokens)].astype(np.uint64)
        self.order = np.argsort(keys, kind="stable")  # [M] positions by key, then by position
        self.keys = keys[self.order]  # [M] sorted

    @classmethod
    def from_texts(cls, texts: Sequence[Sequence[int]], vocab_size: int) -> "Corpus":
        parts = [np.append(np.asarray(t, dtype=np.int64), vocab_size) for t in texts if len(t)]
        return cls(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64), vocab_size)

    def save(self, path: Path, vocab_digest: str, target: str = "") -> None:
        """`target`: the fingerprint of the model whose answers these are (how export finds a shipped corpus)."""
        dtype = np.uint16 if self.sep < 2 ** 16 else np.uint32
        with open(path, "wb") as f:  # np.savez would add ".npz" to a name without it
            np.savez_compressed(f, tokens=self.tokens.astype(dtype), vocab_size=np.int64(self.vocab_size),
                                format=np.str_(CORPUS_FORMAT), version=np.int64(CORPUS_VERSION),
                                vocab_digest=np.str_(vocab_digest), target=np.str_(target))

    @classmethod
    def load(cls, path: Path, vocab_size: int, vocab_digest: str) -> "Corpus":
        try:
            with np.load(path) as d:
                fmt, version, digest = str(d["format"]), int(d["version"]), str(d["vocab_digest"])
                tokens, size = d["tokens"], int(d["vocab_size"])
        except (OSError, KeyError, ValueError) as e:
            raise SpecdecError(f"corpus file {path} is unreadable ({e})", "rebuild it with `specdec corpus`") from None
        if fmt != CORPUS_FORMAT or version != CORPUS_VERSION:
            raise SpecdecError(f"{path} is not a specdec corpus of version {CORPUS_VERSION}", "rebuild it with `specdec corpus`")
        if size != vocab_size or digest != vocab_digest:
            raise SpecdecError(f"corpus {path} was made with another tokenizer", "rebuild it with this bundle's target")
        return cls(tokens, vocab_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def _range(self, gram: Sequence[int]) -> tuple[int, int]:
        """Where keys start with `gram` (n <= max_ngram ids) in the sorted keys."""
        lo = hi = 0
        for t in gram:
            lo = (lo << self.bits) | int(t)
        hi = lo + 1
        shift = self.bits * (self.max_ngram - len(gram))
        return (int(np.searchsorted(self.keys, np.uint64(lo << shift), side="left")),
                int(np.searchsorted(self.keys, np.uint64(hi << shift), side="left")))

    def continuation(self, context: Sequence[int], k: int, min_ngram: int = 1,
                     min_share: float = 0.0) -> tuple[list[int], int]:
        """Up to k tokens following the longest tail of `context` (min_ngram..max_ngram tokens) that the corpus
        holds, each the one most of the surviving occurrences continue with, stopping before a token fewer than
        `min_share` of them agree on; and the tail's length (0: none)."""
        found = self.draft(context, k, min_ngram)
        n_kept = next((i for i, share in enumerate(found.shares) if share < min_share), len(found.tokens))
        return found.tokens[:n_kept], found.n

    def draft(self, context: Sequence[int], k: int, min_ngram: int = 1) -> "Continuation":
        """The majority continuation (see continuation()) with what each token's vote looked like."""
        for n in range(min(self.max_ngram, len(context)), min_ngram - 1, -1):
            lo, hi = self._range(context[len(context) - n:])
            if hi <= lo:
                continue
            picks = np.linspace(lo, hi - 1, num=min(hi - lo, MAX_OCCURRENCES)).astype(np.int64)  # spread, fixed
            at = self.order[picks] + n  # [m] the token after each occurrence
            found = Continuation(n=n)
            while len(found.tokens) < k:
                following = self.tokens[at]  # [m]
                following = following[following != self.sep]
                if not len(following):
                    break
                counts = np.bincount(following)
                token = int(np.argmax(counts))  # ties: the smaller id, deterministically
                found.tokens.append(token)
                found.voters.append(len(following))
                found.shares.append(float(counts[token] / len(following)))
                counts[token] = 0
                found.runner_up.append(float(counts.max() / len(following)))
                at = at[self.tokens[at] == token] + 1
            return found
        return Continuation(n=0)


@dataclass
class Continuation:
    """A corpus draft: the tokens, and per token how the occurrences that reached it voted."""

    n: int  # tokens of context matched (0: no match)
    tokens: list[int] = field(default_factory=list)
    voters: list[int] = field(default_factory=list)  # occurrences (of at most MAX_OCCURRENCES) still agreeing so far
    shares: list[float] = field(default_factory=list)  # share of the voters continuing with the token
    runner_up: list[float] = field(default_factory=list)  # share of the next most common continuation

    def confidence(self) -> np.ndarray:
        """P(token i is the target's | tokens < i were), by the logistic model fitted on specdec's own held-out
        prompts (see CONFIDENCE_WEIGHTS)."""
        w = CONFIDENCE_WEIGHTS
        depth = np.arange(len(self.tokens))  # [k]
        z = (w["bias"] + w["share"] * np.asarray(self.shares) + w["log_voters"] * np.log1p(self.voters)
             + w["depth"] * depth + w["runner_up"] * np.asarray(self.runner_up)
             + w["matched"][min(self.n, len(w["matched"])) - 1])  # [k]
        return 1.0 / (1.0 + np.exp(-z))


# Prior acceptance of a prompt-lookup token by match length (2, 3 or more), measured on specdec's own held-out
# prompts (bench/results/own_heldout_broad.jsonl, 26 greedy answers, 2,820 tokens; never Spec-Bench's questions).
# A corpus token's score is already a probability (CONFIDENCE_WEIGHTS), so its kinds start at 1. They only start
# the running estimates: each drafter learns its own from what the target accepts (Spec-Bench's questions are
# further from the corpus than specdec's own prompts, so there the corpus kinds' rates fall below 1).
LOOKUP_PRIOR = {2: 0.55, 3: 0.78}
CORPUS_KINDS = 4  # matched context lengths 1..4+ learnt apart


class CorpusDrafter:
    """Drafter (see base.py): prompt lookup where the conversation repeats itself, the corpus elsewhere. Each
    token carries a confidence (its score times the learnt reliability of its kind), which the draft length policy
    uses to cut the draft (see draft_len.py)."""

    def __init__(self, lookup: NgramDrafter, corpus: Corpus,
                 reliability: dict[tuple[str, int], Reliability] | None = None) -> None:
        """`reliability`: another drafter's, shared (the rows of a batch learn together)."""
        if lookup.config.min_ngram < LOOKUP_MIN_NGRAM:
            raise ValueError(f"the prompt lookup beside a corpus needs min_ngram >= {LOOKUP_MIN_NGRAM}: a one-token "
                             "match in the prompt predicts worse than the corpus")
        self.lookup, self.corpus = lookup, corpus
        # Kept across sequences: how reliable each kind of token is for this target on this user's prompts.
        self.reliability = reliability if reliability is not None else {
            **{("lookup", n): Reliability(p) for n, p in LOOKUP_PRIOR.items()},
            **{("corpus", n): Reliability(1.0) for n in range(1, CORPUS_KINDS + 1)}}
        self._last: tuple[tuple[str, int], list[int], list[float]] | None = None  # the last draft: kind, tokens, scores

    def begin(self, prompt_ids: Sequence[int], sampling: SamplingConfig, rng: np.random.Generator) -> None:
        self.lookup.begin(prompt_ids, sampling, rng)
        self._last = None

    def source(self, context: Sequence[int]) -> str:
        return "lookup" if self.lookup.has_match(context) else "corpus"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._last = None
        if k <= 0:
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        tokens, n = self.lookup.lookup(context, k)
        if tokens:
            kind, scores = ("lookup", min(n, max(LOOKUP_PRIOR))), np.ones(len(tokens))  # [k]
        else:
            found = self.corpus.draft(context, k)
            kind, tokens, scores = ("corpus", min(found.n, CORPUS_KINDS)), found.tokens, found.confidence()
        if not tokens:
            return Draft(tokens=np.zeros(0, dtype=np.int64))
        confidence = np.minimum(scores * self.reliability[kind].rate, 1.0)  # [k]
        self._last = (kind, list(tokens), list(scores))
        return Draft(tokens=np.asarray(tokens, dtype=np.int64), confidence=confidence)  # [<= k]

    def accept(self, n_accepted: int, next_token: int) -> None:
        if self._last is None:
            return
        kind, tokens, scores = self._last
        rel = self.reliability[kind]
        for i in range(n_accepted):
            rel.learn(True, scores[i])
        # The first token not kept was rejected, or cut before verification: either way the target's own token
        # says whether it was right (greedy: it is the target's argmax there).
        if n_accepted < len(tokens):
            rel.learn(tokens[n_accepted] == next_token, scores[n_accepted])
        self._last = None
