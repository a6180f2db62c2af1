"""GGUF block formats as integer codes + block scales (+ block offsets): what MatMulNBits computes exactly.

Every carried format decodes to w = scale * (q - z) + offset per block along the input axis, with q an integer
code that fits MatMulNBits's 4 or 8 bits; z is MatMulNBits's implied zero point (8 for 4 bits, 128 for 8 bits)
where there is no offset, and 0 where there is one (it is then passed as an explicit zero point):

    format  bits  block  scale        codes q (stored)         offset
    Q4_0    4     32     d            q                         -
    Q4_1    4     32     d            q                         m
    Q4_K    4     32     d*sc         q                         -dmin*m
    Q5_0    8     32     d            q - 16 + 128              -
    Q5_1    8     32     d            q                         m
    Q5_K    8     32     d*sc         q                         -dmin*m
    Q6_K    8     16     d*sc         q - 32 + 128              -
    Q8_0    8     32     d            q + 128                   -

Products (d*sc, dmin*m) are formed in float32 as gguf's own dequantization forms them. Formats with a float
offset need the offset term (export/graph.py adds it as one small MatMul of the activations' block sums). What is not in the table (Q2_K, Q3_K, the IQ and ternary formats) is not carried: the export
names the tensor and the fallback (`--precision fp32`, which dequantizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
# bits, block size of the carried grid, bytes per GGUF block, values per GGUF block
CARRIED = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32),
    "Q5_0": (8, 32), "Q5_1": (8, 32), "Q5_K": (8, 32), "Q6_K": (8, 16), "Q8_0": (8, 32),
}
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class Carried:
    """A weight [rows, K] as MatMulNBits grids along K: w = scale * (q - zp) + offset per block. zp is the explicit
    integer `zero_point` where one is given (AWQ/GPTQ checkpoints: export/hf_quant.py), else 2**(bits-1) without an
    offset (MatMulNBits's implied zero point) and 0 with one."""

    q: np.ndarray  # [rows, nb, block] uint8
    scale: np.ndarray  # [rows, nb] float32
    offset: np.ndarray | None  # [rows, nb] float32, or None
    bits: int
    fmt: str
    zero_point: np.ndarray | None = None  # [rows, nb] uint8, or None
    # The inputs in the order the blocks hold them (GPTQ act-order groups scattered inputs): the weight reads
    # x[..., input_order], and its column j is input input_order[j]. None: inputs in order.
    input_order: np.ndarray | None = None  # [K] int64

    @property
    def block_size(self) -> int:
        return self.q.shape[2]

    def dequantize(self) -> np.ndarray:
        """[rows, K] float32, computed as the kernels compute it (for tests and reference forwards)."""
        if self.zero_point is not None:
            zp = self.zero_point[..., None].astype(np.float32)
        else:
            zp = np.float32(0 if self.offset is not None else 2 ** (self.bits - 1))
        w = self.scale[..., None] * (self.q.astype(np.float32) - zp)
        if self.offset is not None:
            w = w + self.offset[..., None]
        w = w.reshape(self.q.shape[0], -1)
        if self.input_order is not None:
            w = w[:, np.argsort(self.input_order)]  # back to the inputs' own order
        return w

    def rows(self, index) -> "Carried":
        return Carried(self.q[index], self.scale[index], None if self.offset is None else self.offset[index],
                       self.bits, self.fmt, None if self.zero_point is None else self.zero_point[index],
                       self.input_order)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry [..., 2] uint8 -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """qs [..., n/2] bytes -> [..., n]: low nibbles of all bytes first, then the high nibbles (Q4_0/Q4_1/Q5_x)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K/Q5_K super-block [n, 12] -> 6-bit (sc [n,8], m [n,8])."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def carry(fmt: str, raw: np.ndarray, K: int) -> Carried:
    """A GGUF tensor's raw bytes [rows, bytes per row] (uint8) in format `fmt` -> its Carried grids."""
    if fmt not in CARRIED:
        raise ValueError(f"format {fmt} is not carried exactly")
    bits, _ = CARRIED[fmt]
    rows = raw.shape[0]
    if fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[fmt]
        b = raw.reshape(rows, K // 32, size)  # [rows, nb, bytes]
        d = _f16(b[..., 0:2].reshape(rows, -1, 1, 2)).reshape(rows, -1)  # [rows, nb]
        if fmt == "Q8_0":
            q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return Carried(q, d, None, bits, fmt)
        if fmt in ("Q4_0", "Q4_1"):
            q = _nibbles_halves(b[..., 2 + 2 * (fmt == "Q4_1"):])  # [rows, nb, 32]
            m = _f16(b[..., 2:4].reshape(rows, -1, 1, 2)).reshape(rows, -1) if fmt == "Q4_1" else None
            return Carried(q, d, m, bits, fmt)
        start = 2 + 2 * (fmt == "Q5_1")
        qh = np.ascontiguousarray(b[..., start:start + 4]).view(np.uint32)  # [rows, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, nb, 32]
        q5 = _nibbles_halves(b[..., start + 4:]) | (high << 4)  # [rows, nb, 32] in 0..31
        if fmt == "Q5_0":
            return Carried((q5 + 112).astype(np.uint8), d, None, bits, fmt)  # q - 16 + 128
        m = _f16(b[..., 2:4].reshape(rows, -1, 1, 2)).reshape(rows, -1)
        return Carried(q5, d, m, bits, fmt)
    if fmt in ("Q4_K", "Q5_K"):
        size = 144 if fmt == "Q4_K" else 176
        b = raw.reshape(rows * (K // QK_K), size)  # one row per super-block
        n = b.shape[0]
        d, dmin = _f16(b[:, 0:2].reshape(n, 1, 2))[:, 0], _f16(b[:, 2:4].reshape(n, 1, 2))[:, 0]  # [n]
        sc, mn = _k_scale_min(b[:, 4:16])  # [n, 8] each
        scale = d[:, None] * sc.astype(np.float32)  # [n, 8]
        offset = -(dmin[:, None] * mn.astype(np.float32))  # [n, 8]
        qs = b[:, 16:] if fmt == "Q4_K" else b[:, 48:]
        # 4 chunks of 32 bytes; chunk j holds sub-blocks 2j (low nibbles) and 2j+1 (high nibbles)
        qs = qs.reshape(n, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)  # [n, 8, 32]
        if fmt == "Q5_K":
            qh = b[:, 16:48].reshape(n, 1, 32)
            high = (qh >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]: bit j -> sub-block j
            q = q | (high << 4)
        nb = (K // QK_K) * 8
        return Carried(q.astype(np.uint8).reshape(rows, nb, 32), scale.reshape(rows, nb).astype(np.float32),
                       offset.reshape(rows, nb).astype(np.float32), bits, fmt)
    # Q6_K: ql 128, qh 64, scales 16 (int8), d (f16); 16 sub-blocks of 16
    b = raw.reshape(rows * (K // QK_K), 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    ql = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # [n, half, quarter, 32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    qh = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3)  # [n, 2, 4, 32]
    q = (ql | (qh << 4)).reshape(n, 16, 16).astype(np.int16) - 32 + 128  # [n, 16, 16]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210].reshape(n, 1, 2))[:, 0]  # [n]
    nb = (K // QK_K) * 16
    return Carried(q.astype(np.uint8).reshape(rows, nb, 16), (d[:, None] * sc).reshape(rows, nb).astype(np.float32),
                   None, bits, fmt)
