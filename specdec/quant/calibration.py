"""Calibration data for quantizers that look at activations (GPTQ, sensitivity-chosen mixed precision).

The calibration text is what the target itself writes: specdec's own instruction prompts (never benchmark
questions) and the bundle's greedy answers to them, so the activations are those of real decoding.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class CalibrationConfig:
    # GPTQ on SmolLM2-135M, int4 blocks of 128 (bench/results/quant/int4_methods.json): 16 prompts (~1.5k tokens)
    # fit the calibration text and lost to round-to-nearest (top-1 agreement 0.720 vs 0.749); 96 (~9k) beat it
    # (0.752). Answering them takes the bundle ~2.5 min on a 2-core CPU.
    prompts: int = 96
    new_tokens: int = 64
    # Prompts are drawn from export/prompts.py from this seed; distill-data and layerskip draw from seed 0.
    seed: int = 7

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.new_tokens < 1:
            raise SpecdecError(f"calibration needs >= 1 prompt and token, got {self.prompts} x {self.new_tokens}")


def calibration_sequences(bundle: Path, cfg: CalibrationConfig) -> list[np.ndarray]:
    """Token ids [n] per prompt: the chat-formatted prompt and the bundle's own greedy answer to it."""
    from specdec.export.prompts import instruction_prompts
    from specdec.runtime.engine import Engine, GenerationConfig

    eng = Engine(bundle, drafter="ngram")
    out = []
    for conversation in instruction_prompts(cfg.prompts, seed=cfg.seed):
        prompt = eng.encode(conversation)
        answer = eng.generate(conversation, GenerationConfig(max_new_tokens=cfg.new_tokens)).token_ids
        out.append(np.asarray(prompt + list(answer), dtype=np.int64))
    return out


def decoder_feeds(model: onnx.ModelProto, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of one prefill of `ids` [n] from an empty cache for a specdec decoder graph run without IOBinding
    (its K/V buffers sized to the sequence)."""
    n = len(ids)
    elem = {i.name: i.type.tensor_type for i in model.graph.input}
    # The graph's one float type, that of its K/V inputs (fp32, or fp16 in an fp16 graph).
    float_type = onnx.helper.tensor_dtype_to_np_dtype(elem["past.0.key"].elem_type)
    feeds: dict[str, np.ndarray] = {}
    for name, t in elem.items():
        if name == "input_ids":
            feeds[name] = ids[None, :]
        elif name == "position_ids":
            feeds[name] = np.arange(n, dtype=np.int64)[None, :]
        elif name == "seqlens_k":
            feeds[name] = np.array([n - 1], dtype=np.int32)
        elif name == "total_sequence_length":
            feeds[name] = np.array(n, dtype=np.int32)
        elif name == "query_lens":
            feeds[name] = np.array([n], dtype=np.int32)
        elif name == "logits_rows":
            feeds[name] = np.arange(n, dtype=np.int64)  # logits of every position
        elif name == "argmax_rows":
            feeds[name] = np.zeros(0, dtype=np.int64)  # calibration reads activations, not the argmax
        elif name == "attention_bias":
            feeds[name] = np.zeros((1, 1, n, n), dtype=float_type)
        elif name.startswith("past."):
            dims = [d.dim_value for d in t.shape.dim]  # [batch, kv_heads, length, head_dim]
            feeds[name] = np.zeros((1, dims[1], n, dims[3]), dtype=float_type)
        else:
            raise SpecdecError(f"cannot calibrate a graph with input {name!r}", "calibrate the target graph of a bundle")
    return feeds


def matmul_input_grams(model: onnx.ModelProto, sequences: list[np.ndarray], weights) -> dict[str, np.ndarray]:
    """{weight: X^T X [K, K]} over the activations X [rows, K] entering the MatMul that reads each weight, summed
    over all sequences. Weights reading the same activations share one matrix (Gram matrices, not activations,
    are kept: GPTQ and the sensitivity ranking need only X^T X)."""
    import onnxruntime as ort

    from specdec.runtime.session import pooled_session_options

    consumers = {n.input[1]: n.input[0] for n in model.graph.node if n.op_type == "MatMul" and len(n.input) == 2}
    wanted = {w: consumers[w] for w in weights if w in consumers}
    existing = {o.name for o in model.graph.output}
    # Every activation of a specdec graph has the graph's one float type (that of its logits).
    float_type = next(o.type.tensor_type.elem_type for o in model.graph.output if o.name == "logits")
    names = sorted(set(wanted.values()))
    added = [x for x in names if x not in existing]
    # The activations become outputs for one serialization (no second copy of the weights in memory).
    model.graph.output.extend(onnx.helper.make_tensor_value_info(x, float_type, None) for x in added)
    try:
        serialized = model.SerializeToString()
    finally:
        del model.graph.output[len(model.graph.output) - len(added):]
    opts = pooled_session_options()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor by its name
    sess = ort.InferenceSession(serialized, opts, providers=["CPUExecutionProvider"])
    del serialized
    grams: dict[str, np.ndarray] = {}
    for ids in sequences:
        for x, value in zip(names, sess.run(names, decoder_feeds(model, ids))):
            rows = value.reshape(-1, value.shape[-1]).astype(np.float64)  # [n, K]
            grams[x] = grams.get(x, 0) + rows.T @ rows
    return {w: grams[x] for w, x in wanted.items()}
