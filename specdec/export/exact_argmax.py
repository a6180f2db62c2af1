"""The greedy choice of an fp32 LM head without reading the fp32 head: int8 scores, a proven error bound, and
exact fp32 logits for the few tokens the bound cannot rule out.

Why: at batch 1 a decode step reads every weight once, and a tied LM head is a large part of them (SmolLM2-135M:
113 MB of 540, 21%; models with 128k-256k vocabularies more). Greedy verification needs only each row's argmax.

How, per row h [D] (the final-normed hidden state) and head W [D,V]:
1. h is written as two 7-bit levels, h ~= qa*sa + qa2*sa2 (qa2 rounds what qa leaves), so |h - h_hat| <= sa2/2;
   W as int8 per column, W_hat[:,j] = qW[:,j]*sW[j], so |W - W_hat| <= sW[j]/2.
2. One MatMulInteger over the 2 x rows reads the 8-bit head (a quarter of the fp32 bytes): approx_j = h_hat.W_hat[:,j].
3. |h.W[:,j] - approx_j| <= sa2/2 * sum_i |W_ij| + sW[j]/2 * sum_i |h_hat_i| (+ a margin for float rounding)
   = bound_j, so every token j whose approx_j + bound_j reaches max_k (approx_k - bound_k) may be the argmax and no
   other can be. On the default model's answers that leaves 2 tokens at the median, ~40 at most.
4. Those columns' exact fp32 logits (a Gather of the head's columns and a small MatMul) pick the argmax.

The result is the argmax of fp32 logits computed by a MatMul, as the full head's is (the same class of rounding
as any two fp32 kernels: ~1e-6, far below the margin), so greedy output does not change. Sampling needs every
logit and still reads the full head (input logits_rows); greedy steps ask for rows of this path (argmax_rows).

Only targets whose head stays fp32 get the path (fp32 exports, the default int4). MatMulInteger takes uint8
activations here because that is CPUs' fast pairing (u8 x s8: 0.9 ms for the default model's head; s8 x s8 runs
~50x slower on onnxruntime's CPU kernels); onnxruntime's CUDA kernel takes int8 only, so on a GPU this one node
would run on the CPU. GPU device profiles export fp16 targets, which do not have the path.

Why 7 bits: on x86 CPUs without VNNI (AVX2 laptops, AMD before Zen 4) onnxruntime's u8 x s8 kernel multiplies
with VPMADDUBSW, which adds each pair of u8*s8 products into an int16 and saturates: 2 * 255 * 127 overflows it,
and the sums came out wrong by up to 1e5 (tests/test_exact_argmax.py checks a worst case). Activation codes in
[0, 127] keep every pair within 2 * 127 * 127 = 32,258 < 32,767, so the sums are exact on every CPU; the second
level still makes the activation error ~1/(63*63) of a row's largest value, far below the weights' own.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.runtime.manifest import ARGMAX_ROWS

PREFIX = "exact_argmax"
# Added to every bound: the float rounding of approx (int32 sums are exact; three float multiplies and an add,
# ~1e-6 relative on logits of magnitude < 100) and of the exact logits themselves (~1e-5). 100x that, and still
# small next to the bounds themselves (~1.7 logits on the default model), so it costs almost no candidates.
ROUNDING_MARGIN = 1e-2
# Activation codes span [-63, 63], stored as u8 [1, 127] with zero point 64: see "Why 7 bits" above.
ACTIVATION_LEVELS = 63
TINY = 1e-30  # a scale of an all-zero row: 0/TINY = 0


def int8_columns(head: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The head [D,V] as int8 per column: (codes [D,V] int8, scales [V] fp32, column L1 norms [V] fp32)."""
    head = np.asarray(head, dtype=np.float32)
    scales = np.maximum(np.abs(head).max(axis=0) / 127.0, TINY).astype(np.float32)  # [V]
    codes = np.clip(np.round(head / scales), -127, 127).astype(np.int8)  # [D,V]
    return codes, scales, np.abs(head).sum(axis=0, dtype=np.float64).astype(np.float32)


