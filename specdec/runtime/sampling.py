"""Token selection: logits -> processed distribution -> token. Pure numpy, explicit Generator."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # Types first: a float top_k or a string temperature would otherwise fail deep inside a decode step.
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# Top-p sorts only this many leading tokens when they already hold top_p of the mass (see below).
_NUCLEUS_PREFIX = 1024


def probs_from_logits(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Logits [..., vocab] -> the distribution a token is drawn from, float64 [..., vocab], rows sum to 1.

    Order: temperature, top-k, top-p (on the top-k-renormalised distribution), renormalise.
    Greedy gives a one-hot at np.argmax (ties -> lowest index), so the acceptance rule can treat
    greedy and sampled targets the same way. Top-k ties at the k-th value keep the lowest token
    ids. -inf logits (masked tokens) get probability 0.
    """
    logits = np.asarray(logits, dtype=np.float64)  # [..., vocab]
    vocab = logits.shape[-1]
    if cfg.greedy:
        probs = np.zeros_like(logits)  # [..., vocab]
        best = np.argmax(logits, axis=-1)[..., None]  # [..., 1]
        np.put_along_axis(probs, best, 1.0, axis=-1)
        return probs

    rows = logits.reshape(-1, vocab) / cfg.temperature  # [rows, vocab]
    if np.isnan(rows).any() or not np.isfinite(rows.max(axis=1)).all():
        # A NaN or a row with no finite maximum would silently become a NaN distribution.
        raise ValueError("logits must be finite or -inf, with a finite maximum in every row")
    # Work on candidate tokens only (None: every token, in id order). Sorting costs O(vocab log vocab),
    # ~10 ms a row at 150k tokens, so only top-p sorts, and over as few candidates as is exact.
    row_max = rows.max(axis=1, keepdims=True)  # [rows, 1]
    candidates, cand_logits, total = None, rows, None
    if 0 < cfg.top_k < vocab:
        candidates = _top_k_indices(rows, cfg.top_k)  # [rows, m = top_k]
        cand_logits = np.take_along_axis(rows, candidates, axis=1)  # [rows, m]
    elif cfg.top_p < 1.0 and vocab > _NUCLEUS_PREFIX:
        # The nucleus is a prefix of the sorted tokens. If the top _NUCLEUS_PREFIX tokens (the exact
        # stable-sort prefix) hold top_p of the mass, it lies within them and only they need sorting;
        # their probabilities must still be normalised over the whole vocab, hence `total`.
        weights = np.exp(rows - row_max)  # [rows, vocab]
        total = weights.sum(axis=1, keepdims=True)  # [rows, 1]
        prefix = _top_k_indices(rows, _NUCLEUS_PREFIX)  # [rows, m = _NUCLEUS_PREFIX]
        prefix_mass = np.take_along_axis(weights, prefix, axis=1).sum(axis=1, keepdims=True)  # [rows, 1]
        if np.all(prefix_mass >= (cfg.top_p + 1e-9) * total):  # margin: rounding can't move the cut outside
            candidates, cand_logits = prefix, np.take_along_axis(rows, prefix, axis=1)
    if cfg.top_p < 1.0:
        # Stable on -x: equal logits stay in token-id order, so the nucleus is deterministic.
        order = np.argsort(-cand_logits, axis=1, kind="stable")  # [rows, m] largest first
        candidates = order if candidates is None else np.take_along_axis(candidates, order, axis=1)
        cand_logits = np.take_along_axis(cand_logits, order, axis=1)

    p = np.exp(cand_logits - row_max)  # [rows, m] max subtracted: no overflow
    p /= p.sum(axis=1, keepdims=True) if total is None else total
    if cfg.top_p < 1.0:
        # Keep a token while the mass strictly before it is < top_p: the smallest prefix whose
        # mass reaches top_p. The top token has 0 mass before it, so it always survives.
        mass_before = np.cumsum(p, axis=1) - p  # [rows, m]
        p = np.where(mass_before < cfg.top_p, p, 0.0)  # [rows, m]
        p /= p.sum(axis=1, keepdims=True)

    if candidates is None:
        return p.reshape(logits.shape)
    probs = np.zeros_like(rows)  # [rows, vocab]
    np.put_along_axis(probs, candidates, p, axis=1)
    return probs.reshape(logits.shape)


def _top_k_indices(rows: np.ndarray, k: int) -> np.ndarray:
    """Indices [rows, k] (ascending) of each row's k largest values, in O(vocab) without a sort."""
    kth = -np.partition(-rows, k - 1, axis=1)[:, k - 1:k]  # [rows, 1] the k-th largest value
    above = rows > kth  # [rows, vocab]
    at = rows == kth  # [rows, vocab]
    # The slots left after the values above the k-th go to the lowest-index ties, deterministically.
    keep = above | (at & (np.cumsum(at, axis=1) <= k - above.sum(axis=1, keepdims=True)))  # [rows, vocab]
    return np.nonzero(keep)[1].reshape(-1, k)  # exactly k per row, row-major


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw a token from a 1-D distribution by inverse CDF (one rng.random() per call).

    `probs` need not sum to exactly 1 (float32 rows don't); the draw is scaled by the total.
    Zero-mass tokens are never returned.
    """
    probs = np.asarray(probs, dtype=np.float64)  # [vocab]
    if probs.ndim != 1:
        raise ValueError(f"sample takes a 1-D distribution, got shape {probs.shape}")
    cdf = probs.cumsum()  # [vocab]
    total = cdf[-1]
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no mass")
    # side="right" picks the first token whose cdf exceeds u, which skips zero-mass tokens
    # (their cdf equals their predecessor's). random() <= 1 - 2**-53 keeps u below a normal total, but a
    # subnormal total (a row depleted down to 5e-324) rounds u up to it: then the last token with mass.
    token = int(cdf.searchsorted(rng.random() * total, side="right"))
    return token if token < len(cdf) else int(np.flatnonzero(probs)[-1])


def select_token(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    """Pick the next token from 1-D logits [vocab]. Greedy draws nothing from rng."""
    if cfg.greedy:
        return int(np.argmax(logits))
    return sample(probs_from_logits(logits, cfg), rng)


def sample_distinct(probs: np.ndarray, m: int, rng: np.random.Generator) -> tuple[list[int], np.ndarray]:
    """Draw up to m distinct tokens from a 1-D distribution without replacement, one after another.

    Returns (tokens, rows [len(tokens), vocab] float64): rows[i] is the law token i was drawn from, `probs`
    with tokens[:i] removed and renormalised. Those rows are what the tree acceptance rule needs to stay
    lossless for siblings (acceptance.tree_speculative_accept). Stops early when no mass is left.
    """
    p = np.asarray(probs, dtype=np.float64).copy()  # [vocab]
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    for _ in range(m):
        total = p.sum()
        if not total > 0.0:
            break
        rows.append(p / total)
        tokens.append(sample(p, rng))
        p[tokens[-1]] = 0.0
    return tokens, np.asarray(rows).reshape(len(tokens), p.shape[0])
