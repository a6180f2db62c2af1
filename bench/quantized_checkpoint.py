"""A real-size GPTQ or AWQ checkpoint folder written from a GGUF model, for measuring specdec's export of Hugging Face
checkpoints that carry their own quantized weights (no model hub is reachable here).

Each linear layer of the GGUF is dequantized and rounded again to 4 bits, asymmetric, per group of 128 inputs
(round to nearest: what GPTQ and AWQ store, without their calibration), then packed as AutoGPTQ (`gptq`, v1 zero
points) or AutoAWQ GEMM (`awq`) write it; embeddings, head and norms are float16. One safetensors shard per layer and
an index, a config.json and the tokenizer: the folder `specdec export` and onnxruntime-genai's builder read.
Written one layer at a time (bounded memory), under a temporary name renamed when complete.

    python bench/quantized_checkpoint.py qwen-0.5b --method gptq     # prints the folder
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import fetch, models_cache  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


def rtn(w: np.ndarray, group: int, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N out, K in] float32 -> (q [K, N] uint8, z [G, N] uint8, s [G, N] float16), asymmetric round to nearest."""
    N, K = w.shape
    wt = np.ascontiguousarray(w.T).reshape(K // group, group, N)  # [G, g, N]
    lo, hi = np.minimum(wt.min(1), 0), np.maximum(wt.max(1), 0)  # [G, N]: the range holds zero
    top = (1 << bits) - 1
    s = np.maximum((hi - lo) / top, 2.0 ** -14).astype(np.float16)  # float16's smallest normal: never 0
    sf = s.astype(np.float32)
    z = np.clip(np.round(-lo / sf), 0, top).astype(np.uint8)
    q = np.clip(np.round(wt / sf[:, None]) + z[:, None], 0, top).astype(np.uint8)
    return np.ascontiguousarray(q.reshape(K, N)), z, s


def pack_rows(v: np.ndarray, bits: int = 4) -> np.ndarray:
    """[R, C] -> int32 [R*bits/32, C]: value j of a word from row 32/bits*i + j (GPTQ's qweight)."""
    per = 32 // bits
    v = v.astype(np.uint32).reshape(v.shape[0] // per, per, v.shape[1])
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    return np.bitwise_or.reduce(v << shifts, axis=1).view(np.int32)


def pack_cols(v: np.ndarray, bits: int = 4, order=None) -> np.ndarray:
    """[R, C] -> int32 [R, C*bits/32]: value j of a word from column 32/bits*i + order[j] (GPTQ's qzeros, AWQ)."""
    per = 32 // bits
    order = np.arange(per) if order is None else np.asarray(order)
    v = v.astype(np.uint32).reshape(v.shape[0], v.shape[1] // per, per)[:, :, order]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(v << shifts, axis=2).view(np.int32)


def packed(method: str, w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    q, z, s = rtn(w, group)
    if method == "awq":
        return {"qweight": pack_cols(q, order=AWQ_ORDER), "qzeros": pack_cols(z, order=AWQ_ORDER), "scales": s}
    K = q.shape[0]
    return {"qweight": pack_rows(q), "qzeros": pack_cols(((z.astype(np.int16) - 1) & 15).astype(np.uint8)),
            "scales": s, "g_idx": (np.arange(K) // group).astype(np.int32)}


def write_checkpoint(gguf: Path, out: Path, method: str, group: int = 128) -> Path:
    from safetensors.numpy import save_file

    from specdec.export.gguf_source import GGUFSource, load_tokenizer

    src = GGUFSource(gguf)
    cfg, a = src.config, src.arch
    if a != "qwen2":
        raise SystemExit(f"{gguf.name}: only qwen2 GGUFs are converted here (rows of llama Q/K are permuted)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".part", dir=out.parent))
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, np.ndarray]) -> None:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    try:
        f16 = lambda n: src.floats(n).astype(np.float16)  # noqa: E731
        shard("embed.safetensors", {"model.embed_tokens.weight": f16("token_embd.weight"),
                                    "model.norm.weight": f16("output_norm.weight"),
                                    **({"lm_head.weight": f16("output.weight")} if src.head_name else {})})
        for i in range(cfg.n_layers):
            p, h = f"blk.{i}.", f"model.layers.{i}."
            ts = {h + "input_layernorm.weight": f16(p + "attn_norm.weight"),
                  h + "post_attention_layernorm.weight": f16(p + "ffn_norm.weight")}
            for x in "qkv":
                if p + f"attn_{x}.bias" in src.tensors:
                    ts[h + f"self_attn.{x}_proj.bias"] = f16(p + f"attn_{x}.bias")
            for g_name, hf_name in LINEARS.items():
                for k, v in packed(method, src.floats(p + g_name + ".weight"), group).items():
                    ts[f"{h}{hf_name}.{k}"] = v
            shard(f"layer-{i:03d}.safetensors", ts)
            src.release()
            print(f"layer {i + 1}/{cfg.n_layers}", file=sys.stderr, flush=True)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
              if method == "awq" else
              {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
               "checkpoint_format": "gptq"})
        (tmp / "config.json").write_text(json.dumps({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.rms_eps, "rope_theta": src.rope_theta,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": src.head_name is None, "hidden_act": "silu",
            "torch_dtype": "float16", "eos_token_id": list(src.eos_token_ids), "use_sliding_window": False,
            "quantization_config": qc}, indent=1))
        load_tokenizer(gguf).save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["qwen-0.5b", "qwen-1.5b"])
    ap.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    out = models_cache() / f"{args.model}-{args.method}-g{args.group}-rtn"
    if not (out / "config.json").is_file():
        write_checkpoint(fetch(args.model), out, args.method, args.group)
    print(out)


if __name__ == "__main__":
    main()
