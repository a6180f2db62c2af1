"""A profile applied to a bundle: RuntimeOptions, KV length and draft length, with explicit flags winning.

    s = device_setup("orin-nx-16gb", "bundles/smollm2")
    engine = specdec.load("bundles/smollm2", max_len=s.max_len, runtime=s.runtime)

The provider check comes first, before any file is read: a GPU profile on a machine whose onnxruntime has
no CUDA fails at once, saying which provider the profile needs and suggesting `--device cpu`.

`build_engines` (`specdec build-engines`) builds a bundle's TensorRT engines into `BUNDLE/trt_cache` on the
device that will run them; the cache's `engines.json` records what built them (specdec.runtime.trt_engines).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specdec.devices.detect import DetectedDevice, detect
from specdec.devices.memory import MemoryPlan, bundle_parts, graphs_loaded, plan_kv
from specdec.devices.profiles import DeviceProfile, get_profile
from specdec.errors import SpecdecError
from specdec.runtime.manifest import Manifest, read_manifest
from specdec.runtime.session import PROVIDERS, RuntimeOptions
from specdec.runtime.trt_engines import EngineCacheRecord, current_builder, read_engine_record

TRT_CACHE = "trt_cache"  # TensorRT engine cache folder inside the bundle
_LABEL = {"cpu": "CPU", "cuda": "CUDA", "tensorrt": "TensorRT"}


@dataclass(frozen=True)
class DeviceSetup:
    profile: DeviceProfile
    runtime: RuntimeOptions
    max_len: int
    draft_len: int | str  # the profile's; the caller uses it only where --draft-len was not given
    plan: MemoryPlan | None  # None when the budget could not be computed (a fraction of unknown memory)

    def describe(self) -> str:
        kv = f"KV {self.max_len:,} tokens"
        if self.plan is not None:
            kv += (f" (budget {self.plan.budget / 2**30:.2f} GiB, weights {self.plan.weight_bytes / 2**20:.0f} MiB, "
                   f"room for {self.plan.room // self.plan.kv_bytes_per_token:,})")
        return f"device {self.profile.name}: provider {self.runtime.provider}, {kv}, draft {self.draft_len}"


def check_provider(provider: str, available: Sequence[str], profile: DeviceProfile | None = None) -> None:
    """SpecdecError naming what is missing; for a profile's own provider, it names the profile and points at cpu."""
    needed = ["cuda", "tensorrt"] if provider == "tensorrt" else [provider]  # TensorRT hands what it cannot build to CUDA
    missing = [p for p in needed if PROVIDERS[p] not in available]
    if not missing:
        return
    have = ", ".join(p.replace("ExecutionProvider", "").lower() for p in available) or "none"
    what = " and ".join(_LABEL[p] for p in missing) + " execution provider" + ("s" if len(missing) > 1 else "")
    if profile is None:
        raise SpecdecError(f"execution provider {provider} is not available in this onnxruntime (missing: {what}; "
                           f"available: {have})", "install onnxruntime-gpu for cuda/tensorrt, or use --provider cpu")
    if missing == ["tensorrt"]:
        hint = (f"run {profile.name} on CUDA with --provider cuda, or install an onnxruntime-gpu build with TensorRT; "
                "--device cpu runs on the CPU")
    else:
        hint = "use --device cpu here; on a machine with an NVIDIA GPU, replace onnxruntime with onnxruntime-gpu"
    raise SpecdecError(f"device profile {profile.name} needs the {what}, which this onnxruntime lacks "
                       f"(available: {have})", hint)


def runtime_options(profile: DeviceProfile, provider: str | None = None, threads: int = 0, device_id: int = 0,
                    bundle: Path | None = None) -> RuntimeOptions:
    """The profile's RuntimeOptions; `provider` overrides its first provider. TensorRT caches engines in the bundle."""
    provider = provider or profile.provider
    trt_cache = str(Path(bundle) / TRT_CACHE) if (provider == "tensorrt" and bundle is not None) else None
    try:
        return RuntimeOptions(provider=provider, device_id=device_id, threads=threads, trt_cache_dir=trt_cache,
                              cuda_options=dict(profile.cuda_options), trt_options=dict(profile.trt_options))
    except ValueError as e:
        raise SpecdecError(str(e)) from None


def plan_for_bundle(profile: DeviceProfile, bundle: Path, manifest: Manifest | None = None,
                    detected: DetectedDevice | None = None, drafter: str | None = None,
                    requested_len: int | None = None) -> MemoryPlan:
    """The profile's memory arithmetic for the graphs the engine will load from `bundle`."""
    manifest = manifest or read_manifest(Path(bundle), verify_checksums=False)
    weights, kv, max_position = bundle_parts(Path(bundle), manifest, graphs_loaded(manifest, drafter))
    memory = None
    if profile.budget is None:
        detected = detected or detect()
        memory = detected.memory_for(profile)
    budget = profile.budget_bytes(memory)
    how = f"{profile.name}: " + (profile.budget_text() if profile.budget is not None
                                 else f"{profile.budget_fraction:.0%} of {memory / 2**30:.1f} GiB detected")
    return plan_kv(budget, weights, profile.workspace, kv, max_position, requested_len, how)


