#!/usr/bin/env python
"""What `specdec export` of a Hugging Face checkpoint folder spends: the streamed safetensors path
(export/hf_source.py) against the torch path, on one synthetic random-weight checkpoint.

Each export runs as its own process under a 10 GiB address-space cap (`prlimit --as`), `timeout` and
/usr/bin/time -v (peak RSS of the largest process), one after the other.

    .venv/bin/python bench/hf_export_memory.py --layers 16 --hidden 1024 --dtypes fp32,bf16 \\
        --out bench/results/hf_stream_export.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AS_LIMIT = 10 << 30
EXPORT = """
import sys
from specdec.export.bundle import ExportConfig, export_bundle
export_bundle(sys.argv[1], sys.argv[2], ExportConfig(drafter="none", max_len=256, stream=sys.argv[3] == "stream"))
import resource
print("peak_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_checkpoint(folder: Path, layers: int, hidden: int, dtype: str, seed: int = 0) -> int:
    """A Llama checkpoint of random weights written straight to safetensors (numpy; FFN 4x hidden, 16 heads,
    4 KV heads, untied head); returns the weights' bytes as stored."""
    from safetensors.numpy import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tokenizer

    tok = make_tokenizer()
    V, D, F, heads, kv = len(tok), hidden, 4 * hidden, 16, 4
    H = D // heads
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (heads * H, D), p + "self_attn.k_proj.weight": (kv * H, D),
                       p + "self_attn.v_proj.weight": (kv * H, D), p + "self_attn.o_proj.weight": (D, heads * H),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    tensors = {}
    for name, shape in shapes.items():
        w = np.ones(shape, np.float32) if len(shape) == 1 else \
            rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5)
        # bf16: the high half of each float32 (a uint16 view; safetensors' numpy side has no bfloat16 type)
        tensors[name] = w if dtype == "fp32" else (w.view(np.uint32) >> 16).astype(np.uint16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if dtype == "bf16":  # relabel the uint16 tensors BF16: a new header, the data (offsets relative to it) as it is
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, entry in header.items():
            if name != "__metadata__":
                entry["dtype"] = "BF16"
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
              "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": tok.bos_token_id,
              "eos_token_id": tok.eos_token_id, "dtype": "float32" if dtype == "fp32" else "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(folder)
    return sum(int(np.prod(s)) for s in shapes.values()) * (4 if dtype == "fp32" else 2)


def run_export(ckpt: Path, out: Path, path: str, timeout_s: int) -> dict:
    cmd = ["prlimit", f"--as={AS_LIMIT}", "timeout", str(timeout_s), "/usr/bin/time", "-v",
           sys.executable, "-c", EXPORT, str(ckpt), str(out), path]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    own = re.search(r"peak_kb (\d+)", proc.stdout)
    # peak_rss_mb: the largest process (the tokenizer's child included); export_process: the export's own
    result = {"exit": proc.returncode, "wall_s": round(wall, 1),
              "peak_rss_mb": round(int(peak.group(1)) / 1024, 1) if peak else None,
              "peak_rss_export_process_mb": round(int(own.group(1)) / 1024, 1) if own else None}
    if proc.returncode != 0:
        own = proc.stderr.split("\tCommand being timed")[0]  # what the export printed, before time's report
        lines = [ln for ln in own.splitlines() if ln.strip() and not ln.startswith("Command exited")]
        result["error"] = lines[-1][:300] if lines else f"exit {proc.returncode}"
        return result
    manifest = json.loads((out / "specdec.json").read_text())
    result["bundle_mb"] = round(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6, 1)
    result["checks"] = manifest["graphs"]["target"]["checks"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtypes", default="fp32,bf16", help="checkpoint dtypes, one checkpoint each")
    ap.add_argument("--paths", default="stream,torch")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {"address_space_limit_gib": AS_LIMIT >> 30, "machine": platform.processor() or platform.machine(),
              "cpus": len(os.sched_getaffinity(0)), "load_average_at_start": os.getloadavg()[0]}
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory(prefix="specdec-hf-export-") as tmp:
            ckpt = Path(tmp) / "ckpt"
            ckpt.mkdir()
            weights = write_checkpoint(ckpt, args.layers, args.hidden, dtype)
            case = {"checkpoint": {"layers": args.layers, "hidden": args.hidden, "ffn": 4 * args.hidden,
                                   "dtype": dtype, "weights_mb": round(weights / 1e6, 1)}}
            for path in args.paths.split(","):
                case[path] = run_export(ckpt, Path(tmp) / f"bundle-{path}", path, args.timeout)
                print(dtype, path, json.dumps({k: v for k, v in case[path].items() if k != "checks"}), file=sys.stderr)
            result[dtype] = case
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
