"""Weight-only quantization of a decoder graph's MatMul weights to onnxruntime MatMulNBits.

accuracy_level decides the kernel: 4 computes with int8 activations and is fastest; 0/1 keeps fp32 activations.
The int8 rounding amplifies the ~1e-7 by which GroupQueryAttention's 1-token path differs from its multi-token
path into whole logits (FACTS: up to ~0.85; 1.7 measured on the default model), while multi-token steps agree bit
for bit: a target quantized with 4 is lossless under speculation only when every step runs >= 2 tokens
(GraphSpec.min_step_tokens, measured and recorded by export/quantize --fast-kernels). A drafter may use 4 freely,
since its numerics never reach the output.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, replace

import numpy as np
import onnx

from specdec.quant.grid import _blocks, _fit_grid, _grid, _pad, pack_codes, rounding_error


# rtn / hqq: onnxruntime's quantizers (round-to-nearest; HQQ's half-quadratic fit of scales and zero points,
# no data). minmax and gptq: specdec's, below (gptq: Hessian-aware rounding on calibration activations, Frantar
# et al. 2022). onnxruntime's own GPTQ (from Neural Compressor) was tried and left: on the tests' model its
# layer output error on the calibration text was 2x round-to-nearest's, and it quantized the tied LM head that
# it was told to exclude.
METHODS = ("rtn", "minmax", "hqq", "gptq")
# GPTQ's dampening: this fraction of the mean Hessian diagonal is added to it (the paper's default).
GPTQ_DAMP = 0.01


@dataclass(frozen=True)
class WeightQuantConfig:
    bits: int = 4  # 4 or 8
    block_size: int = 32
    # None: the method's better grid, as measured on SmolLM2 in blocks of 128 (bench/README.md): GPTQ
    # asymmetric (an offset per block; it fits its grids, see _fit_grid), every other method symmetric.
    symmetric: bool | None = None
    accuracy_level: int = 0  # 0 = fp32 activations (T-invariant); 4 = int8 activations (fast, not T-invariant)
    # "rtn": onnxruntime's quantizer (integer zero points). "minmax": specdec's (quantize_nbits): each weight
    # first re-encoded exactly where its values already lie on a 4- or 8-bit block grid (a GGUF's Q4_1/Q8_0
    # weights, dequantized at export), else round-to-nearest at `bits` (the LM head at `head_bits`).
    method: str = "rtn"
    # minmax: bits of the LM head when not exact (None = `bits`); 32 keeps it in fp32 (and tied to the embedding)
    head_bits: int | None = None
    # Mixed precision: this fraction of the 4-bit weights, those whose rounding changes their layer's output
    # most on calibration activations (relative squared error), is quantized finer: at 8 bits, or, with
    # sensitive_block, at 4 bits in smaller blocks (CPUs without fast 8-bit fp32-activation kernels: AVX2).
    sensitive: float = 0.0
    sensitive_block: int | None = None
    act_order: bool = False  # gptq: walk the columns by decreasing input energy (see gptq())
    # Activation-aware scales folded into the graph before rounding (quant/awq.py); calibrated.
    awq: bool = False

    def __post_init__(self) -> None:
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.method != "gptq")
        if self.bits not in (4, 8) or self.head_bits not in (None, 4, 8, 32):
            raise ValueError(f"bits must be 4 or 8, got {self.bits} (head {self.head_bits})")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level}")
        if self.method in ("hqq", "gptq") and self.bits != 4:
            raise ValueError(f"method {self.method} quantizes to 4 bits only; use rtn or minmax for 8")
        if self.act_order and self.method != "gptq":
            raise ValueError(f"act_order is a GPTQ option, not one of method {self.method!r}")
        if self.awq and self.method == "minmax":
            raise ValueError("awq scales weights off the grids minmax re-encodes exactly; use rtn, hqq or gptq")
        if not 0.0 <= self.sensitive <= 1.0 or (self.sensitive and self.bits != 4):
            raise ValueError(f"sensitive must be in [0, 1] and applies to 4-bit weights, got {self.sensitive}")
        if self.sensitive_block is not None and not (16 <= self.sensitive_block < self.block_size
                                                     and not self.sensitive_block & (self.sensitive_block - 1)):
            raise ValueError(f"sensitive_block must be a power of two >= 16 below block_size {self.block_size}, "
                             f"got {self.sensitive_block}")

    @property
    def needs_calibration(self) -> bool:
        """Whether quantize_weights needs calibration sequences (GPTQ, AWQ, or choosing weights to keep finer)."""
        return self.method == "gptq" or self.sensitive > 0 or self.awq

    @property
    def quantizes_head(self) -> bool:
        """False: the LM head stays fp32, so a tied head keeps sharing its one matrix with the embedding."""
        return self.head_bits != 32

    @property
    def t_invariant(self) -> bool:
        return self.accuracy_level != 4

    def to_dict(self) -> dict:
        return {**asdict(self), "method": f"matmul_nbits_{self.method}"}


def untie_embedding(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give the embedding Gather its own copy of a weight it shares with the LM head MatMul.

    The tied fp32 graph stores the matrix once and gathers embeddings as its columns; a weight-only
    quantizer replaces the MatMul's weight, so the Gather must keep an fp32 copy to read.
    """
    inits = {i.name: i for i in model.graph.initializer}
    matmul_weights = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0] in matmul_weights and node.input[0] in inits:
            table = onnx.numpy_helper.to_array(inits[node.input[0]])
            copy = onnx.numpy_helper.from_array(np.array(table), "embed.cols")
            model.graph.initializer.append(copy)
            node.input[0] = copy.name
    return model


