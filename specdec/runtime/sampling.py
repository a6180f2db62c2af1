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
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Logits [..., vocab] -> the distribution a token is drawn from, float64 [..., vocab], rows sum to 1.

    Order: temperature, top-k, top-p (on the top-k-renormalised distribution), renormalise.
    Greedy gives a one-hot at np.argmax (ties -> lowest index), so the acceptance rule can treat
    greedy and sampled targets the same way. -inf logits (masked tokens) get probability 0.
    """
    logits = np.asarray(logits, dtype=np.float64)  # [..., vocab]
    vocab = logits.shape[-1]
    if cfg.greedy:
        probs = np.zeros_like(logits)  # [..., vocab]
        best = np.argmax(logits, axis=-1)[..., None]  # [..., 1]
        np.put_along_axis(probs, best, 1.0, axis=-1)
        return probs

    scaled = logits / cfg.temperature  # [..., vocab]
    # One stable sort serves both filters; stable on -x keeps equal logits in index order, so
    # top-k ties are broken towards the lower token id, deterministically.
    order = np.argsort(-scaled, axis=-1, kind="stable")  # [..., vocab] largest first
    sorted_logits = np.take_along_axis(scaled, order, axis=-1)  # [..., vocab]
    top = sorted_logits[..., :1]  # [..., 1]
    if np.isnan(scaled).any() or not np.all(np.isfinite(top)):
        # A NaN or a row with no finite maximum would silently become a NaN distribution.
        raise ValueError("logits must be finite or -inf, with a finite maximum in every row")
    p_sorted = np.exp(sorted_logits - top)  # [..., vocab] subtracting the max keeps exp from overflowing
    if 0 < cfg.top_k < vocab:
        p_sorted[..., cfg.top_k:] = 0.0
    p_sorted /= p_sorted.sum(axis=-1, keepdims=True)
    if cfg.top_p < 1.0:
        # Keep a token while the mass strictly before it is < top_p: the smallest prefix whose
        # mass reaches top_p. The top token has 0 mass before it, so it always survives.
        mass_before = np.cumsum(p_sorted, axis=-1) - p_sorted  # [..., vocab]
        p_sorted = np.where(mass_before < cfg.top_p, p_sorted, 0.0)  # [..., vocab]
        p_sorted /= p_sorted.sum(axis=-1, keepdims=True)

    probs = np.empty_like(p_sorted)  # [..., vocab]
    np.put_along_axis(probs, order, p_sorted, axis=-1)  # undo the sort
    return probs


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
    # (their cdf equals their predecessor's). No clamp is needed: random() <= 1 - 2**-53, and
    # (1 - 2**-53) * total rounds to below total for every normal float, so some cdf entry exceeds u.
    return int(cdf.searchsorted(rng.random() * total, side="right"))


def select_token(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    """Pick the next token from 1-D logits [vocab]. Greedy draws nothing from rng."""
    if cfg.greedy:
        return int(np.argmax(logits))
    return sample(probs_from_logits(logits, cfg), rng)
