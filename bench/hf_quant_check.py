#!/usr/bin/env python
"""Does a specdec bundle hold an AWQ/GPTQ checkpoint's own weights? Teacher-forced logits on held-out text from three
readings of the same folder, compared position by position:

- reference: specdec's numpy forward of the checkpoint's weights decoded to float32 (export/streamed.py), one layer
  resident at a time;
- specdec: the bundle exported from the folder, run as the runtime runs it (int8-activation kernels);
- genai: onnxruntime-genai's model builder on the same folder (its own AWQ/GPTQ loaders), run by its Generator:
  a third party's reading of the same packed codes.

Prints and writes top-1 agreement, mean KL and max |logit difference| for each pair, and the sizes of the folder,
the bundle and genai's model.

    .venv/bin/python bench/hf_quant_check.py CHECKPOINT --bundle BUNDLE --out bench/results/qwen/hf_quant_check_0.5b_gptq.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import emit  # noqa: E402

TEXT = HERE / "results" / "qwen" / "corpus_answers_1.5b.jsonl"  # the 1.5B's answers to specdec's own prompts


def held_out_ids(bundle: Path, n_seqs: int, length: int) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    out = []
    for line in TEXT.read_text().splitlines():
        ids = tok.encode(json.loads(line)["text"]).ids
        if len(ids) >= length:
            out.append(np.array(ids[:length], dtype=np.int64))
        if len(out) == n_seqs:
            break
    return out


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def genai_model(checkpoint: Path, cache: Path) -> Path:
    out = cache / f"{checkpoint.name}-genai"
    if (out / "genai_config.json").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=cache))
    work = Path(tempfile.mkdtemp(prefix="genai-cache.", dir=cache))
    try:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(tmp),
               "-p", "int4", "-e", "cpu", "-c", str(work)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / "genai_config.json").is_file():
            raise SystemExit("onnxruntime-genai builder failed: " + " | ".join((proc.stderr or proc.stdout)
                                                                                .strip().splitlines()[-5:]))
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return out


def genai_logits(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 8)
    gen = og.Generator(model, params)
    gen.append_tokens(ids.reshape(1, -1).astype(np.int32))
    return np.asarray(gen.get_output("logits"), dtype=np.float32).reshape(len(ids), -1)


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """a, b: [n, V] logits."""
    la = a - a.max(-1, keepdims=True)
    lb = b - b.max(-1, keepdims=True)
    pa = np.exp(la) / np.exp(la).sum(-1, keepdims=True)
    log_pa = la - np.log(np.exp(la).sum(-1, keepdims=True))
    log_pb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    return {"top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "mean_kl": float(np.mean(np.sum(pa * (log_pa - log_pb), -1))),
            "max_abs_logit_diff": float(np.abs(a - b).max()), "max_abs_logit": float(np.abs(a).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--bundle", type=Path, required=True, help="the bundle `specdec export CHECKPOINT` wrote")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from specdec.export.hf_source import SafetensorsSource
    from specdec.export.streamed import reference_logits
    from specdec.export.verify import graph_logits
    from specdec.runtime.manifest import read_manifest

    spec = read_manifest(args.bundle).graphs["target"]
    seqs = held_out_ids(args.bundle, args.seqs, args.length)
    ref, ours, theirs = [], [], []
    genai_dir = None if args.no_genai else genai_model(args.checkpoint, args.checkpoint.parent)
    for ids in seqs:
        ref.append(reference_logits(SafetensorsSource(args.checkpoint), ids))
        ours.append(graph_logits(args.bundle / spec.file, spec, ids[None])[0])
        if genai_dir is not None:
            theirs.append(genai_logits(genai_dir, ids))
    ref, ours = np.concatenate(ref), np.concatenate(ours)
    result = {"checkpoint": str(args.checkpoint), "bundle": str(args.bundle), "positions": int(len(ref)),
              "quant": spec.quant, "checkpoint_mb": round(folder_bytes(args.checkpoint) / 1e6, 1),
              "bundle_target_mb": round(sum(f.stat().st_size for f in args.bundle.glob(spec.file + "*")) / 1e6, 1),
              "specdec_vs_reference": compare(ref, ours)}
    if theirs:
        theirs = np.concatenate(theirs)
        result["genai_mb"] = round(folder_bytes(genai_dir) / 1e6, 1)
        result["genai_vs_reference"] = compare(ref, theirs)
        result["specdec_vs_genai"] = compare(theirs, ours)
    emit(result, args.out)


if __name__ == "__main__":
    main()
