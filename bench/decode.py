#!/usr/bin/env python
"""Forward-pass cost and plain decoding speed of specdec's graph, beside the peers, in one run.

1. Memory bandwidth of this machine (numpy copy of 1 GiB, bytes read + written per second), and the
   bandwidth floor of a T=1 forward: bytes of weights / bandwidth.
2. ms per forward at T = 1, 5, 10 with a past of 200, IOBinding, shared in-place KV, for specdec's
   graph and for the graph onnxruntime-genai's builder makes of the same weights (if installed).
3. Plain greedy decoding tok/s: specdec's runtime vs Hugging Face `generate` (fp32, subprocess).

    .venv/bin/python bench/decode.py --bundle bundles/smollm2 --out bench/results/decode.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PAST = 200
WIDTHS = (1, 5, 10)
REPS = 30


def bandwidth_gbs(n_bytes: int = 1 << 30, reps: int = 5) -> float:
    src = np.ones(n_bytes // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n_bytes / best / 1e9  # read + write


def median_ms(fn, reps: int = REPS) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1000 * float(np.median(ts))


def specdec_forward_ms(bundle: Path, threads: int) -> dict:
    import specdec

    engine = specdec.load(bundle, drafter="none", runtime=specdec.RuntimeOptions(threads=threads))
    dec = engine.target
    ids = np.random.default_rng(0).integers(0, dec.model.vocab_size, size=(1, PAST + max(WIDTHS)))
    dec.prefill(ids[:, :PAST])  # the KV now holds PAST tokens; steps below write past it, never kept
    out = {f"T={t}": median_ms(lambda t=t: dec.forward(ids[:, PAST:PAST + t])) for t in WIDTHS}
    g = engine.manifest.graphs["target"]
    out["weights_bytes"] = sum((bundle / f).stat().st_size for f in engine.manifest.files
                               if f == g.file or f.startswith(g.file + "."))
    return out


def genai_forward_ms(model_dir: Path, threads: int) -> dict:
    import onnxruntime as ort

    cfg = json.loads((model_dir / "genai_config.json").read_text())["model"]
    so = ort.SessionOptions()
    so.use_per_session_threads = False  # the same global pool of `threads` that specdec's session used
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    n_layers = cfg["decoder"]["num_hidden_layers"]
    kv_heads, head = cfg["decoder"]["num_key_value_heads"], cfg["decoder"]["head_size"]
    max_len = 2048
    kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv_heads, max_len, head), np.float32))
          for _ in range(2 * n_layers)]
    b = sess.io_binding()
    for i in range(n_layers):  # genai's own layout: one max-length buffer, past and present shared
        for j, kind in enumerate(("key", "value")):
            b.bind_ortvalue_input(f"past_key_values.{i}.{kind}", kv[2 * i + j])
            b.bind_ortvalue_output(f"present.{i}.{kind}", kv[2 * i + j])
    vocab = sess.get_outputs()[0].shape[-1]
    ids = np.random.default_rng(0).integers(0, vocab, size=(1, PAST + max(WIDTHS)))

    def step(tokens: np.ndarray, past: int) -> None:
        t = tokens.shape[1]
        b.bind_cpu_input("input_ids", tokens)
        b.bind_cpu_input("attention_mask", np.ones((1, past + t), np.int64))
        b.bind_output("logits", "cpu")
        sess.run_with_iobinding(b)

    for start in range(0, PAST, 50):
        step(ids[:, start:start + 50], start)
    out = {f"T={t}": median_ms(lambda t=t: step(ids[:, PAST:PAST + t], PAST)) for t in WIDTHS}
    out["weights_bytes"] = sum(f.stat().st_size for f in model_dir.glob("model.onnx*"))
    return out


def specdec_plain_decode(bundle: Path, prompts: list[list[dict]], max_new: int, threads: int) -> dict:
    import specdec

    engine = specdec.load(bundle, drafter="none", runtime=specdec.RuntimeOptions(threads=threads))
    cfg = specdec.GenerationConfig(max_new_tokens=max_new, draft_len=0)
    engine.generate(prompts[0], cfg)  # warm-up
    tokens = wall = 0.0
    for p in prompts:
        engine.reset()
        t0 = time.perf_counter()
        g = engine.generate(p, cfg)
        wall += time.perf_counter() - t0
        tokens += len(g.token_ids)
    return {"tokens": int(tokens), "wall_s": wall, "tok_s": tokens / wall}


HF_CHILD = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from _models import hf_checkpoint
torch.set_num_threads(int(sys.argv[1])); max_new = int(sys.argv[2]); prompts = json.loads(sys.stdin.read())
path = hf_checkpoint(); tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
def run(msgs):
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=2)
    return out.shape[1] - ids.shape[1]
run(prompts[0])
tokens = wall = 0
for p in prompts:
    t0 = time.perf_counter(); tokens += run(p); wall += time.perf_counter() - t0
print(json.dumps({"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}))
"""


