"""Step costs measured on this machine, kept between runs.

`--draft-len auto` weighs each drafted token against what widening the target's step costs, timed on the device
(draft_len.py). Timing every width takes ~0.8 s (9 widths x 4 runs of a 20 ms fp32 step on 2 cores), paid before
the first token of every new process, and a cold first timing is noisy. So the costs (as refined by the rounds a
generation actually ran) are kept per bundle, drafter and machine in one small JSON file, and the next process
starts from them. A cache that cannot be read is measured again; one that cannot be written only costs the next
start its timing.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import onnxruntime as ort

from specdec.runtime.manifest import Manifest
from specdec.runtime.session import RuntimeOptions

# Where the costs live: this variable's path, else $SPECDEC_CACHE/step_costs.json (~/.cache/specdec by default).
STEP_COSTS_ENV = "SPECDEC_STEP_COSTS"
FORMAT = "specdec-step-costs"
VERSION = 1
# Entries kept (the most recently written): one per bundle x drafter x machine x runtime setting in use.
MAX_ENTRIES = 64


def cache_dir() -> Path:
    """specdec's per-user cache (the default model's download, these costs): $SPECDEC_CACHE or ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def default_path() -> Path:
    if os.environ.get(STEP_COSTS_ENV):
        return Path(os.environ[STEP_COSTS_ENV])
    return cache_dir() / "step_costs.json"


def machine_key(manifest: Manifest, opts: RuntimeOptions, *extra: str) -> str:
    """What a timing on this device depends on: the bundle's files, the provider, device and threads, this machine
    and onnxruntime's version (and `extra`)."""
    parts = [json.dumps(sorted(manifest.files.items())), *extra, opts.provider, str(opts.device_id),
             str(opts.threads or os.cpu_count()), platform.node(), platform.machine(), platform.processor(),
             ort.__version__]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def read_entries(path: Path, fmt: str, version: int) -> dict:
    """The "entries" of a small keyed JSON record of this format and version; {} for anything unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != fmt or data.get("version") != version:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def cost_key(manifest: Manifest, drafter: str, opts: RuntimeOptions) -> str:
    """The costs depend on the drafter too."""
    return machine_key(manifest, opts, drafter)


class StepCostCache:
    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()

    def _entries(self) -> dict:
        return read_entries(self.path, FORMAT, VERSION)

    def load(self, key: str) -> tuple[list[float], float] | None:
        """(target step seconds by width 1..n, draft step seconds), or None if not cached (or not valid)."""
        entry = self._entries().get(key)
        try:
            verify, draft = [float(v) for v in entry["verify_s"]], float(entry["draft_s"])
        except (TypeError, KeyError, ValueError):
            return None
        if len(verify) < 2 or not all(0 < v < 60 for v in verify) or not 0 <= draft < 60:
            return None
        return verify, draft

    def store(self, key: str, verify_s: list[float], draft_s: float) -> None:
        """Write (atomically) the costs under `key`; beyond MAX_ENTRIES the least recently written go."""
        entries = {k: v for k, v in self._entries().items() if isinstance(v, dict) and isinstance(v.get("stamp"), int)}
        stamp = 1 + max((v["stamp"] for v in entries.values()), default=0)
        entries[key] = {"verify_s": [round(float(v), 6) for v in verify_s], "draft_s": round(float(draft_s), 6),
                        "stamp": stamp}
        newest = sorted(entries.items(), key=lambda kv: -kv[1]["stamp"])[:MAX_ENTRIES]
        data = {"format": FORMAT, "version": VERSION, "entries": dict(newest)}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
