"""TensorRT engine caches inside a bundle, and the record of what built them (`<cache>/engines.json`).

A TensorRT engine is compiled for one GPU model and one TensorRT version, and onnxruntime names the engines
it caches after the graph file's *name* and structure, not its weights (TRTGenerateId). So a cache copied to
another device, kept across a TensorRT upgrade, or left beside a re-exported graph of the same shape would be
loaded as if it fitted: at best an opaque deserialization error, at worst engines computing with old weights.
The record says which GPU and TensorRT built the engines of a cache, and from which graph bytes; every
TensorRT session with a cache checks it first (Decoder), and a mismatch is one SpecdecError that says how to
rebuild. A cache belongs to one device: all of its graphs' engines, and TensorRT's timing cache beside them,
were built there.

The machine is read by small functions (`read_gpu`, `read_tensorrt_version`, `read_onnxruntime_version`)
that tests replace with monkeypatch. Runtime module: numpy + onnxruntime + stdlib.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from specdec.errors import SpecdecError
from specdec.runtime.manifest import sha256_file
from specdec.version import __version__

ENGINES_RECORD = "engines.json"
ENGINES_FORMAT = "specdec-trt-engines"
ENGINES_FORMAT_VERSION = 1
# Files onnxruntime's TensorRT provider writes into its cache folder: engines, their shape profiles, and
# TensorRT's timing cache. Any of them without a record are engines of unknown origin.
ENGINE_FILE_SUFFIXES = (".engine", ".profile", ".timing")
# CUDA driver API attribute ids (cuda.h: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR).
_CU_CC_MAJOR, _CU_CC_MINOR = 75, 76
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@dataclass(frozen=True)
class EngineBuilder:
    """What TensorRT engines are tied to: the GPU they were built on and the TensorRT that built them."""

    gpu_name: str  # "NVIDIA GeForce RTX 4090", "Orin"
    compute_capability: str  # "8.9"; TensorRT's kernels are chosen per SM version
    tensorrt_version: str  # "10.3.0"; an engine only deserializes in the TensorRT version that built it
    onnxruntime_version: str  # recorded for people reading the record; not compared (engines are TensorRT's)

    def __post_init__(self) -> None:
        for f in fields(self):
            _require(isinstance(getattr(self, f.name), str) and bool(getattr(self, f.name).strip()),
                     f"engine builder: {f.name} must be a non-empty string")
        _require(bool(re.match(r"^\d+\.\d+$", self.compute_capability)),
                 f"engine builder: compute_capability must look like '8.9', got {self.compute_capability!r}")
        _require(bool(re.match(r"^\d+(\.\d+)*$", self.tensorrt_version)),
                 f"engine builder: tensorrt_version must look like '10.3.0', got {self.tensorrt_version!r}")

    def mismatches(self, here: "EngineBuilder") -> list[str]:
        """What differs between the builder of a cache (self) and this machine (`here`) that invalidates engines."""
        out = []
        for f, label in (("gpu_name", "GPU"), ("compute_capability", "compute capability"),
                         ("tensorrt_version", "TensorRT")):
            if getattr(self, f) != getattr(here, f):
                out.append(f"{label} {getattr(here, f)} here, {getattr(self, f)} in the record")
        return out

    def describe(self) -> str:
        return f"{self.gpu_name} (compute capability {self.compute_capability}), TensorRT {self.tensorrt_version}"


@dataclass(frozen=True)
class EngineCacheRecord:
    """`<cache>/engines.json`: the device one engine cache belongs to and the graphs whose engines it holds."""

    builder: EngineBuilder
    # graph path relative to the bundle -> sha256 over the graph's files (the .onnx and its external data)
    graphs: Mapping[str, str]
    created_by: str = ""
    format: str = ENGINES_FORMAT
    version: int = ENGINES_FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "graphs", MappingProxyType(dict(self.graphs)))
        _require(self.format == ENGINES_FORMAT, f"format is {self.format!r}, expected {ENGINES_FORMAT!r}")
        _require(self.version == ENGINES_FORMAT_VERSION,
                 f"engine record version {self.version}, this specdec reads version {ENGINES_FORMAT_VERSION}")
        _require(len(self.graphs) > 0, "graphs must not be empty")
        for name, digest in self.graphs.items():
            _require(bool(name) and isinstance(digest, str) and bool(_SHA256.match(digest)),
                     f"graphs[{name!r}] must be a sha256 hex digest, got {digest!r}")

    def to_json(self) -> str:
        d = {"format": self.format, "version": self.version, "created_by": self.created_by,
             "builder": asdict(self.builder), "graphs": dict(sorted(self.graphs.items()))}
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Any) -> "EngineCacheRecord":
        _require(isinstance(d, dict), "the record must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        _require(not unknown, f"unknown field(s) {', '.join(unknown)}")
        b = d.get("builder")
        _require(isinstance(b, dict), "builder must be an object")
        _require(set(b) == {f.name for f in fields(EngineBuilder)},
                 f"builder must have exactly {', '.join(f.name for f in fields(EngineBuilder))}")
        _require(isinstance(d.get("graphs"), dict), "graphs must be an object")
        try:
            return cls(**{**d, "builder": EngineBuilder(**b)})
        except TypeError as e:  # a missing required field
            raise ValueError(str(e)) from None


# ----------------------------------------------------------------------------------------------- this machine

def tensorrt_version_from_int(v: int) -> str:
    """getInferLibVersion()'s integer as 'major.minor.patch': TensorRT 10+ encodes major*10000 + minor*100 +
    patch (100300 = 10.3.0), TensorRT 8 and older major*1000 + minor*100 + patch (8601 = 8.6.1)."""
    if v <= 0:
        raise ValueError(f"not a TensorRT version: {v}")
    major, rest = (v // 10000, v % 10000) if v >= 100000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def parse_nvidia_smi_gpu(text: str | None) -> tuple[str, str] | None:
    """'NVIDIA GeForce RTX 4090, 8.9' (`--query-gpu=name,compute_cap --format=csv,noheader`) -> (name, '8.9')."""
    for line in (text or "").splitlines():
        name, _, cc = line.rpartition(",")
        if name.strip() and re.match(r"^\d+\.\d+$", cc.strip()):
            return name.strip(), cc.strip()
    return None


def _gpu_from_driver(device_id: int) -> tuple[str, str] | None:
    """Name and compute capability from the CUDA driver (libcuda): present wherever a CUDA GPU can run,
    Jetsons included, where nvidia-smi may be missing."""
    import ctypes

    for lib_name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(lib_name)
            break
        except OSError:
            continue
    else:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    name = ctypes.create_string_buffer(256)
    try:
        ok = (lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), device_id) == 0
              and lib.cuDeviceGetName(name, len(name), dev) == 0
              and lib.cuDeviceGetAttribute(ctypes.byref(major), _CU_CC_MAJOR, dev) == 0
              and lib.cuDeviceGetAttribute(ctypes.byref(minor), _CU_CC_MINOR, dev) == 0)
    except AttributeError:  # not the CUDA driver after all
        return None
    return (name.value.decode("utf-8", "replace").strip(), f"{major.value}.{minor.value}") if ok else None


def _gpu_from_nvidia_smi(device_id: int) -> tuple[str, str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", str(device_id)],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi_gpu(proc.stdout) if proc.returncode == 0 else None


def read_gpu(device_id: int = 0) -> tuple[str, str] | None:
    """(name, compute capability) of CUDA device `device_id`, or None where no GPU answers."""
    return _gpu_from_driver(device_id) or _gpu_from_nvidia_smi(device_id)


def read_tensorrt_version() -> str | None:
    """The TensorRT library's own version (the one onnxruntime loads), or None where none is found."""
    import ctypes

    for lib_name in ("libnvinfer.so.10", "libnvinfer.so.8", "libnvinfer.so", "nvinfer_10.dll", "nvinfer.dll"):
        try:
            fn = ctypes.CDLL(lib_name).getInferLibVersion
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int32
        try:
            return tensorrt_version_from_int(int(fn()))
        except ValueError:
            return None
    try:  # pip's TensorRT keeps libnvinfer in its package folder, out of the loader's path; its module knows
        import tensorrt

        return str(tensorrt.__version__)
    except Exception:
        return None


