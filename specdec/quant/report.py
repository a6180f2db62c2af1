"""`specdec quant-report A B`: what bundle B's (quantized) target costs in quality and buys in speed
against reference bundle A, on the same prompts in one run.

Teacher-forced on A's own greedy answers: perplexity of each model on those answers, mean
KL(p_A || p_B) and top-1 agreement of next-token distributions; size on disk; ms per forward at
T=1 and T=5 after a past of 200; acceptance when B drafts for A (greedy chain, k=4); and the
T-invariance of each graph (max |logits| difference between one T=5 step and five T=1 steps),
which decides whether B may serve as a lossless speculative target.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.runtime.decoder import MAX_STEP, Decoder
from specdec.runtime.engine import Engine, GenerationConfig

FORWARD_PAST = 200
FORWARD_REPS = 15
# The bandwidth floor is taken against a matrix-vector product over this many bytes of fp32 weights (numpy's
# BLAS, all cores): far past any cache, it streams from memory the way a decode step does.
BANDWIDTH_PROBE_BYTES = 512 << 20


def teacher_forced_logits(dec: Decoder, ids: Sequence[int]) -> np.ndarray:
    """Logits [n, vocab] for every position of `ids`, in MAX_STEP chunks from an empty cache."""
    dec.kv.reset()
    out = []
    arr = np.asarray([ids], dtype=np.int64)
    for start in range(0, len(ids), MAX_STEP):
        chunk = arr[:, start:start + MAX_STEP]
        out.append(dec.forward(chunk)[0].copy())
        dec.kv.advance(chunk.shape[1])
    dec.kv.reset()
    return np.concatenate(out)  # [n, vocab]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(logits_a: np.ndarray, logits_b: np.ndarray, targets: np.ndarray) -> dict:
    """Distribution metrics of B against A at positions whose next tokens are `targets` [n]."""
    lp_a, lp_b = log_softmax(logits_a), log_softmax(logits_b)  # [n, vocab]
    rows = np.arange(len(targets))
    return {
        "nll_a": float(-lp_a[rows, targets].sum()),
        "nll_b": float(-lp_b[rows, targets].sum()),
        "kl_sum": float((np.exp(lp_a) * (lp_a - lp_b)).sum()),
        "agree": int((lp_a.argmax(-1) == lp_b.argmax(-1)).sum()),
        "n": int(len(targets)),
    }


def t_invariance(dec: Decoder, ids: Sequence[int], width: int = 5) -> float:
    """max |logits| between one `width`-token step and `width` single steps at the same positions."""
    past = len(ids) - width
    dec.kv.reset()
    dec.prefill(np.asarray([ids[:past]], dtype=np.int64))
    wide = dec.forward(np.asarray([ids[past:]], dtype=np.int64))[0].copy()  # [width, vocab]
    singles = []
    for t in ids[past:]:
        singles.append(dec.forward(np.asarray([[t]], dtype=np.int64))[0, 0].copy())
        dec.kv.advance(1)
    dec.kv.reset()
    return float(np.abs(wide - np.stack(singles)).max())


def forward_ms(dec: Decoder, widths=(1, 5)) -> dict[str, float]:
    rng = np.random.default_rng(0)
    dec.kv.reset()
    dec.prefill(rng.integers(0, dec.model.vocab_size, size=(1, FORWARD_PAST)))
    out = {}
    for t in widths:
        x = rng.integers(0, dec.model.vocab_size, size=(1, t))
        for _ in range(3):
            dec.forward(x)
        times = []
        for _ in range(FORWARD_REPS):
            t0 = time.perf_counter()
            dec.forward(x)
            times.append(time.perf_counter() - t0)
        out[f"T={t}"] = 1000 * float(np.median(times))
    dec.kv.reset()
    return out


def read_bandwidth_gbs(n_bytes: int = BANDWIDTH_PROBE_BYTES, reps: int = 7) -> float:
    """Memory read bandwidth a decode step can reach: the best of `reps` fp32 matrix-vector products over
    `n_bytes` of weights (GB/s of weights read)."""
    cols = 4096
    w = np.ones((n_bytes // 4 // cols, cols), dtype=np.float32)  # [rows, cols]
    x = np.ones(w.shape[0], dtype=np.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t0)
    return w.nbytes / best / 1e9


def bytes_per_token(engine: Engine) -> int:
    """Bytes a T=1 step of the target reads at past FORWARD_PAST: every weight, except embedding tables that
    are only gathered from (one row each), plus the K/V of the past."""
    import onnx

    from onnx import external_data_helper

    g = engine.manifest.graphs["target"]
    model = onnx.load_model(str(engine.path / g.file), load_external_data=False)
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    other_uses = {i for n in model.graph.node if n.op_type != "Gather" for i in n.input}
    total = 0
    for t in model.graph.initializer:
        size = external_data_helper.ExternalDataInfo(t).length if t.data_location == onnx.TensorProto.EXTERNAL \
            else len(t.raw_data)
        if t.name in gathered and t.name not in other_uses:
            size = size // max(t.dims[0], 1) if t.dims else size  # one row
        total += int(size or 0)
    m = g.model
    kv = m.n_layers * 2 * m.n_kv_heads * m.head_dim * FORWARD_PAST * g.kv_dtype.itemsize
    return total + kv


def graph_bytes(engine: Engine) -> int:
    g = engine.manifest.graphs["target"]
    return sum((engine.path / f).stat().st_size for f in engine.manifest.files
               if f == g.file or f.startswith(g.file + "."))


def quant_report(bundle_a: Path, bundle_b: Path, prompts: list, max_new_tokens: int = 96, draft_len: int = 4,
                 draft_prompts: int | None = None) -> dict:
    """`draft_prompts`: measure B drafting for A on the first N prompts only (None: all)."""
    a = Engine(bundle_a, drafter="none")
    b = Engine(bundle_b, drafter="none")
    a.add_draft_bundle(bundle_b, "candidate")
    totals = {"nll_a": 0.0, "nll_b": 0.0, "kl_sum": 0.0, "agree": 0, "n": 0}
    inv_a = inv_b = 0.0
    drafted = accepted = forwards = 0
    for i, prompt in enumerate(prompts):
        ids = a.encode(prompt)
        a.use_drafter("none")
        a.reset()
        answer = a.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, draft_len=0)).token_ids
        seq = ids + answer
        if len(answer) < 2:
            continue
        la = teacher_forced_logits(a.target, seq)[len(ids) - 1:-1]  # [n_answer, vocab] predicting answer
        lb = teacher_forced_logits(b.target, seq)[len(ids) - 1:-1]
        for key, v in compare_logits(la, lb, np.asarray(answer)).items():
            totals[key] += v
        inv_a = max(inv_a, t_invariance(a.target, seq[:len(ids) + 5]))
        inv_b = max(inv_b, t_invariance(b.target, seq[:len(ids) + 5]))
        if draft_prompts is not None and i >= draft_prompts:
            continue
        a.use_drafter("candidate")
        a.reset()
        g = a.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len))
        drafted, accepted, forwards = drafted + g.stats.drafted, accepted + g.stats.accepted, forwards + g.stats.target_forwards
    n = max(totals["n"], 1)
    bandwidth = read_bandwidth_gbs()

    def row(e: Engine, inv: float) -> dict:
        g, fwd, read = e.manifest.graphs["target"], forward_ms(e.target), bytes_per_token(e)
        floor_ms = read / (bandwidth * 1e9) * 1000
        return {"precision": g.precision, "quant": g.quant, "size_mb": round(graph_bytes(e) / 1e6, 1), "forward_ms": fwd,
                "bytes_per_token": read, "floor_ms": floor_ms, "t1_over_floor": fwd["T=1"] / floor_ms,
                "t_invariance_max_abs_logit": inv}

    return {
        "read_bandwidth_gbs": bandwidth,
        "a": {"bundle": str(bundle_a), **row(a, inv_a), "perplexity": float(np.exp(totals["nll_a"] / n))},
        "b": {"bundle": str(bundle_b), **row(b, inv_b), "perplexity": float(np.exp(totals["nll_b"] / n))},
        "tokens": totals["n"],
        "mean_kl_a_b": totals["kl_sum"] / n,
        "top1_agreement": totals["agree"] / n,
        "b_drafting_for_a": {"draft_len": draft_len, "prompts": min(len(prompts), draft_prompts if draft_prompts is not None else len(prompts)),
                             "acceptance_rate": accepted / max(drafted, 1),
                             "tau": (accepted + forwards) / max(forwards, 1)},
    }


def _label(r: dict) -> str:
    q = r["quant"]
    if not q:
        return r["precision"]
    method = q.get("method", "").replace("matmul_nbits_", "")
    finer = f"b{q['sensitive_block']}" if q.get("sensitive_block") else "8b"
    mixed = f"+{q['sensitive']:.0%} {finer}" if q.get("sensitive") else ""
    order = " act-order" if q.get("act_order") else ""
    # the grid of the weights rounded here; minmax re-encodes weights already on a grid as they are (a GGUF's
    # Q4_1 layers stay asymmetric), so its grid would mislabel those
    grid = "" if method == "minmax" else {True: " sym", False: " asym"}.get(q.get("symmetric"), "")
    return f"{r['precision']} {method}{order}{mixed}{grid} blk{q.get('block_size')}/acc{q.get('accuracy_level')}"


def render(reports: dict | list[dict]):
    """One table: the reference's column, then one per candidate (reports of the same reference and prompts)."""
    from rich.table import Table

    reports = [reports] if isinstance(reports, dict) else reports
    first = reports[0]
    t = Table(title=f"quant report over {first['tokens']} teacher-forced answer tokens")
    t.add_column("")
    t.add_column("A (reference)", justify="right")
    for i, _ in enumerate(reports):
        t.add_column("B" if len(reports) == 1 else f"B{i + 1}", justify="right")
    a = first["a"]

    def add(name: str, ref: str, each) -> None:
        t.add_row(name, ref, *(each(r) for r in reports))

    add("bundle", a["bundle"], lambda r: r["b"]["bundle"])
    add("precision", _label(a), lambda r: _label(r["b"]))
    add("size on disk (MB)", f"{a['size_mb']:.0f}", lambda r: f"{r['b']['size_mb']:.0f}")
    for w in ("T=1", "T=5"):
        add(f"ms per forward {w}", f"{a['forward_ms'][w]:.1f}", lambda r, w=w: f"{r['b']['forward_ms'][w]:.1f}")
    if "floor_ms" in a:
        add(f"bytes read per token (MB) -> floor ms at {first['read_bandwidth_gbs']:.1f} GB/s",
            f"{a['bytes_per_token'] / 1e6:.0f} -> {a['floor_ms']:.1f}",
            lambda r: f"{r['b']['bytes_per_token'] / 1e6:.0f} -> {r['b']['floor_ms']:.1f}")
        add("T=1 forward / floor", f"{a['t1_over_floor']:.2f}x", lambda r: f"{r['b']['t1_over_floor']:.2f}x")
    add("perplexity on A's answers", f"{a['perplexity']:.3f}", lambda r: f"{r['b']['perplexity']:.3f}")
    add("T=5 vs 5xT=1 max |dlogit|", f"{a['t_invariance_max_abs_logit']:.1e}",
        lambda r: f"{r['b']['t_invariance_max_abs_logit']:.1e}")
    add("mean KL(A||B)", "", lambda r: f"{r['mean_kl_a_b']:.4f}")
    add("top-1 agreement", "", lambda r: f"{r['top1_agreement']:.3f}")

    def drafting(r: dict) -> str:
        d = r["b_drafting_for_a"]
        return f"accept {d['acceptance_rate']:.3f}, tau {d['tau']:.2f}" if d.get("prompts", 1) else "not measured"

    add(f"B drafting for A, k={first['b_drafting_for_a']['draft_len']}", "", drafting)
    return t
