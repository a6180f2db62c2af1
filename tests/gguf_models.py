"""Small synthetic GGUF files for tests: random blocks of every carried format, a real tokenizer, seconds to write."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Byte offsets of a block's float16 scale fields (d, and dmin/m where the format has one), per format.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
# Largest |code x sub-block scale| per format: a block scale of s / MAGNITUDE gives weights of about +-s.
MAGNITUDE = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 127, "Q4_K": 945, "Q5_K": 1953, "Q6_K": 4064,
             "Q2_K": 45, "Q3_K": 128}


def random_blocks(fmt: str, rows: int, K: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes per row] of format `fmt`: random codes and sub-block scales, float16 block
    scales drawn in +-`scale` (random bytes there would be NaN or huge)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, size=(rows, K // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        vals = rng.uniform(-scale, scale, size=(rows, K // bs)).astype(np.float16)
        raw[..., off:off + 2] = vals.view(np.uint8).reshape(rows, K // bs, 2)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, tokenizer, arch: str = "qwen2", n_layers: int = 2, hidden: int = 256, heads: int = 4,
               kv_heads: int = 2, ffn: int = 512, formats: dict | None = None, seed: int = 0, tied: bool = False,
               chat_template: str | None = None) -> Path:
    """A random-weight decoder GGUF. `formats` maps a tensor role (embed, head, q, k, v, o, gate, up, down) to
    its ggml type (default: a Q4_K_M-like mix: Q4_K, with Q6_K for v/down/head and Q5_0 for the embedding)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    fmt = {"embed": "Q5_0", "head": "Q6_K", "q": "Q4_K", "k": "Q4_K", "v": "Q6_K", "o": "Q4_K", "gate": "Q4_K",
           "up": "Q4_K", "down": "Q6_K", **(formats or {})}
    rng = np.random.default_rng(seed)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    V, H = len(tokens), hidden // heads

    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types([1] * V)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    if chat_template or getattr(tokenizer, "chat_template", None):
        w.add_chat_template(chat_template or tokenizer.chat_template)

    def matrix(name: str, role: str, rows: int, K: int) -> None:
        f = fmt[role]
        if f == "F32":
            w.add_tensor(name, (rng.standard_normal((rows, K)) * 0.05).astype(np.float32))
        elif f == "F16":
            w.add_tensor(name, (rng.standard_normal((rows, K)) * 0.05).astype(np.float16))
        else:
            # Weights of about +-3/sqrt(K): activations keep a useful range through the layers.
            w.add_tensor(name, random_blocks(f, rows, K, rng, scale=3 / np.sqrt(K) / MAGNITUDE[f]),
                         raw_dtype=GGMLQuantizationType[f])

    def vector(name: str, n: int, around: float = 1.0) -> None:
        w.add_tensor(name, (around + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", "embed", V, hidden)
    vector("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", "head", V, hidden)
    for i in range(n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden)
        vector(p + "ffn_norm.weight", hidden)
        matrix(p + "attn_q.weight", "q", heads * H, hidden)
        matrix(p + "attn_k.weight", "k", kv_heads * H, hidden)
        matrix(p + "attn_v.weight", "v", kv_heads * H, hidden)
        if arch == "qwen2":
            vector(p + "attn_q.bias", heads * H, 0.0)
            vector(p + "attn_k.bias", kv_heads * H, 0.0)
            vector(p + "attn_v.bias", kv_heads * H, 0.0)
        matrix(p + "attn_output.weight", "o", hidden, heads * H)
        matrix(p + "ffn_gate.weight", "gate", ffn, hidden)
        matrix(p + "ffn_up.weight", "up", ffn, hidden)
        matrix(p + "ffn_down.weight", "down", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