def device_setup(name: str, bundle: str | Path, provider: str | None = None, max_len: int | None = None,
                 threads: int = 0, drafter: str | None = None, available: Sequence[str] | None = None,
                 detected: DetectedDevice | None = None) -> DeviceSetup:
    """Apply profile `name` to `bundle`: explicit `provider` / `max_len` win over the profile's.

    An explicit max_len is still checked against the budget (a clear error if it does not fit); when the
    budget is a fraction of memory that cannot be read, an explicit max_len is taken as it is.
    """
    profile = get_profile(name)
    if available is None:
        import onnxruntime as ort

        available = ort.get_available_providers()
    chosen = provider or profile.provider
    check_provider(chosen, available, profile if provider is None else None)
    runtime = runtime_options(profile, chosen, threads, bundle=Path(bundle))
    manifest = read_manifest(Path(bundle), verify_checksums=False)  # the engine verifies checksums later
    if profile.budget is None:
        detected = detected or detect()
        if detected.memory_for(profile) is None and max_len is not None:
            return DeviceSetup(profile, runtime, max_len, profile.draft_len, None)
    plan = plan_for_bundle(profile, Path(bundle), manifest, detected, drafter, max_len)
    return DeviceSetup(profile, runtime, plan.kv_len, profile.draft_len, plan)


def build_engines(bundle: str | Path, device: str | None = None, max_len: int | None = None, rebuild: bool = False,
                  available: Sequence[str] | None = None, detected: DetectedDevice | None = None) -> EngineCacheRecord:
    """Build the TensorRT engines of `bundle`'s target and draft graphs on this GPU, cached in the bundle.

    Refuses, before touching the bundle, where engines cannot be built: no TensorRT/CUDA execution provider,
    no GPU or no TensorRT library. `device` is the profile whose TensorRT options (workspace, fp16) and KV
    length are used (default: the one `specdec devices` suggests). `rebuild` deletes the cache first, for
    a cache another GPU or TensorRT version built. Returns the cache's record.
    """
    import specdec

    bundle = Path(bundle)
    if available is None:
        import onnxruntime as ort

        available = ort.get_available_providers()
    try:
        check_provider("tensorrt", available)
    except SpecdecError as e:
        raise SpecdecError(f"cannot build TensorRT engines: {e.message}",
                           "build them on the device that runs the bundle, with an onnxruntime-gpu that has "
                           "TensorRT (engines are tied to one GPU model and TensorRT version)") from None
    current_builder()  # no GPU / no TensorRT library: a clear error before anything is loaded
    if device is None:
        detected = detected or detect(providers=available)
        device = detected.suggested
    if not get_profile(device).gpu:
        raise SpecdecError(f"device profile {device} has no GPU to build TensorRT engines for",
                           "pass --device with a GPU profile (`specdec devices` lists them)")
    manifest = read_manifest(bundle, verify_checksums=False)  # a wrong path fails before the cache is deleted
    if rebuild:
        shutil.rmtree(bundle / TRT_CACHE, ignore_errors=True)
    setup = device_setup(device, bundle, provider="tensorrt", max_len=max_len, available=available, detected=detected)
    engine = specdec.load(bundle, max_len=setup.max_len, runtime=setup.runtime,
                          drafter="model" if manifest.drafter.graph else "none")
    # onnxruntime builds engines for the input shapes it sees and rebuilds when a shape leaves the range
    # built for: run the narrowest and the widest step once, so the engines cover every width the runtime uses.
    decoders = [engine.target] + ([engine.drafter.decoder] if engine.drafter is not None else [])
    for dec in decoders:
        run_every_step_width(dec)
    record = read_engine_record(bundle / TRT_CACHE)  # written by the Decoders as they claimed the cache
    if record is None:
        raise SpecdecError(f"no engine record was written in {bundle / TRT_CACHE}", "please report this")
    return record


def run_every_step_width(dec) -> tuple[int, int]:
    """Run a Decoder's narrowest step (one token) and its widest (a prefill chunk: dec.max_step, or what the cache
    has room for) once, keeping nothing: the cache's length is put back, the K/V written past it are stale rows.
    Returns the two widths asked for."""
    import numpy as np

    start = int(dec.kv.lengths[0])
    dec.forward(np.zeros((1, 1), dtype=np.int64))
    widest = min(dec.max_step, dec.kv.max_len - start)
    dec.prefill(np.zeros((1, widest), dtype=np.int64))
    dec.kv.truncate(start)
    return 1, widest
