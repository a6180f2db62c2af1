"""Check an exported graph against the transformers model it came from."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.runtime.decoder import Decoder
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import GraphSpec
from specdec.runtime.session import RuntimeOptions

# fp32 graphs must reproduce transformers' fp32 logits to this (issue 2; measured ~1e-4 on SmolLM2).
FP32_TOLERANCE = 1e-3


def max_logit_diff(model, graph_path: Path, spec: GraphSpec, n_tokens: int = 48, seed: int = 0) -> float:
    """max |logits_onnx - logits_torch| over a prefill of n_tokens-8 random tokens and an 8-token step after it."""
    import torch

    cfg = spec.model
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, n_tokens))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.float().numpy()  # [1, n, vocab]
    kv = KVCache(spec.n_layers, 1, cfg.n_kv_heads, n_tokens, cfg.head_dim)
    dec = Decoder(graph_path, spec, cfg, kv, RuntimeOptions())
    split = n_tokens - 8
    diff = 0.0
    for start in range(0, split, 32):  # prefill in chunks, then a multi-token step: the verification shape
        stop = min(start + 32, split)
        diff = max(diff, float(np.abs(dec.forward(ids[:, start:stop]) - ref[:, start:stop]).max()))
        kv.advance(stop - start)
    diff = max(diff, float(np.abs(dec.forward(ids[:, split:]) - ref[:, split:]).max()))
    return diff
