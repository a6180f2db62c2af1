"""Will a bundle fit in memory at the KV length asked for? Said before anything is loaded.

onnxruntime memory-maps a graph's weight file; kernels that prepack their weights (MatMulNBits with int8
activations) copy them into private memory as the session loads: ~1.5x the file at the peak, ~1.1x otherwise.
The KV buffers of every loaded graph are allocated whole, max_len positions each. When the sum exceeds the memory
the kernel reports available, loading would end in the OOM killer (or swap) minutes later: refuse now instead,
with the KV length that fits.
"""
from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecdecError
from specdec.runtime.manifest import GraphSpec, Manifest

PREPACK_FACTOR = {4: 1.5}  # accuracy_level -> peak resident bytes per byte of weight file while loading
DEFAULT_FACTOR = 1.1
KV_STEP = 256


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def graph_weight_bytes(bundle: Path, g: GraphSpec) -> int:
    folder = (bundle / g.file).parent
    name = Path(g.file).name
    return sum(p.stat().st_size for p in folder.glob(name + "*") if p.is_file())


def kv_bytes_per_position(g: GraphSpec) -> int:
    m = g.model
    return (g.n_layers - g.first_layer) * 2 * m.n_kv_heads * m.head_dim * (2 if g.precision == "fp16" else 4)


def check_fits(bundle: Path, manifest: Manifest, graphs: list[str], max_len: int,
               available: int | None = None) -> None:
    """SpecdecError when loading `graphs` with KV buffers of max_len positions needs more than the available memory."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    specs = [manifest.graphs[n] for n in graphs if n in manifest.graphs]
    weights = sum(graph_weight_bytes(bundle, g) * PREPACK_FACTOR.get(g.quant.get("accuracy_level"), DEFAULT_FACTOR)
                  for g in specs)
    per_position = sum(kv_bytes_per_position(g) for g in specs)
    need = weights + per_position * max_len
    if need <= available:
        return
    fit = int((available - weights) // max(per_position, 1)) // KV_STEP * KV_STEP
    hint = f"pass --max-len {fit} or less, or free memory" if fit >= KV_STEP else \
        "free memory, or use a smaller model or precision"
    raise SpecdecError(f"not enough memory for {bundle} at --max-len {max_len}: loading needs about {need / 2**30:.2f} GiB "
                       f"({weights / 2**30:.2f} GiB of weights as loaded, {per_position * max_len / 2**30:.2f} GiB of KV), "
                       f"{available / 2**30:.2f} GiB available", hint)
