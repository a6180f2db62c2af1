#!/usr/bin/env python
"""Peer runtimes side by side: the same prompt token ids, the same token budget, greedy.

Peers (each runs in its own subprocess, so its peak RSS is its own):

  hf                 Hugging Face transformers `generate`, fp32 torch, plain greedy
  hf-lookup          the same with `prompt_lookup_num_tokens=K` (its n-gram speculation)
  llamacpp           llama.cpp (llama-cpp-python) on the default GGUF (Q4_1), greedy
  llamacpp-lookup    the same with `LlamaPromptLookupDecoding` as draft model
  genai              onnxruntime-genai Generator on the genai-builder model, fp32
  genai-lookup       the same with its n-gram speculation (`set_speculative_options`)
  genai-int4         onnxruntime-genai, int4 model from the same builder
  genai-int4-lookup  the same with n-gram speculation

Every peer gets the token ids of the model's chat template (add_generation_prompt=True)
applied to a Spec-Bench question's first turn, computed once here; nobody re-tokenizes.
Generation is greedy, stops at EOS or after --max-new-tokens, with 2 threads everywhere.

Timing per prompt: `total_s` is the wall time of one whole generation (prefill + decode,
from handing over the ids to the last token); `ttft_s` the time to the first new token.
Aggregates: `tok_s` = total new tokens / total time, `decode_tok_s` = tokens after the
first / time after the first token (prefill excluded). One warm-up generation per peer is
run first and not counted.

    .venv/bin/python bench/peers.py --limit 1 --max-new-tokens 128 \
        --peers hf,hf-lookup,llamacpp,llamacpp-lookup,genai,genai-lookup \
        --out bench/results/peers.json

A peer that cannot be imported, built or run is reported as unavailable with the reason.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

from prompts import load_spec_bench  # noqa: E402

DEFAULT_QUESTIONS = os.environ.get("SPECDEC_SPEC_BENCH", "/work/shared/data/spec_bench_questions.jsonl")

PEERS: dict[str, dict] = {
    "hf": {"kind": "hf", "lookup": False,
           "describe": "transformers generate, fp32 torch, greedy"},
    "hf-lookup": {"kind": "hf", "lookup": True,
                  "describe": "transformers generate, fp32 torch, prompt_lookup_num_tokens=K"},
    "llamacpp": {"kind": "llamacpp", "lookup": False,
                 "describe": "llama-cpp-python on the GGUF (Q4_1), greedy"},
    "llamacpp-lookup": {"kind": "llamacpp", "lookup": True,
                        "describe": "llama-cpp-python, LlamaPromptLookupDecoding draft model"},
    "genai": {"kind": "genai", "lookup": False, "precision": "fp32",
              "describe": "onnxruntime-genai Generator, genai-builder fp32 model, greedy"},
    "genai-lookup": {"kind": "genai", "lookup": True, "precision": "fp32",
                     "describe": "onnxruntime-genai Generator, fp32, n-gram speculation"},
    "genai-int4": {"kind": "genai", "lookup": False, "precision": "int4",
                   "describe": "onnxruntime-genai Generator, genai-builder int4 model, greedy"},
    "genai-int4-lookup": {"kind": "genai", "lookup": True, "precision": "int4",
                          "describe": "onnxruntime-genai Generator, int4, n-gram speculation"},
}
DEFAULT_PEERS = "hf,hf-lookup,llamacpp,llamacpp-lookup,genai,genai-lookup,genai-int4,genai-int4-lookup"


# --------------------------------------------------------------------------------------------
# Workers: run inside the peer's own subprocess. Each writes JSON lines to `out`:
#   {"event": "loaded", ...}, then {"event": "prompt", ...} per prompt, then {"event": "done"}.
# --------------------------------------------------------------------------------------------

class _Out:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", encoding="utf-8")

    def write(self, **obj) -> None:
        self.f.write(json.dumps(obj) + "\n")
        self.f.flush()


def _hwm_mb(pid: int | str = "self") -> float | None:
    """Peak resident set size (VmHWM) of a process, in MiB.

    Not getrusage's ru_maxrss: that one keeps the high-water mark of the process image before
    exec, i.e. the parent's RSS at fork time, so a child forked from a parent holding a
    tokenizer would report the parent's memory. VmHWM belongs to the current address space.
    """
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


def _self_rss_mb() -> float | None:
    return _hwm_mb("self")


def _run_prompts(spec: dict, out: _Out, generate) -> None:
    """`generate(ids, max_new) -> (new_ids, ttft_s, total_s, extra)`; a warm-up run first."""
    generate(spec["warmup_ids"], min(8, spec["max_new_tokens"]))
    for p in spec["prompts"]:
        new_ids, ttft, total, extra = generate(p["ids"], spec["max_new_tokens"])
        out.write(event="prompt", id=p["id"], new_ids=[int(t) for t in new_ids], ttft_s=ttft,
                  total_s=total, extra=extra, rss_mb=_self_rss_mb())


def _cut_at_eos(ids: list[int], eos: set[int], max_new: int) -> list[int]:
    ids = list(ids)[:max_new]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def worker_hf(spec: dict, out: _Out) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    eos = spec["eos_ids"]
    kwargs = dict(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None,
                  eos_token_id=eos, pad_token_id=eos[0])
    if spec["lookup"]:
        kwargs.update(prompt_lookup_num_tokens=spec["lookup_k"],
                      max_matching_ngram_size=spec["ngram"])

    class FirstToken(BaseStreamer):
        def __init__(self, t0: float) -> None:
            self.t0, self.calls, self.ttft = t0, 0, None

        def put(self, value) -> None:
            self.calls += 1  # the first call carries the prompt
            if self.calls == 2 and self.ttft is None:
                self.ttft = time.perf_counter() - self.t0

        def end(self) -> None:
            pass

    def generate(ids, max_new):
        x = torch.tensor([ids], dtype=torch.long)
        mask = torch.ones_like(x)
        t0 = time.perf_counter()
        streamer = FirstToken(t0)
        with torch.inference_mode():
            y = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new,
                               streamer=streamer, **kwargs)
        total = time.perf_counter() - t0
        new = _cut_at_eos(y[0, len(ids):].tolist(), set(eos), max_new)
        return new, streamer.ttft, total, {}

    out.write(event="loaded", load_s=load_s, rss_after_load_mb=_self_rss_mb(),
              versions={"torch": torch.__version__, "transformers": transformers.__version__},
              settings={k: v for k, v in kwargs.items() if v is not None} | {"threads": spec["threads"]})
    _run_prompts(spec, out, generate)


def _patch_llama_no_extra_bufts():
    """Make every llama model load with `use_extra_bufts = False`.

    The source-built llama.cpp segfaults in its AMX matmul path (an "extra" CPU buffer type)
    on the first decode on this CPU. `Llama.__init__` takes its model params from
    `llama_cpp.llama_cpp.llama_model_default_params()`, so wrapping that function switches the
    extra buffer types off without rebuilding the library.
    """
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params
    if getattr(orig, "_specdec_patched", False):
        return
    if "use_extra_bufts" not in {f[0] for f in C.llama_model_params._fields_}:
        return  # an older llama.cpp without extra buffer types: nothing to switch off

    def patched():
        params = orig()
        params.use_extra_bufts = False
        return params

    patched._specdec_patched = True
    C.llama_model_default_params = patched
    import llama_cpp.llama as L

    if getattr(L, "llama_cpp", None) is C:
        pass  # llama.py calls through the module object, which now holds the patch
    elif hasattr(L, "llama_model_default_params"):
        L.llama_model_default_params = patched


def worker_llamacpp(spec: dict, out: _Out) -> None:
    import llama_cpp

    _patch_llama_no_extra_bufts()
    from llama_cpp import Llama

    draft = None
    settings = {"n_threads": spec["threads"], "n_threads_batch": spec["threads"],
                "use_extra_bufts": False, "sampler": "greedy (temp=0)"}
    if spec["lookup"]:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=spec["ngram"], num_pred_tokens=spec["lookup_k"])
        settings.update(draft="LlamaPromptLookupDecoding", max_ngram_size=spec["ngram"],
                        num_pred_tokens=spec["lookup_k"])
    n_ctx = max(len(p["ids"]) for p in spec["prompts"]) + spec["max_new_tokens"] + 64
    n_ctx = max(n_ctx, len(spec["warmup_ids"]) + 72, 512)
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                n_threads=spec["threads"], n_threads_batch=spec["threads"], seed=0,
                draft_model=draft, verbose=False)
    load_s = time.perf_counter() - t0
    eos = set(spec["eos_ids"])

    def generate(ids, max_new):
        llm.reset()  # no prefix reuse between prompts: every prompt is prefilled in full
        new: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                                reset=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            new.append(int(tok))
            if tok in eos or len(new) >= max_new:
                break
        total = time.perf_counter() - t0
        return new, ttft, total, {}

    out.write(event="loaded", load_s=load_s, rss_after_load_mb=_self_rss_mb(),
              versions={"llama_cpp_python": llama_cpp.__version__}, settings=settings | {"n_ctx": n_ctx})
    _run_prompts(spec, out, generate)


def worker_genai(spec: dict, out: _Out) -> None:
    import onnxruntime_genai as og

    threads = spec["threads"]
    t0 = time.perf_counter()
    config = og.Config(spec["genai_dir"])
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - t0
    eos = set(spec["eos_ids"])
    settings = {"precision": spec["precision"], "intra_op_num_threads": threads,
                "inter_op_num_threads": 1, "do_sample": False}
    spec_opts = None
    if spec["lookup"]:
        probe = og.GeneratorParams(model)
        if not hasattr(probe, "set_speculative_options"):
            raise RuntimeError(f"onnxruntime-genai {og.__version__} has no speculative options in its Python API")
        spec_opts = {"ngram_size": spec["ngram"], "max_draft_tokens": min(spec["lookup_k"], 16)}
        probe.set_speculative_options(**spec_opts)
        settings["speculative"] = probe.get_speculative_options()

    def generate(ids, max_new):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new, do_sample=False, num_beams=1)
        if spec_opts:
            params.set_speculative_options(**spec_opts)
        gen = og.Generator(model, params)
        ttft = None
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
            if ttft is None:
                ttft = time.perf_counter() - t0
        total = time.perf_counter() - t0
        seq = [int(t) for t in gen.get_sequence(0)]
        new = _cut_at_eos(seq[len(ids):], eos, max_new)
        extra = {}
        if spec_opts:
            s = gen.get_speculative_stats()
            extra = {k: s.get(k) for k in ("rounds", "draft_tokens_proposed", "draft_tokens_accepted",
                                           "target_forward_passes", "acceptance_rate",
                                           "mean_emitted_tokens_per_round", "ngram_lookup_hits",
                                           "ngram_lookup_misses", "standard_fallback_steps")}
        del gen
        return new, ttft, total, extra

    out.write(event="loaded", load_s=load_s, rss_after_load_mb=_self_rss_mb(),
              versions={"onnxruntime_genai": og.__version__}, settings=settings)
    _run_prompts(spec, out, generate)


WORKERS = {"hf": worker_hf, "llamacpp": worker_llamacpp, "genai": worker_genai}


def worker_main(spec_path: str, out_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    out = _Out(out_path)
    try:
        WORKERS[spec["kind"]](spec, out)
    except ImportError as e:
        out.write(event="unavailable", reason=f"not installed: {e}")
        return 3
    except Exception as e:  # noqa: BLE001 - any failure of a peer is a result, not a crash
        out.write(event="error", reason=f"{type(e).__name__}: {str(e).strip()[:400]}",
                  traceback=traceback.format_exc()[-2000:])
        return 4
    out.write(event="done", rss_mb=_self_rss_mb())
    return 0


# --------------------------------------------------------------------------------------------
# Parent: prepare prompts and models, run each peer, aggregate.
# --------------------------------------------------------------------------------------------

def _chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time spent by all processes on the machine since boot (/proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _wait_for_idle(max_wait_s: float, max_other_cores: float = 0.3, window_s: float = 3.0) -> float:
    """Wait (at most max_wait_s) until the machine's CPU use stays under max_other_cores for
    window_s seconds. Returns the seconds waited."""
    t0 = time.perf_counter()
    if max_wait_s <= 0:
        return 0.0
    while time.perf_counter() - t0 < max_wait_s:
        a = _cpu_busy_s()
        time.sleep(window_s)
        b = _cpu_busy_s()
        if a is None or b is None or (b - a) / window_s < max_other_cores:
            break
    return time.perf_counter() - t0


def _run_child(spec: dict, timeout_s: float, workdir: Path, name: str) -> tuple[list[dict], dict]:
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.out.jsonl"
    err_path = workdir / f"{name}.stderr.txt"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    threads = str(spec["threads"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)]
    stat0 = _cpu_busy_s()
    t0 = time.perf_counter()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    peak = [0.0]
    finished = threading.Event()

    def watch() -> None:  # VmHWM only grows: the last read before exit is the peak
        while not finished.is_set():
            v = _hwm_mb(proc.pid)
            if v is not None:
                peak[0] = max(peak[0], v)
            finished.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
        finished.set()
        watcher.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    cpu_s = usage.ru_utime + usage.ru_stime  # CPU time of the worker (rusage times are its own)
    stat1 = _cpu_busy_s()
    # Cores kept busy by everything else on the machine meanwhile (the parent's polling is ~0).
    others = (stat1 - stat0 - cpu_s) / wall if (stat0 is not None and stat1 is not None and wall > 0) else None
    events = []
    if out_path.exists():
        for line in out_path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    for e in events:  # the worker's own VmHWM reports, exact at the moment it wrote them
        if isinstance(e.get("rss_mb"), (int, float)):
            peak[0] = max(peak[0], e["rss_mb"])
    stderr_tail = err_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-8:]
    info = {"returncode": proc.returncode, "timed_out": timed_out.is_set(),
            "wall_s": wall, "peak_rss_mb": peak[0] or None, "cpu_s": cpu_s,
            "others_cores": None if others is None else max(others, 0.0),
            "stderr_tail": stderr_tail}
    return events, info


def _summ(rows: list[dict]) -> dict:
    n = sum(r["new_tokens"] for r in rows)
    t = sum(r["total_s"] for r in rows)
    dec_n = sum(max(r["new_tokens"] - 1, 0) for r in rows if r["ttft_s"] is not None)
    dec_t = sum(r["total_s"] - r["ttft_s"] for r in rows if r["ttft_s"] is not None)
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    return {"prompts": len(rows), "new_tokens": n, "total_s": round(t, 4),
            "tok_s": round(n / t, 2) if t > 0 else None,
            "decode_tok_s": round(dec_n / dec_t, 2) if dec_t > 0 else None,
            "mean_ttft_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(args) -> dict:
    peer_names = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peer_names if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    prompts = load_spec_bench(args.questions, args.limit, args.seed)
    if args.categories:
        wanted = set(args.categories.split(","))
        prompts = [p for p in prompts if p.category in wanted]
    if not prompts:
        raise SystemExit("no prompts selected")

    import _models

    t0 = time.perf_counter()
    gguf = _models.gguf_path()
    hf_dir = _models.hf_checkpoint()
    prep_s = {"hf_checkpoint_s": round(time.perf_counter() - t0, 2)}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    eos_ids = sorted({int(tok.eos_token_id)})
    prompt_rows = [{"id": p.id, "category": p.category, "ids": _chat_ids(tok, p.messages)} for p in prompts]
    warmup_ids = _chat_ids(tok, [{"role": "user", "content": "Say hello."}])
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)
    log(f"{len(prompts)} prompts, {sum(len(p['ids']) for p in prompt_rows)} prompt tokens, "
        f"max_new_tokens={args.max_new_tokens}, peers: {', '.join(peer_names)}")

    result = {
        "meta": {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {"platform": platform.platform(), "machine": platform.machine(),
                     "cpu": _cpu_name(), "cpu_flags": _cpu_flags(), "cpu_count": os.cpu_count(),
                     "mem_total_gib": _mem_gib()},
            "python": platform.python_version(),
            "model": {"gguf": str(gguf), "hf_checkpoint": str(hf_dir)},
            "questions": str(args.questions), "limit_per_category": args.limit, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads,
            "lookup_k": args.lookup_k, "ngram": args.ngram, "eos_ids": eos_ids,
            "timing": ("total_s: wall time of one generation incl. prefill; ttft_s: time to the first "
                       "new token; tok_s = sum(new_tokens)/sum(total_s); decode_tok_s = "
                       "sum(new_tokens-1)/sum(total_s-ttft_s). One untimed warm-up per peer."),
            "prep": prep_s,
            "contention_note": ("peers[*].others_cores = average number of CPU cores that other "
                                "processes kept busy while the peer ran (from /proc/stat minus the "
                                "worker's own CPU time); loadavg_1m = 1-minute load average before/"
                                "after. On a shared machine anything well above 0 slows the peer, "
                                "and multi-threaded runtimes that spin (OpenMP) lose the most."),
        },
        "prompts": [{"id": p["id"], "category": p["category"], "prompt_tokens": len(p["ids"])}
                    for p in prompt_rows],
        "peers": {},
    }

    token_ids: dict[str, dict[str, list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="specdec-peers-") as tmp:
        workdir = Path(tmp)
        for name in peer_names:
            cfg = PEERS[name]
            entry: dict = {"describe": cfg["describe"], "status": "unavailable"}
            result["peers"][name] = entry
            spec = {"kind": cfg["kind"], "lookup": cfg["lookup"], "threads": args.threads,
                    "max_new_tokens": args.max_new_tokens, "lookup_k": args.lookup_k,
                    "ngram": args.ngram, "eos_ids": eos_ids, "prompts": prompt_rows,
                    "warmup_ids": warmup_ids, "hf_dir": str(hf_dir), "gguf": str(gguf)}
            if cfg["kind"] == "genai":
                spec["precision"] = cfg["precision"]
                try:
                    import onnxruntime_genai  # noqa: F401  (checked here: the builder needs it too)
                except ImportError as e:
                    entry["reason"] = f"not installed: {e} (pip install onnxruntime-genai==0.18.0)"
                    log(f"[{name}] unavailable: {entry['reason']}")
                    continue
                try:
                    t1 = time.perf_counter()
                    spec["genai_dir"] = str(_models.genai_model(cfg["precision"]))
                    entry["prep_s"] = round(time.perf_counter() - t1, 2)
                except Exception as e:  # noqa: BLE001
                    entry["reason"] = f"model build failed: {str(e)[:400]}"
                    log(f"[{name}] unavailable: {entry['reason']}")
                    continue
            waited = _wait_for_idle(args.wait_idle)
            if args.wait_idle > 0:
                entry["waited_for_idle_s"] = round(waited, 1)
            log(f"[{name}] running ...")
            load_before = os.getloadavg()[0]
            events, info = _run_child(spec, args.peer_timeout, workdir, name)
            entry.update(_collect(name, events, info, prompt_rows, tok, args.max_new_tokens))
            # Other processes on the machine skew the timings: keep the 1-minute load average.
            entry["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            if "per_prompt" in entry:
                token_ids[name] = {r["id"]: r.pop("_ids") for r in entry["per_prompt"]}
            o = entry.get("overall") or {}
            log(f"[{name}] {entry['status']}" + (f": {entry.get('reason')}" if entry.get("reason") else "")
                + (f"  {o.get('new_tokens')} tok, {o.get('tok_s')} tok/s, decode {o.get('decode_tok_s')} tok/s"
                   if o else ""))

    _compare(result, token_ids, args.reference)
    if args.keep_tokens:
        result["token_ids"] = token_ids
    return result


def _collect(name, events, info, prompt_rows, tok, max_new) -> dict:
    entry: dict = {"peak_rss_mb": info["peak_rss_mb"] and round(info["peak_rss_mb"], 1),
                   "wall_s": round(info["wall_s"], 2), "cpu_s": round(info["cpu_s"], 2),
                   "others_cores": info["others_cores"] and round(info["others_cores"], 2)}
    loaded = next((e for e in events if e.get("event") == "loaded"), None)
    failed = next((e for e in events if e.get("event") in ("unavailable", "error")), None)
    done = any(e.get("event") == "done" for e in events)
    by_id = {e["id"]: e for e in events if e.get("event") == "prompt"}
    if loaded:
        entry.update(load_s=round(loaded["load_s"], 3), rss_after_load_mb=loaded["rss_after_load_mb"] and round(loaded["rss_after_load_mb"], 1),
                     versions=loaded.get("versions"), settings=loaded.get("settings"))
    if done and len(by_id) == len(prompt_rows):
        entry["status"] = "ok"
    elif by_id:
        entry["status"] = "partial"
    else:
        entry["status"] = "unavailable" if (failed or {}).get("event") == "unavailable" or not loaded else "failed"
    if failed:
        entry["reason"] = failed["reason"]
        if failed.get("traceback"):
            entry["traceback_tail"] = failed["traceback"][-800:]
    elif not done:
        rc = info["returncode"]
        why = "timed out" if info["timed_out"] else (
            f"killed by signal {-rc}" + (" (segfault)" if rc == -11 else "") if rc < 0 else f"exit code {rc}")
        entry["reason"] = f"worker {why} after {len(by_id)}/{len(prompt_rows)} prompts"
        entry["stderr_tail"] = info["stderr_tail"]
    if not by_id:
        return entry
    rows = []
    for p in prompt_rows:
        e = by_id.get(p["id"])
        if e is None:
            continue
        n = len(e["new_ids"])
        text = tok.decode(e["new_ids"], skip_special_tokens=True)
        row = {"id": p["id"], "category": p["category"], "prompt_tokens": len(p["ids"]), "new_tokens": n,
               "ttft_s": None if e["ttft_s"] is None else round(e["ttft_s"], 4),
               "total_s": round(e["total_s"], 4), "tok_s": round(n / e["total_s"], 2) if e["total_s"] > 0 else None,
               "eos": bool(e["new_ids"]) and e["new_ids"][-1] in set(_eos_of(tok)),
               "text80": text[:80], "_ids": e["new_ids"]}
        if e.get("extra"):
            row["speculation"] = e["extra"]
        rows.append(row)
    entry["overall"] = _summ(rows)
    entry["per_category"] = {c: _summ([r for r in rows if r["category"] == c])
                             for c in dict.fromkeys(r["category"] for r in rows)}
    entry["per_prompt"] = rows
    return entry


def _eos_of(tok) -> list[int]:
    return [int(tok.eos_token_id)]


def _compare(result: dict, token_ids: dict, reference: str) -> None:
    """Greedy outputs vs the reference peer, and each -lookup peer vs its plain peer."""
    peers = result["peers"]
    ref = reference if reference in token_ids else None
    for name, ids in token_ids.items():
        entry = peers[name]
        base = name[: -len("-lookup")] if name.endswith("-lookup") else None
        pairs = []
        if ref and name != ref:
            pairs.append(("vs_" + ref, token_ids[ref]))
        if base and base in token_ids:
            pairs.append(("vs_" + base, token_ids[base]))
            b, s = peers[base].get("overall", {}), entry.get("overall", {})
            if b.get("tok_s") and s.get("tok_s"):
                entry["speedup_vs_" + base] = round(s["tok_s"] / b["tok_s"], 3)
        agree = {}
        for label, other in pairs:
            common = [pid for pid in ids if pid in other]
            if not common:
                continue
            same = sum(ids[pid] == other[pid] for pid in common)
            prefix = [_common_prefix(ids[pid], other[pid]) for pid in common]
            agree[label] = {"identical": f"{same}/{len(common)}",
                            "mean_common_prefix_tokens": round(sum(prefix) / len(prefix), 1)}
            for r in entry["per_prompt"]:
                if r["id"] in other:
                    r.setdefault("common_prefix", {})[label] = _common_prefix(ids[r["id"]], other[r["id"]])
        if agree:
            entry["agreement"] = agree


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def _cpu_flags() -> list[str]:
    """The SIMD features that decide which kernels the peers use."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    return []


