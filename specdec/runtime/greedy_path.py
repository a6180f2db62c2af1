"""Per step shape, the faster of a target graph's two exact ways to its greedy choices, timed on this device.

A graph with the exact-argmax path (export/exact_argmax.py) gives a step's greedy choices two ways, both the argmax
of the step's fp32 logits: in the graph, from 8-bit scores of every token (a quarter of the head's bytes) and exact
logits for the few the error bound cannot rule out; or from every row's full logits (the fp32 head), argmax on the
host. Which is faster depends on the CPU and the width. With VNNI (AVX-512 EPYC) the 8-bit scores cost ~1 ms at
any width that verification uses. Without it (AVX2 laptops, AMD before Zen 4) onnxruntime's u8 x s8 kernel is
compute-bound: 2.0 ms of a 1-token step and 6.5 ms of a 4-token one (ORT profiler, the default model, past 300), so
from ~2-4 tokens on the fp32 head can win. By how much moves with the machine's state: two timings of the same
steps, minutes apart (ms at T = 1 / 4 / 8, graph -> logits): 25.4 -> 28.6, 38.6 -> 36.1, 58.3 -> 50.4; then 28.8
-> 32.2, 39.6 -> 38.0, 54.9 -> 55.2. So the decoder times both on the steps it runs and keeps the faster per step
shape (bench/README.md).
"""
from __future__ import annotations

from collections import defaultdict, deque

GRAPH = "graph"  # the graph's argmax output (8-bit scores + exact rescoring); no logits row computed
LOGITS = "logits"  # every row's fp32 logits, argmax on the host
PATHS = (GRAPH, LOGITS)
# Timings of each path per shape kept and compared by their minimum: interference only ever adds time, so the
# minimum of a few is the steadiest estimate of a path's own cost (medians of 3 taken during generation, where
# drafting and the cache's growth sit between steps, disagreed with a quiet micro-benchmark on 3 of 9 widths).
# Trying the slower path 4 times costs a few milliseconds once per shape.
TRIALS = 4
# Uses of a shape between two timings of the path not taken: a choice made while the machine was busy is revisited.
REVISIT_EVERY = 64


class GreedyPaths:
    """Which path a greedy step of a given shape takes: each is tried TRIALS times first (alternately, the graph's
    first), then the one with the lower minimum over its last TRIALS timings, the other now and then."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, ...], dict[str, deque]] = defaultdict(
            lambda: {p: deque(maxlen=TRIALS) for p in PATHS})
        self._uses: dict[tuple[int, ...], int] = defaultdict(int)

    def pick(self, shape: tuple[int, ...]) -> str:
        seconds = self._seconds[shape]
        untried = [p for p in PATHS if len(seconds[p]) < TRIALS]
        if untried:
            return min(untried, key=lambda p: len(seconds[p]))
        self._uses[shape] += 1
        best = self.best(shape)
        if self._uses[shape] % REVISIT_EVERY == 0:
            return LOGITS if best == GRAPH else GRAPH
        return best

    def best(self, shape: tuple[int, ...]) -> str | None:
        """The path with the lower minimum timing once both were tried TRIALS times, else None."""
        seconds = self._seconds.get(shape)
        if seconds is None or any(len(seconds[p]) < TRIALS for p in PATHS):
            return None
        return min(PATHS, key=lambda p: min(seconds[p]))

    def fastest_seconds(self) -> dict[tuple[int, ...], dict[str, float]]:
        """The fastest timing of each path per shape timed so far (for reports)."""
        return {shape: {p: min(t) for p, t in seconds.items() if t} for shape, seconds in self._seconds.items()}

    def record(self, shape: tuple[int, ...], path: str, seconds: float) -> None:
        if path not in PATHS:
            raise ValueError(f"unknown greedy path {path!r} (one of {PATHS})")
        self._seconds[shape][path].append(float(seconds))


class OnePath(GreedyPaths):
    """Every step on one path, untimed: for comparing the two ways side by side (bench/experiments/greedy_paths_ab.py)
    and for tests of one way."""

    def __init__(self, path: str) -> None:
        if path not in PATHS:
            raise ValueError(f"unknown greedy path {path!r} (one of {PATHS})")
        super().__init__()
        self.path = path

    def pick(self, shape: tuple[int, ...]) -> str:
        return self.path
