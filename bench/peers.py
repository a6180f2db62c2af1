#!/usr/bin/env python
"""Peer runtimes side by side: the same prompt token ids, the same token budget, greedy.

Peers (each in its own worker process, so its peak RSS is its own):

  hf                 Hugging Face transformers `generate`, fp32 torch, plain greedy
  hf-lookup          the same with `prompt_lookup_num_tokens=K` (its n-gram speculation)
  llamacpp           llama.cpp (llama-cpp-python) on the default GGUF (Q4_1), greedy
  llamacpp-lookup    the same with `LlamaPromptLookupDecoding` as draft model
  genai              onnxruntime-genai Generator on its model builder's fp32 model, greedy
  genai-lookup       the same with its n-gram speculation (`set_speculative_options`)
  genai-int4         onnxruntime-genai, the builder's int4 model, greedy
  genai-int4-lookup  the same with n-gram speculation
  specdec[-V]:D[:K]  specdec on the bundle bundles/smollm2[-V] (see --bundles), drafter D
                     (any of specdec's, e.g. none, ngram, corpus, model, hybrid), draft length K
                     (an integer or auto), e.g. specdec:none, specdec:corpus:auto, specdec-int4:ngram:auto

Every peer gets the token ids of the model's chat template (add_generation_prompt=True)
applied to a Spec-Bench question's first turn, computed once here; no peer tokenizes text.
Generation is greedy and stops at EOS or after --max-new-tokens; 2 threads everywhere.

All workers are loaded first (one after the other, so load times are clean), warmed up
with one untimed generation, then fed the prompts. With `--schedule interleaved` (default)
prompt k goes to every peer before prompt k+1, the peer order rotating, so background load
on a shared machine falls on all peers alike; `sequential` runs one peer at a time.

Timing per prompt: `total_s` is the wall time of one whole generation (prefill + decode,
from handing over the ids to the last token), `ttft_s` the time to the first new token,
`cpu_s` the worker's CPU time for it, `others_cores` the CPU cores other processes kept
busy meanwhile. Aggregates: `tok_s` = new tokens / total time, `decode_tok_s` = tokens
after the first / time after the first token (prefill excluded).

    .venv/bin/python bench/peers.py --limit 1 --max-new-tokens 128 \\
        --peers hf,hf-lookup,llamacpp,llamacpp-lookup,genai,genai-lookup \\
        --out bench/results/peers.json --table

A peer that cannot be imported, built or run is reported as unavailable/failed with the
reason; the run goes on with the others.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import queue
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
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from prompts import DEFAULT_QUESTIONS as SPEC_BENCH, load_spec_bench  # noqa: E402

from specdec.runtime.drafters import DRAFTER_CHOICES  # noqa: E402  (runtime only: no torch in this process)

DEFAULT_QUESTIONS = os.environ.get("SPECDEC_SPEC_BENCH", str(SPEC_BENCH))

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
PEERS.update({
    "llama-server": {"kind": "llamaserver", "lookup": False, "mode": "plain",
                     "describe": "native llama.cpp llama-server on the GGUF, greedy"},
    "llama-server-draft": {"kind": "llamaserver", "lookup": True, "mode": "draft",
                           "describe": "native llama-server, --spec-type draft-simple -md DRAFT_GGUF"},
    "llama-server-ngram": {"kind": "llamaserver", "lookup": True, "mode": "ngram",
                           "describe": "native llama-server, --spec-type ngram-mod"},
})
DEFAULT_PEERS = "hf,hf-lookup,llamacpp,llamacpp-lookup,genai,genai-lookup,genai-int4,genai-int4-lookup"


# --------------------------------------------------------------------------------------------
# Measurements shared by parent and workers
# --------------------------------------------------------------------------------------------

def _hwm_mb(pid: int | str = "self") -> float | None:
    """Peak resident set size (VmHWM) of a process, in MiB.

    Not getrusage's ru_maxrss: that keeps the high-water mark of the process image before
    exec, i.e. the parent's RSS at fork time, so a worker forked from a parent holding a
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


def _cpu_busy_s() -> float | None:
    """CPU seconds spent by all processes on the machine since boot (/proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (fields + [0] * 7)[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


_HELPER_PIDS: list[int] = []  # processes a peer runs on (llama-server): their CPU time is the peer's own


def _own_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    own = r.ru_utime + r.ru_stime
    for pid in _HELPER_PIDS:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            own += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return own


def _wait_for_idle(max_wait_s: float, max_other_cores: float, window_s: float = 1.0) -> float:
    """Wait, at most max_wait_s, until the machine's CPU use over window_s stays under
    max_other_cores (call it while idle yourself). Returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        a = _cpu_busy_s()
        time.sleep(window_s)
        b = _cpu_busy_s()
        if a is None or b is None or (b - a) / window_s < max_other_cores:
            break
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# Workers. A loader returns (generate, info); generate(ids, max_new) returns
# (new_ids, ttft_s, total_s, extra). The worker then serves JSON-line commands on stdin.
# --------------------------------------------------------------------------------------------