def quantize_weights(model: onnx.ModelProto, cfg: WeightQuantConfig,
                     calibration: list[np.ndarray] | None = None) -> onnx.ModelProto:
    """Replace every MatMul with a constant weight by MatMulNBits. A tied LM head (cfg.quantizes_head) is
    untied first and, where its quantization is exact, serves as the embedding again (embedding_from_head).
    `calibration` (token sequences, see quant.calibration): required when cfg.needs_calibration."""
    if cfg.quantizes_head:
        model = untie_embedding(model)
    if cfg.needs_calibration and not calibration:
        raise ValueError(f"{cfg.method} with sensitive={cfg.sensitive}, awq={cfg.awq} needs calibration sequences")
    grams = None
    if cfg.needs_calibration:
        from specdec.quant.calibration import matmul_input_grams

        grams = matmul_input_grams(model, calibration, quantizable_weights(model, cfg))
    # Ranked before any AWQ scales: a weight kept in finer blocks may be on their grid already (see below).
    sensitive = sensitive_weights(model, cfg, grams) if cfg.sensitive > 0 else {}
    awq_record = None
    if cfg.awq:
        from specdec.quant.awq import scale_for_rounding

        frozen = frozenset(sensitive) if cfg.sensitive_block else frozenset()
        model, grams, awq_record = scale_for_rounding(model, grams, cfg.bits, cfg.block_size, cfg.symmetric, frozen)
    if cfg.method in ("minmax", "gptq"):
        model = quantize_nbits(model, cfg, finer=set(sensitive), grams=grams)
    else:
        model = _ort_quantize(model, cfg, exclude=sorted(sensitive.values()))
        if sensitive:  # the weights left as MatMul are the sensitive ones: 8 bits, or 4 in smaller blocks
            finer = {"block_size": cfg.sensitive_block} if cfg.sensitive_block else {"bits": 8, "method": "rtn"}
            model = _ort_quantize(model, replace(cfg, sensitive=0.0, sensitive_block=None, **finer), exclude=[])
        # after every pass: the offsets' small MatMuls must not be taken for weights by a later pass
        model = float_zero_points_as_offsets(model)
    if awq_record is not None:  # {weights: [alpha, output error / plain rounding's]} per site, for inspection
        model.metadata_props.append(onnx.StringStringEntryProto(key="specdec.awq", value=str(awq_record)))
    return embedding_from_head(model) if cfg.quantizes_head else model


