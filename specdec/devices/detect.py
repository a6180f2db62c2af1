"""What machine is this? onnxruntime's providers, nvidia-smi, the Jetson release files, /proc/meminfo.

Every source is injectable: `detect(nvidia_smi="NVIDIA GeForce RTX 4090, 24564", providers=[...])` fakes
one (a string is the source's text, None means the source is absent), so tests run anywhere. Without
arguments each source is read from the machine; a missing or failing one reads as absent, never an error.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

from specdec.devices.memory import GiB, MiB, fmt_bytes
from specdec.devices.profiles import PROFILES

NVIDIA_SMI_QUERY = ["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
TEGRA_RELEASE = "/etc/nv_tegra_release"
DEVICE_TREE_MODEL = "/proc/device-tree/model"
MEMINFO = "/proc/meminfo"


class _Read:
    def __repr__(self) -> str:
        return "READ"


READ = _Read()  # the default of every source: read it from this machine


@dataclass(frozen=True)
class GpuInfo:
    name: str
    memory_bytes: int | None  # None where nvidia-smi says [N/A] (Jetson: memory is the board's RAM)


@dataclass(frozen=True)
class DetectedDevice:
    providers: tuple[str, ...]  # onnxruntime's available providers (full names)
    gpus: tuple[GpuInfo, ...]
    jetson_model: str | None  # "NVIDIA Jetson Orin Nano Developer Kit" when this is a Jetson
    l4t_release: str | None  # "R36.4.3" from /etc/nv_tegra_release
    ram_bytes: int | None
    suggested: str  # a profile name
    reasons: tuple[str, ...]  # why that profile (and what would make a better one usable)

    @property
    def is_jetson(self) -> bool:
        return self.jetson_model is not None or self.l4t_release is not None

    def has_provider(self, short: str) -> bool:
        from specdec.runtime.session import PROVIDERS

        return PROVIDERS[short] in self.providers

    def memory_for(self, profile) -> int | None:
        """The memory a fractional budget is taken of: RAM for cpu and shared-memory boards, else GPU 0's."""
        if not profile.gpu or profile.shared_memory or self.is_jetson:
            return self.ram_bytes
        return self.gpus[0].memory_bytes if self.gpus else None

    def summary(self) -> str:
        short = ", ".join(p.replace("ExecutionProvider", "").lower() for p in self.providers) or "none"
        lines = [f"  onnxruntime providers: {short}"]
        if self.gpus:
            for i, g in enumerate(self.gpus):
                mem = fmt_bytes(g.memory_bytes) if g.memory_bytes else "memory n/a"
                lines.append(f"  GPU {i}: {g.name} ({mem}) [nvidia-smi]")
        else:
            lines.append("  GPU: none found (no nvidia-smi output)")
        if self.is_jetson:
            lines.append(f"  Jetson: {self.jetson_model or 'model unknown'}"
                         + (f", L4T {self.l4t_release}" if self.l4t_release else ""))
        lines.append(f"  RAM: {fmt_bytes(self.ram_bytes) if self.ram_bytes else 'unknown'}")
        lines.append(f"  suggested profile: {self.suggested}")
        lines += [f"    - {r}" for r in self.reasons]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- sources

def read_nvidia_smi(timeout: float = 5.0) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 and proc.stdout.strip() else None


def read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None


def _available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


# ----------------------------------------------------------------------------------------------- parsers

def parse_nvidia_smi(text: str | None) -> tuple[GpuInfo, ...]:
    """`name, memory.total` lines (MiB, no units) -> GpuInfo; lines that do not parse are skipped."""
    gpus = []
    for line in (text or "").splitlines():
        if not line.strip():
            continue
        name, _, mem = line.rpartition(",")
        name, mem = name.strip(), mem.strip()
        if not name:
            continue
        try:
            memory = int(float(mem)) * MiB
        except ValueError:  # "[N/A]" (Jetson), "[Not Supported]"
            memory = None
        gpus.append(GpuInfo(name, memory))
    return tuple(gpus)


def parse_meminfo(text: str | None) -> int | None:
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def parse_l4t_release(text: str | None) -> str | None:
    """'# R36 (release), REVISION: 4.3, GCID: ...' -> 'R36.4.3'."""
    m = re.search(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text or "")
    return f"R{m.group(1)}.{m.group(2)}" if m else None


def parse_device_tree_model(text: str | None) -> str | None:
    """The board name if it is a Jetson ('NVIDIA Jetson AGX Orin Developer Kit'), else None."""
    model = (text or "").replace("\x00", "").strip()
    return model if model and ("jetson" in model.lower() or "orin" in model.lower()) else None


def _ram_fallback() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------- suggestion

