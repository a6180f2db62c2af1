"""Runs one decoder graph of a bundle over a KVCache with IOBinding.

The KV buffers are bound once, as both past input and present output. Per step only the small control
inputs are bound; logits (and hidden taps) land in preallocated buffers, one OrtValue view per step
width, so a decode step allocates nothing of size vocab or KV.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import GraphSpec, ModelConfig
from specdec.runtime.session import RuntimeOptions, make_session

# Widest step the output buffers hold. Verification steps are k+1 <= this; prefill runs in chunks of
# this many tokens, which bounds the logits buffer (64 x 49k vocab x 4 B = 12.6 MB) while keeping the
# matmuls wide enough to be compute-bound.
MAX_STEP = 64


class Decoder:
    def __init__(self, path: Path, spec: GraphSpec, model: ModelConfig, kv: KVCache, opts: RuntimeOptions) -> None:
        self.spec, self.model, self.kv = spec, model, kv
        self.session = make_session(path, opts)
        names = {i.name for i in self.session.get_inputs()}
        missing = [n for n in spec.inputs if n not in names]
        if missing:
            raise ValueError(f"graph {path.name} lacks inputs {missing} listed in the manifest")
        if kv.n_layers != spec.n_layers:
            raise ValueError(f"KV cache has {kv.n_layers} layers, graph {path.name} needs {spec.n_layers}")
        self.binding = self.session.io_binding()
        for i, (k_buf, v_buf) in enumerate(kv.values):
            self.binding.bind_ortvalue_input(f"past.{i}.key", k_buf)
            self.binding.bind_ortvalue_input(f"past.{i}.value", v_buf)
            self.binding.bind_ortvalue_output(f"present.{i}.key", k_buf)
            self.binding.bind_ortvalue_output(f"present.{i}.value", v_buf)
        B = kv.batch
        self._logits = np.empty(B * MAX_STEP * model.vocab_size, dtype=np.float32)
        self._hidden = {t: np.empty(B * MAX_STEP * model.hidden_size, dtype=np.float32) for t in spec.hidden_layers}
        self._out_views: dict[int, list[tuple[str, np.ndarray, ort.OrtValue]]] = {}
        self._control: dict[int, dict[str, np.ndarray]] = {}

    def _outputs_for(self, T: int) -> list[tuple[str, np.ndarray, ort.OrtValue]]:
        if T not in self._out_views:
            B = self.kv.batch
            views = [("logits", self._logits[: B * T * self.model.vocab_size].reshape(B, T, self.model.vocab_size))]
            views += [(f"hidden.{t}", buf[: B * T * self.model.hidden_size].reshape(B, T, self.model.hidden_size))
                      for t, buf in self._hidden.items()]
            self._out_views[T] = [(n, v, ort.OrtValue.ortvalue_from_numpy(v)) for n, v in views]
        return self._out_views[T]

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """Run tokens [B,T] at the rows' current lengths; return logits [B,T,vocab] (a reused buffer).

        K/V for the T tokens are written at [length, length+T) but not made valid: the caller decides
        how many to keep with kv.advance(). `positions` default to length + arange(T) (tree steps pass
        their own).
        """
        B, T = tokens.shape
        if T > MAX_STEP:
            raise ValueError(f"step of {T} tokens exceeds MAX_STEP={MAX_STEP}; prefill in chunks")
        for row in range(B):
            self.kv.check_room(T, row)
        lengths = self.kv.lengths
        if positions is None:
            positions = lengths[:, None] + np.arange(T, dtype=np.int64)[None, :]  # [B,T]
        b = self.binding
        b.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, dtype=np.int64))
        b.bind_cpu_input("position_ids", np.ascontiguousarray(positions, dtype=np.int64))
        b.bind_cpu_input("seqlens_k", (lengths + T - 1).astype(np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(int(lengths.max()) + T, dtype=np.int32))
        b.bind_cpu_input("query_lens", np.full(B, T, dtype=np.int32))
        for name, _, value in self._outputs_for(T):
            b.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(b)
        return self._outputs_for(T)[0][1]

    def hidden(self, tap: int, T: int) -> np.ndarray:
        """The tap's output of the last forward of width T: [B,T,hidden] (a reused buffer)."""
        B = self.kv.batch
        return self._hidden[tap][: B * T * self.model.hidden_size].reshape(B, T, self.model.hidden_size)

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Run a prompt [B,T] in MAX_STEP chunks, keep all of it, return the last position's logits [B,vocab]."""
        B, T = tokens.shape
        self.kv.check_room(T)
        last = None
        for start in range(0, T, MAX_STEP):
            chunk = tokens[:, start:start + MAX_STEP]
            last = self.forward(chunk)[:, -1, :].copy()  # [B,vocab]; copy: the buffer is reused
            self.kv.advance(chunk.shape[1])
        return last