@dataclass(frozen=True)
class HeadCodes:
    """A tied LM head's MatMulNBits codes as GatherBlockQuantized reads them: the codes initializer itself
    (shared by name and bytes with the graph that holds the head), per-block scales, bits and block size."""

    codes: onnx.TensorProto  # [V, nb, bs*bits/8] uint8
    scales: np.ndarray  # [V, nb, 1] float32
    bits: int
    block_size: int

    def dequantized(self) -> np.ndarray:
        """The [V, K] matrix the codes stand for."""
        from onnx import numpy_helper

        V, nb = self.scales.shape[:2]
        packed = numpy_helper.to_array(self.codes).reshape(V, nb, -1)  # [V, nb, bs*bits/8]
        q = packed if self.bits == 8 else np.stack([packed & 15, packed >> 4], -1).reshape(V, nb, self.block_size)
        return ((q.astype(np.float32) - 2 ** (self.bits - 1)) * self.scales).reshape(V, nb * self.block_size)


def head_codes(model: onnx.ModelProto) -> HeadCodes | None:
    """The codes of the graph's MatMulNBits LM head (the node writing "logits"), if it has one without zero points
    (those are not handled) and whole blocks."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    head = next((n for n in model.graph.node if n.op_type == "MatMulNBits" and list(n.output) == ["logits"]), None)
    if head is None or len(head.input) > 3 and head.input[3] or head.input[1] not in inits:
        return None
    a = {x.name: x.i for x in head.attribute}
    if a["K"] % a["block_size"]:
        return None
    scales = numpy_helper.to_array(inits[head.input[2]]).reshape(a["N"], a["K"] // a["block_size"], 1)
    codes = onnx.TensorProto()
    codes.CopyFrom(inits[head.input[1]])  # its own copy: saving the graph may move the original's bytes out
    return HeadCodes(codes=codes, scales=scales.astype(np.float32), bits=a["bits"], block_size=a["block_size"])


def embedding_from_head(model: onnx.ModelProto) -> onnx.ModelProto:
    """Gather the token embedding from the quantized LM head's codes where the embedding is the head's own
    matrix (a tied model) and the head's quantization kept it exactly (a GGUF's Q8_0 head, re-encoded bit for
    bit): GatherBlockQuantized reads the head's MatMulNBits initializer itself, so the tied weights are stored
    once again instead of an fp32 copy beside 8-bit codes (113 MB on SmolLM2-135M). Elsewhere the embedding
    stays as it is: a rounded embedding would change the model, not just its storage."""
    codes = head_codes(model)
    return model if codes is None else gather_from_codes(model, codes)


def gather_from_codes(model: onnx.ModelProto, codes: HeadCodes) -> onnx.ModelProto:
    """Replace the graph's embedding lookup (a Gather of input_ids from a constant table used by it alone) by
    GatherBlockQuantized over `codes` where the table is exactly what the codes stand for. The codes may be
    another graph's (a quantized target's head, for its EAGLE head or LayerSkip exit graph): the copy placed
    here has their name and bytes, so save_graph_sharing points it into that graph's file."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    users: dict[str, int] = {}
    for n in model.graph.node:
        for name in n.input:
            users[name] = users.get(name, 0) + 1
    gather = next((n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"
                   and n.input[0] in inits), None)
    if gather is None or users.get(gather.input[0]) != 1:
        return model
    axis = next((x.i for x in gather.attribute if x.name == "axis"), 0)
    table = numpy_helper.to_array(inits[gather.input[0]])
    table = table.T if axis == 1 else table  # [V, D]: the tied-graph layout gathers columns of [D, V]
    transpose = None
    if axis == 1:  # Gather [D, B, T] -> Transpose -> [B, T, D]
        transpose = next((n for n in model.graph.node if n.op_type == "Transpose" and n.input[0] == gather.output[0]), None)
        if transpose is None or users.get(gather.output[0]) != 1:
            return model
    V, nb = codes.scales.shape[:2]
    K = nb * codes.block_size
    if table.shape != (V, K) or np.abs(codes.dequantized() - table).max() > \
            EXACT_TOLERANCE * max(float(np.abs(table).max()), 1e-30):
        return model
    out = (transpose or gather).output[0]
    extra = [numpy_helper.from_array(codes.scales, "embed.scales"),
             numpy_helper.from_array(np.array([0, 0, K], dtype=np.int64), "embed.shape")]
    if codes.codes.name not in inits:
        extra.append(codes.codes)
    ins = [codes.codes.name, "input_ids", "embed.scales"]
    if codes.bits == 8:  # MatMulNBits's implied 8-bit zero point; GatherBlockQuantized's must be given
        extra.append(numpy_helper.from_array(np.full((V, nb, 1), 128, dtype=np.uint8), "embed.zero_points"))
        ins.append("embed.zero_points")
    mk = onnx.helper.make_node
    new = [mk("GatherBlockQuantized", ins, ["embed.blocks"], name="embed", domain="com.microsoft", gather_axis=0,
              quantize_axis=2, block_size=codes.block_size, bits=codes.bits),  # [B,T,nb,bs]
           mk("Reshape", ["embed.blocks", "embed.shape"], [out], name="embed.reshape")]  # [B,T,D]
    nodes = []
    for n in model.graph.node:
        if n is gather:
            nodes += new
        elif n is not transpose:
            nodes.append(n)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept = [t for t in model.graph.initializer if t.name != gather.input[0]]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + extra)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return model


