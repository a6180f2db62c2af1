"""The one owner of a decoder's K/V buffers and of how much of them is valid.

Buffers are allocated once at full length and bound to the graph as both past and present, so the
graph writes new K/V in place. `lengths` is the only state that says what is valid: accepting drafts
advances it, rejecting them is simply not advancing it (the stale rows get overwritten next step).
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from specdec.errors import SpecdecError


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: str = "cpu", device_id: int = 0, dtype=np.float32, slack: int = 0) -> None:
        """`slack` positions past max_len hold only padding (a graph with min_step_tokens > 1 pads short steps:
        their K/V are written past the valid length like rejected drafts', and must have somewhere to go even
        when the valid tokens fill max_len). check_room counts max_len only."""
        if max_len <= 0 or batch <= 0 or slack < 0:
            raise ValueError("max_len and batch must be > 0, slack >= 0")
        self.n_layers, self.batch, self.max_len = n_layers, batch, max_len
        self.capacity = max_len + slack  # positions in the buffers
        self.shape = (batch, n_kv_heads, self.capacity, head_dim)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.lengths = np.zeros(batch, dtype=np.int64)  # valid tokens per row
        if device == "cpu":
            # One slab for all layers: each layer's OrtValue wraps a view of it, so numpy can move rows
            # of every layer with one fancy-index assignment (tree compaction) and ORT sees the result.
            self.slab = np.zeros((n_layers, 2) + self.shape, dtype=dtype)  # [L, 2, B, KV, M, H]
            self.values = [[ort.OrtValue.ortvalue_from_numpy(self.slab[i, j]) for j in (0, 1)]
                           for i in range(n_layers)]
        else:
            self.slab = None
            self.values = [[ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), dtype, device, device_id)
                            for _ in (0, 1)] for _ in range(n_layers)]

    @classmethod
    def for_graph(cls, spec, batch: int, max_len: int, device: str = "cpu", device_id: int = 0) -> "KVCache":
        """A cache for the graph `spec` (a GraphSpec): its model's shape, its K/V dtype, and the slack its
        min_step_tokens padding writes into."""
        m = spec.model
        return cls(m.n_layers, batch, m.n_kv_heads, max_len, m.head_dim, device=device, device_id=device_id,
                   dtype=spec.kv_dtype, slack=spec.min_step_tokens - 1)

    @property
    def nbytes(self) -> int:
        return self.n_layers * 2 * int(np.prod(self.shape)) * self.dtype.itemsize

    def reset(self) -> None:
        self.lengths[:] = 0

    def check_room(self, n_new: int, row: int = 0) -> None:
        if self.lengths[row] + n_new > self.max_len:
            raise SpecdecError(
                f"sequence of {int(self.lengths[row]) + n_new} tokens does not fit the KV buffer of {self.max_len}",
                "raise it with --max-len, or shorten the prompt",
            )

    def advance(self, n: int | np.ndarray) -> None:
        """Make `n` more positions valid (per row when an array): the tokens the caller kept."""
        self.lengths += n

    def compact(self, start: int, slots: np.ndarray) -> None:
        """Row 0: move the K/V at positions start + slots to start, start + 1, ... (an accepted tree path).
        The source rows are gathered before any is written, so overlapping moves are safe."""
        if self.slab is None:
            raise SpecdecError("token-tree verification needs the K/V on the host (CPU provider) in this version",
                               "use chain drafting (the default) on a GPU provider")
        n = len(slots)
        row = self.slab[:, :, 0]  # [L, 2, KV, M, H] a view
        row[:, :, :, start:start + n] = row[:, :, :, start + np.asarray(slots)]

    def truncate(self, length: int | np.ndarray) -> None:
        """O(1) rollback: everything at or after `length` is invalid from now on."""
        self.lengths[:] = np.minimum(self.lengths, length)