def read_onnxruntime_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def current_builder(device_id: int = 0) -> EngineBuilder:
    """This machine as an engine builder; a SpecdecError when the GPU or TensorRT cannot be read."""
    gpu = read_gpu(device_id)
    if gpu is None:
        raise SpecdecError(f"no NVIDIA GPU {device_id} found (neither the CUDA driver nor nvidia-smi answered): "
                           "TensorRT engines can only be built and checked on the GPU they run on",
                           "run on a machine with an NVIDIA GPU and its driver, or use --provider cuda / cpu")
    trt = read_tensorrt_version()
    if trt is None:
        raise SpecdecError("TensorRT is not installed or not found (no libnvinfer, no tensorrt module)",
                           "install TensorRT for this onnxruntime-gpu build, or use --provider cuda")
    try:
        return EngineBuilder(gpu_name=gpu[0], compute_capability=gpu[1], tensorrt_version=trt,
                             onnxruntime_version=read_onnxruntime_version())
    except ValueError as e:
        raise SpecdecError(f"cannot identify this TensorRT device: {e}") from None


# ----------------------------------------------------------------------------------------------- the record

def graph_files(graph_path: Path) -> list[Path]:
    """The graph and its external data: `<name>` and the `<name>.*` files beside it (as the manifest lists them)."""
    graph_path = Path(graph_path)
    return [graph_path] + sorted(p for p in graph_path.parent.glob(graph_path.name + ".*") if p.is_file())