def quantizable_weights(model: onnx.ModelProto, cfg: WeightQuantConfig) -> dict[str, str]:
    """{weight name: MatMul node name} of the weights cfg quantizes: constant [K, N] MatMul weights read by that
    node only; the LM head only if cfg.quantizes_head."""
    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    return {n.input[1]: n.name for n in model.graph.node
            if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2
            and consumers[n.input[1]] == 1 and (n.name != HEAD_NAME or cfg.quantizes_head)}


def _ort_quantize(model: onnx.ModelProto, cfg: WeightQuantConfig, exclude: list[str]) -> onnx.ModelProto:
    import logging

    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    level = cfg.accuracy_level or None
    if cfg.method == "hqq":
        algo = mnq.HQQWeightOnlyQuantConfig(block_size=cfg.block_size, bits=cfg.bits, op_types_to_quantize=("MatMul",))
    else:
        algo = mnq.DefaultWeightOnlyQuantConfig(block_size=cfg.block_size, is_symmetric=cfg.symmetric,
                                                accuracy_level=level, bits=cfg.bits, op_types_to_quantize=("MatMul",))
    if not cfg.quantizes_head:  # the head stays fp32, tied to the embedding
        exclude = [*exclude, HEAD_NAME]
    q = mnq.MatMulNBitsQuantizer(model, bits=cfg.bits, block_size=cfg.block_size, is_symmetric=cfg.symmetric,
                                 accuracy_level=level, nodes_to_exclude=exclude, algo_config=algo)
    with warnings.catch_warnings():  # HQQ hands torch read-only numpy views; it only reads them
        warnings.simplefilter("ignore", UserWarning)
        q.process()
    out = q.model.model  # the quantizer keeps its result wrapped in an ONNXModel
    if cfg.method == "hqq":
        if level is not None:  # its node writer leaves the kernel choice unset
            for node in out.graph.node:
                if node.op_type == "MatMulNBits":
                    attr = [a for a in node.attribute if a.name == "accuracy_level"]
                    if attr:
                        attr[0].i = level
                    else:
                        node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    return out


