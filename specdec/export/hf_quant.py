"""Hugging Face checkpoints that carry their own quantized weights (AWQ, GPTQ) as MatMulNBits codes, exactly.

Both formats store a linear layer [out N, in K] as integer codes q, a float16 scale s and an integer zero point z per
group of `group_size` inputs: w = s * (q - z). That is MatMulNBits's own arithmetic (uint8 zero points), so the codes
are carried as they are (export/gguf_blocks.py's Carried with explicit zero points), no second rounding:

    method  bits  qweight (int32)                     qzeros (int32)                 stored zero
    awq     4     [K, N/8], packed along N, nibble    [K/g, N/8], same packing        z
                  j holding column 8i + AWQ_ORDER[j]
    gptq    4, 8  [K*bits/32, N], packed along K,     [K/g, N*bits/32], packed along  z - 1 ("gptq", v1);
                  value j at bits [j*bits, ...)       N the same way                  z ("gptq_v2")

MatMulNBits's block is 32 (16 for groups of 16): a wider group repeats its scale and zero point over its blocks (a
group of -1, one group over all of K, is written that way too), since only blocks of at most 32 keep a 1-token step
equal to a wider step's rows (MAX_BLOCK). GPTQ's act-order (desc_act: each group a scattered set of inputs, given
by `g_idx`) is carried by permuting the weight's inputs so that every group is contiguous, and gathering the
activations in the same order before the MatMulNBits (export/graph.py): the same products, summed in another order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.gguf_blocks import Carried

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ's GEMM packing: nibble j of a word holds column AWQ_ORDER[j]
METHODS = {"awq": (4,), "gptq": (4, 8)}
# MatMulNBits block for groups wider than this (and for group_size -1). With int8 activations, blocks of 16 or 32
# compute a 1-token step exactly as a wider step computes its rows; blocks of 64 or 128 differ by ~2e-6, which the
# next layers' activation rounding amplifies to ~0.3 in the logits (a 1.5B GPTQ bundle in blocks of 128 measured
# max_logit_diff_T_step_vs_2_token_steps 0.29): speculation would no longer be token-identical. A group of 128 is
# written as 4 blocks of 32 sharing its scale and zero point: the same weights, 19% more bytes in the layers.
MAX_BLOCK = 32


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # -1: one group over the whole input
    zero_offset: int  # added to the stored zero points (GPTQ v1 stores z - 1)

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "QuantScheme":
        """The scheme of config.json's `quantization_config`; one error naming what is not carried."""
        method = str(qc.get("quant_method", "")).lower()
        if method not in METHODS:
            raise SpecdecError(f"{where}: quantization {method or qc!r} is not read by specdec (it reads "
                               f"{', '.join(METHODS)})", "export an unquantized (fp16/bf16/fp32) checkpoint instead")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits not in METHODS[method]:
            raise SpecdecError(f"{where}: {method} with {bits}-bit weights is not read by specdec "
                               f"({method}: {', '.join(map(str, METHODS[method]))} bits)",
                               "export an unquantized checkpoint instead")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise SpecdecError(f"{where}: AWQ version {version!r} is not read by specdec (it reads 'gemm')",
                                   "export an AWQ GEMM or unquantized checkpoint")
            if not qc.get("zero_point", True):
                raise SpecdecError(f"{where}: AWQ without zero points is not read by specdec")
            return cls("awq", bits, group, 0)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise SpecdecError(f"{where}: GPTQ checkpoint format {fmt!r} is not read by specdec (gptq, gptq_v2)")
        # act-order (desc_act) needs nothing here: each layer's g_idx says where its inputs go (carried())
        return cls("gptq", bits, group, 1 if fmt == "gptq" else 0)

    @property
    def label(self) -> str:
        """One line for the manifest and the export's summary, e.g. "GPTQ 4-bit g128"."""
        return f"{self.method.upper()} {self.bits}-bit g{self.group_size if self.group_size > 0 else 'all'}"


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32/bits values (uint8), value j of a word at bits [j*bits, (j+1)*bits), the values of one
    word adjacent along `axis`."""
    per = 32 // bits
    u = words.view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    vals = ((u[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)  # [..., per] after the last axis
    vals = np.moveaxis(vals, -1, axis + 1 if axis >= 0 else axis)  # the values right after their word's axis
    shape = list(words.shape)
    shape[axis] *= per
    return vals.reshape(shape)


def _unpack_awq(words: np.ndarray) -> np.ndarray:
    """AWQ words [R, N/8] -> [R, N] 4-bit values in column order."""
    nib = _unpack(words, 4, axis=-1).reshape(words.shape[0], -1, 8)  # [R, N/8, 8]: nibble order
    out = np.empty_like(nib)
    out[:, :, AWQ_ORDER] = nib
    return out.reshape(words.shape[0], -1)


def codes(scheme: QuantScheme, qweight: np.ndarray, qzeros: np.ndarray | None, K: int, N: int
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """(q [K, N] uint8, z [G, N] uint8 or None) from the packed tensors, zero points as the arithmetic uses them."""
    if scheme.method == "awq":
        q = _unpack_awq(qweight)
        z = None if qzeros is None else _unpack_awq(qzeros)
    else:
        q = _unpack(qweight, scheme.bits, axis=0)  # [K, N]
        z = None if qzeros is None else _unpack(qzeros, scheme.bits, axis=1)  # [G, N]
    if q.shape != (K, N):
        raise SpecdecError(f"packed weight unpacks to {q.shape}, expected {(K, N)}",
                           "the checkpoint's quantization_config does not match its tensors")
    if z is not None:
        z = ((z.astype(np.int16) + scheme.zero_offset) & ((1 << scheme.bits) - 1)).astype(np.uint8)
    return q, z


def _block(group: int, K: int) -> int:
    """MatMulNBits's block for a group: MAX_BLOCK where it divides the group (K for group -1), else 16."""
    span = K if group <= 0 else group
    for bs in (MAX_BLOCK, 16):
        if span % bs == 0 and bs <= span:
            return bs
    raise SpecdecError(f"group size {group} (inputs {K}) has no MatMulNBits block (a power of two >= 16 dividing it)",
                       "export with --precision fp32 to dequantize it")