def format_table(result: dict) -> str:
    peers = result["peers"]
    lines = []
    hdr = (f"{'peer':<18} {'status':<11} {'tok/s':>7} {'decode':>7} {'TTFT s':>7} {'tokens':>6} "
           f"{'RSS MB':>7} {'load s':>6} {'others':>6}  same tokens as")
    lines += [hdr, "-" * len(hdr)]
    for name, e in peers.items():
        o = e.get("overall") or {}
        agree = e.get("agreement") or {}
        ag = ", ".join(f"{k[3:]}: {v['identical']}" for k, v in agree.items())
        sp = e.get("speedup_vs_" + name[:-7]) if name.endswith("-lookup") else None
        if sp:
            ag = (ag + "; " if ag else "") + f"x{sp} vs plain"

        def f(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        lines.append(f"{name:<18} {e['status']:<11} {f(o.get('tok_s'), '7.1f')} {f(o.get('decode_tok_s'), '7.1f')} "
                     f"{f(o.get('mean_ttft_s'), '7.3f')} {f(o.get('new_tokens'), '6d')} "
                     f"{f(e.get('peak_rss_mb'), '7.0f')} {f(e.get('load_s'), '6.1f')} "
                     f"{f(e.get('others_cores'), '6.2f')}  {ag}")
        if e.get("reason"):
            lines.append(f"{'':<18} reason: {e['reason'][:150]}")
    ok = [n for n, e in peers.items() if e.get("per_category")]
    if ok:
        cats = list(dict.fromkeys(c for n in ok for c in peers[n]["per_category"]))
        lines.append("")
        lines.append("tok/s per category (new tokens / whole-generation time)")
        w = max(8, *(len(n) for n in ok))
        lines.append(f"{'category':<15}" + "".join(f" {n:>{w}}" for n in ok))
        for c in cats:
            cells = []
            for n in ok:
                v = peers[n]["per_category"].get(c, {}).get("tok_s")
                cells.append(f" {v:>{w}.1f}" if v is not None else f" {'-':>{w}}")
            lines.append(f"{c:<15}" + "".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--limit", type=int, default=1, help="questions per category (0 < n; -1: all)")
    ap.add_argument("--seed", type=int, default=0, help="which questions --limit keeps")
    ap.add_argument("--categories", default="", help="comma-separated subset of categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--peers", default=DEFAULT_PEERS, help=f"comma-separated; known: {', '.join(PEERS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup-k", type=int, default=10, help="draft tokens per lookup (genai caps at 16)")
    ap.add_argument("--ngram", type=int, default=2, help="n-gram size matched by the lookup drafters")
    ap.add_argument("--reference", default="hf", help="peer whose token ids the others are compared to")
    ap.add_argument("--wait-idle", type=float, default=0,
                    help="before each peer, wait up to this many seconds for other CPU use to drop")
    ap.add_argument("--peer-timeout", type=float, default=900, help="seconds before a peer is killed")
    ap.add_argument("--out", default=str(HERE / "results" / "peers.json"))
    ap.add_argument("--keep-tokens", action="store_true", help="store every generated token id in the JSON")
    ap.add_argument("--table", action="store_true", help="print the table to stdout (default: when a TTY)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 0:
        args.limit = None
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.table or sys.stdout.isatty():
        print(format_table(result))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