def sensitive_weights(model: onnx.ModelProto, cfg: WeightQuantConfig, grams: dict[str, np.ndarray]) -> dict[str, str]:
    """{weight name: MatMul node name} of the cfg.sensitive fraction of weights whose `bits`-bit rounding
    changes the MatMul's output most on the calibration activations X: ||X (W - Q(W))||^2 / ||X W||^2, from the
    Gram matrix H = X^T X as trace(D^T H D) / trace(W^T H W)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes = quantizable_weights(model, cfg)
    error = {}
    for w_name in nodes:
        W, H = numpy_helper.to_array(inits[w_name]).astype(np.float64), grams[w_name]  # [K, N], [K, K]
        symmetric = cfg.symmetric or W.shape[0] % cfg.block_size != 0
        error[w_name] = rounding_error(W, H, cfg.bits, cfg.block_size, symmetric) / max((W * (H @ W)).sum(), 1e-30)
    n_keep = int(round(cfg.sensitive * len(error)))
    ranked = sorted(error, key=error.get, reverse=True)[:n_keep]
    return {w: nodes[w] for w in ranked}


def gptq(W: np.ndarray, H: np.ndarray, bits: int, bs: int, symmetric: bool, act_order: bool = False) -> tuple:
    """GPTQ rounding of W [K, N] for inputs with Gram matrix H = X^T X [K, K]: columns of K are rounded one by
    one, each one's rounding error spread over the not-yet-rounded ones through the inverse Hessian, so the
    layer's output on X moves least. Block scales are set (like _fit_grid) from the block's values when the walk
    reaches it. `act_order`: the walk takes the columns with the largest input energy (diag H) first, while
    they can still absorb the most error; the blocks then mix in the walk, so their scales are fixed first from
    the original weights ("static groups"). Returns _grid's (q [N,nb,bs], scale [N,nb], offset [N,nb] or None)."""
    K, N = W.shape
    Wt = np.array(W.T, dtype=np.float64)  # [N, K]: GPTQ works on rows = outputs
    H = np.array(H, dtype=np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    Wt[:, dead] = 0.0
    H[np.diag_indices(K)] += GPTQ_DAMP * np.mean(np.diag(H))
    nb = K // bs
    scale, offset = np.empty((N, nb)), np.zeros((N, nb))  # [N, nb]
    order = np.arange(K)  # [K] column walked at step j
    if act_order:
        order = np.argsort(-np.diag(H), kind="stable")
        _, static_scale, static_offset = _fit_grid(Wt.reshape(N, nb, bs), bits, symmetric)
        scale[:] = static_scale
        offset[:] = 0.0 if static_offset is None else static_offset
        Wt, H = Wt[:, order], H[np.ix_(order, order)]
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: inv(H) = U^T U
    q = np.empty((N, K), dtype=np.uint8)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
    for b0 in range(0, K, bs):  # bs walked columns at a time; later columns get their error in one GEMM
        b1 = b0 + bs
        block = Wt[:, b0:b1].copy()  # [N, bs]
        if not act_order:  # the walk's chunk is a quantization block: its grid from its current values
            _, sb, ob = _fit_grid(block[:, None, :], bits, symmetric)
            scale[:, b0 // bs] = sb[:, 0]
            offset[:, b0 // bs] = 0.0 if ob is None else ob[:, 0]
        errors = np.empty((N, bs))  # [N, bs]
        for j in range(bs):
            column = order[b0 + j]
            sb, ob = scale[:, column // bs], offset[:, column // bs]  # [N] its quantization block's grid
            qj = np.clip(np.rint((block[:, j] - ob) / sb), lo, hi)
            q[:, column] = qj - lo
            errors[:, j] = (block[:, j] - (sb * qj + ob)) / U[b0 + j, b0 + j]
            block[:, j + 1:] -= np.outer(errors[:, j], U[b0 + j, b0 + j + 1:b1])
        Wt[:, b1:] -= errors @ U[b0:b1, b1:]
    return q.reshape(N, nb, bs), scale.astype(np.float32), None if symmetric else offset.astype(np.float32)


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


def pack_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits's uint8 zero points from [N, nb] integers: one byte each for 8 bits; for 4 bits two per byte, low
    nibble first, each row padded to whole bytes ([N * ceil(nb/2)])."""
    if bits == 8:
        return np.ascontiguousarray(zp, dtype=np.uint8).reshape(-1)
    N, nb = zp.shape
    padded = np.zeros((N, nb + nb % 2), dtype=np.uint8)
    padded[:, :nb] = zp
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)


def emit_nbits(x: str, y: str, base: str, grid: tuple, bits: int, block_size: int, K: int,
                accuracy_level: int, sums: dict | None = None) -> tuple[list, list]:
    """Nodes and initializers computing y = x @ W for W given as _grid's (q [N,nb,bs], scale [N,nb], offset
    [N,nb] or None): MatMulNBits on the integer codes, plus, for a float block offset m, m * (x's block sums)
    through one small MatMul. MatMulNBits's zero points are integers; float ones (HQQ's) fall to a slow
    dequantizing kernel on CPUs, so they come here as offsets too. A K that is not a multiple of the block is
    zero-padded before the block sums. `sums` {(x, block size): block sums tensor} shares one x's block sums
    among the weights that read it (each small op costs ~5 us of dispatch, which is what offsets cost)."""
    from onnx import numpy_helper

    q, scale, offset, *rest = grid
    zero_point = rest[0] if rest else None  # [N, nb] uint8 integer zero points (AWQ/GPTQ), or None
    N, nb, bs = q.shape
    mk = onnx.helper.make_node
    inits = [numpy_helper.from_array(pack_codes(q, bits), f"{base}.qweight"),
             numpy_helper.from_array(scale.reshape(-1).astype(np.float32), f"{base}.scales")]
    ins = [x, f"{base}.qweight", f"{base}.scales"]
    if offset is not None or zero_point is not None:  # integer zero points (0 under a float offset)
        zp = np.zeros((N, nb), dtype=np.uint8) if zero_point is None else zero_point.astype(np.uint8)
        inits.append(numpy_helper.from_array(pack_zero_points(zp, bits), f"{base}.zero_points"))
        ins.append(f"{base}.zero_points")
    out = y if offset is None else f"{base}.q_out"
    nodes = [mk("MatMulNBits", ins, [out], name=f"{base}.nbits", domain="com.microsoft",
                K=K, N=N, bits=bits, block_size=bs, accuracy_level=accuracy_level)]
    if offset is None:
        return nodes, inits
    sums = {} if sums is None else sums
    if (x, bs) not in sums:
        padded = x
        if K % bs:
            inits.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, nb * bs - K], dtype=np.int64), f"{base}.pad"))
            nodes.append(mk("Pad", [x, f"{base}.pad"], [f"{base}.x_padded"], name=f"{base}.pad"))  # [B,T,nb*bs]
            padded = f"{base}.x_padded"
        inits += [numpy_helper.from_array(np.array([0, 0, nb, bs], dtype=np.int64), f"{base}.block_shape"),
                  numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{base}.last_axis")]
        nodes += [mk("Reshape", [padded, f"{base}.block_shape"], [f"{base}.x_blocks"], name=f"{base}.blocks"),  # [B,T,nb,bs]
                  mk("ReduceSum", [f"{base}.x_blocks", f"{base}.last_axis"], [f"{base}.x_sums"], name=f"{base}.sums",
                     keepdims=0)]  # [B,T,nb]
        sums[(x, bs)] = f"{base}.x_sums"
    inits.append(numpy_helper.from_array(np.ascontiguousarray(offset.T).astype(np.float32), f"{base}.offsets"))
    nodes += [mk("MatMul", [sums[(x, bs)], f"{base}.offsets"], [f"{base}.off_out"], name=f"{base}.offset"),  # [B,T,N]
              mk("Add", [f"{base}.q_out", f"{base}.off_out"], [y], name=f"{base}.add_offset")]
    return nodes, inits


def float_zero_points_as_offsets(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite MatMulNBits nodes with float zero points z (HQQ's) as integer codes + float block offsets
    m = -scale * z: the same weights (scale * (q - z) = scale * q + m), computed by the fast kernels."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    new_nodes, drop = [], set()
    new_inits = []
    sums: dict = {}
    for node in model.graph.node:
        zp = inits.get(node.input[3]) if node.op_type == "MatMulNBits" and len(node.input) > 3 else None
        if zp is None or zp.data_type != onnx.TensorProto.FLOAT:
            new_nodes.append(node)
            continue
        a = {x.name: x.i for x in node.attribute}
        K, N, bits, bs = a["K"], a["N"], a["bits"], a["block_size"]
        nb = -(-K // bs)
        packed = numpy_helper.to_array(inits[node.input[1]]).reshape(N, nb, -1)
        q = packed if bits == 8 else np.stack([packed & 15, packed >> 4], -1).reshape(N, nb, bs)
        scale = numpy_helper.to_array(inits[node.input[2]]).reshape(N, nb)
        offset = -scale * numpy_helper.to_array(zp).reshape(N, nb)
        nodes, inits_ = emit_nbits(node.input[0], node.output[0], node.name, (q, scale, offset), bits=bits,
                                    block_size=bs, K=K, accuracy_level=a.get("accuracy_level", 0), sums=sums)
        new_nodes += nodes
        new_inits += inits_
        drop.update(node.input[1:4])
    kept = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return model


def quantize_nbits(model: onnx.ModelProto, cfg: WeightQuantConfig, finer: set[str] = frozenset(),
                   grams: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """MatMul(x, W) -> MatMulNBits(x, W_q) [+ MatMul(block sums of x, offsets)] for every constant W [K, N].

    Per weight, the first exact grid wins: 4-bit symmetric (no offsets to add; a Q4_0 block spanning codes -8..7
    fits an offset grid too), 4-bit asymmetric, 8-bit symmetric, 8-bit asymmetric (a GGUF's Q4_0/Q4_1 layers and
    Q8_0 head come back bit for bit: the bundle is the GGUF's own weights, not a second rounding of them).
    Otherwise `bits` (the head `head_bits`) with cfg.symmetric. An asymmetric block's float
    offset m adds m * sum(x over the block) to each output: MatMulNBits's zero points are integers, so the
    offsets go through one small MatMul of the activations' block sums [.., K/bs] @ [K/bs, N] (how llama.cpp's
    Q4_1 dot product works too); every op keeps fp32 activations, so T-invariance is that of the kernels.
    """
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    candidates = quantizable_weights(model, cfg)

    def exact(W: np.ndarray, bs: int) -> tuple[tuple, int, bool] | None:
        """(grid, bits, symmetric) of the first grid at blocks of `bs` that holds W exactly, else None."""
        padded = W.shape[0] % bs != 0  # a padded block holds zeros: only a grid holding 0 (symmetric) re-encodes it
        blocks = _blocks(_pad(W, bs), bs)  # [N, nb, bs]
        for bits, symmetric in ((4, True), (8, True)) if padded else ((4, True), (4, False), (8, True), (8, False)):
            q, scale, offset, err = _grid(blocks, bits, symmetric)
            if err <= EXACT_TOLERANCE:
                return (q, scale, offset), bits, symmetric
        return None

    def choose(node) -> tuple[tuple, int, int, str]:
        """(grid, bits, block size, choice key) of one weight."""
        w_name = node.input[1]
        W = numpy_helper.to_array(inits[w_name]).astype(np.float32)  # [K, N]
        bs, how = cfg.block_size, "exact"
        found = exact(W, bs)
        if found is None and w_name in finer and cfg.sensitive_block:
            # a sensitive weight in smaller blocks: a GGUF's own 4-bit blocks of 32 come back bit for bit
            bs = cfg.sensitive_block
            found = exact(W, bs)
        if found is not None:
            grid, bits, symmetric = found
        else:
            bits = (cfg.head_bits or cfg.bits) if node.name == HEAD_NAME else cfg.bits
            if w_name in finer and not cfg.sensitive_block:  # a sensitive weight: 8 bits
                bits = 8
            symmetric = cfg.symmetric
            if cfg.method == "gptq" and bits == cfg.bits:
                H = _pad(_pad(grams[w_name], bs).T, bs)  # [K', K']: padded inputs are dead columns
                grid, how = gptq(_pad(W, bs), H, bits, bs, symmetric, cfg.act_order), "gptq"
            else:  # min/max grids: fitted clipping helped GPTQ but cost round-to-nearest (0.754 -> 0.728)
                grid, how = _grid(_blocks(_pad(W, bs), bs), bits, symmetric)[:3], "rtn"
        key = f"{bits}bit_{'sym' if symmetric else 'asym'}_{how}" + (f"_b{bs}" if bs != cfg.block_size else "")
        return grid, bits, bs, key

    # Weights reading the same activations (a layer's gate and up) become one MatMulNBits over their concatenated
    # columns and one offsets MatMul, then a Split: per step, fewer small ops to dispatch.
    siblings: dict[str, list] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in candidates:
            siblings.setdefault(node.input[0], []).append(node)
    new_nodes, new_inits, drop = [], [], set()
    choices: dict[str, int] = {}
    sums: dict = {}
    for node in model.graph.node:
        w_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w_name not in candidates:
            new_nodes.append(node)
            continue
        if w_name in drop:  # emitted with its first sibling
            continue
        group = siblings[node.input[0]]
        chosen = [choose(n) for n in group]
        for n, (_, _, _, key) in zip(group, chosen):
            choices[key] = choices.get(key, 0) + 1
            drop.add(n.input[1])
        K = inits[w_name].dims[0]
        mergeable = len(group) > 1 and len({(bits, bs, grid[2] is None, inits[n.input[1]].dims[0])
                                             for n, (grid, bits, bs, _) in zip(group, chosen)}) == 1
        if mergeable:
            (_, bits, bs, _), widths = chosen[0], [grid[0].shape[0] for grid, *_ in chosen]
            grid = tuple(None if parts[0] is None else np.concatenate(parts, axis=0)
                         for parts in zip(*(g for g, *_ in chosen)))  # columns of every sibling, in order
            base = "+".join(n.name or n.input[1] for n in group)
            nodes, inits_ = emit_nbits(node.input[0], f"{base}.out", base, grid, bits=bits, block_size=bs, K=K,
                                        accuracy_level=cfg.accuracy_level, sums=sums)
            inits_.append(numpy_helper.from_array(np.array(widths, dtype=np.int64), f"{base}.widths"))
            nodes.append(onnx.helper.make_node("Split", [f"{base}.out", f"{base}.widths"],
                                               [n.output[0] for n in group], name=f"{base}.split", axis=-1))
            new_nodes += nodes
            new_inits += inits_
            continue
        for n, (grid, bits, bs, _) in zip(group, chosen):
            nodes, inits_ = emit_nbits(n.input[0], n.output[0], n.name or n.input[1], grid, bits=bits,
                                        block_size=bs, K=inits[n.input[1]].dims[0],
                                        accuracy_level=cfg.accuracy_level, sums=sums)
            new_nodes += nodes
            new_inits += inits_
    kept = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    model.metadata_props.append(onnx.StringStringEntryProto(key="specdec.nbits_choices", value=str(sorted(choices.items()))))
    return model