def _cut_at_eos(ids: list[int], eos: set[int], max_new: int) -> list[int]:
    ids = list(ids)[:max_new]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def load_hf(spec: dict):
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
        kwargs.update(prompt_lookup_num_tokens=spec["lookup_k"], max_matching_ngram_size=spec["ngram"])

    class FirstToken(BaseStreamer):
        def __init__(self, t0: float) -> None:
            self.t0, self.calls, self.ttft = t0, 0, None

        def put(self, value) -> None:
            self.calls += 1  # the first call carries the prompt
            if self.calls == 2:
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
        return _cut_at_eos(y[0, len(ids):].tolist(), set(eos), max_new), streamer.ttft, total, {}

    settings = {k: v for k, v in kwargs.items() if v is not None}
    settings.update(torch_threads=torch.get_num_threads(), weights="fp32 (GGUF dequantized)")
    return generate, {"load_s": load_s, "settings": settings,
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def _patch_llama_no_extra_bufts() -> None:
    """Make every llama model load with `use_extra_bufts = False`.

    The source-built llama.cpp segfaults in its AMX matmul path (an "extra" CPU buffer type)
    on the first decode on CPUs with AMX. `Llama.__init__` takes its model params from
    `llama_cpp.llama_cpp.llama_model_default_params()` (called through the module), so wrapping
    that function switches the extra buffer types off without rebuilding the library.
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


def load_llamacpp(spec: dict):
    import llama_cpp

    _patch_llama_no_extra_bufts()
    from llama_cpp import Llama

    draft = None
    settings = {"n_threads": spec["threads"], "n_threads_batch": spec["threads"],
                "use_extra_bufts": False, "sampler": "greedy (temp=0)", "weights": "Q4_1 GGUF"}
    if spec["lookup"]:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=spec["ngram"], num_pred_tokens=spec["lookup_k"])
        settings.update(draft="LlamaPromptLookupDecoding", max_ngram_size=spec["ngram"],
                        num_pred_tokens=spec["lookup_k"])
    n_ctx = max([len(p["ids"]) for p in spec["prompts"]] + [len(spec["warmup_ids"])])
    n_ctx = max(n_ctx + spec["max_new_tokens"] + 64, 512)
    settings["n_ctx"] = n_ctx
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                n_threads=spec["threads"], n_threads_batch=spec["threads"], seed=0,
                draft_model=draft, verbose=False,
                # With a draft model llama-cpp-python keeps logits of every position, but it sizes
                # its score buffer from this argument: left False, the buffer has n_batch rows and
                # any prompt longer than n_batch fails ("could not broadcast ... into shape (0,)").
                logits_all=draft is not None)
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
        return new, ttft, time.perf_counter() - t0, {}

    return generate, {"load_s": load_s, "settings": settings,
                      "versions": {"llama_cpp_python": llama_cpp.__version__}}


_GENAI_STATS = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "target_forward_passes",
                "acceptance_rate", "mean_emitted_tokens_per_round", "ngram_lookup_hits",
                "ngram_lookup_misses", "standard_fallback_steps")


def load_genai(spec: dict):
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
            raise RuntimeError(f"onnxruntime-genai {og.__version__} exposes no speculative options in Python")
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
        new = _cut_at_eos([int(t) for t in gen.get_sequence(0)][len(ids):], eos, max_new)
        # genai leaves the EOS that stopped it out of the sequence (get_next_tokens shows it).
        # Done short of max_length means EOS: count it, as the other peers do.
        if len(new) < max_new and (not new or new[-1] not in eos):
            new.append(spec["eos_ids"][0])
        extra = {}
        if spec_opts:
            stats = gen.get_speculative_stats()
            extra = {k: stats.get(k) for k in _GENAI_STATS}
        del gen
        return new, ttft, total, extra

    return generate, {"load_s": load_s, "settings": settings,
                      "versions": {"onnxruntime_genai": og.__version__}}


def load_specdec(spec: dict):
    import specdec
    from specdec.runtime.engine import GenerationConfig

    t0 = time.perf_counter()
    engine = specdec.load(spec["bundle"], drafter=spec["drafter"],
                          runtime=specdec.RuntimeOptions(threads=spec["threads"]))
    load_s = time.perf_counter() - t0
    draft_len = spec["draft_len"]

    def generate(ids, max_new):
        engine.reset()  # no prefix reuse between prompts, as for the other peers
        cfg = GenerationConfig(max_new_tokens=max_new, draft_len=draft_len)
        new: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        for chunk in engine.stream_ids(ids, cfg):
            if ttft is None:
                ttft = time.perf_counter() - t0
            new += chunk
        total = time.perf_counter() - t0
        s = engine.last_stats
        return new, ttft, total, {"target_forwards": s.target_forwards, "drafted": s.drafted,
                                  "accepted": s.accepted, "tau": round(s.tau, 3)}

    m = engine.manifest
    settings = {"bundle": spec["bundle"], "drafter": spec["drafter"], "draft_len": draft_len,
                "threads": spec["threads"], "target_precision": m.graphs["target"].precision,
                "draft_precision": m.graphs[m.drafter.graph].precision if m.drafter.graph else None}
    return generate, {"load_s": load_s, "settings": settings,
                      "versions": {"specdec": getattr(specdec, "__version__", "dev")}}


def load_llamaserver(spec: dict):
    """Native llama.cpp: its `llama-server` (bench/llama_native.py builds it) on 127.0.0.1, fed the prompt token ids
    through /completion and timed by its own `timings` (prompt_ms + predicted_ms: no HTTP or Python in the figure).
    Greedy (top_k 1), no prompt cache between prompts. Its VmHWM is the peak RSS reported."""
    import socket
    import urllib.request

    from llama_native import llama_server

    exe = llama_server()
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    n_ctx = max([len(p["ids"]) for p in spec["prompts"]] + [len(spec["warmup_ids"])]) + spec["max_new_tokens"] + 64
    cmd = [str(exe), "-m", spec["gguf"], "--host", "127.0.0.1", "--port", str(port), "-t", str(spec["threads"]),
           "-tb", str(spec["threads"]), "-c", str(max(n_ctx, 512)), "-np", "1", "--no-repack", "--no-webui",
           "--log-disable"]
    settings = {"threads": spec["threads"], "n_ctx": max(n_ctx, 512), "sampler": "top_k 1", "flags": "--no-repack"}
    if spec["mode"] == "draft":
        cmd += ["--spec-type", "draft-simple", "-md", spec["draft_gguf"], "-td", str(spec["threads"])]
        settings.update(spec_type="draft-simple", draft=spec["draft_gguf"])
    elif spec["mode"] == "ngram":
        cmd += ["--spec-type", "ngram-mod"]
        settings.update(spec_type="ngram-mod")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _HELPER_PIDS.append(proc.pid)
    import atexit

    atexit.register(proc.kill)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}: {proc.stderr.read()[-400:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.perf_counter() - t0 > 300:
            raise RuntimeError("llama-server did not become ready in 300 s")
        time.sleep(0.5)
    load_s = time.perf_counter() - t0

    def generate(ids, max_new):
        body = {"prompt": ids, "n_predict": max_new, "top_k": 1, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "stream": False, "seed": 0}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0_ = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        wall = time.perf_counter() - t0_
        t = out["timings"]
        new = [int(x) for x in out.get("tokens", [])]
        extra = {"wall_s": round(wall, 3), "server_peak_rss_mb": _hwm_mb(proc.pid)}
        if "draft_n" in t:
            extra.update(drafted=t["draft_n"], accepted=t.get("draft_n_accepted"))
        return new, t["prompt_ms"] / 1e3, (t["prompt_ms"] + t["predicted_ms"]) / 1e3, extra

    return generate, {"load_s": load_s, "settings": settings, "rss_pid": proc.pid,
                      "versions": {"llama_cpp": "vendored in " + "llama-cpp-python 0.3.36"}}


LOADERS = {"hf": load_hf, "llamacpp": load_llamacpp, "genai": load_genai, "specdec": load_specdec,
           "llamaserver": load_llamaserver}


def specdec_peer(name: str, bundles: str) -> dict | None:
    """`specdec[-VARIANT]:DRAFTER[:K]` -> a peer config on bundle {bundles}[-VARIANT]; None if not specdec."""
    head, _, rest = name.partition(":")
    if head != "specdec" and not head.startswith("specdec-"):
        return None
    drafter, _, k = rest.partition(":")
    drafter = drafter or "none"
    if drafter not in DRAFTER_CHOICES:
        raise SystemExit(f"peer {name}: unknown drafter {drafter!r} ({', '.join(DRAFTER_CHOICES)})")
    k = k or ("0" if drafter == "none" else "auto")
    if k != "auto" and not k.isdigit():
        raise SystemExit(f"peer {name}: draft length must be an integer or auto")
    bundle = bundles + head[len("specdec"):]
    return {"kind": "specdec", "lookup": drafter != "none", "bundle": bundle, "drafter": drafter,
            "draft_len": k if k == "auto" else int(k),
            "describe": f"specdec on {bundle}, drafter {drafter}, draft length {k}"}


def _measured(generate, ids, spec) -> dict:
    """One prompt, redone (at most `retries` times, after waiting for a quiet moment) while
    other processes kept more than `max_others` cores busy; keeps the least disturbed run."""
    max_others = spec.get("max_others")
    attempts = 1 + (spec.get("retries", 0) if max_others is not None else 0)
    best = None
    for attempt in range(attempts):
        if attempt:
            _wait_for_idle(spec.get("retry_wait_s", 30), max_others)
        busy0, own0 = _cpu_busy_s(), _own_cpu_s()
        new_ids, ttft, total, extra = generate(ids, spec["max_new_tokens"])
        busy1, own1 = _cpu_busy_s(), _own_cpu_s()
        others = None
        if busy0 is not None and busy1 is not None and total > 0:
            others = max((busy1 - busy0 - (own1 - own0)) / total, 0.0)
        row = {"new_ids": [int(t) for t in new_ids], "ttft_s": ttft, "total_s": total,
               "cpu_s": own1 - own0, "others_cores": others, "extra": extra}
        if best is None or (others is not None and others < (best["others_cores"] or 0.0)):
            best = row
        if max_others is None or others is None or others <= max_others:
            break
    best["attempts"] = attempt + 1
    return best


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the parent process dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(spec_path: str) -> int:
    _die_with_parent()
    # Protocol on the original stdout; anything the libraries print goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(**obj) -> None:
        proto.write(json.dumps(obj) + "\n")

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    try:
        generate, info = LOADERS[spec["kind"]](spec)
    except ImportError as e:
        emit(event="unavailable", reason=f"not installed: {e}")
        return 3
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
        emit(event="error", reason=f"load failed: {type(e).__name__}: {str(e).strip()[:400]}",
             traceback=traceback.format_exc()[-2000:])
        return 4
    rss_pid = info.pop("rss_pid", "self")  # a peer running in a server process of its own reports that one
    emit(event="loaded", rss_mb=_hwm_mb(rss_pid), **info)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "warmup":
                generate(spec["warmup_ids"], min(8, spec["max_new_tokens"]))
                emit(event="warm", rss_mb=_hwm_mb(rss_pid))
            elif cmd["op"] == "run":
                p = spec["prompts"][cmd["index"]]
                emit(event="prompt", id=p["id"], rss_mb=_hwm_mb(rss_pid), **_measured(generate, p["ids"], spec))
            elif cmd["op"] == "quit":
                break
        except Exception as e:  # noqa: BLE001
            emit(event="error", reason=f"{type(e).__name__}: {str(e).strip()[:400]}",
                 traceback=traceback.format_exc()[-2000:])
            return 4
    emit(event="done", rss_mb=_hwm_mb(rss_pid))
    return 0


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------

class Worker:
    """One peer's worker process, driven by JSON lines on its stdin/stdout."""

    def __init__(self, name: str, spec: dict, workdir: Path, budget_s: float) -> None:
        self.name, self.spec = name, spec
        self.events: list[dict] = []
        self.status, self.reason = "running", None
        self.budget_s = budget_s  # seconds of generation time this peer may use in all
        self.budget_total_s = budget_s
        self.peak_mb = 0.0
        self.rusage = None
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.stderr_path = workdir / f"{name}.stderr.txt"
        env = dict(os.environ)
        threads = str(spec["threads"])
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         env=env, start_new_session=True, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def alive(self) -> bool:
        return self.status == "running"

    def poll_rss(self) -> None:
        if self.rusage is None:
            v = _hwm_mb(self.proc.pid)
            if v is not None:
                self.peak_mb = max(self.peak_mb, v)

    def request(self, op: dict | None, timeout_s: float) -> dict | None:
        """Send a command (None: just wait) and return the next event, or None on failure."""
        t0 = time.perf_counter()
        try:
            if op is not None:
                self.proc.stdin.write(json.dumps(op) + "\n")
                self.proc.stdin.flush()
            line = self.lines.get(timeout=max(timeout_s, 0.1))
        except (BrokenPipeError, OSError):
            line = None
        except queue.Empty:
            if op is not None and op.get("op") == "run":
                why = (f"stopped when its generation budget (--peer-timeout {self.budget_total_s:.0f} s) "
                       f"ran out, during prompt #{op['index']}")
            else:
                why = f"no answer to {op['op'] if op else 'loading'} within {timeout_s:.0f} s"
            self.fail("failed", why)
            return None
        finally:
            if op is not None and op.get("op") == "run":
                self.budget_s -= time.perf_counter() - t0
        if line is None:
            self.fail("failed", None)
            return None
        event = json.loads(line)
        self.events.append(event)
        if isinstance(event.get("rss_mb"), (int, float)):
            self.peak_mb = max(self.peak_mb, event["rss_mb"])
        if event["event"] in ("unavailable", "error"):
            self.fail("unavailable" if event["event"] == "unavailable" else "failed", event["reason"])
            return None
        return event

    def fail(self, status: str, reason: str | None) -> None:
        if not self.alive():
            return
        self.status = status
        self.kill()
        if reason is None:
            rc = self.proc.returncode
            why = (f"killed by signal {-rc}" + (" (segfault)" if rc == -11 else "")) if rc and rc < 0 \
                else f"exit code {rc}"
            tail = self.stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
            reason = f"worker died: {why}" + (f"; stderr: {' | '.join(tail)[-400:]}" if tail else "")
        self.reason = reason

    def kill(self) -> None:
        if self.rusage is None:
            self.poll_rss()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reap(5)

    def reap(self, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while self.rusage is None and time.perf_counter() < deadline:
            self.poll_rss()
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.rusage = usage
                return
            time.sleep(0.05)

    def quit(self) -> None:
        if self.alive():
            event = self.request({"op": "quit"}, 60)
            if event is not None:
                self.status = "done"
            self.reap(30)
        self.kill()


def _chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def run(args) -> dict:
    peer_names = [p.strip() for p in args.peers.split(",") if p.strip()]
    for name in peer_names:
        cfg = specdec_peer(name, args.bundles)
        if cfg is not None:
            PEERS[name] = cfg
    unknown = [p for p in peer_names if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    prompts = load_spec_bench(args.questions, args.limit, args.seed)
    if args.categories:
        wanted = set(args.categories.split(","))
        prompts = [p for p in prompts if p.category in wanted]
    if not prompts:
        raise SystemExit("no prompts selected")
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    import _models

    t0 = time.perf_counter()
    if args.gguf:  # another model than the default: llama-server and specdec peers only, its own tokenizer
        from specdec.export.gguf_source import load_tokenizer

        gguf, hf_dir = Path(args.gguf), None
        tok = load_tokenizer(gguf)
        prep = {}
    else:
        gguf = _models.gguf_path()
        hf_dir = _models.hf_checkpoint()
        prep = {"hf_checkpoint_s": round(time.perf_counter() - t0, 2)}
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf_dir))
    eos_ids = [int(tok.eos_token_id)]
    prompt_rows = [{"id": p.id, "category": p.category, "ids": _chat_ids(tok, p.messages)} for p in prompts]
    warmup_ids = _chat_ids(tok, [{"role": "user", "content": "Say hello."}])
    log(f"{len(prompts)} prompts, {sum(len(p['ids']) for p in prompt_rows)} prompt tokens, "
        f"max_new_tokens={args.max_new_tokens}, schedule={args.schedule}, peers: {', '.join(peer_names)}")

    result = {
        "meta": {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {"platform": platform.platform(), "cpu": _cpu_name(), "cpu_flags": _cpu_flags(),
                     "cpu_count": os.cpu_count(), "mem_total_gib": _mem_gib()},
            "python": platform.python_version(),
            "model": {"gguf": str(gguf), "hf_checkpoint": str(hf_dir), "draft_gguf": args.draft_gguf},
            "questions": str(args.questions), "limit_per_category": args.limit, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "lookup_k": args.lookup_k,
            "ngram": args.ngram, "eos_ids": eos_ids, "schedule": args.schedule, "reference": args.reference,
            "contention": {"max_others": args.max_others, "retries": args.retries,
                           "retry_wait_s": args.retry_wait},
            "definitions": (
                "total_s: wall time of one generation incl. prefill; ttft_s: to the first new token; "
                "tok_s = sum(new_tokens)/sum(total_s); decode_tok_s = sum(new_tokens-1)/sum(total_s-ttft_s); "
                "cpu_s: the worker's CPU time for the generation; others_cores: CPU cores other processes "
                "kept busy during it (/proc/stat minus the worker's own), time-weighted in aggregates; "
                "well above 0 means a shared CPU slowed the peer (spinning thread pools lose the most). "
                "peak_rss_mb: VmHWM of the worker process. One untimed warm-up generation per peer."),
            "prep": prep,
        },
        "prompts": [{"id": p["id"], "category": p["category"], "prompt_tokens": len(p["ids"])}
                    for p in prompt_rows],
        "peers": {},
    }

    workers: dict[str, Worker] = {}
    stop = threading.Event()

    def watch_rss() -> None:  # VmHWM only grows; polling catches a worker that dies uncleanly
        while not stop.is_set():
            for w in list(workers.values()):
                w.poll_rss()
            stop.wait(0.2)

    watcher = threading.Thread(target=watch_rss, daemon=True)
    watcher.start()
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-peers-") as tmp:
            workdir = Path(tmp)
            # 1. prepare models and load the workers one at a time
            for name in peer_names:
                cfg = PEERS[name]
                entry: dict = {"describe": cfg["describe"], "status": "unavailable"}
                result["peers"][name] = entry
                spec = {"kind": cfg["kind"], "lookup": cfg["lookup"], "threads": args.threads,
                        "max_new_tokens": args.max_new_tokens, "lookup_k": args.lookup_k,
                        "ngram": args.ngram, "eos_ids": eos_ids, "prompts": prompt_rows,
                        "warmup_ids": warmup_ids, "hf_dir": str(hf_dir), "gguf": str(gguf),
                        "max_others": args.max_others, "retries": args.retries,
                        "retry_wait_s": args.retry_wait, "mode": cfg.get("mode"), "draft_gguf": args.draft_gguf}
                if cfg["kind"] == "llamaserver" and cfg["mode"] == "draft" and not args.draft_gguf:
                    entry["reason"] = "needs --draft-gguf"
                    log(f"[{name}] unavailable: {entry['reason']}")
                    continue
                if cfg["kind"] == "specdec":
                    if not (Path(cfg["bundle"]) / "specdec.json").is_file():
                        entry["reason"] = f"no bundle at {cfg['bundle']} (specdec export first)"
                        log(f"[{name}] unavailable: {entry['reason']}")
                        continue
                    spec.update({k: cfg[k] for k in ("bundle", "drafter", "draft_len")})
                if cfg["kind"] == "genai":
                    spec["precision"] = cfg["precision"]
                    if importlib.util.find_spec("onnxruntime_genai") is None:  # its builder needs it too
                        entry["reason"] = "not installed: onnxruntime_genai (pip install onnxruntime-genai==0.18.0)"
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
                log(f"[{name}] loading ...")
                w = Worker(name, spec, workdir, args.peer_timeout)
                workers[name] = w
                if w.request(None, args.load_timeout) is not None and w.request({"op": "warmup"}, 300) is not None:
                    entry["status"] = "running"
                else:
                    log(f"[{name}] {w.status}: {w.reason}")
                    w.kill()  # free its memory and CPU before the others run

            # 2. the prompts
            live = [n for n in peer_names if n in workers and workers[n].alive()]
            jobs = ([(k, n) for k in range(len(prompt_rows))
                     for n in (live[k % len(live):] + live[:k % len(live)])] if args.schedule == "interleaved"
                    else [(k, n) for n in live for k in range(len(prompt_rows))]) if live else []
            done_count = 0
            for k, name in jobs:
                w = workers[name]
                if not w.alive():
                    continue
                if w.budget_s <= 0:
                    w.fail("failed", f"stopped when its generation budget (--peer-timeout "
                                     f"{args.peer_timeout:.0f} s) ran out, before prompt #{k}")
                    continue
                event = w.request({"op": "run", "index": k}, w.budget_s)
                done_count += 1
                if event is not None and not args.quiet:
                    n = len(event["new_ids"])
                    log(f"  [{done_count}/{len(jobs)}] {name:<18} {prompt_rows[k]['category']:<15} "
                        f"{n:4d} tok {event['total_s']:7.2f} s {n / event['total_s']:7.1f} tok/s "
                        f"others {event['others_cores'] or 0:.2f}")
            for w in workers.values():
                w.quit()
    finally:
        stop.set()
        for w in workers.values():
            w.kill()

    token_ids: dict[str, dict[str, list[int]]] = {}
    for name, w in workers.items():
        entry = result["peers"][name]
        entry.update(_collect(w, prompt_rows, tok))
        if "per_prompt" in entry:
            token_ids[name] = {r["id"]: r.pop("_ids") for r in entry["per_prompt"]}
        o = entry.get("overall") or {}
        log(f"[{name}] {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason") else "")
            + (f": {o['new_tokens']} tok, {o['tok_s']} tok/s, decode {o['decode_tok_s']} tok/s" if o else ""))
    _compare(result, token_ids, args.reference)
    if args.keep_tokens:
        result["token_ids"] = token_ids
    return result


