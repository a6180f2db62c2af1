"""ONNX Runtime sessions: execution-provider choice and one process-wide thread pool.

Draft and target sessions live in one process. With a thread pool per session, the idle pool spins
while the other runs and on a 2-core machine that costs all of speculation's gain (FACTS: 42.8 vs
71.9 tok/s), so every specdec session shares ORT's global pool.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort

from specdec.errors import SpecdecError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
# Set to 1 to run fp16 graphs on the CPU provider anyway (tests, checks): the CLI has no flag for it on purpose.
ALLOW_CPU_FP16_ENV = "SPECDEC_ALLOW_CPU_FP16"


@dataclass(frozen=True)
class RuntimeOptions:
    provider: str = "cpu"  # cpu | cuda | tensorrt
    device_id: int = 0
    threads: int = 0  # intra-op threads of the shared pool; 0 = one per usable core
    trt_cache_dir: str | None = None  # TensorRT engine cache (inside the bundle)
    # Extra onnxruntime provider options (a device profile's), merged over the defaults below; stored as
    # sorted (key, value) pairs so the options stay frozen. A dict is accepted.
    cuda_options: tuple[tuple[str, Any], ...] = ()
    trt_options: tuple[tuple[str, Any], ...] = ()
    # fp16 graphs are refused on the CPU provider (slow and pointless there) unless this is set, or the
    # environment has SPECDEC_ALLOW_CPU_FP16=1: export checks and tests run fp16 on the CPU on purpose.
    allow_cpu_fp16: bool = False

    def __post_init__(self) -> None:
        for f in ("cuda_options", "trt_options"):
            v = getattr(self, f)
            object.__setattr__(self, f, tuple(sorted(dict(v).items())))
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.threads < 0 or self.device_id < 0:
            raise ValueError("threads and device_id must be >= 0")

    @property
    def device(self) -> str:
        """Where KV buffers live: ORT's device name for OrtValue allocation."""
        return "cpu" if self.provider == "cpu" else "cuda"

    @property
    def runs_fp16_on_cpu(self) -> bool:
        """Whether fp16 graphs may run on the CPU provider (the option, or SPECDEC_ALLOW_CPU_FP16=1)."""
        return self.allow_cpu_fp16 or os.environ.get(ALLOW_CPU_FP16_ENV, "") == "1"


def provider_list(opts: RuntimeOptions, available: list[str] | None = None) -> list:
    """The provider list for a session, or a clear error if this onnxruntime build lacks the provider."""
    available = ort.get_available_providers() if available is None else available
    wanted = PROVIDERS[opts.provider]
    if wanted not in available:
        raise SpecdecError(
            f"execution provider {opts.provider} is not available in this onnxruntime "
            f"(available: {', '.join(p.replace('ExecutionProvider', '').lower() for p in available)})",
            "install onnxruntime-gpu for cuda/tensorrt, or use --provider cpu",
        )
    if opts.provider == "cpu":
        return ["CPUExecutionProvider"]
    cuda = ("CUDAExecutionProvider", {"device_id": opts.device_id, **dict(opts.cuda_options)})
    if opts.provider == "cuda":
        return [cuda, "CPUExecutionProvider"]
    trt = {"device_id": opts.device_id, "trt_fp16_enable": True, "trt_engine_cache_enable": True,
           **dict(opts.trt_options)}
    if opts.trt_cache_dir:
        trt["trt_engine_cache_path"] = opts.trt_cache_dir
        if trt.get("trt_timing_cache_enable"):
            trt.setdefault("trt_timing_cache_path", opts.trt_cache_dir)
    return [("TensorrtExecutionProvider", trt), cuda, "CPUExecutionProvider"]


class _GlobalPool:
    """ORT's global thread pool can be sized once per process, before the first session exists."""

    size: int | None = None

    @classmethod
    def ensure(cls, threads: int) -> None:
        if cls.size is None:
            ort.set_global_thread_pool_sizes(threads, 1)
            cls.size = threads


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pooled_session_options(threads: int | None = None) -> ort.SessionOptions:
    """SessionOptions running on the process's one global thread pool (created here if none exists yet): once
    it exists, onnxruntime refuses sessions with their own threads, and two pools would spin against each other."""
    _GlobalPool.ensure(threads or usable_cores())
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    return so


def make_session(path: Path, opts: RuntimeOptions) -> ort.InferenceSession:
    so = pooled_session_options(opts.threads)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # ORT's warnings about unused initializers etc. are not the user's problem
    try:
        with paging_out(Path(str(path) + ".data")):
            session = ort.InferenceSession(str(path), sess_options=so, providers=provider_list(opts))
    except SpecdecError:
        raise
    except Exception as e:  # ORT raises its own exception types for corrupt/truncated graphs
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise SpecdecError(f"cannot load graph {path}: {msg}", "the bundle may be corrupt; re-export it") from None
    return session


PAGE_OUT_EVERY_S = 0.2


@contextmanager
def paging_out(data_file: Path):
    """Page out the weight file's resident pages every PAGE_OUT_EVERY_S while the block runs, and once after it.

    onnxruntime releases the GIL while it builds a session; meanwhile it reads each prepacked initializer from the
    mapped file into memory of its own. Without this, every page it read stays resident until the load ends, and
    the load's peak is the private copies plus most of the file; with it, the peak is the copies plus the pages of
    the last fraction of a second."""
    import threading

    done = threading.Event()

    def pager() -> None:
        while not done.wait(PAGE_OUT_EVERY_S):
            release_mapped_pages(data_file)

    thread = threading.Thread(target=pager, name="specdec-page-out", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        release_mapped_pages(data_file)


MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now; dirty private pages (none here) are left alone


def resident_bytes(data_file: Path) -> int:
    """Bytes of `data_file` this process has mapped and resident (0 where there is no /proc/self/smaps)."""
    target, total, inside = str(Path(data_file).resolve()), 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                    inside = len(head) > 5 and head[5] == target
                elif inside and head and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except OSError:
        return 0
    return total


def release_mapped_pages(data_file: Path) -> int:
    """Page out what this process has resident of `data_file` (a graph's external weights); returns the bytes asked.

    onnxruntime maps external weights and copies the ones its kernels prepack into memory of its own; the file
    pages it read to do so stay resident (counted in RSS) until the kernel needs memory. What inference reads
    from the file later (embedding rows, rotary rows) is faulted back in as used. A no-op where the platform has
    no /proc/self/maps or no MADV_PAGEOUT."""
    import ctypes

    if not data_file.is_file():
        return 0
    try:
        target = str(data_file.resolve())
        ranges = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    start, end = (int(v, 16) for v in fields[0].split("-"))
                    ranges.append((start, end - start))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError, ValueError):
        return 0
    asked = 0
    for start, length in ranges:
        if libc.madvise(start, length, MADV_PAGEOUT) == 0:
            asked += length
    return asked
