"""Statistical checks that sampled speculative decoding emits exactly the target's distribution.

Speculative sampling promises that every emitted token follows the target's own law given what came before.
The check here runs an engine many times from fixed prompts with different seeds, collects the first tokens of
each answer, and compares their counts with the exact counts that law predicts, read from the target itself
(`TargetLaw`): a chi-square goodness-of-fit test (`continuation_check`).

The first token of an answer comes from the prompt's prefill, before any draft is verified; it is taken as given
(its observed counts fix how many answers continue from each of its values) and the tokens after it are tested.
Cells are the sequences of those tokens, split only as deep as their expected count allows (see
`continuation_check`); a token emitted where the law, read at that prefix, gives it no mass fails the check
outright.

The tests of the engines (tests/test_sampled_lossless.py) and `specdec verify` share this code.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import numpy as np

from specdec.errors import SpecdecError
from specdec.runtime.batched import BatchRequest
from specdec.runtime.sampling import SamplingConfig, probs_from_logits
from specdec.runtime.speculative import SpecStats

if TYPE_CHECKING:
    from specdec.runtime.batched import BatchedEngine
    from specdec.runtime.engine import Engine, GenerationConfig

# Chi-square's approximation holds when every cell expects at least this many counts (Cochran's rule).
MIN_EXPECTED = 5.0

Law = Callable[[Sequence[int]], np.ndarray]  # context ids -> the next token's distribution [vocab]


class TargetLaw:
    """The target's next-token distribution after a context, as a sampled answer draws it: the target graph's
    logits for the context's last position through `probs_from_logits(sampling)`. Each context is prefilled from
    scratch on `target` (a Decoder or SplitTarget whose KV this owns), so no speculative step is involved."""

    def __init__(self, target, sampling: SamplingConfig) -> None:
        if sampling.greedy:
            raise ValueError("the law of a greedy answer is one token: compare token ids instead")
        self.target, self.sampling = target, sampling
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, context: Sequence[int]) -> np.ndarray:
        key = tuple(int(t) for t in context)
        if key not in self._cache:
            self.target.kv.reset()
            logits = self.target.prefill(np.asarray([key], dtype=np.int64))[0]  # [vocab]
            self._cache[key] = probs_from_logits(logits, self.sampling)  # [vocab]
        return self._cache[key]


@dataclass(frozen=True)
class LawCheck:
    """The outcome of a goodness-of-fit check; `pvalue` is 0 when a sequence the law rules out was emitted."""

    statistic: float
    pvalue: float
    n: int  # answers checked
    cells: int  # chi-square cells after pooling
    impossible: int  # answers holding a token the law gives no mass
    tv: float  # total variation between the observed and expected frequencies over the cells

    def __str__(self) -> str:
        return (f"chi2 {self.statistic:.1f} over {self.cells} cells, p = {self.pvalue:.3g}, TV {self.tv:.3f}, "
                f"n = {self.n}" + (f", {self.impossible} impossible" if self.impossible else ""))


def continuation_check(answers: Mapping[tuple[int, ...], Iterable[Sequence[int]]], law: Law, depth: int,
                       stop: Iterable[int] = (), min_expected: float = MIN_EXPECTED) -> LawCheck:
    """Test that the `depth` tokens after each answer's first token follow `law`.

    `answers` maps each prompt (ids) to the answers generated from it: each at least 1 + depth tokens, or ending
    earlier with a token of `stop` (EOS), whose continuation is then that token alone. Answers
    are grouped by prompt and first token; a group of n answers expects n * P(sequence | prompt, first token)
    of each continuation. A continuation's prefix is split into its next tokens where its expected count is at
    least `min_expected`; next tokens expected fewer times are pooled into one cell per prefix, and pooled cells
    still below `min_expected` into one cell for the whole check. Only the prefixes split call `law`, so the
    number of target forwards grows with the number of answers, not with the vocabulary.

    Every group fixes the sum of its cells, so the degrees of freedom are the cells less one per group with cells
    of its own only, less one for the groups sharing the pooled cell. That pooled cell adds up independent
    multinomial shares, whose variance is at most the one chi-square assumes: the p-value then errs on the large
    side, and an exact engine passes at least as often as the threshold promises.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    stop = {int(t) for t in stop}
    observed: list[float] = []
    expected: list[float] = []
    owner: list[int] = []  # the group each cell belongs to
    rest = [0.0, 0.0]  # pooled (observed, expected) of cells too small to stand alone, over every group
    pooled: set[int] = set()  # groups with a share in `rest`
    impossible = 0
    n = 0

    def cell(group: int, obs: float, exp: float) -> None:
        if exp >= min_expected:
            observed.append(obs)
            expected.append(exp)
            owner.append(group)
        elif exp > 0.0:
            rest[0] += obs
            rest[1] += exp
            pooled.add(group)

    def split(group: int, context: tuple[int, ...], tails: list[tuple[int, ...]], mass: float, left: int) -> None:
        nonlocal impossible
        p = law(context)  # [vocab]
        exp = mass * p  # [vocab] expected counts of each next token
        counts = Counter(t[0] for t in tails)
        impossible += sum(c for token, c in counts.items() if p[token] <= 0.0)
        big = np.flatnonzero(exp >= min_expected)
        for token in big:
            if left > 1 and int(token) not in stop:
                split(group, context + (int(token),), [t[1:] for t in tails if t[0] == token], float(exp[token]),
                      left - 1)
            else:
                cell(group, counts.get(int(token), 0), float(exp[token]))
        small = np.ones(p.shape[0], dtype=bool)  # [vocab]
        small[big] = False
        cell(group, sum(c for token, c in counts.items() if small[token] and p[token] > 0.0), float(exp[small].sum()))

    n_groups = 0
    for prompt, seqs in answers.items():
        groups: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        for seq in seqs:
            seq = tuple(int(t) for t in seq)
            if len(seq) < 1 + depth and not (seq and seq[-1] in stop):
                raise ValueError(f"an answer has {len(seq)} tokens; the check needs {1 + depth} or a stop token")
            if seq[0] in stop:  # nothing was drafted or verified
                continue
            groups[seq[0]].append(seq[1:1 + depth])
            n += 1
        for first, tails in groups.items():
            split(n_groups, tuple(prompt) + (first,), tails, float(len(tails)), depth)
            n_groups += 1

    if rest[1] > 0.0:
        if rest[1] < min_expected and expected:  # too small alone: joined to the smallest cell
            i = int(np.argmin(expected))
            observed[i] += rest[0]
            expected[i] += rest[1]
            pooled.add(owner[i])
        else:
            observed.append(rest[0])
            expected.append(rest[1])
    obs, exp = np.asarray(observed), np.asarray(expected)  # [cells]
    tv = 0.5 * float(np.abs(obs - exp).sum()) / max(n, 1)
    if impossible:
        return LawCheck(float("inf"), 0.0, n, len(obs), impossible, tv)
    # Each group's counts sum to its size: a group whose cells are all its own fixes one more sum (one degree
    # of freedom); the groups sharing the pooled cell fix one sum together.
    constraints = (n_groups - len(pooled)) + (1 if pooled else 0)
    if len(obs) <= constraints:  # nothing left free to compare
        return LawCheck(0.0, 1.0, n, len(obs), 0, tv)
    try:  # scipy is a test dependency, not a runtime one: only this check needs it
        from scipy.stats import chisquare
    except ImportError:
        raise SpecdecError("the statistical check needs scipy", "pip install scipy") from None
    exp = exp * (obs.sum() / exp.sum())  # the same total up to rounding, as chisquare requires
    result = chisquare(obs, exp, ddof=constraints - 1)
    return LawCheck(float(result.statistic), float(result.pvalue), n, len(obs), 0, tv)