def _collect(w: Worker, prompt_rows: list[dict], tok) -> dict:
    entry: dict = {"peak_rss_mb": round(w.peak_mb, 1) if w.peak_mb else None}
    loaded = next((e for e in w.events if e["event"] == "loaded"), None)
    by_id = {e["id"]: e for e in w.events if e["event"] == "prompt"}
    if loaded:
        entry.update(load_s=round(loaded["load_s"], 3), rss_after_load_mb=loaded.get("rss_mb"),
                     versions=loaded.get("versions"), settings=loaded.get("settings"))
    if w.rusage is not None:
        entry["worker_cpu_s"] = round(w.rusage.ru_utime + w.rusage.ru_stime, 2)
    if w.status == "done" and len(by_id) == len(prompt_rows):
        entry["status"] = "ok"
    elif by_id:
        entry["status"] = "partial"
    else:
        entry["status"] = "failed" if loaded or w.status == "failed" else "unavailable"
    if w.reason:
        entry["reason"] = w.reason
        tb = next((e.get("traceback") for e in w.events if e.get("traceback")), None)
        if tb:
            entry["traceback_tail"] = tb[-800:]
    if not by_id:
        return entry
    eos = {int(tok.eos_token_id)}
    rows = []
    for p in prompt_rows:
        e = by_id.get(p["id"])
        if e is None:
            continue
        n = len(e["new_ids"])
        row = {"id": p["id"], "category": p["category"], "prompt_tokens": len(p["ids"]), "new_tokens": n,
               "ttft_s": None if e["ttft_s"] is None else round(e["ttft_s"], 4),
               "total_s": round(e["total_s"], 4), "tok_s": round(n / e["total_s"], 2) if e["total_s"] > 0 else None,
               "cpu_s": round(e["cpu_s"], 3),
               "others_cores": None if e.get("others_cores") is None else round(e["others_cores"], 2),
               "attempts": e.get("attempts", 1), "eos": bool(e["new_ids"]) and e["new_ids"][-1] in eos,
               "text80": tok.decode(e["new_ids"], skip_special_tokens=True)[:80], "_ids": e["new_ids"]}
        if e.get("extra"):
            row["speculation"] = e["extra"]
        rows.append(row)
    entry["overall"] = _summ(rows)
    entry["per_category"] = {c: _summ([r for r in rows if r["category"] == c])
                             for c in dict.fromkeys(r["category"] for r in rows)}
    entry["per_prompt"] = rows
    return entry


