"""Block grids of weight-only quantization: rounding blocks of weights onto a 4- or 8-bit grid, packing the codes
as MatMulNBits stores them, dequantizing them back, and the output error a grid leaves.

Numpy only. Shared by weight_only (the quantizers) and awq (which searches scales by this error), so neither
imports the other for it.
"""
from __future__ import annotations

import numpy as np


def rounding_error(W: np.ndarray, H: np.ndarray, bits: int, block_size: int, symmetric: bool,
                   dtype=np.float64) -> float:
    """trace(D^T H D), D = W - (W on min/max block grids): the squared change of the layer's output X W over the
    calibration activations whose Gram matrix is H = X^T X [K, K]; W [K, N]. `dtype` of the product (float32
    ranks candidates as well at half the time)."""
    Wp = _pad(W, block_size)  # [K', N]
    D = Wp - _dequantize(*_grid(_blocks(Wp, block_size), bits, symmetric)[:3], bits, Wp.shape)
    D = D[: W.shape[0]].astype(dtype)  # padded rows meet no activations
    return float((D * (H.astype(dtype) @ D)).sum(dtype=np.float64))


def _pad(W: np.ndarray, bs: int) -> np.ndarray:
    """W [K, N] with zero rows appended up to a multiple of the block: MatMulNBits's last block of a K that is
    not a multiple holds zeros past K (they meet no activations, so a symmetric grid stores them exactly)."""
    return np.pad(W, ((0, -W.shape[0] % bs), (0, 0)))


def _blocks(W: np.ndarray, bs: int) -> np.ndarray:
    """W [K, N] (K a multiple of bs, see _pad) -> [N, K/bs, bs]: MatMulNBits blocks run along K."""
    K, N = W.shape
    return np.ascontiguousarray(W.T).reshape(N, K // bs, bs)


def _dequantize(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, bits: int, shape) -> np.ndarray:
    """_grid's (q, scale, offset) back to W [K, N]."""
    deq = scale[..., None] * (q.astype(np.float64) - (2 ** (bits - 1) if offset is None else 0))
    if offset is not None:
        deq = deq + offset[..., None]
    K, N = shape
    return deq.reshape(N, K).T


def _symmetric_extreme(w: np.ndarray, bits: int) -> np.ndarray:
    """The value a symmetric grid maps to its end code, per block of w [N, nb, bs]: 4 bits, the value of largest
    magnitude with its sign (Q4_0); 8 bits, the largest magnitude (Q8_0)."""
    if bits != 4:
        return np.abs(w).max(-1)
    idx = np.abs(w).argmax(-1)[..., None]  # [N,nb,1]
    return np.take_along_axis(w, idx, -1)[..., 0]  # [N,nb]


def _round_to(w: np.ndarray, scale: np.ndarray, lo: np.ndarray | None, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks w [N, nb, bs] rounded onto the grid of scale [N, nb] (nonzero) and, asymmetric, offset lo [N, nb]
    (None: symmetric): (codes as stored, 0..2^bits-1 [N,nb,bs], the values they stand for [N,nb,bs])."""
    half = 2 ** (bits - 1)
    if lo is None:
        q = np.clip(np.rint(w / scale[..., None]), -half, half - 1) + half
        return q, scale[..., None] * (q - half)
    q = np.clip(np.rint((w - lo[..., None]) / scale[..., None]), 0, 2 ** bits - 1)
    return q, scale[..., None] * q + lo[..., None]


def _grid(w: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float]:
    """Quantize blocks w [N, nb, bs] to `bits`: (q [N,nb,bs] uint8, scale [N,nb], offset [N,nb] or None, error).

    symmetric: w = scale * (q - 2^(bits-1)). 8 bits: scale = amax / 127 (Q8_0). 4 bits: scale = -m / 8 for m the
    block's value of largest magnitude (Q4_0, and onnxruntime's quantizer): m lands on code -8 exactly and all 16
    codes serve the block (amax / 7 would leave one unused, a coarser step); the scale is negative where m > 0.
    asymmetric: w = scale * q + offset, offset = the block's min, scale = range / (2^bits - 1) (Q4_1/Q8_1).
    error: the largest |w - dequantized| over the blocks, relative to each block's range.
    """
    half = 2 ** (bits - 1)
    if symmetric:
        offset, scale = None, _symmetric_extreme(w, bits) / (-half if bits == 4 else half - 1)  # [N,nb]
    else:
        offset, scale = w.min(-1), (w.max(-1) - w.min(-1)) / (2 ** bits - 1)  # [N,nb]
    safe = np.where(scale != 0, scale, 1.0)
    q, deq = _round_to(w, safe, offset, bits)
    span = np.maximum(w.max(-1) - w.min(-1), np.abs(w).max(-1))[..., None]  # [N,nb,1]
    err = float((np.abs(w - deq) / np.where(span > 0, span, 1.0)).max())
    return q.astype(np.uint8), safe.astype(np.float32), offset, err


# Clipping searched by _fit_grid for GPTQ's block grids: a block's range shrunk by each of these factors (the GPTQ
# reference code's "mse" grid search, finer). GPTQ then pushes each rounding's error onto the columns not yet
# rounded, so a finer step pays; plain round-to-nearest measured worse with it (0.728 against 0.754 top-1
# agreement with fp32 on the default model in blocks of 128).
CLIP_SHRINKS = np.linspace(1.0, 0.55, 19)


def _fit_grid(w: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """_grid's (q, scale, offset) with each block's range shrunk by the CLIP_SHRINKS factor that gives the least
    squared error: at 4 bits, clipping a few outlying weights buys a finer step for all the others. 8 bits keep
    the full range (their step is already fine; clipping only adds error)."""
    if bits != 4:
        return _grid(w, bits, symmetric)[:3]
    lo0, range0, extreme = w.min(-1), w.max(-1) - w.min(-1), _symmetric_extreme(w, bits)  # [N,nb] each
    best = None  # (squared error [N,nb], codes [N,nb,bs], scale [N,nb], offset [N,nb] or None)
    for shrink in CLIP_SHRINKS:
        lo = None if symmetric else lo0 * shrink
        scale = extreme * shrink / -(2 ** (bits - 1)) if symmetric else range0 * shrink / (2 ** bits - 1)
        safe = np.where(scale != 0, scale, 1.0)
        q, deq = _round_to(w, safe, lo, bits)
        err = np.square(deq - w).sum(-1)  # [N,nb]
        if best is None:
            best = (err, q, safe, lo)
            continue
        better = err < best[0]  # [N,nb]
        best = (np.where(better, err, best[0]), np.where(better[..., None], q, best[1]),
                np.where(better, safe, best[2]), None if symmetric else np.where(better, lo, best[3]))
    _, q, scale, lo = best
    return q.astype(np.uint8), scale.astype(np.float32), lo


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B layout [N, nb, bs*bits/8]: 4-bit values two per byte, the first in the low nibble."""
    return q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
