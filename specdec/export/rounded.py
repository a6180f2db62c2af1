"""A float streamed source rounded to int8/int4 block grids as it is read: `specdec export --precision int4|int8`
of a GGUF or a safetensors checkpoint with bounded memory (no torch model).

`RoundedSource(src, cfg)` wraps export/gguf_source.py's GGUFSource or export/hf_source.py's SafetensorsSource and
gives the streaming writer (export/gguf_export.py) a quantized source: each linear layer, read one layer at a time,
is rounded to `cfg`'s grids (quant/grid.py: a weight already on a 4- or 8-bit block grid, such as a GGUF's Q4_0,
Q4_1 or Q8_0 layers read as floats, is re-encoded exactly; any other rounds to nearest at `cfg.bits`, the LM head at
`cfg.head_bits`) and handed over as Carried codes; with carry_codes=False the same grids come back dequantized, so
the export's check compares the written graph with a reference forward of exactly the rounded weights.
"""
from __future__ import annotations

import functools

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.gguf_blocks import Carried
from specdec.export.graph import LayerWeights
from specdec.export.streamed import LazyWeights
from specdec.quant.grid import _blocks, _grid
from specdec.quant.weight_only import EXACT_TOLERANCE, WeightQuantConfig

MATRICES = ("qkv", "o_proj", "gate", "up", "down")  # LayerWeights' matrices
CHUNK_COLS = 8192  # output columns rounded at a time
PROBE_COLS = 64  # output columns tried first on each exact grid


