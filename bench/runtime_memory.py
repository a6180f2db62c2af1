#!/usr/bin/env python
"""Where a bundle's memory goes at run time: RSS after loading, after a prompt, after generating, split into
onnxruntime's private copies (heap and anonymous maps: prepacked weights, arena, KV, Python) and the bundle's
weight file still mapped; against the bound `bundle + KV + 300 MB`.

One process, plain decoding (a drafter adds its own graph or index on top), 2 threads:

    .venv/bin/python bench/runtime_memory.py bundles/qwen15 --prompt-tokens 512 \
        --out bench/results/qwen/runtime_memory_1.5b.json
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from report import emit  # noqa: E402

MB = 1e6


def status() -> dict:
    """VmHWM (peak), VmRSS, RssAnon, RssFile of this process, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = round(int(line.split()[1]) * 1024 / MB, 1)
    return out


def resident_by_mapping(bundle: Path) -> dict:
    """Resident MB per kind of mapping: the bundle's files, private memory, libraries."""
    kinds: collections.Counter = collections.Counter()
    where = "private"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                path = head[5] if len(head) > 5 else ""
                where = ("bundle " + Path(path).name if path.startswith(str(bundle.resolve()))
                         else "private" if not path or path.startswith("[") else "libraries")
            elif head and head[0] == "Rss:":
                kinds[where] += int(head[1]) * 1024
    return {k: round(v / MB, 1) for k, v in kinds.most_common()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-mapped", action="store_true",
                    help="leave the weight file's pages resident after loading (the runtime pages them out)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import specdec
    from specdec.runtime import session

    if args.keep_mapped:
        session.release_mapped_pages = lambda path: 0

    stages = {"imported": status()}
    engine = specdec.load(args.bundle, drafter="none", runtime=specdec.RuntimeOptions(threads=args.threads))
    stages["loaded"] = {**status(), "resident": resident_by_mapping(args.bundle)}
    text = " ".join(["The quick brown fox jumps over the lazy dog and keeps running through the field."] * 64)
    ids = engine.codec.encode(text)[: args.prompt_tokens]
    config = specdec.GenerationConfig(max_new_tokens=args.new_tokens, draft_len=0)
    new_tokens = sum(len(chunk) for chunk in engine.stream_ids(ids, config))
    stages["generated"] = {**status(), "resident": resident_by_mapping(args.bundle)}
    bundle_mb = sum(p.stat().st_size for p in args.bundle.iterdir() if p.is_file()) / MB
    kv_mb = engine.target.kv.nbytes / MB
    peak = stages["generated"]["VmHWM"]
    result = {
        "bundle": str(args.bundle), "bundle_mb": round(bundle_mb, 1), "kv_mb": round(kv_mb, 1),
        "kv_positions": int(engine.target.kv.max_len),
        "prompt_tokens": len(ids), "new_tokens": new_tokens, "threads": args.threads,
        "weight_pages_released_after_load": not args.keep_mapped,
        "stages": stages, "peak_rss_mb": peak,
        "bound_mb": round(bundle_mb + kv_mb + 300, 1), "over_bound_mb": round(peak - (bundle_mb + kv_mb + 300), 1),
        "definitions": "MB = 1e6 bytes. private: heap and anonymous maps (onnxruntime's prepacked weights, its "
                       "arena, the KV cache as written, Python); bundle FILE: pages of the bundle's files mapped "
                       "and resident; bound: bundle files + KV buffers + 300 MB.",
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
