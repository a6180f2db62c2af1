"""Weight-only quantization of a decoder graph's MatMul weights to onnxruntime MatMulNBits.

accuracy_level decides the kernel: 4 computes with int8 activations and is fastest, but its T=1 and
T>1 paths round differently (logits differ by up to ~0.85, FACTS), so a target quantized that way is
not lossless under speculation. 0/1 keeps fp32 activations: T-invariant. A drafter may use 4 freely,
since its numerics never reach the output.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx


METHODS = ("rtn", "minmax")


@dataclass(frozen=True)
class WeightQuantConfig:
    bits: int = 4  # 4 or 8
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0  # 0 = fp32 activations (T-invariant); 4 = int8 activations (fast, not T-invariant)
    # "rtn": onnxruntime's quantizer (integer zero points). "minmax": specdec's (quantize_minmax): each weight
    # first re-encoded exactly where its values already lie on a 4- or 8-bit block grid (a GGUF's Q4_1/Q8_0
    # weights, dequantized at export), else round-to-nearest at `bits` (the LM head at `head_bits`).
    method: str = "rtn"
    # minmax: bits of the LM head when not exact (None = `bits`); 32 keeps it in fp32 (and tied to the embedding)
    head_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.head_bits not in (None, 4, 8, 32):
            raise ValueError(f"bits must be 4 or 8, got {self.bits} (head {self.head_bits})")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level}")

    @property
    def quantizes_head(self) -> bool:
        """False: the LM head stays fp32, so a tied head keeps sharing its one matrix with the embedding."""
        return self.head_bits != 32

    @property
    def t_invariant(self) -> bool:
        return self.accuracy_level != 4

    def to_dict(self) -> dict:
        return {**asdict(self), "method": f"matmul_nbits_{self.method}"}


def quantize_weights(model: onnx.ModelProto, cfg: WeightQuantConfig) -> onnx.ModelProto:
    """Replace every MatMul with a constant weight by MatMulNBits. The tied Gemm head is not a MatMul:
    build the graph with DecoderWeights.with_own_lm_head() first to quantize the head too."""
    if cfg.method == "minmax":
        return quantize_minmax(model, cfg)
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

    algo = DefaultWeightOnlyQuantConfig(block_size=cfg.block_size, is_symmetric=cfg.symmetric,
                                        accuracy_level=cfg.accuracy_level or None, bits=cfg.bits,
                                        op_types_to_quantize=("MatMul",))
    q = MatMulNBitsQuantizer(model, bits=cfg.bits, block_size=cfg.block_size, is_symmetric=cfg.symmetric,
                             accuracy_level=cfg.accuracy_level or None, algo_config=algo)
    q.process()
    return q.model.model


# Target presets: fp32 activations (accuracy_level 0), so a T-token verification computes what T single
# steps compute and greedy speculation stays token-identical.
TARGET_PRESETS = {
    "int8": WeightQuantConfig(bits=8, block_size=32, accuracy_level=0),
    # minmax: a GGUF's Q4_1 layers re-encoded bit for bit; other weights round to 4 bits. The LM head stays fp32
    # (tied to the embedding, stored once): 8-bit weights with fp32 activations have no fast kernel on CPUs
    # without VNNI (SmolLM2 on a 2-core AVX2 CPU: 108-180 ms per token with an 8-bit head, 18 ms with fp32).
    "int4": WeightQuantConfig(bits=4, block_size=32, accuracy_level=0, method="minmax", head_bits=32),
}
# Opt-in only (`specdec quantize --fast-kernels`): int8-activation kernels, 2.5-10x faster per step on a
# CPU without VNNI than the T-invariant ones (which fall back to slow paths there), but a T-token step
# rounds differently from T single steps (logits differ by up to ~1), so speculative output may differ
# from this bundle's own plain decoding. Plain decoding (one token per step) is unaffected.
FAST_TARGET_PRESETS = {
    "int8": WeightQuantConfig(bits=8, block_size=32, accuracy_level=4),
    "int4": WeightQuantConfig(bits=4, block_size=32, accuracy_level=4, method="minmax", head_bits=8),
}
# Self-drafts never reach the output, so they take the fastest kernels (int8 activations).
SELF_DRAFT_PRESETS = {
    "self-int8": WeightQuantConfig(bits=8, block_size=32, accuracy_level=4),
    "self-int4": WeightQuantConfig(bits=4, block_size=32, accuracy_level=4, method="minmax", head_bits=8),
}


# A block re-encodes "exactly" when every value is within this fraction of the block's range of its grid
# point: fp32 rounding of d*q+m leaves ~1e-7; a real (non-grid) weight misses by up to half a step (~3e-2).
EXACT_TOLERANCE = 1e-5
HEAD_NAME = "lm_head"  # the graph writer's name for the LM head MatMul node


def _grid(w: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float]:
    """Quantize blocks w [N, nb, bs] to `bits`: (q [N,nb,bs] uint8, scale [N,nb], offset [N,nb] or None, error).

    symmetric: w = scale * (q - 2^(bits-1)), scale = amax / (2^(bits-1) - 1) (how Q8_0/Q4_0 store weights).
    asymmetric: w = scale * q + offset, offset = the block's min, scale = range / (2^bits - 1) (Q4_1/Q8_1).
    error: the largest |w - dequantized| over the blocks, relative to each block's range.
    """
    if symmetric:
        half = 2 ** (bits - 1)
        scale = np.abs(w).max(-1) / (half - 1)  # [N,nb]
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint(w / safe[..., None]), -half, half - 1) + half
        offset, deq = None, safe[..., None] * (q - half)
    else:
        lo = w.min(-1)
        scale = (w.max(-1) - lo) / (2 ** bits - 1)
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint((w - lo[..., None]) / safe[..., None]), 0, 2 ** bits - 1)
        offset, deq = lo, safe[..., None] * q + lo[..., None]
    span = np.maximum(w.max(-1) - w.min(-1), np.abs(w).max(-1))[..., None]  # [N,nb,1]
    err = float((np.abs(w - deq) / np.where(span > 0, span, 1.0)).max())
    return q.astype(np.uint8), safe.astype(np.float32), offset, err


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B layout [N, nb, bs*bits/8]: 4-bit values two per byte, the first in the low nibble."""
    return q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def quantize_minmax(model: onnx.ModelProto, cfg: WeightQuantConfig) -> onnx.ModelProto:
    """MatMul(x, W) -> MatMulNBits(x, W_q) [+ MatMul(block sums of x, offsets)] for every constant W [K, N].

    Per weight, the first exact grid wins: 4-bit asymmetric, 4-bit symmetric, 8-bit symmetric, 8-bit asymmetric
    (a GGUF's Q4_1 layers and Q8_0 head come back bit for bit: the bundle is the GGUF's own weights, not a second
    rounding of them). Otherwise `bits` (the head `head_bits`) with cfg.symmetric. An asymmetric block's float
    offset m adds m * sum(x over the block) to each output: MatMulNBits's zero points are integers, so the
    offsets go through one small MatMul of the activations' block sums [.., K/bs] @ [K/bs, N] (how llama.cpp's
    Q4_1 dot product works too); every op keeps fp32 activations, so T-invariance is that of the kernels.
    """
    from onnx import numpy_helper

    bs = cfg.block_size
    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    new_nodes, new_inits, drop = [], [], set()
    choices: dict[str, int] = {}
    for node in model.graph.node:
        w_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        t = inits.get(w_name) if w_name else None
        if t is None or len(t.dims) != 2 or t.dims[0] % bs or consumers.get(w_name, 0) != 1:
            new_nodes.append(node)
            continue
        W = numpy_helper.to_array(t).astype(np.float32)  # [K, N]
        K, N = W.shape
        nb = K // bs
        blocks = np.ascontiguousarray(W.T).reshape(N, nb, bs)  # [N, nb, bs]: MatMulNBits blocks run along K
        if node.name == HEAD_NAME and not cfg.quantizes_head:
            new_nodes.append(node)
            continue
        fallback = (cfg.head_bits or cfg.bits) if node.name == HEAD_NAME else cfg.bits
        for bits, symmetric in ((4, False), (4, True), (8, True), (8, False), (fallback, cfg.symmetric)):
            q, scale, offset, err = _grid(blocks, bits, symmetric)
            if err <= EXACT_TOLERANCE:
                break
        key = f"{bits}bit_{'sym' if symmetric else 'asym'}_{'exact' if err <= EXACT_TOLERANCE else 'rtn'}"
        choices[key] = choices.get(key, 0) + 1
        base = node.name or w_name
        drop.add(w_name)
        new_inits += [numpy_helper.from_array(_pack(q, bits), f"{base}.qweight"),
                      numpy_helper.from_array(scale.reshape(-1), f"{base}.scales")]
        ins = [node.input[0], f"{base}.qweight", f"{base}.scales"]
        if offset is not None:  # integer zero point 0; the float offsets follow below
            zp_len = N * nb if bits == 8 else N * ((nb + 1) // 2)
            new_inits.append(numpy_helper.from_array(np.zeros(zp_len, dtype=np.uint8), f"{base}.zero_points"))
            ins.append(f"{base}.zero_points")
        out = node.output[0] if offset is None else f"{base}.q_out"
        new_nodes.append(onnx.helper.make_node("MatMulNBits", ins, [out], name=f"{base}.nbits", domain="com.microsoft",
                                               K=K, N=N, bits=bits, block_size=bs, accuracy_level=cfg.accuracy_level))
        if offset is not None:
            new_inits += [numpy_helper.from_array(np.array([0, 0, nb, bs], dtype=np.int64), f"{base}.block_shape"),
                          numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{base}.last_axis"),
                          numpy_helper.from_array(np.ascontiguousarray(offset.T).astype(np.float32), f"{base}.offsets")]
            mk = onnx.helper.make_node
            new_nodes += [mk("Reshape", [node.input[0], f"{base}.block_shape"], [f"{base}.x_blocks"], name=f"{base}.blocks"),  # [B,T,nb,bs]
                          mk("ReduceSum", [f"{base}.x_blocks", f"{base}.last_axis"], [f"{base}.x_sums"], name=f"{base}.sums",
                             keepdims=0),  # [B,T,nb]
                          mk("MatMul", [f"{base}.x_sums", f"{base}.offsets"], [f"{base}.off_out"], name=f"{base}.offset"),  # [B,T,N]
                          mk("Add", [f"{base}.q_out", f"{base}.off_out"], [node.output[0]], name=f"{base}.add_offset")]
    kept = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    model.metadata_props.append(onnx.StringStringEntryProto(key="specdec.minmax_choices", value=str(sorted(choices.items()))))
    return model