def _summ(rows: list[dict]) -> dict:
    n = sum(r["new_tokens"] for r in rows)
    t = sum(r["total_s"] for r in rows)
    timed = [r for r in rows if r["ttft_s"] is not None]
    dec_n = sum(max(r["new_tokens"] - 1, 0) for r in timed)
    dec_t = sum(r["total_s"] - r["ttft_s"] for r in timed)
    oth = [(r["others_cores"], r["total_s"]) for r in rows if r.get("others_cores") is not None]
    ot = sum(w for _, w in oth)
    cpu = sum(r["cpu_s"] for r in rows)
    return {"prompts": len(rows), "new_tokens": n, "total_s": round(t, 4),
            "tok_s": round(n / t, 2) if t > 0 else None,
            "decode_tok_s": round(dec_n / dec_t, 2) if dec_t > 0 else None,
            "mean_ttft_s": round(sum(r["ttft_s"] for r in timed) / len(timed), 4) if timed else None,
            "cpu_ms_per_token": round(1000 * cpu / n, 2) if n else None,
            "others_cores": round(sum(o * w for o, w in oth) / ot, 2) if ot > 0 else None}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _plain_of(name: str) -> str | None:
    """The plain-decoding peer a speculative peer is checked and timed against: X for X-lookup, specdec[-V]:none
    for specdec[-V]:D[:K] (the same bundle without drafting)."""
    if name.endswith("-lookup"):
        return name[: -len("-lookup")]
    if name.startswith("specdec") and ":" in name and name.split(":")[1] != "none":
        return name.split(":")[0] + ":none"
    return None


