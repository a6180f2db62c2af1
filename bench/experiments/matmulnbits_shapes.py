"""Time one MatMulNBits node per (bits, block size) layout at a decode row and a prefill chunk.

The 1.5B Q4_K_M carries Q4_K as 4-bit codes in blocks of 32 and Q6_K as 8-bit codes in blocks of 16; a prefill chunk
spends most of its time in these nodes. This prints which layout costs what per row, next to two references of
the same shape (an fp32 MatMul; an int8 GEMM with per-column weight scales, DynamicQuantizeMatMul), so the prefill
gap to llama.cpp can be placed on a kernel.

  python bench/experiments/matmulnbits_shapes.py --k 8960 --n 1536 --rows 1,16,256 -o bench/results/qwen/matmulnbits_shapes_ffn_down.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


def node_model(k: int, n: int, bits: int, block: int, zero_points: bool, accuracy_level: int) -> bytes:
    rng = np.random.default_rng(0)
    n_blocks = k // block
    blob = block * bits // 8
    b = rng.integers(0, 256, size=(n, n_blocks, blob), dtype=np.uint8)  # [N, K/bs, bs*bits/8]
    scales = (rng.random(n * n_blocks, dtype=np.float32) * 0.01).astype(np.float32)  # [N*K/bs]
    inits = [onnx.numpy_helper.from_array(b, "B"), onnx.numpy_helper.from_array(scales, "S")]
    inputs = ["A", "B", "S"]
    if zero_points:
        zp_per_byte = 8 // bits
        zp = rng.integers(0, 256, size=(n * ((n_blocks + zp_per_byte - 1) // zp_per_byte),), dtype=np.uint8)
        inits.append(onnx.numpy_helper.from_array(zp, "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def reference_model(k: int, n: int, op: str) -> bytes:
    rng = np.random.default_rng(0)
    if op == "fp32":
        w = rng.standard_normal((k, n), dtype=np.float32)  # [K, N]
        node, inits = helper.make_node("MatMul", ["A", "W"], ["Y"]), [onnx.numpy_helper.from_array(w, "W")]
    else:
        w = rng.integers(-127, 128, size=(k, n), dtype=np.int8)  # [K, N]
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "W", "S"], ["Y"], domain="com.microsoft")
        inits = [onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(np.full(n, 0.01, np.float32), "S")]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def time_node(model: bytes, k: int, rows: int, threads: int, repeats: int) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    a = np.random.default_rng(1).standard_normal((rows, k), dtype=np.float32)  # [M, K]
    sess.run(None, {"A": a})
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, {"A": a})
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8960)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--rows", default="1,256")
    ap.add_argument("--layouts", default="4:32:zp,4:32,8:16:zp,8:32:zp,8:32,4:64:zp")
    ap.add_argument("--accuracy-levels", default="4")
    ap.add_argument("--references", default="fp32,int8-per-column")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-o", "--out", type=Path)
    args = ap.parse_args()
    cases = [(f"MatMulNBits {layout} level {level}", layout, level)
             for level in map(int, args.accuracy_levels.split(",")) for layout in args.layouts.split(",")]
    cases += [(ref, None, None) for ref in args.references.split(",") if ref]
    results = []
    for name, layout, level in cases:
        if layout is None:
            model = reference_model(args.k, args.n, name)
        else:
            bits, block, *zp = layout.split(":")
            model = node_model(args.k, args.n, int(bits), int(block), bool(zp), level)
        for rows in map(int, args.rows.split(",")):
            s = time_node(model, args.k, rows, args.threads, args.repeats)
            gops = 2 * rows * args.k * args.n / s / 1e9
            row = {"op": name, "rows": rows, "ms": round(s * 1e3, 2), "gop_s": round(gops, 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"k": args.k, "n": args.n, "threads": args.threads,
                                        "onnxruntime": ort.__version__, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
