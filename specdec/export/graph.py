"""specdec's own ONNX graph writer for Llama-family decoders.

One graph serves prefill, decode and verification: inputs carry explicit positions and the valid
KV length, and the static KV buffers of every layer are bound as both past input and present output,
so GroupQueryAttention writes the new K/V in place at [P, P+T). Rolling back rejected drafts is
then just passing a smaller length next time.

Inputs  input_ids [B,T] int64 (or hidden_in [B,T,hidden], the residual stream entering layer first_layer,
        for a graph that starts there), position_ids [B,T] int64, seqlens_k [B] int32 (= P+T-1),
        total_sequence_length [] int32 (= P+T), query_lens [B] int32 (= T),
        past.{i}.key / past.{i}.value [B, kv_heads, max_len, head_dim] for layers first_layer <= i < n_layers.
Outputs logits [B,T,vocab] (unless the graph stops before the final norm), present.{i}.key / present.{i}.value
        (the same buffers), hidden.{l} [B,T,hidden] for each requested tap l: the residual stream after the
        first l layers (0 = embeddings, n_layers = before the final norm).

A graph may run a slice of the layers, [first_layer, n_layers): LayerSkip self-speculation splits the target
into an exit graph (layers [0, E), no head) and a tail graph (layers [E, L) + head) over one KV cache.
Float tensors (weights, activations, KV buffers, logits, taps) are all of the graph's one float type, fp32
or fp16 (`dtype`); ids, positions and lengths stay integers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.export.exact_argmax import add_exact_argmax
from specdec.export.gguf_blocks import Carried
from specdec.runtime.manifest import ARGMAX_ROWS, ATTENTION_BIAS, FEATURES, LOGITS_ROWS, ModelConfig

OPSET = 17
MS = "com.microsoft"


@dataclass
class LayerWeights:
    """One decoder layer, every matrix stored [in, out] so that MatMul(x, W) applies it."""

    input_norm: np.ndarray  # [D]
    qkv: np.ndarray  # [D, (N + 2*KV) * H]
    qkv_bias: np.ndarray | None  # [(N + 2*KV) * H]
    o_proj: np.ndarray  # [N*H, D]
    post_norm: np.ndarray  # [D]
    gate: np.ndarray  # [D, F]
    up: np.ndarray  # [D, F]
    down: np.ndarray  # [F, D]


@dataclass
class DecoderWeights:
    embed: np.ndarray  # [V, D]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [D]
    lm_head: np.ndarray | None  # [D, V]; None when tied to `embed`
    inv_freq: np.ndarray  # [H/2] rotary inverse frequencies (any rope scaling already applied)
    rope_scale: float = 1.0  # multiplies cos/sin (HF's attention_scaling)

    @property
    def tied(self) -> bool:
        return self.lm_head is None

    @property
    def head_carried(self) -> bool:
        return isinstance(self.embed if self.lm_head is None else self.lm_head, Carried)

    @property
    def embed_carried(self) -> bool:
        return isinstance(self.embed, Carried)

    def head_matrix(self) -> np.ndarray:
        """The LM head as the float [D, V] MatMul weight (the embedding's transpose when tied)."""
        return np.ascontiguousarray(self.embed.T) if self.lm_head is None else self.lm_head

    def with_layers(self, layers: list) -> "DecoderWeights":
        """These weights around other layers (an EAGLE head's graph: its one layer, the model's embedding and head)."""
        return replace(self, layers=layers)

    def head_columns(self, vocab: np.ndarray) -> np.ndarray:
        """The float LM head's columns `vocab` [D, N] (a draft vocabulary's head)."""
        full = self.embed.T if self.lm_head is None else self.lm_head  # [D, V]
        return np.ascontiguousarray(full[:, vocab], dtype=np.float32)


def weights_from_torch(model) -> DecoderWeights:
    """Read a transformers Llama/Mistral/Qwen2 model into plain numpy arrays."""
    import torch

    def np32(t: "torch.Tensor") -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    inner = model.model
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = np.concatenate([np32(attn.q_proj.weight), np32(attn.k_proj.weight), np32(attn.v_proj.weight)], axis=0)
        bias = None
        if attn.q_proj.bias is not None:
            bias = np.concatenate([np32(attn.q_proj.bias), np32(attn.k_proj.bias), np32(attn.v_proj.bias)])
        layers.append(LayerWeights(
            input_norm=np32(layer.input_layernorm.weight),
            qkv=np.ascontiguousarray(qkv.T),
            qkv_bias=bias,
            o_proj=np.ascontiguousarray(np32(attn.o_proj.weight).T),
            post_norm=np32(layer.post_attention_layernorm.weight),
            gate=np.ascontiguousarray(np32(mlp.gate_proj.weight).T),
            up=np.ascontiguousarray(np32(mlp.up_proj.weight).T),
            down=np.ascontiguousarray(np32(mlp.down_proj.weight).T),
        ))
    tied = bool(model.config.tie_word_embeddings)
    rotary = inner.rotary_emb
    return DecoderWeights(
        embed=np32(inner.embed_tokens.weight),
        layers=layers,
        final_norm=np32(inner.norm.weight),
        lm_head=None if tied else np.ascontiguousarray(np32(model.lm_head.weight).T),
        inv_freq=np32(rotary.inv_freq),
        rope_scale=float(getattr(rotary, "attention_scaling", 1.0)),
    )


def model_config_from_hf(hf_config) -> ModelConfig:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return ModelConfig(
        model_type=hf_config.model_type,
        n_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position=hf_config.max_position_embeddings,
        rms_eps=float(hf_config.rms_norm_eps),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        attention_bias=bool(getattr(hf_config, "attention_bias", False) or hf_config.model_type == "qwen2"),
    )


def kv_input_names(n_layers: int, first_layer: int = 0) -> list[str]:
    return [f"past.{i}.{kv}" for i in range(first_layer, n_layers) for kv in ("key", "value")]


def kv_output_names(n_layers: int, first_layer: int = 0) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(first_layer, n_layers) for kv in ("key", "value")]