def _compare(result: dict, token_ids: dict, reference: str) -> None:
    """Greedy outputs vs the reference peer, and each speculative peer vs its plain peer (_plain_of)."""
    peers = result["peers"]
    ref = reference if reference in token_ids else None
    for name, ids in token_ids.items():
        entry = peers[name]
        base = _plain_of(name)
        pairs = []
        if ref and name != ref:
            pairs.append(("vs_" + ref, token_ids[ref]))
        if base and base in token_ids:
            if base != ref:
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


def _cpu_flags() -> list[str]:
    """The SIMD features that decide which kernels the peers use."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    return []


def _mem_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def format_table(result: dict) -> str:
    peers = result["peers"]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    hdr = (f"{'peer':<18} {'status':<8} {'tok/s':>6} {'decode':>6} {'TTFT s':>6} {'tokens':>6} "
           f"{'cpu ms/t':>8} {'RSS MB':>6} {'load s':>6} {'others':>6}  same tokens as / speedup")
    lines = [hdr, "-" * len(hdr)]
    for name, e in peers.items():
        o = e.get("overall") or {}
        ag = ", ".join(f"{k[3:]} {v['identical']}" for k, v in (e.get("agreement") or {}).items())
        sp = e.get("speedup_vs_" + _plain_of(name)) if _plain_of(name) else None
        if sp:
            ag = (ag + "; " if ag else "") + f"x{sp} vs plain"
        lines.append(f"{name:<18} {e['status']:<8} {f(o.get('tok_s'), '6.1f')} {f(o.get('decode_tok_s'), '6.1f')} "
                     f"{f(o.get('mean_ttft_s'), '6.3f')} {f(o.get('new_tokens'), '6d')} "
                     f"{f(o.get('cpu_ms_per_token'), '8.1f')} {f(e.get('peak_rss_mb'), '6.0f')} "
                     f"{f(e.get('load_s'), '6.1f')} {f(o.get('others_cores'), '6.2f')}  {ag}")
        if e.get("reason"):
            lines.append(f"{'':<18} reason: {e['reason'][:160]}")
    ok = [n for n, e in peers.items() if e.get("per_category")]
    if ok:
        cats = list(dict.fromkeys(c for n in ok for c in peers[n]["per_category"]))
        w = max(8, *(len(n) for n in ok))
        lines += ["", "tok/s per category (new tokens / whole-generation time)",
                  f"{'category':<15}" + "".join(f" {n:>{w}}" for n in ok)]
        for c in cats:
            cells = [peers[n]["per_category"].get(c, {}).get("tok_s") for n in ok]
            lines.append(f"{c:<15}" + "".join(f" {v:>{w}.1f}" if v is not None else f" {'-':>{w}}" for v in cells))
    lines += ["", "tok/s: new tokens / generation time incl. prefill; decode: after the first token; "
              "others: CPU cores used by other processes meanwhile (0 = quiet machine)"]
    return "\n".join(lines)


_ENGINE_LABELS = {
    "hf": "transformers `generate`, fp32",
    "hf-lookup": "transformers `generate`, prompt lookup",
    "llamacpp": "llama-cpp-python (its Python loop), plain",
    "llamacpp-lookup": "llama-cpp-python, prompt lookup",
    "genai": "onnxruntime-genai, fp32",
    "genai-lookup": "onnxruntime-genai, fp32, n-gram speculation",
    "genai-int4": "onnxruntime-genai, int4 re-rounded by its builder",
    "genai-int4-lookup": "onnxruntime-genai, int4 re-rounded, n-gram speculation",
    "llama-server": "llama.cpp `llama-server`, plain",
    "llama-server-draft": "llama.cpp, draft model (`--spec-type draft-simple`)",
    "llama-server-ngram": "llama.cpp, `--spec-type ngram-mod`",
}
_DRAFTER_LABELS = {"none": "plain", "ngram": "prompt lookup", "corpus": "corpus lookup", "model": "draft model",
                   "hybrid": "lookup + draft model or heads", "eagle": "EAGLE head", "medusa": "Medusa heads",
                   "layerskip": "LayerSkip exit", "tuned": "its tuned choice"}


def engine_label(name: str) -> str:
    """A peer's name as a reader of the README knows it."""
    if name in _ENGINE_LABELS:
        return _ENGINE_LABELS[name]
    head, _, rest = name.partition(":")
    if head.startswith("specdec"):
        drafter = rest.split(":")[0] or "none"
        label = _DRAFTER_LABELS.get(drafter, drafter)
        variant = head[len("specdec"):]  # specdec-V: the bundle <prefix>-V
        where = f", bundle `{variant}`" if variant else ""
        return f"specdec, {label}" + ("" if drafter == "none" and not variant else f" (`{rest}`{where})")
    return name


