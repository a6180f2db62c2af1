"""Device profiles: which execution providers, which precision, how much memory, how long a draft.

A profile is a frozen, validated description of one class of machine. It does not run anything: the
memory arithmetic (`specdec.devices.memory`) turns its budget into a KV length for a given bundle, and
`specdec.devices.setup` turns it into `RuntimeOptions`.

Every number carries its reason beside it. Memory figures are bytes (GiB = 2**30). On a Jetson the CPU and
the GPU share one LPDDR5 pool, so a Jetson budget is what is left of the *whole* board's RAM after the OS,
the CUDA libraries and this process: there is no separate "VRAM" to spend.

This module is part of the runtime: numpy + onnxruntime + stdlib only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from specdec.errors import SpecdecError
from specdec.runtime.decoder import MAX_STEP
from specdec.runtime.manifest import PRECISIONS
from specdec.runtime.session import PROVIDERS

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# onnxruntime's TensorRT and CUDA provider options a profile may set (names as onnxruntime spells them).
TRT_OPTION_KEYS = frozenset({
    "trt_max_workspace_size", "trt_fp16_enable", "trt_int8_enable", "trt_engine_cache_enable",
    "trt_engine_cache_path", "trt_timing_cache_enable", "trt_timing_cache_path", "trt_builder_optimization_level",
    "trt_max_partition_iterations", "trt_min_subgraph_size", "trt_dla_enable", "trt_dla_core",
    "trt_cuda_graph_enable", "trt_layer_norm_fp32_fallback", "trt_detailed_build_log", "trt_sparsity_enable",
    "trt_auxiliary_streams", "trt_force_sequential_engine_build", "trt_context_memory_sharing_enable",
    "trt_profile_min_shapes", "trt_profile_max_shapes", "trt_profile_opt_shapes", "trt_dump_subgraphs",
})
CUDA_OPTION_KEYS = frozenset({
    "gpu_mem_limit", "arena_extend_strategy", "cudnn_conv_algo_search", "do_copy_in_default_stream",
    "enable_cuda_graph", "use_tf32", "prefer_nhwc", "enable_skip_layer_norm_strict_mode", "tunable_op_enable",
    "tunable_op_tuning_enable",
})
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    providers: tuple[str, ...]  # short names (cpu | cuda | tensorrt), in onnxruntime's order of preference
    precision: str  # the target precision to export for this device: fp32 | fp16 | int8 | int4
    workspace: int  # bytes kept out of the budget for ORT's arenas, activations, logits, the TRT workspace
    budget: int | None = None  # bytes for weights + KV + workspace; None: budget_fraction of detected memory
    budget_fraction: float | None = None  # of the memory `specdec devices` detects (RAM for cpu, VRAM for a GPU)
    memory_total: int | None = None  # what the hardware has (None: whatever is detected)
    shared_memory: bool = False  # CPU and GPU use one RAM (Jetson): the budget is out of the whole board's RAM
    draft_len: int | str = 4  # default draft length: K, or "auto" (measured on the device at load)
    max_draft_len: int = 8  # longest draft this device should ever verify in one pass
    trt_options: Mapping[str, Any] = field(default_factory=dict)
    cuda_options: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # the reasons for the numbers, printed by `specdec devices`

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", tuple(self.providers))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "trt_options", MappingProxyType(dict(self.trt_options)))
        object.__setattr__(self, "cuda_options", MappingProxyType(dict(self.cuda_options)))
        where = f"profile {self.name!r}"
        _require(bool(_NAME.match(self.name)), f"{where}: name must be lowercase words joined by '-'")
        _require(bool(self.description.strip()), f"{where}: description is empty")
        _require(len(self.providers) > 0, f"{where}: providers is empty")
        unknown = [p for p in self.providers if p not in PROVIDERS]
        _require(not unknown, f"{where}: unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
        _require(len(set(self.providers)) == len(self.providers), f"{where}: providers has duplicates")
        _require(self.providers[-1] == "cpu",
                 f"{where}: providers must end with cpu (onnxruntime runs nodes no GPU provider takes there)")
        if "tensorrt" in self.providers:
            i = self.providers.index("tensorrt")
            _require("cuda" in self.providers[i + 1:],
                     f"{where}: tensorrt needs cuda after it (TensorRT hands the nodes it cannot build to CUDA)")
        _require(self.precision in PRECISIONS, f"{where}: precision must be one of {PRECISIONS}, got {self.precision!r}")
        _require(not (self.precision == "fp16" and self.providers[0] == "cpu"),
                 f"{where}: fp16 on the CPU provider is slower than fp32; use fp32, int8 or int4")
        _require((self.budget is None) != (self.budget_fraction is None),
                 f"{where}: set exactly one of budget (bytes) and budget_fraction")
        if self.budget is not None:
            _require(self.budget > 0, f"{where}: budget must be > 0")
            _require(self.workspace < self.budget, f"{where}: workspace ({self.workspace}) must be below the budget")
            if self.memory_total is not None:
                _require(self.budget <= self.memory_total,
                         f"{where}: budget ({self.budget}) exceeds the memory the device has ({self.memory_total})")
        else:
            _require(0.0 < self.budget_fraction <= 1.0, f"{where}: budget_fraction must be in (0, 1]")
        _require(self.workspace >= 0, f"{where}: workspace must be >= 0")
        _require(not self.shared_memory or self.memory_total is not None,
                 f"{where}: a shared-memory profile must say how much memory the board has")
        _require(1 <= self.max_draft_len <= MAX_STEP - 1,
                 f"{where}: max_draft_len must be in 1..{MAX_STEP - 1} (a verification step is k+1 <= {MAX_STEP})")
        if isinstance(self.draft_len, str):
            _require(self.draft_len == "auto", f"{where}: draft_len must be an integer or 'auto'")
        else:
            _require(1 <= self.draft_len <= self.max_draft_len,
                     f"{where}: draft_len must be in 1..max_draft_len ({self.max_draft_len})")
        bad = sorted(set(self.trt_options) - TRT_OPTION_KEYS)
        _require(not bad, f"{where}: unknown TensorRT option(s) {bad}")
        bad = sorted(set(self.cuda_options) - CUDA_OPTION_KEYS)
        _require(not bad, f"{where}: unknown CUDA option(s) {bad}")
        ws = self.trt_options.get("trt_max_workspace_size")
        if ws is not None and "tensorrt" in self.providers:
            _require(0 < int(ws) <= self.workspace,
                     f"{where}: trt_max_workspace_size ({ws}) must fit in the workspace reserve ({self.workspace})")

    @property
    def provider(self) -> str:
        """The provider sessions are created for; the rest of `providers` is onnxruntime's fallback chain."""
        return self.providers[0]

    @property
    def gpu(self) -> bool:
        return self.provider != "cpu"

    def budget_bytes(self, detected_memory: int | None) -> int:
        """Bytes for weights + KV + workspace; a fractional budget needs the detected memory."""
        if self.budget is not None:
            return self.budget
        if detected_memory is None or detected_memory <= 0:
            what = "GPU memory" if self.gpu else "RAM"
            raise SpecdecError(f"profile {self.name} sizes its budget as {self.budget_fraction:.0%} of this machine's "
                               f"{what}, which could not be read",
                               "pass --max-len to choose the KV length yourself")
        return int(detected_memory * self.budget_fraction)

    def budget_text(self) -> str:
        if self.budget is not None:
            return f"{self.budget / GiB:.1f} GiB" + (f" of {self.memory_total / GiB:.0f}" if self.memory_total else "")
        return f"{self.budget_fraction:.0%} of {'VRAM' if self.gpu else 'RAM'}"