@dataclass
class FeatureEntry:
    """An EAGLE-style entry: the layer stack's input is fc(concat(rms_norm(features) * norm, embed(ids))) + fc_bias,
    where `features` [B,T,D] is a residual stream (the target's, or the head's own previous output)."""

    norm: np.ndarray  # [D]
    fc: np.ndarray  # [2D, D]
    fc_bias: np.ndarray  # [D]


CONTROL_INPUTS = ("input_ids", "position_ids", "seqlens_k", "total_sequence_length", "query_lens")
HIDDEN_IN = "hidden_in"  # a slice graph's entry (first_layer > 0): the residual stream, in place of input_ids


def control_inputs(first_layer: int = 0) -> tuple[str, ...]:
    return ((HIDDEN_IN,) if first_layer else ("input_ids",)) + CONTROL_INPUTS[1:]
# The graph float types: every float tensor of a graph is one of these (GroupQueryAttention,
# SkipSimplifiedLayerNormalization and SimplifiedLayerNormalization take one type for all their float inputs).
GRAPH_DTYPES = {"fp32": np.float32, "fp16": np.float16}


class _Builder:
    """Nodes and initializers of one graph. With a `sink` (export/external.py's ExternalData), every initializer's
    bytes go to the bundle's weight file as it is made and the graph keeps a reference: a model is written one
    tensor at a time, never held whole."""

    def __init__(self, dtype=np.float32, sink=None, accuracy_level: int = 4) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.dtype = np.dtype(dtype)
        self.sink = sink
        self.accuracy_level = accuracy_level  # MatMulNBits kernels of carried (GGUF-quantized) weights
        self.block_sums: dict = {}  # (activation, block size) -> its block sums, shared by the weights reading it
        self.reorders: dict = {}  # (activation, input order bytes) -> the activation's inputs in that order
        self._names: set[str] = set()
        self._n = 0

    def init(self, name: str, arr: np.ndarray) -> str:
        """A float initializer, rounded once from its source precision to the graph's float type (with a sink,
        written from the array itself: no serialized copy of a large matrix is held beside it)."""
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        if self.sink is None or name in self._names:
            return self.add(numpy_helper.from_array(arr, name))
        self._names.add(name)
        self.inits.append(self.sink.put_array(name, arr))
        return name

    def add(self, tensor: onnx.TensorProto) -> str:
        """An initializer as it is (its own type); one already added under the name is kept (shared codes)."""
        if tensor.name not in self._names:
            self._names.add(tensor.name)
            self.inits.append(self.sink.put(tensor) if self.sink is not None else tensor)
        return tensor.name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
           outputs: list[str] | None = None, **attrs) -> list[str]:
        self._n += 1
        base = name or f"{op_type}_{self._n}"
        outs = outputs or [f"{base}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain or None, **attrs))
        return outs


def _linear(b: _Builder, x: str, weight, name: str, out: str | None = None) -> str:
    """y = x @ W. `weight`: [in, out] float array (MatMul), Carried codes [out, nb, block] (MatMulNBits, plus the
    offset term of formats with block minimums), or a tuple of those whose outputs are concatenated (a fused QKV
    whose parts a GGUF stores in different formats)."""
    if isinstance(weight, tuple):
        parts = [_linear(b, x, w_part, f"{name}.{j}") for j, w_part in enumerate(weight)]
        return b.op("Concat", parts, name=f"{name}.concat", axis=-1, outputs=[out] if out else None)[0]
    if isinstance(weight, Carried):
        from specdec.quant.weight_only import emit_nbits

        if weight.input_order is not None:
            x = _reordered(b, x, weight.input_order)  # [B,T,K] in the order the blocks hold the inputs
        K = weight.q.shape[1] * weight.block_size
        y = out or f"{name}/out0"
        nodes, inits = emit_nbits(x, y, name, (weight.q, weight.scale, weight.offset, weight.zero_point),
                                   weight.bits, weight.block_size, K, b.accuracy_level, sums=b.block_sums)
        for t in inits:
            b.add(t)
        b.nodes.extend(nodes)
        return y
    return b.op("MatMul", [x, b.init(f"{name}.weight", weight)], name=name, outputs=[out] if out else None)[0]


def _reordered(b: _Builder, x: str, order: np.ndarray) -> str:
    """x[..., order], gathered once per (activation, order): weights sharing both (a layer's q, k and v) read one
    copy."""
    key = (x, order.tobytes())
    if key not in b.reorders:
        idx = b.add(numpy_helper.from_array(np.asarray(order, dtype=np.int64), f"{x}.order{len(b.reorders)}"))
        b.reorders[key] = b.op("Gather", [x, idx], name=f"{x}.reorder{len(b.reorders)}", axis=-1)[0]
    return b.reorders[key]


# An untied carried LM head is written as vocabulary slices of at most this many bytes of codes, their logits
# concatenated: onnxruntime prepacks one initializer at a time while its mapped file pages are resident, so the
# widest matrix sets the load's transient peak (a 152k x 1536 8-bit head alone is ~290 MB).
HEAD_PART_BYTES = 16 << 20


def head_parts(head: Carried) -> Carried | tuple[Carried, ...]:
    """`head` [V, nb, block] as row slices of at most HEAD_PART_BYTES of codes (itself when it fits in one);
    each slice's logits are its columns of the whole head's, exactly."""
    V = head.q.shape[0]
    rows = max(1, HEAD_PART_BYTES // max(1, head.q[0].nbytes))
    if rows >= V:
        return head
    return tuple(head.rows(slice(r0, min(V, r0 + rows))) for r0 in range(0, V, rows))


def _embed_carried(b: _Builder, table: Carried, codes_name: str) -> str:
    """Token embeddings [B,T,D] gathered from a GGUF table's own codes: GatherBlockQuantized dequantizes the T rows
    (`codes_name`: the LM head's MatMulNBits codes where the head is this table, so they are stored once)."""
    from specdec.quant.grid import pack_codes

    V, nb, bs = table.q.shape
    b.add(numpy_helper.from_array(pack_codes(table.q, table.bits), codes_name))  # [V, nb, bs*bits/8]
    ins = [codes_name, "input_ids", b.add(numpy_helper.from_array(table.scale.reshape(V, nb, 1), "embed.scales"))]
    if table.offset is not None or table.bits == 8:  # GatherBlockQuantized's 8-bit zero point must be given
        zp = 0 if table.offset is not None else 128
        ins.append(b.add(numpy_helper.from_array(np.full((V, nb, 1), zp, dtype=np.uint8), "embed.zero_points")))
    blocks = b.op("GatherBlockQuantized", ins, name="embed", domain=MS, gather_axis=0, quantize_axis=2,
                  block_size=bs, bits=table.bits)[0]  # [B,T,nb,bs]
    if table.offset is not None:
        offsets = b.add(numpy_helper.from_array(table.offset.reshape(V, nb, 1), "embed.offsets"))
        rows = b.op("Gather", [offsets, "input_ids"], name="embed.offsets")[0]  # [B,T,nb,1]
        blocks = b.op("Add", [blocks, rows], name="embed.add_offsets")[0]  # [B,T,nb,bs]
    shape = b.add(numpy_helper.from_array(np.array([0, 0, nb * bs], dtype=np.int64), "embed.shape"))
    return b.op("Reshape", [blocks, shape], name="embed.reshape")[0]  # [B,T,D]


def build_decoder_graph(cfg: ModelConfig, w: DecoderWeights, hidden_layers: tuple[int, ...] = (),
                        n_layers: int | None = None, dtype=np.float32, first_layer: int = 0,
                        logits: bool = True, features: FeatureEntry | None = None,
                        head_vocab: np.ndarray | None = None, tree: bool = False,
                        argmax: bool = False, logits_rows: bool = False,
                        exact_argmax: bool = False, sink=None, accuracy_level: int = 4,
                        pad_attention: bool = False) -> onnx.ModelProto:
    """Write the decoder as ONNX: layers [first_layer, n_layers), then (if `logits`) final norm and LM head.

    `n_layers` < cfg.n_layers keeps only the first layers (early exit); `first_layer` > 0 starts from the
    residual stream (`hidden_in`) instead of token ids. Without `logits` the graph ends at the residual
    stream after its last layer, output as the tap `hidden.{n_layers}` (which is then always present).
    `dtype` (np.float32 or np.float16) is the float type of every weight, activation, KV buffer and output.
    `features` makes an EAGLE head's graph: a second input `features` enters the layer stack with the token
    embeddings (FeatureEntry). `head_vocab` [N] keeps only those rows of the LM head: logits [B,T,N] (cfg.vocab_size
    must then be N; the embedding still covers the whole vocabulary). `tree` adds the input `attention_bias`
    [B,1,T,P+T], added to every layer's attention scores (0 = may attend, -inf = may not): token-tree verification.
    `argmax` adds the output `argmax` [B,T] int64, the logits' argmax (first on ties, as numpy's), computed where
    the logits are: greedy verification on a GPU then copies T ids to the host instead of T x vocab logits.
    `logits_rows` adds the input `logits_rows` [R] int64, the step positions that get logits (and argmax): outputs
    [B,R,...]. A prefill chunk needs its last row only, and the LM head is ~a fifth of the model's weights. (A
    Gather, not a Slice: its indices are data, not a shape, which TensorRT builds without shape profiles.)
    `exact_argmax` (fp32, with argmax and logits_rows) adds the input `argmax_rows` [A] int64 and computes the
    `argmax` output [B,A] for those positions from 8-bit scores and a proven error bound (export/exact_argmax.py):
    greedy steps read a quarter of the head's bytes and ask logits_rows for no row.
    `w` may hold GGUF codes (Carried) in place of float matrices, and its layers may be loaded one at a time (export/
    gguf_source.py); with a `sink` each initializer is written out as it is made (see _Builder). `accuracy_level` is
    the MatMulNBits kernel of Carried weights. `pad_attention` (GraphSpec.pads_attention_only): position_ids may
    describe more positions than input_ids has tokens; Q/K/V get zero rows up to that width before each attention
    and lose them after it.
    """
    if (argmax or logits_rows) and not logits:
        raise ValueError("argmax and logits_rows need the logits")
    if exact_argmax and not (argmax and logits_rows and head_vocab is None and np.dtype(dtype) == np.float32):
        raise ValueError("exact_argmax needs an fp32 graph with argmax and logits_rows over the whole vocabulary")
    if np.dtype(dtype) not in [np.dtype(t) for t in GRAPH_DTYPES.values()]:
        raise ValueError(f"graph dtype must be float32 or float16, got {np.dtype(dtype)}")
    n_layers = cfg.n_layers if n_layers is None else n_layers
    if not 0 < n_layers <= cfg.n_layers:
        raise ValueError(f"n_layers must be in 1..{cfg.n_layers}, got {n_layers}")
    if not 0 <= first_layer < n_layers:
        raise ValueError(f"first_layer must be in 0..{n_layers - 1}, got {first_layer}")
    if not logits and n_layers not in hidden_layers:
        hidden_layers = (*hidden_layers, n_layers)
    bad_taps = [t for t in hidden_layers if not first_layer <= t <= n_layers]
    if bad_taps:
        raise ValueError(f"hidden taps {bad_taps} outside {first_layer}..{n_layers}")
    D, N, KV, H = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    b = _Builder(dtype, sink=sink, accuracy_level=accuracy_level)
    eps = float(cfg.rms_eps)
    float_type = helper.np_dtype_to_tensor_dtype(b.dtype)

    # Rotary tables for every position the model may see; cos/sin are [max_position, H/2], computed in
    # float64 and rounded once to the graph's type (GroupQueryAttention wants them in the type of Q).
    t = np.arange(cfg.max_position, dtype=np.float64)[:, None] * w.inv_freq.astype(np.float64)[None, :]
    cos = b.init("rope.cos", np.cos(t) * w.rope_scale)
    sin = b.init("rope.sin", np.sin(t) * w.rope_scale)
    head = None
    # Read once: a lazily loaded model (export/gguf_source.py) decodes a table on every access to embed / lm_head.
    tied, carried_embed = w.tied, w.embed_carried
    # A draft-vocabulary head is float rows (head_columns) whatever the model's head is stored as.
    carried_head = w.head_carried and head_vocab is None
    if carried_head and exact_argmax:
        raise ValueError("a graph with GGUF codes as its head has no exact argmax")
    if first_layer:
        x = HIDDEN_IN  # [B,T,D]
    elif carried_embed:
        x = _embed_carried(b, w.embed, "lm_head.qweight" if tied else "embed.qweight")  # [B,T,D]
    elif tied:
        # Tied head: store the matrix once, as the head's [D, V] MatMul weight (MatMul beats Gemm with
        # transB at verification widths), and look embeddings up as its columns.
        head = b.init("lm_head.weight", w.head_matrix())
        cols = b.op("Gather", [head, "input_ids"], name="embed", axis=1)[0]  # [D,B,T]
        x = b.op("Transpose", [cols], name="embed.transpose", perm=[1, 2, 0])[0]  # [B,T,D]
    elif getattr(w, "embed_half", False) and b.dtype == np.float32:
        # A float16 table (an fp16 checkpoint's, or AWQ/GPTQ's unquantized one) is stored as it is and its T rows
        # widened after the Gather: exact (float16 -> float32 is), half the bytes of a float32 copy.
        table = b.add(numpy_helper.from_array(np.asarray(w.embed, dtype=np.float16), "embed.weight"))
        rows = b.op("Gather", [table, "input_ids"], name="embed")[0]  # [B,T,D] float16
        x = b.op("Cast", [rows], name="embed.cast", to=onnx.TensorProto.FLOAT)[0]  # [B,T,D]
    else:
        x = b.op("Gather", [b.init("embed.weight", w.embed), "input_ids"], name="embed")[0]  # [B,T,D]
    if features is not None:
        if first_layer:
            raise ValueError("a graph with a features entry starts at layer 0")
        f = b.op("SimplifiedLayerNormalization", [FEATURES, b.init("features.norm", features.norm)],
                 name="features.norm", axis=-1, epsilon=eps)[0]  # [B,T,D]
        cat = b.op("Concat", [f, x], name="features.concat", axis=-1)[0]  # [B,T,2D]
        x = b.op("Add", [b.op("MatMul", [cat, b.init("features.fc.weight", features.fc)], name="features.fc")[0],
                         b.init("features.fc.bias", features.fc_bias)], name="features.fc_bias")[0]  # [B,T,D]
    if logits and head_vocab is not None:
        head = b.init("draft_head.weight", w.head_columns(np.asarray(head_vocab)))  # [D, N]
    elif logits and head is None and not carried_head:
        head = b.init("lm_head.weight", w.head_matrix())
    pad_rows = None
    if pad_attention:
        if first_layer or tree or features is not None:
            raise ValueError("pad_attention is for whole token-id graphs without trees or features")
        t_att = b.op("Shape", ["position_ids"], name="steps.attention_width", start=1, end=2)[0]  # [1]
        t_real = b.op("Shape", ["input_ids"], name="steps.width", start=1, end=2)[0]  # [1]
        extra = b.op("Sub", [t_att, t_real], name="steps.pad")[0]  # [1]
        zeros = b.add(numpy_helper.from_array(np.zeros(4, dtype=np.int64), "steps.zeros4"))
        zero1 = b.add(numpy_helper.from_array(np.zeros(1, dtype=np.int64), "steps.zero1"))
        pad_rows = b.op("Concat", [zeros, extra, zero1], name="steps.pads", axis=0)[0]  # [6]: rows appended on axis 1
        axis1 = b.add(numpy_helper.from_array(np.ones(1, dtype=np.int64), "steps.axis1"))
    taps: dict[int, str] = {first_layer: x}
    residual = None
    pending = None  # output of the previous block, not yet added to the residual stream
    for i in range(first_layer, n_layers):
        lw = w.layers[i]
        g_in = b.init(f"layers.{i}.input_norm", lw.input_norm)
        if pending is None:
            h = b.op("SimplifiedLayerNormalization", [x, g_in], name=f"layers.{i}.input_norm", axis=-1, epsilon=eps)[0]
            residual = x
        else:
            h, _, _, residual = b.op("SkipSimplifiedLayerNormalization", [pending, residual, g_in], n_out=4,
                                     domain=MS, name=f"layers.{i}.input_norm", epsilon=eps)
            taps[i] = residual
        qkv = _linear(b, h, lw.qkv, f"layers.{i}.qkv")  # [B,T,(N+2KV)H]
        if lw.qkv_bias is not None:
            qkv = b.op("Add", [qkv, b.init(f"layers.{i}.qkv.bias", lw.qkv_bias)], name=f"layers.{i}.qkv_bias")[0]
        if pad_rows is not None:
            qkv = b.op("Pad", [qkv, pad_rows], name=f"layers.{i}.pad_rows")[0]  # [B,T_att,(N+2KV)H]
        # Packed QKV: key/value inputs left empty. The KV buffers are shared past/present.
        attn = b.op("GroupQueryAttention",
                    [qkv, "", "", f"past.{i}.key", f"past.{i}.value", "seqlens_k", "total_sequence_length",
                     cos, sin, "position_ids", ATTENTION_BIAS if tree else "", "", "", "", "", "", "query_lens"],
                    outputs=[f"layers.{i}.attn", f"present.{i}.key", f"present.{i}.value"],
                    domain=MS, name=f"layers.{i}.gqa", num_heads=N, kv_num_heads=KV, do_rotary=1,
                    rotary_interleaved=0, scale=float(H ** -0.5))[0]  # [B,T,N*H]
        if pad_rows is not None:
            attn = b.op("Slice", [attn, zero1, t_real, axis1], name=f"layers.{i}.real_rows")[0]  # [B,T,N*H]
        o = _linear(b, attn, lw.o_proj, f"layers.{i}.o_proj")  # [B,T,D]
        h, _, _, residual = b.op("SkipSimplifiedLayerNormalization",
                                 [o, residual, b.init(f"layers.{i}.post_norm", lw.post_norm)], n_out=4,
                                 domain=MS, name=f"layers.{i}.post_norm", epsilon=eps)
        gate = _linear(b, h, lw.gate, f"layers.{i}.gate")  # [B,T,F]
        up = _linear(b, h, lw.up, f"layers.{i}.up")  # [B,T,F]
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate], name=f"layers.{i}.sigmoid")[0]], name=f"layers.{i}.silu")[0]
        pending = _linear(b, b.op("Mul", [act, up], name=f"layers.{i}.gated")[0], lw.down, f"layers.{i}.down")
    if logits:
        normed, _, _, residual = b.op("SkipSimplifiedLayerNormalization",
                                      [pending, residual, b.init("final_norm", w.final_norm)], n_out=4,
                                      domain=MS, name="final_norm", epsilon=eps)  # [B,T,D]
        if exact_argmax:
            add_exact_argmax(b, normed, head, w.head_matrix())  # [B,A]
        rows = b.op("Gather", [normed, LOGITS_ROWS], name="logits_rows", axis=1)[0] if logits_rows else normed
        if carried_head:
            _linear(b, rows, w.embed if tied else head_parts(w.lm_head), "lm_head", out="logits")  # [B,R,V]
        else:
            b.op("MatMul", [rows, head], outputs=["logits"], name="lm_head")  # [B,R,V] (R = T without logits_rows)
        if argmax and not exact_argmax:
            b.op("ArgMax", ["logits"], outputs=["argmax"], name="argmax", axis=-1, keepdims=0)  # [B,T]
    else:  # one fp32 add, bit for bit the sum the next layer's SkipSimplifiedLayerNormalization forms
        residual = b.op("Add", [pending, residual], name="residual_out")[0]  # [B,T,D]
    taps[n_layers] = residual

    tap_outputs = []
    for t_idx in hidden_layers:
        b.op("Identity", [taps[t_idx]], outputs=[f"hidden.{t_idx}"], name=f"tap.{t_idx}")
        tap_outputs.append(helper.make_tensor_value_info(f"hidden.{t_idx}", float_type, ["batch", "seq", D]))

    kv_shape = ["batch", KV, "max_len", H]
    entry = helper.make_tensor_value_info(HIDDEN_IN, float_type, ["batch", "seq", D]) if first_layer else \
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    inputs = [
        entry,
        *([helper.make_tensor_value_info(FEATURES, float_type, ["batch", "seq", D])] if features is not None else []),
        *([helper.make_tensor_value_info(ATTENTION_BIAS, float_type, ["batch", 1, "seq", "total"])] if tree else []),
        *([helper.make_tensor_value_info(LOGITS_ROWS, TensorProto.INT64, ["rows"])] if logits_rows else []),
        *([helper.make_tensor_value_info(ARGMAX_ROWS, TensorProto.INT64, ["argmax_rows"])] if exact_argmax else []),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("query_lens", TensorProto.INT32, ["batch"]),
    ] + [helper.make_tensor_value_info(n, float_type, kv_shape) for n in kv_input_names(n_layers, first_layer)]
    rows = "rows" if logits_rows else "seq"
    outputs = [helper.make_tensor_value_info("logits", float_type, ["batch", rows, cfg.vocab_size])] if logits else []
    outputs += [helper.make_tensor_value_info("argmax", TensorProto.INT64, ["batch", "argmax_rows" if exact_argmax else rows])] \
        if argmax else []
    outputs += [helper.make_tensor_value_info(n, float_type, kv_shape) for n in kv_output_names(n_layers, first_layer)]
    outputs += tap_outputs
    graph = helper.make_graph(b.nodes, "specdec_decoder", inputs, outputs, initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="specdec")
    model.ir_version = 10
    return model