def carried(scheme: QuantScheme, qweight: np.ndarray, qzeros: np.ndarray | None, scales: np.ndarray,
            g_idx: np.ndarray | None = None) -> Carried:
    """A linear layer's packed tensors -> Carried codes [N, K/block, block] with explicit zero points."""
    scales = np.asarray(scales, dtype=np.float32)  # [G, N]
    G, N = scales.shape
    K = qweight.shape[0] if scheme.method == "awq" else qweight.shape[0] * 32 // scheme.bits
    q, z = codes(scheme, qweight, qzeros, K, N)
    bs = _block(scheme.group_size, K)
    group = K if scheme.group_size <= 0 else scheme.group_size
    if K % group or K // group != G:
        raise SpecdecError(f"{G} groups of scales for {K} inputs with group size {scheme.group_size}",
                           "the checkpoint's quantization_config does not match its tensors")
    order = None
    if not trivial_groups(scheme, g_idx, K):
        order = act_order(g_idx, group, G)
        q = q[order]  # [K, N]: each group's inputs contiguous, group by group
    rep = group // bs  # MatMulNBits blocks per group
    if z is None:  # symmetric without stored zeros: the midpoint
        z = np.full((G, N), 1 << (scheme.bits - 1), dtype=np.uint8)
    return Carried(np.ascontiguousarray(q.T).reshape(N, K // bs, bs),  # [N, nb, bs]
                   np.ascontiguousarray(np.repeat(scales.T, rep, axis=1)),  # [N, nb]
                   None, scheme.bits, scheme.method.upper(),
                   np.ascontiguousarray(np.repeat(z.T, rep, axis=1)),  # [N, nb]
                   order)


def act_order(g_idx: np.ndarray, group: int, G: int) -> np.ndarray:
    """GPTQ act-order's input permutation: the inputs sorted by group (stably), so that group g is inputs
    [g*group, (g+1)*group) of the permuted weight; the graph gathers the activations in the same order. Every group
    must hold `group` inputs (GPTQ's act-order assigns them so); one error otherwise."""
    g_idx = np.asarray(g_idx, dtype=np.int64).reshape(-1)
    if g_idx.min() < 0 or g_idx.max() >= G or not np.all(np.bincount(g_idx, minlength=G) == group):
        raise SpecdecError(f"g_idx assigns inputs to groups unevenly ({G} groups of {group} expected)",
                           "export with --precision fp32 to dequantize it")
    return np.argsort(g_idx, kind="stable")


def trivial_groups(scheme: QuantScheme, g_idx: np.ndarray | None, K: int) -> bool:
    """Whether input k belongs to group k // group_size (no act-order): what MatMulNBits blocks hold."""
    if g_idx is None:
        return True
    group = K if scheme.group_size <= 0 else scheme.group_size
    return bool(np.array_equal(np.asarray(g_idx).reshape(-1), np.arange(K) // group))


def dequantize(scheme: QuantScheme, qweight: np.ndarray, qzeros: np.ndarray | None, scales: np.ndarray,
               g_idx: np.ndarray | None = None) -> np.ndarray:
    """The layer's weight as float32 [N out, K in] (act-order included): s[g(k)] * (q - z[g(k)])."""
    scales = np.asarray(scales, dtype=np.float32)  # [G, N]
    G, N = scales.shape
    K = qweight.shape[0] if scheme.method == "awq" else qweight.shape[0] * 32 // scheme.bits
    q, z = codes(scheme, qweight, qzeros, K, N)  # [K, N], [G, N]
    group = K if scheme.group_size <= 0 else scheme.group_size
    gk = np.arange(K) // group if g_idx is None else np.asarray(g_idx, dtype=np.int64).reshape(-1)  # [K]
    zf = np.float32(1 << (scheme.bits - 1)) if z is None else z[gk].astype(np.float32)  # [K, N]
    return np.ascontiguousarray((scales[gk] * (q.astype(np.float32) - zf)).T)  # [N, K]
