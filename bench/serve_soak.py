#!/usr/bin/env python
"""Soak test of `specdec serve`: mixed traffic for a while, the server's RSS sampled every minute.

Clients loop over a mix of requests: streamed answers, whole answers, streams the client drops after a few
chunks, and bad requests (invalid JSON, n=2, a prompt over the KV buffer, an unknown field) that must get their
4xx. Reports RSS per minute, growth after the warm-up, and errors on good requests (goal: 0).

    .venv/bin/python bench/serve_soak.py bundles/smollm2 --minutes 30 --out bench/results/serve_soak_smollm2.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import QUESTIONS, load_spec_bench, start_server  # noqa: E402

BAD = [  # (body, the status it must get)
    (b"{not json", 400),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokenz": 5}).encode(), 400),
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client_loop(base: str, questions: list, deadline: float, rng: random.Random, tally: dict) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        while time.monotonic() < deadline:
            kind = rng.choices(["stream", "whole", "drop", "bad"], weights=[5, 2, 1.5, 1.5])[0]
            url = base + "/v1/chat/completions"
            body = {"messages": rng.choice(questions), "max_tokens": rng.choice([16, 64, 128]),
                    "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(1000)}
            r = None
            try:
                if kind == "bad":
                    content, want = rng.choice(BAD)
                    r = await c.post(url, content=content, headers={"Content-Type": "application/json"})
                    ok = r.status_code == want and "error" in r.json()
                elif kind == "whole":
                    r = await c.post(url, json=body)
                    ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
                else:
                    ok, chunks = False, 0
                    async with c.stream("POST", url, json={**body, "stream": True}) as r:
                        if r.status_code != 200:
                            await r.aread()
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                chunks += 1
                            if line == "data: [DONE]":
                                ok = r.status_code == 200
                            if kind == "drop" and chunks >= 3:
                                ok = True
                                break  # leaving the block closes the connection mid-answer
            except httpx.HTTPError as e:
                ok = False
                tally.setdefault("exceptions", []).append(f"{type(e).__name__}: {e}"[:200])
            tally[kind] = tally.get(kind, 0) + 1
            if not ok:
                tally[f"{kind}_failed"] = tally.get(f"{kind}_failed", 0) + 1
                if r is not None:
                    tally.setdefault("failures", []).append(f"{kind}: HTTP {r.status_code} {r.text[:160]}")


async def soak(base: str, pid: int, minutes: float, clients: int) -> dict:
    # Questions that fit the server's KV buffer with room for the answer (a longer one is a 400, tested apart).
    questions = [p.messages for p in load_spec_bench(QUESTIONS) if len(p.messages[0]["content"]) < 2000]
    deadline = time.monotonic() + 60 * minutes
    tally: dict = {}
    samples = [(0.0, rss_mb(pid))]
    t0 = time.monotonic()

    async def sampler() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(60, max(0.0, deadline - time.monotonic())))
            samples.append((round((time.monotonic() - t0) / 60, 2), round(rss_mb(pid), 1)))

    await asyncio.gather(sampler(), *(client_loop(base, questions, deadline, random.Random(i), tally)
                                      for i in range(clients)))
    return {"tally": tally, "rss_mb_by_minute": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--warmup-minutes", type=float, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    proc, base = start_server(args.bundle, args.max_batch, "auto", 1024)
    try:
        result = asyncio.run(soak(base, proc.pid, args.minutes, args.clients))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    after = [rss for minute, rss in result["rss_mb_by_minute"] if minute >= args.warmup_minutes]
    tally = result["tally"]
    good = sum(tally.get(k, 0) for k in ("stream", "whole", "drop"))
    good_failed = sum(tally.get(f"{k}_failed", 0) for k in ("stream", "whole", "drop"))
    out = {"bundle": str(args.bundle), "minutes": args.minutes, "clients": args.clients, "max_batch": args.max_batch,
           **result, "good_requests": good, "good_failed": good_failed, "bad_requests": tally.get("bad", 0),
           "bad_answered_wrong": tally.get("bad_failed", 0), "server_exit_code": code,
           "rss_growth_after_warmup": round(after[-1] / after[0] - 1, 4) if len(after) > 1 else None}
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0 if good_failed == 0 and tally.get("bad_failed", 0) == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