# ----------------------------------------------------------------------------------------------- the profiles

# Shared by every GPU profile:
# - arena_extend_strategy kSameAsRequested: ORT's default BFC arena grows in powers of two, so a 1.1 GiB
#   request can reserve 2 GiB and the arithmetic below would be off by up to 2x; this makes it allocate
#   what is asked.
_CUDA = {"arena_extend_strategy": "kSameAsRequested"}
# - engine + timing cache: building TensorRT engines takes minutes; the cache (inside the bundle, set by
#   specdec.devices.setup) makes that a one-off per bundle, GPU and TensorRT version.
# - builder optimization level 3 is TensorRT's default trade of build time against kernel search.
_TRT = {"trt_fp16_enable": True, "trt_engine_cache_enable": True, "trt_timing_cache_enable": True,
        "trt_builder_optimization_level": 3}

_PROFILES = [
    DeviceProfile(
        name="cpu",
        description="Any x86-64 or Arm CPU (onnxruntime's CPU provider)",
        providers=("cpu",),
        precision="fp32",
        budget_fraction=0.5,
        workspace=512 * MiB,
        draft_len=4,
        max_draft_len=8,
        notes=(
            "precision fp32: the default export (fp32 target, int8 self-draft); greedy speculation is "
            "token-identical to plain greedy (FACTS: fp32 T=1 vs T>1 logits differ ~3e-5)",
            "budget 50% of RAM: the OS, the editor/browser and other programs keep the other half",
            "workspace 512 MiB: ORT's CPU arena (activations of a 256-token prefill chunk), the logits buffer "
            "(64 x vocab x 4 B = 12.6 MB at 49k), tokenizer, Python + onnxruntime (~150 MB)",
            "draft 4 (max 8): fp32 verification of 5 tokens costs 1.2x one token on a 2-core CPU, int8 self-drafts "
            "keep 4.3-5.0 of 5 (FACTS)",
            "fastest on a CPU: `specdec quantize DIR --to int4 --fast-kernels` (int8 activations, every step padded "
            "to 2 tokens so speculation stays token-identical; top-1 agreement with fp32 0.949 on the default model)",
        ),
    ),
    DeviceProfile(
        name="rtx-laptop-8gb",
        description="RTX laptop GPU with 8 GB (e.g. RTX 4060/4070 Laptop), CUDA provider",
        providers=("cuda", "cpu"),
        precision="fp16",
        memory_total=8 * GiB,
        budget=6 * GiB + 512 * MiB,
        workspace=1 * GiB,
        draft_len="auto",
        max_draft_len=8,
        cuda_options=_CUDA,
        trt_options={**_TRT, "trt_max_workspace_size": 512 * MiB},
        notes=(
            "budget 6.5 GiB = 8 GiB - 0.5 GiB CUDA context and cuBLAS handles of this process (nvidia-smi shows "
            "300-500 MiB per process before any tensor) - 0.5 GiB for the display when the dGPU drives it "
            "(compositor, browser) - 0.5 GiB for other CUDA programs",
            "workspace 1 GiB: ORT's CUDA arena for activations and the 64-token prefill, the logits buffer, "
            "cuBLAS workspace; with --provider tensorrt also TensorRT's 512 MiB workspace",
            "precision fp16: tensor cores, half the bytes of fp32; the CUDA provider is first because specdec's "
            "GroupQueryAttention and MatMulNBits nodes are com.microsoft ops TensorRT does not build",
            "draft auto (max 8): a small model's step on a GPU is launch-bound, so verifying 8 tokens costs about "
            "as much as 1 and longer drafts pay; auto measures both on the device",
        ),
    ),
    DeviceProfile(
        name="rtx-desktop-24gb",
        description="Desktop GPU with 24 GB (e.g. RTX 3090/4090), CUDA provider",
        providers=("cuda", "cpu"),
        precision="fp16",
        memory_total=24 * GiB,
        budget=21 * GiB,
        workspace=2 * GiB,
        draft_len="auto",
        max_draft_len=8,
        cuda_options=_CUDA,
        trt_options={**_TRT, "trt_max_workspace_size": 1 * GiB},
        notes=(
            "budget 21 GiB = 24 GiB - 0.5 GiB CUDA context - 1.5 GiB desktop, compositor and browser on the card "
            "that drives the monitors - 1 GiB for other CUDA programs",
            "workspace 2 GiB: ORT's CUDA arena, activations, logits, cuBLAS; with --provider tensorrt also "
            "TensorRT's 1 GiB workspace",
            "precision fp16, CUDA first, draft auto (max 8): as rtx-laptop-8gb",
        ),
    ),
    DeviceProfile(
        name="nvidia-gpu",
        description="Any other NVIDIA GPU: 80% of the memory nvidia-smi reports, CUDA provider",
        providers=("cuda", "cpu"),
        precision="fp16",
        budget_fraction=0.8,
        workspace=1 * GiB,
        draft_len="auto",
        max_draft_len=8,
        cuda_options=_CUDA,
        trt_options={**_TRT, "trt_max_workspace_size": 1 * GiB},
        notes=(
            "budget 80% of the reported memory: the CUDA context (~0.5 GiB), a display if any, and other "
            "programs share the rest",
            "workspace 1 GiB: ORT's CUDA arena, activations, logits, cuBLAS; TensorRT's workspace when used",
        ),
    ),
    DeviceProfile(
        name="orin-nano-8gb",
        description="Jetson Orin Nano 8GB (CPU and GPU share 8 GB LPDDR5), CUDA provider",
        providers=("cuda", "cpu"),
        precision="int4",
        memory_total=8 * GiB,
        shared_memory=True,
        budget=4 * GiB + 512 * MiB,
        workspace=768 * MiB,
        draft_len="auto",
        max_draft_len=8,
        cuda_options=_CUDA,
        trt_options={**_TRT, "trt_max_workspace_size": 256 * MiB},
        notes=(
            "budget 4.5 GiB = ~7.4 GiB the kernel sees (8 GiB minus carve-outs) - 1.2 GiB L4T/Ubuntu with the "
            "desktop (0.6 headless) - 0.9 GiB CUDA, cuBLAS and cuDNN libraries and context, in the same RAM - "
            "0.3 GiB this process (Python, onnxruntime, tokenizers) - 0.5 GiB headroom: onnxruntime holds the "
            "graph in host memory while it copies the weights to the device, and here both copies are one RAM",
            "workspace 768 MiB: ORT's CUDA arena, activations, logits; TensorRT's workspace is capped at 256 MiB",
            "precision int4: decoding reads every weight once per token and the board has 68 GB/s (102 on the "
            "Super); int4 halves int8's bytes, and a 1B model in fp16 would take half the budget",
            "CUDA first, not TensorRT: an engine build holds the weights twice (ORT's and TensorRT's) and takes "
            "minutes on 6 A78AE cores; try --provider tensorrt once the budget allows",
            "draft auto (max 8): the GPU verifies 8 tokens at about the cost of 1 for small models",
        ),
    ),
    DeviceProfile(
        name="orin-nx-16gb",
        description="Jetson Orin NX 16GB (CPU and GPU share 16 GB LPDDR5), TensorRT then CUDA",
        providers=("tensorrt", "cuda", "cpu"),
        precision="fp16",
        memory_total=16 * GiB,
        shared_memory=True,
        budget=11 * GiB,
        workspace=1 * GiB + 512 * MiB,
        draft_len="auto",
        max_draft_len=8,
        cuda_options=_CUDA,
        trt_options={**_TRT, "trt_max_workspace_size": 1 * GiB, "trt_dla_enable": False},
        notes=(
            "budget 11 GiB = ~15.3 GiB the kernel sees - 1.2 GiB L4T/Ubuntu - 0.9 GiB CUDA/cuDNN/TensorRT "
            "libraries - 0.3 GiB this process - 1.9 GiB for a TensorRT engine build (TensorRT holds its own copy "
            "of the weights while building) and the host copy of the graph at load",
            "workspace 1.5 GiB: TensorRT's 1 GiB workspace, ORT's CUDA arena, activations, logits",
            "precision fp16: keeps the MatMuls inside TensorRT (int8/int4 MatMulNBits are com.microsoft ops "
            "TensorRT does not take); 102 GB/s carries a <=1B fp16 model",
            "TensorRT first: its fused fp16 kernels cut the per-node launch cost that dominates on Orin; "
            "GroupQueryAttention falls back to CUDA. DLA off: it lacks the attention ops",
        ),
    ),
    DeviceProfile(
        name="agx-orin-64gb",
        description="Jetson AGX Orin 64GB (CPU and GPU share 64 GB LPDDR5), TensorRT then CUDA",
        providers=("tensorrt", "cuda", "cpu"),
        precision="fp16",
        memory_total=64 * GiB,
        shared_memory=True,
        budget=48 * GiB,
        workspace=3 * GiB,
        draft_len="auto",
        max_draft_len=8,
        cuda_options=_CUDA,
        trt_options={**_TRT, "trt_max_workspace_size": 2 * GiB, "trt_dla_enable": False},
        notes=(
            "budget 48 GiB = ~61.4 GiB the kernel sees - 1.5 GiB L4T/Ubuntu with the desktop - 1 GiB CUDA/cuDNN/"
            "TensorRT libraries - 0.4 GiB this process - ~10.5 GiB left to the camera and vision pipelines an "
            "AGX Orin usually runs beside a language model (and to a TensorRT build's second copy of the weights)",
            "workspace 3 GiB: TensorRT's 2 GiB workspace, ORT's CUDA arena, activations, logits",
            "precision fp16, TensorRT first, DLA off: as orin-nx-16gb (at 204 GB/s a 7B fp16 model, 14 GB, reads "
            "at most ~14 tokens/s before speculation)",
        ),
    ),
]

PROFILES: Mapping[str, DeviceProfile] = MappingProxyType({p.name: p for p in _PROFILES})


def profile_names() -> list[str]:
    return list(PROFILES)


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise SpecdecError(f"unknown device profile {name!r}",
                           f"known profiles: {', '.join(PROFILES)}; `specdec devices` lists them") from None
