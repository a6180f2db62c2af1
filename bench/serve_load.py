#!/usr/bin/env python
"""Load test of `specdec serve`: N concurrent streaming clients on Spec-Bench prompts, with and without speculation.

Two servers of one bundle run side by side on loopback (plain: --draft-len 0; speculative: the bundle's drafter
with --draft-len auto), each with --max-batch rows; for each concurrency level the two are measured one after the
other (the idle one costs no CPU), so their ratio comes from one run. Every client streams its answer
(temperature 0) and records time to first token and end-to-end latency; throughput is all generated tokens over
the level's wall time. Peak RSS of each server process is read from /proc (VmHWM).

    .venv/bin/python bench/serve_load.py bundles/smollm2 --out bench/results/serve_load_smollm2.json

Bounded: at most --requests per level per server, and --max-tokens per answer; loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from specdec.spec_bench import load_spec_bench  # noqa: E402

QUESTIONS = REPO / "specdec" / "data" / "spec_bench_questions.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: Path, max_batch: int, draft_len: str, max_len: int | None,
                 drafter: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", str(bundle), "--port", str(port), "--max-batch",
           str(max_batch), "--draft-len", draft_len, *(["--max-len", str(max_len)] if max_len else []),
           *(["--drafter", drafter] if drafter else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server did not start: {proc.stderr.read().strip()}")
        try:
            if httpx.get(base + "/health").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("error: the server did not answer /health within 600 s")


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def one_request(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, spec = None, None, None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    usage, spec = chunk["usage"], chunk.get("speculation")
                elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "tokens": usage["completion_tokens"],
            "target_passes": spec["target_passes"] if spec else None}


async def level(base: str, prompts: list[list[dict]], clients: int, max_tokens: int) -> dict:
    """`clients` workers take prompts from one list until it is empty."""
    todo = list(prompts)
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            results.append(await one_request(client, base, todo.pop(0), max_tokens))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    good = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in good)
    passes = sum(r["target_passes"] or 0 for r in good)

    def pct(values: list[float], q: float) -> float | None:
        values = sorted(v for v in values if v is not None)
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None

    return {"clients": clients, "requests": len(results), "errors": len(errors), "first_errors": errors[:3],
            "tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
            "ttft_p50_s": pct([r["ttft_s"] for r in good], 0.5), "ttft_p99_s": pct([r["ttft_s"] for r in good], 0.99),
            "latency_p50_s": pct([r["latency_s"] for r in good], 0.5),
            "latency_p99_s": pct([r["latency_s"] for r in good], 0.99),
            "tokens_per_target_pass": round((tokens - len(good)) / passes, 3) if passes else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--clients", default="1,4,8,16", help="Concurrency levels (comma-separated).")
    ap.add_argument("--requests", type=int, default=32, help="Requests per level and server.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--drafter", default=None, help="The speculative server's drafter (default: the bundle's).")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not (args.bundle / "specdec.json").is_file():
        print(f"error: {args.bundle} is not a bundle (no specdec.json); export one first", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.clients.split(",")]
    questions = [p.messages for p in load_spec_bench(QUESTIONS)]
    servers = {"plain": start_server(args.bundle, args.max_batch, "0", args.max_len),
               "speculative": start_server(args.bundle, args.max_batch, "auto", args.max_len, args.drafter)}
    out: dict = {"bundle": str(args.bundle), "drafter": args.drafter or "the bundle's", "max_batch": args.max_batch, "max_tokens": args.max_tokens,
                 "requests_per_level": args.requests, "cpu_count": os.cpu_count(), "levels": []}
    try:
        for i, clients in enumerate(levels):
            # Each level takes its own slice of the questions (the same slice for both servers).
            prompts = [questions[(i * args.requests + j) % len(questions)] for j in range(args.requests)]
            row = {"clients": clients}
            for name, (proc, base) in servers.items():
                row[name] = asyncio.run(level(base, prompts, clients, args.max_tokens))
            row["speculative_over_plain"] = round(row["speculative"]["tok_s"] / row["plain"]["tok_s"], 3)
            out["levels"].append(row)
            print(json.dumps(row), flush=True)
        for name, (proc, _) in servers.items():
            out[f"{name}_peak_rss_mb"] = peak_rss_mb(proc.pid)
        one = {name: next(r[name]["tok_s"] for r in out["levels"] if r["clients"] == min(levels)) for name in servers}
        for row in out["levels"]:
            for name in servers:
                row[name]["over_fewest_clients"] = round(row[name]["tok_s"] / one[name], 3)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
