#!/usr/bin/env python
"""What `specdec export` spends on real models: peak RSS, wall time, bundle size against the source's, per graph.

Sources: the Qwen2.5-Coder GGUFs (bench/models.py) and GPTQ checkpoint folders written from them
(bench/quantized_checkpoint.py). Each export runs as its own process under /usr/bin/time -v (peak RSS of the largest
process, the tokenizer's child included), one after the other.

    .venv/bin/python bench/export_memory.py --out bench/results/qwen/export_memory.json
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402

CASES = {
    "qwen-0.5b": (["qwen-0.5b"], []),
    "qwen-1.5b": (["qwen-1.5b"], []),
    "qwen-1.5b+0.5b-draft": (["qwen-1.5b"], ["qwen-0.5b"]),
    "qwen-0.5b-gptq": (["qwen-0.5b:gptq"], []),
    "qwen-1.5b-gptq": (["qwen-1.5b:gptq"], []),
    # the file's weights rounded again to the fast int4 preset, streamed (export/rounded.py)
    "qwen-1.5b-int4": (["qwen-1.5b"], [], ["--precision", "int4", "--fast-kernels"]),
}


def source(name: str) -> Path:
    """A GGUF ("qwen-1.5b") or a GPTQ/AWQ folder written from it ("qwen-1.5b:gptq")."""
    if ":" not in name:
        return models.fetch(name)
    import quantized_checkpoint

    model, method = name.split(":")
    out = models.models_cache() / f"{model}-{method}-g128-rtn"
    if not (out / "config.json").is_file():
        quantized_checkpoint.write_checkpoint(models.fetch(model), out, method, 128)
    return out


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def run_case(target: Path, draft: Path | None, folder: Path, extra: list[str] = ()) -> dict:
    out = folder / "bundle"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "specdec.cli", "export", str(target), "-o", str(out),
           "--drafter", f"model:{draft}" if draft else "none", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    manifest = json.loads((out / "specdec.json").read_text())
    graphs = {}
    for name, g in manifest["graphs"].items():
        files = [f for f in manifest["files"] if f == g["file"] or f.startswith(g["file"] + ".")]
        graphs[name] = {"bytes": sum((out / f).stat().st_size for f in files), "precision": g["precision"],
                        "formats": g.get("quant", {}).get("formats"), "checks": g.get("checks", {})}
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    sources = size(target) + (size(draft) if draft else 0)
    return {"peak_rss_mb": round(peak_kb / 1024, 1), "wall_s": round(wall, 1), "bundle_mb": round(total / 1e6, 1),
            "source_mb": round(sources / 1e6, 1), "bundle_over_source": round(total / sources, 3), "graphs": graphs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {}
    for case in args.cases.split(","):
        targets, drafts, *extra = CASES[case]
        target = source(targets[0])
        draft = source(drafts[0]) if drafts else None
        with tempfile.TemporaryDirectory(prefix="specdec-export-") as tmp:
            result[case] = run_case(target, draft, Path(tmp), *extra)
            shutil.rmtree(tmp, ignore_errors=True)
        print(case, json.dumps({k: v for k, v in result[case].items() if k != "graphs"}), file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
