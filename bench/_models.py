"""Model artefacts the peer benchmark needs, built once into a cache folder.

- ``hf_checkpoint()``: the default GGUF dequantized to fp32 and written as a plain Hugging Face
  checkpoint folder (config, safetensors, tokenizer), so tools that want a checkpoint folder
  (the onnxruntime-genai model builder) read exactly the weights every other peer runs.
- ``genai_model(precision)``: that checkpoint turned into an onnxruntime-genai model folder by
  the genai model builder (``fp32`` or ``int4``).

The cache lives in ``$SPECDEC_CACHE/peers`` (default ``~/.cache/specdec/peers``). A folder is
written under a temporary name and renamed when complete, so a killed build never leaves a
half-written cache entry behind.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def peers_cache() -> Path:
    base = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
    return base / "peers"


def gguf_path() -> Path:
    from specdec.export.source import default_model_path

    return Path(default_model_path())


def _stem() -> str:
    return gguf_path().stem  # e.g. SmolLM2-135M-Instruct.Q4_1


def hf_checkpoint() -> Path:
    """Folder holding the default model as an fp32 HF checkpoint plus its tokenizer."""
    out = peers_cache() / "hf" / _stem()
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from specdec.export.source import load_source

    src = load_source(None)
    model, tok = src.model, src.tokenizer
    # A GGUF-loaded model carries quantization markers although its weights are fp32 by now;
    # save_pretrained refuses to write it until they are gone.
    if hasattr(model.config, "quantization_config"):
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                setattr(model, attr, None)
    model.is_quantized = False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".part", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def genai_model(precision: str = "int4") -> Path:
    """onnxruntime-genai model folder built from ``hf_checkpoint()`` (precision fp32 | int8 | int4)."""
    if precision not in ("fp32", "int8", "int4"):
        raise ValueError(f"unsupported genai precision {precision!r}")
    out = peers_cache() / "genai" / f"{_stem()}-{precision}"
    if (out / "genai_config.json").is_file() and any(out.glob("*.onnx")):
        return out
    hf = hf_checkpoint()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".part", dir=out.parent))
    cache = Path(tempfile.mkdtemp(prefix="genai-cache.", dir=out.parent))
    try:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder",
               "-i", str(hf), "-o", str(tmp), "-p", precision, "-e", "cpu", "-c", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / "genai_config.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError("onnxruntime-genai builder failed: " + " | ".join(tail))
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(hf_checkpoint())
    for p in sys.argv[1:]:
        print(genai_model(p))
