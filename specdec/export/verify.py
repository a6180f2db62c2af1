"""Check an exported graph against the transformers model it came from (or a converted graph against its source)."""
from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specdec.quant.report import t_invariance
from specdec.runtime.decoder import Decoder
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import GraphSpec
from specdec.runtime.session import RuntimeOptions

# fp32 graphs must reproduce transformers' fp32 logits to this (issue 2; measured ~1e-4 on SmolLM2).
FP32_TOLERANCE = 1e-3
# fp16 graphs, relative to the largest |logit|. Every fp16 rounding (weights, each op's output, the logits
# themselves) is off by up to 2**-11 = 4.9e-4 relative, and a decoder has ~10 of them per layer, so the
# error grows with depth: 4-5e-3 of the largest logit on the tests' 3-layer models, ~1e-2 expected on a
# 30-layer one. 5e-2 passes rounding with room and still fails what a broken fp16 graph does: activations
# past fp16's 65504 (inf/NaN logits), a mis-typed rotary table or norm (errors of the size of the logits).
FP16_RELATIVE_TOLERANCE = 5e-2


REFERENCES = ("transformers", "fp32_graph")


@dataclass(frozen=True)
class LogitCheck:
    """A graph's logits against fp32 reference logits on the same tokens."""

    reference: str  # "transformers" (export) or "fp32_graph" (a bundle's fp32 graph, for `specdec quantize`)
    max_abs_diff: float  # max |logits - reference|; NaN/inf when the graph overflowed
    max_abs_logit: float  # max |reference|: the scale a relative tolerance is taken of

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {self.reference!r}")
        if not self.max_abs_logit >= 0:
            raise ValueError(f"max_abs_logit must be >= 0, got {self.max_abs_logit}")

    def tolerance(self, precision: str) -> float | None:
        """The largest difference a correct graph of `precision` shows; None: not bounded (int8/int4 graphs
        are compared and the difference recorded, but their error is the quantizer's, reported by quant-report)."""
        if precision == "fp32":
            return FP32_TOLERANCE
        if precision == "fp16":
            return FP16_RELATIVE_TOLERANCE * max(1.0, self.max_abs_logit)
        return None

    def passes(self, precision: str) -> bool:
        tol = self.tolerance(precision)
        return tol is None or bool(self.max_abs_diff <= tol)  # False for NaN

    def to_checks(self, precision: str) -> dict:
        """The manifest's GraphSpec.checks entries."""
        checks = {f"max_abs_logit_diff_vs_{self.reference}": self.max_abs_diff,
                  f"max_abs_logit_{self.reference}": self.max_abs_logit}
        tol = self.tolerance(precision)
        if tol is not None:
            checks["tolerance"] = tol
        return checks


def graph_logits(graph_path: Path, spec: GraphSpec, ids: np.ndarray) -> np.ndarray:
    """The graph's logits [1,n,vocab] (float32) for ids [1,n]: a prefill in chunks of 32, then the last 8 in
    one multi-token step, the verification shape."""
    cfg = spec.model
    n = ids.shape[1]
    kv = KVCache.for_graph(spec, 1, n)
    # The check runs on the CPU provider whatever the graph's precision: ORT's CPU kernels take fp16, slowly.
    dec = Decoder(graph_path, spec, cfg, kv, RuntimeOptions(allow_cpu_fp16=True))
    split = n - 8
    steps = [(start, min(start + 32, split)) for start in range(0, split, 32)] + [(split, n)]
    out = []
    for start, stop in steps:
        out.append(dec.forward(ids[:, start:stop]).astype(np.float32))  # a copy: the buffer is reused
        kv.advance(stop - start)
    return np.concatenate(out, axis=1)


def _compare(reference: str, got: np.ndarray, ref: np.ndarray) -> LogitCheck:
    # np.max keeps a NaN (an overflowed graph), which then fails every tolerance.
    return LogitCheck(reference, max_abs_diff=float(np.max(np.abs(got - ref))), max_abs_logit=float(np.abs(ref).max()))


def check_logits(model, graph_path: Path, spec: GraphSpec, n_tokens: int = 48, seed: int = 0) -> LogitCheck:
    """The graph's logits on n_tokens random tokens against the transformers model's (fp32)."""
    import torch

    ids = np.random.default_rng(seed).integers(0, spec.model.vocab_size, size=(1, n_tokens))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.float().numpy()  # [1, n, vocab]
    return _compare("transformers", graph_logits(graph_path, spec, ids), ref)


def check_against_graph(ref_path: Path, ref_spec: GraphSpec, graph_path: Path, spec: GraphSpec,
                        n_tokens: int = 48, seed: int = 0) -> LogitCheck:
    """A converted graph's logits against the fp32 graph it was converted from (`specdec quantize --to fp16`)."""
    ids = np.random.default_rng(seed).integers(0, spec.model.vocab_size, size=(1, n_tokens))
    return _compare("fp32_graph", graph_logits(graph_path, spec, ids), graph_logits(ref_path, ref_spec, ids))


# int8-activation kernels round each activation block to 8 bits, so a float difference upstream, however small,
# can move a rounding step and grow layer by layer: GroupQueryAttention's 1-token (decoding) path differs from its
# multi-token path by ~1e-7, which reaches ~2-5 in the logits of the 30-layer default model (fp32 graphs: ~3e-5).
# Multi-token steps agree bit for bit whatever their width, so such a graph runs every step with >= 2 tokens.
STEP_CHECK_TOKENS = 24  # a prompt of 19 random tokens, then 5 verified as one step and as 5 single steps


def measure_min_step_tokens(graph: Path, spec: GraphSpec, seed: int = 0) -> tuple[int, dict]:
    """The step width (1 or 2) from which `graph`'s multi-token steps compute exactly what narrower steps do,
    and the differences measured (for GraphSpec.checks). 1 when neither holds: not T-invariant (the runtime
    says so when drafting on it)."""
    ids = np.random.default_rng(seed).integers(0, spec.model.vocab_size, size=STEP_CHECK_TOKENS).tolist()
    diffs = {}
    for width in (1, 2):
        s = replace(spec, min_step_tokens=width)
        dec = Decoder(graph, s, s.model, KVCache.for_graph(s, 1, len(ids)), RuntimeOptions())
        diffs[width] = t_invariance(dec, ids)
        del dec  # one session at a time: each holds the graph's prepacked weights (~1.5x its file)
        gc.collect()
    checks = {"max_logit_diff_T_step_vs_1_token_steps": diffs[1],
              "max_logit_diff_T_step_vs_2_token_steps": diffs[2]}
    min_step_tokens = 1 if diffs[1] == 0.0 else 2 if diffs[2] == 0.0 else 1
    return min_step_tokens, checks
