"""The target run as two slices over its one KV cache, for LayerSkip self-speculation.

The exit slice runs layers [0, E) and stops at the residual stream; the tail slice runs layers [E, L), the
final norm and the LM head. Chained they are the target (same weights, same arithmetic: the boundary is one
fp32 add). Drafting runs the exit slice a token at a time and reads draft logits through a small exit head;
the K/V it writes for layers < E are the target's own, so verification computes only layers >= E for the
drafted positions, from the residual streams the drafting left behind (`remember`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from specdec.runtime.decoder import MAX_STEP, Decoder
from specdec.runtime.kv import KVCache
from specdec.runtime.session import RuntimeOptions, make_session


class SplitTarget:
    """Decoder-compatible (kv, model, forward, prefill) target made of an exit and a tail slice."""

    def __init__(self, exit_slice: Decoder, tail: Decoder) -> None:
        if exit_slice.kv is not tail.kv:
            raise ValueError("the exit and tail slices must share one KV cache")
        if tail.spec.first_layer != exit_slice.spec.n_layers or not tail.spec.has_logits:
            raise ValueError(f"tail slice starts at layer {tail.spec.first_layer}, the exit slice ends at "
                             f"{exit_slice.spec.n_layers}; the tail must also carry the LM head")
        self.exit, self.tail = exit_slice, tail
        self.kv: KVCache = tail.kv
        self.model, self.spec = tail.model, tail.spec
        self.exit_layer = exit_slice.spec.n_layers
        # What drafting left at the current length: (position, tokens, their residual streams [n, hidden]).
        self._known: tuple[int, list[int], np.ndarray] | None = None

    def remember(self, start: int, tokens: Sequence[int], residual: np.ndarray) -> None:
        """Layers < E already ran for `tokens` at positions start.. (their K/V are in the cache), leaving
        `residual` [n, hidden]: a forward over the same tokens there reuses them."""
        self._known = (start, list(tokens), residual)

    def residual(self, tokens: np.ndarray) -> np.ndarray:
        """Run (or reuse) layers < E for tokens [1,T] at the current length: the residual stream [1,T,hidden]."""
        known, self._known = self._known, None
        kv, T = self.kv, tokens.shape[1]
        n = 0
        if known is not None and known[0] == int(kv.lengths[0]):
            ids = tokens[0].tolist()
            n = next((i for i, (a, b) in enumerate(zip(known[1], ids)) if a != b), min(len(known[1]), T))
        if n == T:
            return known[2][None, :T]
        self.exit.kv.lengths += n  # the rows after the reused ones go where a plain forward would put them
        try:
            self.exit.forward(tokens[:, n:])
        finally:
            self.exit.kv.lengths -= n
        fresh = self.exit.hidden(self.exit_layer, T - n)  # [1, T-n, hidden]
        return fresh if n == 0 else np.concatenate([known[2][None, :n], fresh], axis=1)

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                query_lens: np.ndarray | None = None) -> np.ndarray:
        """Logits [B,T,vocab] of the full target, like Decoder.forward (K/V written, not made valid)."""
        if positions is None and query_lens is None and tokens.shape[0] == 1:
            hidden = self.residual(tokens)
        else:
            self._known = None
            self.exit.forward(tokens, positions, query_lens)
            hidden = self.exit.hidden(self.exit_layer, tokens.shape[1])
        return self.tail.forward(hidden, positions, query_lens)

    def forward_choices(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                        bias: np.ndarray | None = None) -> np.ndarray:
        """The greedy choice at each position of a step [B,T] (see Decoder.forward_choices). Chains only."""
        if bias is not None:
            raise ValueError("a LayerSkip split verifies chains, not token trees")
        return np.argmax(self.forward(tokens, positions), axis=-1)

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Like Decoder.prefill: keep all of tokens [B,T], return the last position's logits [B,vocab]."""
        self.kv.check_room(tokens.shape[1])
        self._known = None
        last = None
        for start in range(0, tokens.shape[1], MAX_STEP):
            chunk = tokens[:, start:start + MAX_STEP]
            last = self.forward(chunk)[:, -1, :].copy()  # [B,vocab]; copy: the buffer is reused
            self.kv.advance(chunk.shape[1])
        return last


class ExitHead:
    """Draft logits from the residual stream after layer E: (adapter) + final norm + the LM head's rows of
    the draft vocabulary (`vocab`, the ids its N logits stand for). Small and without K/V: a plain run."""

    def __init__(self, path: Path, vocab: np.ndarray, opts: RuntimeOptions) -> None:
        self.session = make_session(path, opts)
        self.vocab = np.asarray(vocab, dtype=np.int64)  # [N]
        out = self.session.get_outputs()[0]
        if out.shape[-1] != len(self.vocab):
            raise ValueError(f"exit head {Path(path).name} has {out.shape[-1]} logits, the draft vocabulary "
                             f"{len(self.vocab)} ids")
        self._input = self.session.get_inputs()[0].name
        self._run_opts = ort.RunOptions()

    def logits(self, residual: np.ndarray) -> np.ndarray:
        """Draft logits [N] for one position's residual stream [hidden]."""
        x = residual.astype(np.float32, copy=False)[None, None, :]  # [1,1,hidden]; an fp16 target feeds it too
        return self.session.run(None, {self._input: x}, self._run_opts)[0][0, 0]