def add_exact_argmax(b, normed: str, head_name: str, head: np.ndarray, output: str = "argmax") -> None:
    """Nodes computing `output` [B,A] int64: the argmax of normed[:, argmax_rows] @ head, as described above.

    `b` is export/graph.py's _Builder (fp32), `normed` [B,T,D] the final norm's output, `head_name` the [D,V] fp32
    initializer the logits path also reads (its columns are gathered here, so no copy is stored)."""
    def n(s: str) -> str:
        return f"{PREFIX}/{s}"

    def op(op_type: str, inputs: list[str], name: str, **attrs) -> str:
        return b.op(op_type, inputs, name=n(name), **attrs)[0]

    def const(name: str, value, dtype) -> str:
        return _const(b, n(name), value, dtype)

    codes, scales, col_l1 = int8_columns(head)
    D = head.shape[0]
    q_head = const("head.codes", codes, np.int8)  # [D,V]
    half_scale = const("head.half_scale", scales / 2, np.float32)  # [V]
    half_l1 = const("head.half_l1", col_l1 / 2, np.float32)  # [V]
    level, tiny, margin = const("level", float(ACTIVATION_LEVELS), np.float32), const("tiny", TINY, np.float32), \
        const("margin", ROUNDING_MARGIN, np.float32)
    axis_last = const("axis_last", [-1], np.int64)  # ReduceSum's axes (an input); ReduceMax takes attributes

    rows = op("Gather", [normed, ARGMAX_ROWS], "rows", axis=1)  # [B,A,D]
    shape_ba = op("Shape", [rows], "rows.shape", end=2)  # [2] = (B, A)
    h = op("Reshape", [rows, const("flat", [-1, D], np.int64)], "h")  # [BA,D]

    def level_of(x: str, tag: str) -> tuple[str, str]:
        """(codes as floats in [-ACTIVATION_LEVELS, ACTIVATION_LEVELS], scale [BA,1]) of x, per row."""
        scale = op("Max", [op("Div", [op("ReduceMax", [op("Abs", [x], f"{tag}.abs")], f"{tag}.absmax",
                                         axes=[-1], keepdims=1), level], f"{tag}.scale0"), tiny], f"{tag}.scale")  # [BA,1]
        return op("Round", [op("Div", [x, scale], f"{tag}.scaled")], f"{tag}.codes"), scale

    qa, sa = level_of(h, "a1")
    qa_sa = op("Mul", [qa, sa], "a1.value")  # [BA,D]
    qa2, sa2 = level_of(op("Sub", [h, qa_sa], "a1.rest"), "a2")
    h_hat = op("Add", [qa_sa, op("Mul", [qa2, sa2], "a2.value")], "h_hat")  # [BA,D]
    # Both levels in one MatMulInteger: u8 activations in [0, 127] (codes + zero point) x s8 weights.
    zero = ACTIVATION_LEVELS + 1
    stacked = op("Cast", [op("Add", [op("Concat", [qa, qa2], "levels", axis=0), const("offset", float(zero), np.float32)],
                                "levels.shifted")], "levels.u8", to=TensorProto.UINT8)  # [2BA,D]
    dots = op("Cast", [op("MatMulInteger", [stacked, q_head, const("zero_point", zero, np.uint8)], "dots.i32")],
              "dots", to=TensorProto.FLOAT)  # [2BA,V], exact integers (< 2^24)
    dots1, dots2 = _halves(b, dots, n)
    column_scale = const("head.scale", scales, np.float32)  # [V]
    approx = op("Mul", [op("Add", [op("Mul", [dots1, sa], "approx.1"), op("Mul", [dots2, sa2], "approx.2")],
                           "approx.sum"), column_scale], "approx")  # [BA,V]
    h_l1 = op("ReduceSum", [op("Abs", [h_hat], "h_hat.abs"), axis_last], "h_hat.l1", keepdims=1)  # [BA,1]
    bound = op("Add", [op("Add", [op("Mul", [sa2, half_l1], "bound.act"), op("Mul", [h_l1, half_scale], "bound.w")],
                          "bound.sum"), margin], "bound")  # [BA,V]
    best_low = op("ReduceMax", [op("Sub", [approx, bound], "low")], "best_low", axes=[-1], keepdims=1)  # [BA,1]
    maybe = op("GreaterOrEqual", [op("Add", [approx, bound], "high"), best_low], "maybe")  # [BA,V] bool
    # Columns any row may pick; token 0 is always among them, so the set is never empty (nor is A = 0 a problem).
    anyrow = op("ReduceMax", [op("Concat", [op("Cast", [maybe], "maybe.i32", to=TensorProto.INT32),
                                            const("none", np.zeros((1, head.shape[1])), np.int32)], "maybe.padded",
                                 axis=0)], "any_row", axes=[0], keepdims=0)  # [V]
    found = op("Reshape", [op("NonZero", [anyrow], "found.nz"), const("vector", [-1], np.int64)], "found")  # [n]
    cand = op("Concat", [const("token0", [0], np.int64), found], "candidates", axis=0)  # [n+1]
    exact = op("MatMul", [h, op("Gather", [head_name, cand], "columns", axis=1)], "exact")  # [BA,n+1]
    allowed = op("Gather", [maybe, cand], "allowed", axis=1)  # [BA,n+1]
    masked = op("Where", [allowed, exact, const("never", -np.inf, np.float32)], "masked")
    pick = op("ArgMax", [masked], "pick", axis=-1, keepdims=0)  # [BA], first on ties (token 0 comes first)
    token = op("Gather", [cand, pick], "token", axis=0)  # [BA]
    b.op("Reshape", [token, shape_ba], outputs=[output], name=n("argmax"), allowzero=1)  # [B,A] (A may be 0)


def _halves(b, x: str, n) -> tuple[str, str]:
    """x [2R, ...] as its first and second R rows (Split by computed sizes works for R = 0 too)."""
    half = b.op("Div", [b.op("Shape", [x], name=n("dots.rows"), start=0, end=1)[0],
                        _const(b, n("two"), [2], np.int64)], name=n("dots.half"))[0]  # [1]
    return tuple(b.op("Split", [x, b.op("Concat", [half, half], name=n("dots.sizes"), axis=0)[0]], n_out=2,
                      name=n("dots.split"), axis=0))


def _const(b, name: str, value, dtype) -> str:
    b.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
    return name


def strip_exact_argmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (in place) with the argmax computed from its logits again, and without the argmax_rows input: what
    `specdec quantize` starts from (its head is quantized, so the fp32 columns this path gathers would be gone)."""
    g = model.graph
    if not any(node.name.startswith(PREFIX + "/") for node in g.node):
        return model
    keep = [node for node in g.node if not node.name.startswith(PREFIX + "/")]
    del g.node[:]
    g.node.extend(keep)
    g.node.append(helper.make_node("ArgMax", ["logits"], ["argmax"], name="argmax", axis=-1, keepdims=0))
    inits = [t for t in g.initializer if not t.name.startswith(PREFIX + "/")]
    del g.initializer[:]
    g.initializer.extend(inits)
    inputs = [i for i in g.input if i.name != ARGMAX_ROWS]
    del g.input[:]
    g.input.extend(inputs)
    for o in g.output:
        if o.name == "argmax":
            o.type.tensor_type.shape.dim[1].dim_param = "rows"
    return model
