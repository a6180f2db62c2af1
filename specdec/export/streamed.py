"""A checkpoint read lazily, one layer at a time: what the streaming graph writer and its reference forward share.

A streamed source (export/gguf_source.py's GGUFSource, export/hf_source.py's SafetensorsSource) gives:
  config (ModelConfig), inv_freq() [H/2], layer(i, carry_codes) -> LayerWeights, release(),
  embed_name / head_name (None when the head is tied to the embedding) / final_norm_name,
  floats(name) (float32, numpy order), float_rows(name, rows) (rows of a matrix, float32 [len(rows), K]),
  matrix(name, carry_codes) (float32 [in, out] for MatMul, or Carried codes), quantized_tensor(name).
`LazyWeights` turns it into export/graph.py's DecoderWeights, and `reference_logits` runs the same weights through
a plain numpy forward: the export's check of the graph it wrote. Nothing holds more than one layer's weights.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence

import numpy as np

from specdec.export.gguf_blocks import Carried


def cat_rows(parts: list):
    """Q, K and V fused into one weight: concatenated along the output axis (codes of one format, or floats),
    else a tuple the graph writer runs as three MatMulNBits and concatenates."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=1)  # [in, out]
    if all(isinstance(p, Carried) for p in parts) and len({(p.fmt, p.bits, p.block_size) for p in parts}) == 1 \
            and _same_order([p.input_order for p in parts]):
        def cat(field: str):
            arrays = [getattr(p, field) for p in parts]
            return None if arrays[0] is None else np.concatenate(arrays)

        return Carried(cat("q"), cat("scale"), cat("offset"), parts[0].bits, parts[0].fmt, cat("zero_point"),
                       parts[0].input_order)
    return tuple(parts)


def _same_order(orders: list) -> bool:
    """Whether the weights read their inputs in one order (all in order, or one permutation)."""
    if all(o is None for o in orders):
        return True
    return all(o is not None and np.array_equal(o, orders[0]) for o in orders)


class _Layers(Sequence):
    def __init__(self, src, carry_codes: bool) -> None:
        self.src, self.carry = src, carry_codes
        self.on_read = None  # called with the layer index as a layer is read (progress)

    def __len__(self) -> int:
        return self.src.config.n_layers

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        # The layers read so far are converted and written: their pages leave this process's resident memory.
        self.src.release()
        if self.on_read is not None:
            self.on_read(i)
        return self.src.layer(i, self.carry)


class LazyWeights:
    """export/graph.py's DecoderWeights, read from the source as the writer asks: `layers[i]` reads layer i."""

    def __init__(self, src, carry_codes: bool) -> None:
        self.src, self.carry = src, carry_codes
        self.layers = _Layers(src, carry_codes)
        self.inv_freq = src.inv_freq()
        self.rope_scale = 1.0
        self.final_norm = src.floats(src.final_norm_name)

    @property
    def tied(self) -> bool:
        return self.src.head_name is None

    def _carries(self, name: str) -> bool:
        return self.carry and self.src.quantized_tensor(name)

    @property
    def head_carried(self) -> bool:
        return self._carries(self.src.head_name or self.src.embed_name)

    @property
    def embed_carried(self) -> bool:
        return self._carries(self.src.embed_name)

    @property
    def embed_half(self) -> bool:
        """Whether the source stores the (untied, unquantized) embedding as float16: the graph keeps it so."""
        return not self.tied and not self.embed_carried and self.src.stored_dtype(self.src.embed_name) == "F16"

    @property
    def embed(self):
        """[V, D]: Carried codes (carry) or float32."""
        if self.embed_carried:
            return self.src.matrix(self.src.embed_name, True)
        return self.src.floats(self.src.embed_name)

    def head_matrix(self) -> np.ndarray:
        """The float LM head [D, V] (the embedding's transpose when tied), read from the source in one copy."""
        return self.src.matrix(self.src.head_name or self.src.embed_name)

    def head_columns(self, vocab: np.ndarray) -> np.ndarray:
        """The float LM head's columns `vocab` [D, N], dequantized from those rows of the source alone."""
        rows = self.src.float_rows(self.src.head_name or self.src.embed_name, np.asarray(vocab))  # [N, D]
        return np.ascontiguousarray(rows.T, dtype=np.float32)

    def with_layers(self, layers: list) -> "LazyWeights":
        """These weights around other (resident) layers: an EAGLE head's graph reads the model's embedding and head."""
        other = copy.copy(self)
        other.layers = layers
        return other

    @property
    def lm_head(self):
        """None when tied to the embedding; else Carried codes [V, D] or float32 [D, V]."""
        if self.tied:
            return None
        return self.src.matrix(self.src.head_name, self.carry)