def save_graph(model: onnx.ModelProto, path, external: bool = True) -> list[str]:
    """Save with weights in one external file next to the graph; return the file names written."""
    from pathlib import Path

    path = Path(path)
    if not external:
        onnx.save_model(model, str(path))
        return [path.name]
    data = path.name + ".data"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data, size_threshold=1024)
    # onnx creates the weight file owner-only (0600); a bundle is data like its graph file: readable by whoever
    # may read the folder (a service account, a copy on a shared disk), as the process's umask allows
    if not path.with_name(data).exists():  # every tensor small (or none): they live in the graph file itself
        return [path.name]
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path.with_name(data), 0o666 & ~mask)
    return [path.name, data]


def save_graph_sharing(model: onnx.ModelProto, path, reference) -> list[str]:
    """Save `model` with every initializer that the already-saved graph `reference` holds byte for byte
    pointing into the reference's external data file instead of a copy of its own.

    onnxruntime memory-maps external data, so two graphs sharing a file share its pages: a LayerSkip split of
    the target costs no second copy of the weights on disk or in memory. A tensor is matched by its bytes, not
    its name (a quantized target may hold the tied embedding under another name than the graph that gathers
    from it). The rest (new tensors) goes into this graph's own data file. Returns the file names written.
    """
    from pathlib import Path

    from onnx import external_data_helper

    path, reference = Path(path), Path(reference)
    ref = onnx.load_model(str(reference), load_external_data=False)
    by_shape: dict[tuple, list] = {}  # (dtype, dims) -> reference tensors, same-named first
    for r in ref.graph.initializer:
        if r.data_location == TensorProto.EXTERNAL:
            by_shape.setdefault((r.data_type, tuple(r.dims)), []).append(r)
    shared = 0
    files: dict[str, object] = {}
    try:
        for t in model.graph.initializer:
            candidates = sorted(by_shape.get((t.data_type, tuple(t.dims)), []), key=lambda r: r.name != t.name)
            data = None
            for r in candidates:
                info = external_data_helper.ExternalDataInfo(r)
                f = files.get(info.location) or files.setdefault(info.location, open(reference.parent / info.location, "rb"))
                data = numpy_helper.to_array(t).tobytes() if data is None else data
                if info.length != len(data):
                    continue
                f.seek(info.offset or 0)
                if f.read(info.length) == data:
                    t.ClearField("raw_data")
                    del t.external_data[:]
                    t.external_data.extend(r.external_data)
                    t.data_location = TensorProto.EXTERNAL
                    shared += 1
                    break
    finally:
        for f in files.values():
            f.close()
    if shared == len(model.graph.initializer):
        onnx.save_model(model, str(path))
        return [path.name]
    return save_graph(model, path)
