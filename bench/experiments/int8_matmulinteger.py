"""Experiment (negative result, kept to be reproducible): int8 weights x int8 activations through MatMulInteger.

Rewrites every MatMul with a weight initializer of a specdec fp32 target as per-row dynamic activation
quantization (ReduceMax |x| per row -> uint8 with zero point 128) x per-column int8 weights, optionally with
SmoothQuant scales (alpha) from calibration Gram diagonals saved by `grams.py` below as /tmp/w8a8/diag.npz.
Measured against onnxruntime's quantize_dynamic and MatMulNBits 8-bit accuracy_level 4 (`specdec quantize --to
int8 --fast-kernels`) in bench/results/quant/int8_dynamic*.json: the MatMulNBits kernel was faster and closer
to fp32 than either MatMulInteger graph, so specdec ships that one as its dynamic int8.

usage: python bench/experiments/int8_matmulinteger.py SRC/target.onnx DST/target.onnx s8|s7|u8 [ALPHA]
(then copy specdec.json, tokenizer.json and the draft graph beside DST and refresh the manifest checksums).
"""
import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto
src, dst, mode = sys.argv[1], sys.argv[2], sys.argv[3]
bits = 7 if mode == 's7' else 8
alpha = float(sys.argv[4]) if len(sys.argv) > 4 else None
diag = np.load('/tmp/w8a8/diag.npz') if alpha is not None else None
m = onnx.load(src)
inits = {i.name: i for i in m.graph.initializer}
qmax = 2 ** (bits - 1) - 1
new_nodes, new_inits, drop = [], [], set()
c = lambda name, arr: new_inits.append(numpy_helper.from_array(np.asarray(arr), name)) or name
c("w8a8.eps", np.array(1e-8, np.float32)); c("w8a8.127", np.array(127.0, np.float32)); c("w8a8.zp", np.array(128, np.uint8))
c("w8a8.axes", np.array([-1], np.int64))
for n in m.graph.node:
    if n.op_type == "MatMul" and n.input[1] in inits:
        W = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)  # [K, N]
        x = n.input[0]
        if alpha is not None and n.input[1] in diag.files:
            rms = np.sqrt(np.maximum(diag[n.input[1]], 1e-12))
            wmax = np.maximum(np.abs(W).max(axis=1), 1e-8)
            sm = (rms ** alpha / wmax ** (1 - alpha)).astype(np.float32)
            sm /= np.exp(np.log(sm).mean())
            W = W * sm[:, None]
            inv = c(n.name + ".inv_smooth", (1.0 / sm).astype(np.float32))
            new_nodes.append(helper.make_node("Mul", [x, inv], [n.name + "/xsm"]))
            x = n.name + "/xsm"
        s = np.abs(W).max(axis=0) / qmax  # [N]
        s[s == 0] = 1.0
        Wq = np.clip(np.round(W / s), -qmax, qmax)
        Wq = (Wq + 128).astype(np.uint8) if mode == 'u8' else Wq.astype(np.int8)
        p = n.name
        wq = c(p + ".wq", Wq); ws = c(p + ".ws", s.astype(np.float32))
        drop.add(n.input[1])
        y = n.output[0]
        new_nodes += [
            helper.make_node("Abs", [x], [p + "/abs"]),
            helper.make_node("ReduceMax", [p + "/abs", "w8a8.axes"], [p + "/amax"], keepdims=1),
            helper.make_node("Max", [p + "/amax", "w8a8.eps"], [p + "/amax2"]),
            helper.make_node("Div", [p + "/amax2", "w8a8.127"], [p + "/xs"]),
            helper.make_node("QuantizeLinear", [x, p + "/xs", "w8a8.zp"], [p + "/xq"], axis=0) if False else
            helper.make_node("Div", [x, p + "/xs"], [p + "/xd"]),
            helper.make_node("Round", [p + "/xd"], [p + "/xr"]),
            helper.make_node("Add", [p + "/xr", "w8a8.128f"], [p + "/xa"]),
            helper.make_node("Cast", [p + "/xa"], [p + "/xq"], to=TensorProto.UINT8),
            helper.make_node("MatMulInteger", [p + "/xq", wq, "w8a8.zp"] + (["w8a8.zp"] if mode == 'u8' else []), [p + "/yi"]),
            helper.make_node("Cast", [p + "/yi"], [p + "/yf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [p + "/yf", p + "/xs"], [p + "/ys"]),
            helper.make_node("Mul", [p + "/ys", ws], [y]),
        ]
    else:
        new_nodes.append(n)
c("w8a8.128f", np.array(128.0, np.float32))
used = {i for nd in new_nodes for i in nd.input}
keep = [i for i in m.graph.initializer if i.name not in drop or i.name in used]
del m.graph.node[:]; m.graph.node.extend(new_nodes)
del m.graph.initializer[:]; m.graph.initializer.extend(keep + new_inits)
if not any(o.domain in ("", "ai.onnx") and o.version >= 18 for o in m.opset_import):
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"): o.version = max(o.version, 18)
onnx.save(m, dst, save_as_external_data=True, location=dst.split("/")[-1] + ".data")
print("saved")
