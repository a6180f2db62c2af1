"""Activation-aware scaling of weights before rounding (AWQ, Lin et al. 2023).

A few input channels of a layer carry most of its activation energy, so their weights' rounding errors cost the
layer's output most. Multiplying those rows of W by s > 1 gives them a finer share of their block's grid; the op
that produces the activations divides them by s, so the fp32 graph computes the same function and only the
rounding changes. Where s can move without changing anything else:

- a (Skip)SimplifiedLayerNormalization's gamma, for the MatMuls reading its normalized output (q/k/v; gate and up);
- the columns of a MatMul whose output is multiplied elementwise before the next MatMul (up -> gate*up -> down);
- the value columns of a packed q/k/v MatMul, for the MatMul reading the attention output (o_proj); a value head
  serves several query heads (grouped-query attention), so their channels share one scale.

Per site, s = e ** alpha for e each channel's RMS on the calibration text, alpha chosen from ALPHAS by the
layer's output error on that text, trace(D^T H D) with D = W - Q(W * s) / s and H = X^T X (the Gram matrices of
calibration.matmul_input_grams; alpha = 0 is plain rounding, so no site gets worse on the calibration text).
Rounding in the search is the min/max grid; the weights are then rounded by the configured method.
onnxruntime's quantizer offers AWQ only through NVIDIA ModelOpt (`nvidia-modelopt`, a large extra dependency);
this reuses the Gram matrices that GPTQ and the sensitivity ranking already collect.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from specdec.quant.grid import rounding_error

# AWQ searches 20 steps over [0, 1]; half as many keeps the search under ~2 minutes for SmolLM2-135M's 120 sites.
ALPHAS = np.linspace(0.0, 1.0, 11)
NORM_OPS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # op -> gamma's input index


@dataclass(frozen=True)
class ScaleSite:
    """Weights reading the same activations [.., K] (rows multiplied by s) and the initializer whose entries divide
    by s to compensate: a gamma [K], or columns of a weight [K', N'] (`source_index[k]`: the gamma entry or source
    column that produces input channel k; channels sharing one take one scale)."""

    weights: tuple[str, ...]
    source: str
    source_index: np.ndarray  # [K] int


def scale_sites(model: onnx.ModelProto, quantizable: set[str]) -> list[ScaleSite]:
    """Every site of the graph where a scale can move exactly, for weights in `quantizable` only (a site whose
    activations also reach anything else, e.g. a graph output or the fp32 LM head, is left alone)."""
    inits = {t.name: t for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    readers: dict[str, list] = {}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            readers.setdefault(name, []).append((n, i))
            uses[name] = uses.get(name, 0) + 1
    producer = {o: n for n in model.graph.node for o in n.output}

    def matmul_readers(x: str) -> tuple[str, ...] | None:
        """The weights of the MatMuls reading x as their input, if they are x's only readers and quantizable."""
        if x in outputs or not readers.get(x):
            return None
        ws = tuple(n.input[1] for n, i in readers[x])
        ok = all(n.op_type == "MatMul" and i == 0 and n.input[1] in quantizable for n, i in readers[x])
        return ws if ok else None

    def sole_weight(x: str) -> str | None:
        """The weight of the quantizable MatMul producing x, if x has one reader and the weight one use."""
        n = producer.get(x)
        if n is None or n.op_type != "MatMul" or n.input[1] not in quantizable or uses.get(x) != 1 or x in outputs:
            return None
        return n.input[1]

    sites = []
    for n in model.graph.node:
        if n.op_type in NORM_OPS:
            gamma = n.input[NORM_OPS[n.op_type]]
            ws = matmul_readers(n.output[0])
            if ws and gamma in inits and uses[gamma] == 1:
                sites.append(ScaleSite(ws, gamma, np.arange(inits[gamma].dims[0])))
        elif n.op_type == "Mul":
            ws = matmul_readers(n.output[0])
            for side in n.input:
                src = sole_weight(side)
                if ws and src is not None:
                    sites.append(ScaleSite(ws, src, np.arange(inits[src].dims[1])))
                    break
        elif n.op_type == "GroupQueryAttention":
            a = {x.name: x.i for x in n.attribute}
            ws = matmul_readers(n.output[0])
            packed = len(n.input) > 2 and not n.input[1] and not n.input[2]
            src = sole_weight(n.input[0]) if packed else None
            if ws and src is not None:
                heads, kv_heads = a["num_heads"], a["kv_num_heads"]
                width = inits[src].dims[1]  # q, k, v columns side by side
                head_dim = width // (heads + 2 * kv_heads)
                channel = np.arange(heads * head_dim)  # o_proj input channel = query head h, dim d
                h, d = channel // head_dim, channel % head_dim
                v0 = (heads + kv_heads) * head_dim
                sites.append(ScaleSite(ws, src, v0 + (h // (heads // kv_heads)) * head_dim + d))
    return sites


def _site_scale(site: ScaleSite, W: dict[str, np.ndarray], H: np.ndarray, bits: int, block_size: int,
                symmetric: bool) -> tuple[np.ndarray, float, float]:
    """(s [K], alpha, error / error at alpha 0) for one site."""
    rms = np.sqrt(np.maximum(np.diag(H), 0.0))  # [K] up to a constant (the number of calibration rows)
    # channels fed by one source entry take one scale: their mean RMS
    n_src = int(site.source_index.max()) + 1
    per_source = np.bincount(site.source_index, rms, n_src) / np.maximum(np.bincount(site.source_index, None, n_src), 1)
    energy = np.maximum(per_source[site.source_index], 1e-8 * max(rms.max(), 1e-30))  # [K]
    best = None
    for alpha in ALPHAS:
        s = energy ** alpha
        s = s / np.sqrt(s.max() * s.min())  # centred around 1, as AWQ does: no channel pushed far from fp32 range
        err = sum(rounding_error(w * s[:, None], H / np.outer(s, s), bits, block_size, symmetric, np.float32)
                  for w in W.values())
        if best is None or err < best[1]:
            best = (s, err, alpha)
        if alpha == 0.0:
            base = err
    s, err, alpha = best
    return s, float(alpha), err / base if base > 0 else 1.0


def fold_scale(model: onnx.ModelProto, site: ScaleSite, s: np.ndarray) -> None:
    """Multiply the site's weight rows by s [K] and divide its source by s, in place: the fp32 graph computes the
    same function. Channels sharing a source entry must have equal s."""
    inits = {t.name: t for t in model.graph.initializer}
    for w in site.weights:
        W = numpy_helper.to_array(inits[w]).astype(np.float64)  # [K, N]
        inits[w].CopyFrom(numpy_helper.from_array((W * s[:, None]).astype(np.float32), w))
    src = numpy_helper.to_array(inits[site.source]).astype(np.float64)  # [K] gamma, or [K', N'] weight
    divisor = np.ones(src.shape[-1])
    divisor[site.source_index] = s
    inits[site.source].CopyFrom(numpy_helper.from_array((src / divisor).astype(np.float32), site.source))


def scale_for_rounding(model: onnx.ModelProto, grams: dict[str, np.ndarray], bits: int, block_size: int,
                       symmetric: bool, frozen: frozenset[str] = frozenset()
                       ) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict]:
    """The graph with AWQ scales folded in (the same function in fp32), the Gram matrices of its weights' new
    inputs (X / s: H / s s^T), and a record {weights: [alpha, error / plain rounding's]} per scaled site.
    Sites with a weight in `frozen` are left alone: scaling its rows would move it off a grid it lies on (a GGUF's
    4-bit blocks, which a sensitive weight in smaller blocks re-encodes exactly). Scaling a weight's columns keeps
    every block on a grid, so a frozen weight may still be a site's source."""
    inits = {t.name: t for t in model.graph.initializer}
    grams = dict(grams)
    record = {}
    for site in scale_sites(model, set(grams)):
        if frozen.intersection(site.weights):
            continue
        W = {w: numpy_helper.to_array(inits[w]).astype(np.float64) for w in site.weights}  # [K, N] each
        H = grams[site.weights[0]]  # the weights of a site read the same activations
        s, alpha, ratio = _site_scale(site, W, H, bits, block_size, symmetric)
        if alpha == 0.0:
            continue
        fold_scale(model, site, s)
        for w in site.weights:
            grams[w] = H / np.outer(s, s)
        record["+".join(site.weights)] = [round(alpha, 3), round(ratio, 4)]
    return model, grams, record