def graph_digest(graph_path: Path) -> str:
    """sha256 over the graph's files (names and contents): the engines depend on the weights too."""
    h = hashlib.sha256()
    for p in graph_files(graph_path):
        h.update(f"{p.name}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def rebuild_hint(cache_dir: Path) -> str:
    bundle = Path(cache_dir).parent
    return (f"delete {cache_dir} (the next TensorRT run rebuilds its engines, which takes minutes) or run "
            f"`specdec build-engines {bundle} --rebuild` on this device")


def read_engine_record(cache_dir: Path) -> EngineCacheRecord | None:
    path = Path(cache_dir) / ENGINES_RECORD
    if not path.is_file():
        return None
    try:
        return EngineCacheRecord.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValueError) as e:
        raise SpecdecError(f"TensorRT engine record {path} is invalid: {e}", rebuild_hint(cache_dir)) from None


def write_engine_record(cache_dir: Path, record: EngineCacheRecord) -> None:
    """Write atomically: a reader sees the old record or the new one, never half of one."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / (ENGINES_RECORD + ".tmp")
    tmp.write_text(record.to_json())
    os.replace(tmp, cache_dir / ENGINES_RECORD)


def _graph_key(cache_dir: Path, graph_path: Path) -> str:
    """The graph's path relative to the bundle holding the cache (a draft bundle's graph added from elsewhere
    gets a '../' path, so it never takes the place of this bundle's own `target.onnx`)."""
    return Path(os.path.relpath(Path(graph_path).resolve(), Path(cache_dir).resolve().parent)).as_posix()


def claim_engine_cache(cache_dir: Path, graph_path: Path, device_id: int = 0,
                       builder: EngineBuilder | None = None) -> EngineCacheRecord:
    """Check that the engines cached in `cache_dir` fit this machine and `graph_path`, then record the graph.

    Called before a TensorRT session is created (which loads or builds engines), so engines of another GPU,
    another TensorRT or another version of the graph are never loaded. The record is written before the
    build: if a build is interrupted, the cache still says which device its partial engines belong to.
    """
    cache_dir = Path(cache_dir)
    here = builder or current_builder(device_id)
    key, digest = _graph_key(cache_dir, graph_path), graph_digest(graph_path)
    record = read_engine_record(cache_dir)
    if record is None:
        stray = sorted(p.name for p in cache_dir.glob("*") if p.suffix in ENGINE_FILE_SUFFIXES) \
            if cache_dir.is_dir() else []
        if stray:
            raise SpecdecError(f"TensorRT engine cache {cache_dir} holds engines ({', '.join(stray[:3])}"
                               f"{', ...' if len(stray) > 3 else ''}) but no {ENGINES_RECORD} saying which GPU, "
                               "TensorRT and graph built them", rebuild_hint(cache_dir))
        record = EngineCacheRecord(builder=here, graphs={key: digest}, created_by=f"specdec {__version__}")
    else:
        diffs = record.builder.mismatches(here)
        if diffs:
            raise SpecdecError(f"the TensorRT engines in {cache_dir} were built for {record.builder.describe()}, "
                               f"not for this machine ({'; '.join(diffs)})", rebuild_hint(cache_dir))
        built_from = record.graphs.get(key)
        if built_from == digest:
            return record
        if built_from is not None:
            # onnxruntime would load them: it names engines by file name and structure, not by weights.
            raise SpecdecError(f"the TensorRT engines in {cache_dir} were built from another {key} "
                               f"(sha256 {built_from[:12]}..., the graph is now {digest[:12]}...)",
                               rebuild_hint(cache_dir))
        record = replace(record, graphs={**record.graphs, key: digest})
    write_engine_record(cache_dir, record)
    return record
