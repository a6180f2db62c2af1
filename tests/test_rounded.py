"""export/rounded.py: float weights rounded to block grids as a streamed export reads them."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.export import rounded
from specdec.quant.grid import _blocks, _grid
from specdec.quant.weight_only import TARGET_PRESETS


@pytest.mark.parametrize("chunk", [7, 64, 10_000])
def test_rounding_in_column_chunks_equals_rounding_whole(monkeypatch, chunk):
    """Chunked rounding (any chunk width) gives the grids of rounding the whole weight at once; a weight already on
    an asymmetric 4-bit grid is found exact and re-encoded to the same values."""
    monkeypatch.setattr(rounded, "CHUNK_COLS", chunk)
    src = rounded.RoundedSource(object(), TARGET_PRESETS["int4"], "int4")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 100)).astype(np.float32)  # [K, N]
    c = src._round(w, 4)
    q, scale, offset, _ = _grid(_blocks(w, 32), 4, True)
    np.testing.assert_array_equal(c.q, q)
    np.testing.assert_array_equal(c.scale, scale)
    assert c.offset is None and c.fmt == "4bit_sym_rtn"
    # on a Q4_1-like grid: codes 0..15 in every block, scale and minimum per block
    codes = rng.integers(0, 16, size=(100, 3, 32))
    codes[..., 0], codes[..., 1] = 0, 15
    d, m = rng.uniform(0.01, 0.1, (100, 3, 1)), rng.uniform(-1, 0, (100, 3, 1))
    on_grid = (codes * d + m).astype(np.float32).reshape(100, 96).T  # [K, N]
    e = src._round(np.ascontiguousarray(on_grid), 4)
    assert e.fmt == "4bit_asym_exact"
    np.testing.assert_allclose(e.dequantize(), on_grid.T, atol=1e-6)
