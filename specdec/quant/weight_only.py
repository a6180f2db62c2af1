"""Weight-only quantization of a decoder graph's MatMul weights to onnxruntime MatMulNBits.

accuracy_level decides the kernel: 4 computes with int8 activations and is fastest, but its T=1 and
T>1 paths round differently (logits differ by up to ~0.85, FACTS), so a target quantized that way is
not lossless under speculation. 0/1 keeps fp32 activations: T-invariant. A drafter may use 4 freely,
since its numerics never reach the output.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import onnx


@dataclass(frozen=True)
class WeightQuantConfig:
    bits: int = 4  # 4 or 8
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 0  # 0 = fp32 activations (T-invariant); 4 = int8 activations (fast, not T-invariant)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level}")

    @property
    def t_invariant(self) -> bool:
        return self.accuracy_level != 4

    def to_dict(self) -> dict:
        return {"method": "matmul_nbits_rtn", **asdict(self)}


def quantize_weights(model: onnx.ModelProto, cfg: WeightQuantConfig) -> onnx.ModelProto:
    """Replace every MatMul with a constant weight by MatMulNBits (RTN). The tied Gemm head is not a MatMul:
    build the graph with DecoderWeights.with_own_lm_head() first to quantize the head too."""
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
    "int4": WeightQuantConfig(bits=4, block_size=32, accuracy_level=0),
}
# Opt-in only (`specdec quantize --fast-kernels`): int8-activation kernels, 2.5-10x faster per step on a
# CPU without VNNI than the T-invariant ones (which fall back to slow paths there), but a T-token step
# rounds differently from T single steps (logits differ by up to ~1), so speculative output may differ
# from this bundle's own plain decoding. Plain decoding (one token per step) is unaffected.
FAST_TARGET_PRESETS = {
    "int8": WeightQuantConfig(bits=8, block_size=32, accuracy_level=4),
    "int4": WeightQuantConfig(bits=4, block_size=32, accuracy_level=4),
}
# Self-drafts never reach the output, so they take the fastest kernels (int8 activations).
SELF_DRAFT_PRESETS = {
    "self-int8": WeightQuantConfig(bits=8, block_size=32, accuracy_level=4),
    "self-int4": WeightQuantConfig(bits=4, block_size=32, accuracy_level=4),
}