def format_markdown(result: dict, baseline: str = "llama-server") -> str:
    """The comparison as one markdown table (the README's): whole-answer and decode speed, time to the first
    token, peak RSS, speed against `baseline`, and whether the greedy output equals the reference peer's."""
    peers = {n: e for n, e in result["peers"].items() if e.get("overall")}
    base = (peers.get(baseline) or {}).get("overall", {}).get("tok_s")
    ref = result.get("meta", {}).get("reference")
    head = ["engine", "tok/s (whole answers)", "decode tok/s", "time to first token", "peak RSS"]
    if base:
        head.append(f"vs {engine_label(baseline).split(',')[0]}")
    if ref in peers:
        head.append(f"same tokens as {engine_label(ref)}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in peers.items():
        o = e["overall"]
        row = [engine_label(name), f"{o['tok_s']:.1f}", f"{o['decode_tok_s']:.1f}", f"{o['mean_ttft_s']:.2f} s",
               f"{e['peak_rss_mb']:,.0f} MB" if e.get("peak_rss_mb") else "-"]
        if base:
            row.append(f"{o['tok_s'] / base:.2f}x")
        if ref in peers:
            agree = (e.get("agreement") or {}).get("vs_" + ref, {}).get("identical")
            row.append("(reference)" if name == ref else (f"{agree} prompts" if agree else "-"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_png(result: dict, path: Path, baseline: str = "llama-server") -> None:
    """Bars of whole-answer and decode tok/s per engine (needs the `plot` extra: matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = {n: e for n, e in result["peers"].items() if e.get("overall")}
    names = list(peers)
    whole = [peers[n]["overall"]["tok_s"] for n in names]
    decode = [peers[n]["overall"]["decode_tok_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(names) + 1.4))
    y = list(range(len(names)))
    colors = ["#d62728" if n.startswith("specdec") else "#7f7f7f" for n in names]
    ax.barh([v + 0.2 for v in y], whole, height=0.4, color=colors, label="whole answers (incl. prefill)")
    ax.barh([v - 0.2 for v in y], decode, height=0.4, color=colors, alpha=0.45, label="decode only")
    for v, w in zip(y, whole):
        ax.text(w, v + 0.2, f" {w:.1f}" if w < 20 else f" {w:.0f}", va="center", fontsize=8)
    if baseline in peers:
        ax.axvline(peers[baseline]["overall"]["tok_s"], color="black", lw=0.8, ls="--")
    ax.set_yticks(y, [engine_label(n).replace("`", "") for n in names], fontsize=8)
    ax.invert_yaxis()
    meta = result.get("meta", {})
    model = Path(str(meta.get("model", {}).get("gguf", ""))).name
    ax.set_xlabel("tokens per second (greedy, 2 threads)")
    ax.set_title(f"{model}\n{len(result.get('prompts', []))} Spec-Bench questions, "
                 f"{meta.get('max_new_tokens')} new tokens", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dumps(obj, flat_depth: int = 4, _depth: int = 0, _indent: str = "") -> str:
    """JSON with one line per object from `flat_depth` down (a per-prompt row is one line)."""
    scalars = isinstance(obj, list) and all(not isinstance(v, (dict, list)) for v in obj)
    if _depth >= flat_depth or not isinstance(obj, (dict, list)) or not obj or scalars:
        return json.dumps(obj, ensure_ascii=False)
    inner = _indent + " "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, flat_depth, _depth + 1, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + _indent + "}"
    items = [inner + dumps(v, flat_depth, _depth + 1, inner) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + _indent + "]"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--limit", type=int, default=1, help="questions per category (-1: all)")
    ap.add_argument("--seed", type=int, default=0, help="which questions --limit keeps")
    ap.add_argument("--categories", default="", help="comma-separated subset of categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--peers", default=DEFAULT_PEERS, help=f"comma-separated; known: {', '.join(PEERS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bundles", default=str(REPO / "bundles" / "smollm2"),
                    help="specdec bundle path prefix: peer specdec-V uses <prefix>-V")
    ap.add_argument("--gguf", default=None, help="target GGUF for llama-server peers (default: the default model); "
                    "prompts are tokenized with its tokenizer")
    ap.add_argument("--draft-gguf", default=None, help="draft GGUF for the llama-server-draft peer")
    ap.add_argument("--lookup-k", type=int, default=10, help="draft tokens per lookup (genai caps at 16)")
    ap.add_argument("--ngram", type=int, default=2, help="n-gram size matched by the lookup drafters")
    ap.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved")
    ap.add_argument("--reference", default="hf", help="peer whose token ids the others are compared to")
    ap.add_argument("--max-others", type=float, default=None,
                    help="redo a generation during which other processes kept more CPU cores busy than this")
    ap.add_argument("--retries", type=int, default=2, help="redos per prompt with --max-others")
    ap.add_argument("--retry-wait", type=float, default=20, help="seconds to wait for a quiet moment before a redo")
    ap.add_argument("--peer-timeout", type=float, default=600, help="generation seconds per peer before it is stopped")
    ap.add_argument("--load-timeout", type=float, default=600, help="seconds a peer may take to load")
    ap.add_argument("--out", default=str(HERE / "results" / "peers.json"))
    ap.add_argument("--keep-tokens", action="store_true", help="store every generated token id in the JSON")
    ap.add_argument("--table", action="store_true", help="print the table to stdout (default: when a TTY)")
    ap.add_argument("--markdown", action="store_true", help="print the comparison as a markdown table")
    ap.add_argument("--baseline", default="llama-server", help="peer the markdown table's ratios are against")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart of the comparison here")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="run nothing: print --markdown/--table and write --plot from a result file")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text(encoding="utf-8"))
        _emit(result, args)
        return 0
    if args.limit is not None and args.limit < 0:
        args.limit = None

    def on_term(signum, frame):  # run `finally` blocks: the workers are killed, not orphaned
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result) + "\n", encoding="utf-8")
    _emit(result, args)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _emit(result: dict, args) -> None:
    if args.table or (sys.stdout.isatty() and not args.markdown):
        print(format_table(result))
    if args.markdown:
        print(format_markdown(result, args.baseline))
    if args.plot:
        plot_png(result, Path(args.plot), args.baseline)
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