def hf_plain_decode(prompts: list[list[dict]], max_new: int, threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", HF_CHILD, str(threads), str(max_new)], input=json.dumps(prompts),
                          capture_output=True, text=True, cwd=HERE)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path("bundles/smollm2"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench questions per category for tok/s")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from prompts import DEFAULT_QUESTIONS, load_spec_bench

    prompts = [p.messages for p in load_spec_bench(DEFAULT_QUESTIONS, args.limit)]
    prompts = [p for p in prompts if len(p[0]["content"]) < 1500]  # decode speed, not prefill speed
    res: dict = {"threads": args.threads, "past": PAST}
    res["bandwidth_gbs"] = bandwidth_gbs()
    res["specdec_forward_ms"] = specdec_forward_ms(args.bundle, args.threads)
    res["floor_ms"] = res["specdec_forward_ms"]["weights_bytes"] / (res["bandwidth_gbs"] * 1e9) * 1000
    try:
        from _models import genai_model

        res["genai_forward_ms"] = genai_forward_ms(genai_model("fp32"), args.threads)
    except Exception as e:  # genai not installed / builder failed: say so, keep going
        res["genai_forward_ms"] = {"error": f"{type(e).__name__}: {e}"}
    res["specdec_plain"] = specdec_plain_decode(args.bundle, prompts, args.max_new_tokens, args.threads)
    res["hf_plain"] = hf_plain_decode(prompts, args.max_new_tokens, args.threads)

    s, g = res["specdec_forward_ms"], res["genai_forward_ms"]
    print(f"bandwidth {res['bandwidth_gbs']:.1f} GB/s; specdec weights {s['weights_bytes'] / 1e6:.0f} MB "
          f"-> floor {res['floor_ms']:.1f} ms per T=1 forward")
    print(f"{'ms/forward (past 200)':24s}" + "".join(f"{f'T={t}':>9s}" for t in WIDTHS))
    print(f"{'specdec':24s}" + "".join(f"{s[f'T={t}']:9.1f}" for t in WIDTHS))
    if "error" not in g:
        print(f"{'genai builder graph':24s}" + "".join(f"{g[f'T={t}']:9.1f}" for t in WIDTHS))
        print(f"{'specdec / genai':24s}" + "".join(f"{s[f'T={t}'] / g[f'T={t}']:9.2f}" for t in WIDTHS))
    else:
        print(f"genai: {g['error']}")
    print(f"specdec T=1 / floor: {s['T=1'] / res['floor_ms']:.2f}")
    sp, hf = res["specdec_plain"], res["hf_plain"]
    print(f"plain greedy decoding, {len(prompts)} prompts x {args.max_new_tokens} tokens: specdec {sp['tok_s']:.1f} tok/s"
          + (f", HF generate {hf['tok_s']:.1f} tok/s ({sp['tok_s'] / hf['tok_s']:.2f}x)" if "tok_s" in hf else
             f", HF: {hf.get('error')}"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