class RoundedSource:
    def __init__(self, src, cfg: WeightQuantConfig, precision: str) -> None:
        if cfg.needs_calibration or cfg.method not in ("minmax", "rtn"):
            raise ValueError("a streamed export rounds to nearest; calibrated methods go through `specdec quantize`")
        self.src, self.cfg, self.precision = src, cfg, precision
        self._head: tuple[str, Carried] | None = None  # the rounded head, read by the reference forward in slices
        self.formats_seen: dict[str, int] = {}

    def __getattr__(self, name: str):  # config, path, inv_freq, release, embed_name, eos_token_ids, ...
        return getattr(self.src, name)

    quantized = True

    @property
    def quant_method(self) -> str:
        return "matmul_nbits_minmax"

    @property
    def accuracy_level(self) -> int:
        return self.cfg.accuracy_level

    def quant(self) -> dict:
        """The manifest's quant entry: the preset (rounding by specdec's own grids), what each weight became."""
        return {**self.cfg.to_dict(), "method": self.quant_method, "formats": dict(self.formats_seen)}

    def formats(self) -> dict[str, int]:
        return dict(self.formats_seen)

    def not_carried(self) -> list:
        return []

    def _head_name(self) -> str:
        return self.src.head_name or self.src.embed_name

    def quantized_tensor(self, name: str) -> bool:
        """The head (or the tied embedding serving as it) when the preset rounds it, and an untied embedding the
        source carries as codes; layers are rounded in layer()."""
        return self._rounds(name) or (name == self.src.embed_name and self._own_embedding)

    @functools.cached_property
    def _own_embedding(self) -> bool:
        """Whether an untied embedding stays at the source's own codes (a GGUF's Q5_0, Q8_0, Q6_K, ...): it is
        gathered a few rows a step, so rounding it again saves no time, and float32 would make it large (the Qwen
        0.5B's 151,936 x 896 table: 544 MB, against 153 MB as its Q5_0 codes carried in 8 bits)."""
        name = self.src.embed_name
        return self.src.head_name is not None and getattr(self.src, "carries", lambda _: False)(name)

    # ------------------------------------------------------------------------------------------ rounding
    def _round(self, w: np.ndarray, bits: int) -> Carried:
        """A float weight [in K, out N] -> Carried [N, K/bs, bs]: the first grid that holds every block exactly,
        else round to nearest. Output columns are rounded CHUNK_COLS at a time (a 150k-token head's intermediates
        stay ~50 MB each, not GBs); the grid is chosen for the whole weight."""
        bs = self.cfg.block_size
        K, N = w.shape
        if K % bs:
            fits = K & -K  # the largest power of two dividing K
            raise SpecdecError(f"a weight with {K} inputs does not fill blocks of {bs}",
                               f"pass --block-size {fits} or less" if fits >= 16 else
                               "export with --precision fp32, or use `specdec quantize` on an fp32 bundle")
        chunks = [slice(n0, min(N, n0 + CHUNK_COLS)) for n0 in range(0, N, CHUNK_COLS)]
        tried = ((4, True), (4, False), (8, True), (8, False)) if self.cfg.method == "minmax" else ()
        probe = [slice(0, min(N, PROBE_COLS))]  # a weight off a grid shows it in its first columns: cheap to refuse
        for grid_bits, symmetric in tried:
            if all(_grid(_blocks(w[:, c], bs), grid_bits, symmetric)[3] <= EXACT_TOLERANCE for c in probe + chunks):
                return self._chunked(w, chunks, grid_bits, symmetric, "exact")
        return self._chunked(w, chunks, bits, self.cfg.symmetric, "rtn")

    def _chunked(self, w: np.ndarray, chunks: list, bits: int, symmetric: bool, how: str) -> Carried:
        bs = self.cfg.block_size
        K, N = w.shape
        q = np.empty((N, K // bs, bs), dtype=np.uint8)  # [N, nb, bs]
        scale = np.empty((N, K // bs), dtype=np.float32)  # [N, nb]
        offset = None if symmetric else np.empty_like(scale)
        for c in chunks:
            q[c], scale[c], off, _err = _grid(_blocks(w[:, c], bs), bits, symmetric)
            if offset is not None:
                offset[c] = off
        return Carried(q, scale, offset, bits, f"{bits}bit_{'sym' if symmetric else 'asym'}_{how}")

    def _written(self, c: Carried) -> Carried:
        """Count a grid the writer takes (the manifest's formats: how many weights became what)."""
        self.formats_seen[c.fmt] = self.formats_seen.get(c.fmt, 0) + 1
        return c

    def _rounded_head(self) -> Carried:
        name = self._head_name()
        if self._head is None or self._head[0] != name:
            bits = self.cfg.head_bits or self.cfg.bits
            self._head = (name, self._round(self.src.matrix(name), bits))  # [V, nb, bs]
        return self._head[1]

    # ------------------------------------------------------------------------------------------ the interface
    def matrix(self, name: str, carry_codes: bool = False, rows: np.ndarray | None = None):
        if not self._rounds(name):  # the source's own (codes or floats)
            carried = carry_codes and self.quantized_tensor(name)
            return self._written(self.src.matrix(name, True, rows)) if carried else self.src.matrix(name, False, rows)
        c = self._rounded_head()
        c = c if rows is None else c.rows(rows)
        return self._written(c) if carry_codes else np.ascontiguousarray(c.dequantize().T)

    def _rounds(self, name: str) -> bool:
        """Whether this tensor is the head (or the tied embedding serving as it) and the preset rounds it."""
        return name == self._head_name() and self.cfg.quantizes_head

    def floats(self, name: str) -> np.ndarray:
        return self._rounded_head().dequantize() if self._rounds(name) else self.src.floats(name)

    def float_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        if self._rounds(name):
            return self._rounded_head().rows(np.asarray(rows)).dequantize()
        return self.src.float_rows(name, rows)

    def layer(self, i: int, carry_codes: bool = False) -> LayerWeights:
        """Layer i read as floats, each matrix rounded: Carried codes, or (carry_codes=False) their float values."""
        lw = self.src.layer(i, False)
        for field in MATRICES:
            c = self._round(getattr(lw, field), self.cfg.bits)
            setattr(lw, field, self._written(c) if carry_codes else np.ascontiguousarray(c.dequantize().T))
        return lw

    def weights(self, carry_codes: bool = False) -> LazyWeights:
        return LazyWeights(self, carry_codes)