def _rms(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)).astype(np.float32) * g


HEAD_ROWS = 8192  # LM head rows dequantized at a time by the reference forward


def reference_logits(src, ids: np.ndarray) -> np.ndarray:
    """Logits [n, V] of token ids [n] (positions 0..n-1) from the source's weights, read as float32 (quantized
    formats dequantized as the kernels read them), by a float32 numpy forward written from the architecture's
    definition: one layer resident at a time, the LM head in slices of rows."""
    cfg = src.config
    w = LazyWeights(src, carry_codes=False)
    N, KV, H, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
    n = len(ids)
    x = src.float_rows(src.embed_name, ids)  # [n, D]
    ang = np.arange(n, dtype=np.float64)[:, None] * w.inv_freq.astype(np.float64)[None, :]  # [n, H/2]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rope(t: np.ndarray) -> np.ndarray:  # [heads, n, H], halves rotated (non-interleaved)
        a, b_ = t[..., : H // 2], t[..., H // 2:]
        return np.concatenate([a * cos - b_ * sin, b_ * cos + a * sin], axis=-1)

    mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
    for i in range(cfg.n_layers):
        lw = w.layers[i]
        h = _rms(x, lw.input_norm, eps)
        qkv = h @ lw.qkv  # [n, (N+2KV)H]
        if lw.qkv_bias is not None:
            qkv = qkv + lw.qkv_bias
        q = rope(qkv[:, : N * H].reshape(n, N, H).transpose(1, 0, 2))  # [N, n, H]
        k = rope(qkv[:, N * H:(N + KV) * H].reshape(n, KV, H).transpose(1, 0, 2))  # [KV, n, H]
        v = qkv[:, (N + KV) * H:].reshape(n, KV, H).transpose(1, 0, 2)  # [KV, n, H]
        rep = N // KV
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)  # [N, n, H]
        scores = q @ k.transpose(0, 2, 1) * np.float32(H ** -0.5) + mask  # [N, n, n]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v  # [N, n, H]
        x = x + attn.transpose(1, 0, 2).reshape(n, N * H) @ lw.o_proj
        h = _rms(x, lw.post_norm, eps)
        gate, up = h @ lw.gate, h @ lw.up  # [n, F]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lw.down
        del lw
    src.release()
    h = _rms(x, w.final_norm, eps)  # [n, D]
    name = src.head_name or src.embed_name
    V = cfg.vocab_size
    logits = np.empty((n, V), dtype=np.float32)
    for r0 in range(0, V, HEAD_ROWS):  # [rows, D] slices: the head is never dequantized whole
        rows = np.arange(r0, min(V, r0 + HEAD_ROWS))
        logits[:, rows] = h @ src.float_rows(name, rows).T
    return logits


def fingerprint(src) -> str:
    """export/eagle.py's target_fingerprint of the source's weights, read as float32 (it keys the heads and corpora
    specdec ships): computed from the few rows it reads, not from the whole model."""
    w = LazyWeights(src, carry_codes=False)
    h = hashlib.sha256()
    for arr in (w.final_norm, src.float_rows(src.embed_name, np.arange(64)), w.layers[0].qkv[:64],
                w.layers[-1].down[:64]):
        h.update(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    return h.hexdigest()[:32]