JETSON_BY_NAME = (("agx orin", "agx-orin-64gb"), ("orin nx", "orin-nx-16gb"), ("orin nano", "orin-nano-8gb"))
JETSON_BY_SIZE = ("agx-orin-64gb", "orin-nx-16gb", "orin-nano-8gb")  # largest first
# The kernel sees less RAM than the board has (carve-outs: 7.4 GiB of 8, 15.3 of 16, 61.4 of 64).
VISIBLE_RAM = 0.9


def suggest_profile(providers: Sequence[str], gpus: Sequence[GpuInfo], jetson_model: str | None,
                    l4t_release: str | None, ram_bytes: int | None) -> tuple[str, list[str]]:
    has_cuda = "CUDAExecutionProvider" in providers
    has_trt = "TensorrtExecutionProvider" in providers
    reasons: list[str] = []
    if jetson_model is not None or l4t_release is not None:
        name = next((p for key, p in JETSON_BY_NAME if key in (jetson_model or "").lower()), None)
        fits = [p for p in JETSON_BY_SIZE if ram_bytes is None or ram_bytes >= VISIBLE_RAM * PROFILES[p].memory_total]
        if name is None:
            name = fits[0] if fits else JETSON_BY_SIZE[-1]
            reasons.append(f"Jetson board ({jetson_model or 'model unknown'}); profile chosen by its RAM")
        else:
            reasons.append(f"Jetson board: {jetson_model}")
        if ram_bytes is not None and ram_bytes < VISIBLE_RAM * PROFILES[name].memory_total:
            smaller = fits[0] if fits else None
            reasons.append(f"this board has {fmt_bytes(ram_bytes)} of RAM, less than {name}'s "
                           f"{fmt_bytes(PROFILES[name].memory_total)}" + (f": using {smaller}" if smaller else
                                                                           ": no Jetson profile fits, pass --max-len"))
            name = smaller or name
        if not has_cuda:
            reasons.append(f"but this onnxruntime has no CUDA provider: install the onnxruntime-gpu wheel built for "
                           f"this JetPack to use {name}; until then cpu")
            return "cpu", reasons
        if PROFILES[name].provider == "tensorrt" and not has_trt:
            reasons.append(f"{name} starts with TensorRT, which this onnxruntime lacks: run it with --provider cuda")
        return name, reasons
    if gpus:
        gpu = gpus[0]
        mem = gpu.memory_bytes
        label = f"{gpu.name} ({fmt_bytes(mem) if mem else 'memory n/a'})"
        if mem is not None and "laptop" in gpu.name.lower() and 7 * GiB <= mem <= 8.5 * GiB:
            name = "rtx-laptop-8gb"
        elif mem is not None and "laptop" not in gpu.name.lower() and 22 * GiB <= mem <= 26 * GiB:
            name = "rtx-desktop-24gb"
        else:
            name = "nvidia-gpu"
        reasons.append(f"NVIDIA GPU: {label}" + (" (80% of its memory)" if name == "nvidia-gpu" else ""))
        if not has_cuda:
            reasons.append(f"but this onnxruntime has no CUDA provider: `pip uninstall -y onnxruntime && pip install "
                           f"onnxruntime-gpu` to use {name}; until then cpu")
            return "cpu", reasons
        return name, reasons
    if has_cuda:
        reasons.append("onnxruntime has CUDA but nvidia-smi reported no GPU: memory unknown, pass --max-len")
        return "nvidia-gpu", reasons
    reasons.append("no NVIDIA GPU found (no nvidia-smi output, no Jetson release file)")
    return "cpu", reasons


def detect(*, providers: Sequence[str] | _Read = READ, nvidia_smi: str | None | _Read = READ,
           tegra_release: str | None | _Read = READ, device_tree_model: str | None | _Read = READ,
           meminfo: str | None | _Read = READ) -> DetectedDevice:
    providers = tuple(_available_providers() if providers is READ else providers)
    smi = read_nvidia_smi() if nvidia_smi is READ else nvidia_smi
    tegra = read_text(TEGRA_RELEASE) if tegra_release is READ else tegra_release
    dt_model = read_text(DEVICE_TREE_MODEL) if device_tree_model is READ else device_tree_model
    ram = parse_meminfo(read_text(MEMINFO)) if meminfo is READ else parse_meminfo(meminfo)
    if ram is None and meminfo is READ:
        ram = _ram_fallback()
    gpus = parse_nvidia_smi(smi)
    jetson = parse_device_tree_model(dt_model)
    l4t = parse_l4t_release(tegra)
    if tegra and l4t is None:
        l4t = "unknown"  # the file exists: a Jetson, whatever its format
    name, reasons = suggest_profile(providers, gpus, jetson, l4t, ram)
    return DetectedDevice(providers, gpus, jetson, l4t, ram, name, tuple(reasons))