@dataclass
class Answers:
    """Answers collected from an engine, by prompt, and how many drafts they had verified and accepted."""

    by_prompt: dict[tuple[int, ...], list[list[int]]] = field(default_factory=lambda: defaultdict(list))
    drafted: int = 0
    accepted: int = 0

    def add(self, prompt_ids: Sequence[int], token_ids: Sequence[int], stats: SpecStats) -> None:
        self.by_prompt[tuple(int(t) for t in prompt_ids)].append(list(token_ids))
        self.drafted += stats.drafted
        self.accepted += stats.accepted


def answers_from_engine(engine: Engine, prompt_ids: Sequence[int], cfg: GenerationConfig,
                        seeds: Iterable[int]) -> Answers:
    """One answer per seed from `engine` (an Engine) to `prompt_ids`, each under `cfg` with that seed."""
    answers = Answers()
    for seed in seeds:
        ids: list[int] = []
        for tokens in engine.stream_ids(prompt_ids, replace(cfg, seed=seed)):
            ids += tokens
        answers.add(prompt_ids, ids, engine.last_stats)
    return answers


def answers_from_batch(engine: BatchedEngine, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
                       seeds: Iterable[int]) -> Answers:
    """Answers of a BatchedEngine: one request per seed, cycling through `prompts` (ragged rows side by side)."""
    requests = [BatchRequest(i, tuple(prompts[i % len(prompts)]), replace(cfg, seed=seed))
                for i, seed in enumerate(seeds)]
    answers = Answers()
    for req, result in engine.run(requests):
        if isinstance(result, Exception):
            raise result
        answers.add(req.prompt_ids, result.token_ids, result.stats)
    return answers
