"""The drafter `specdec tune` found fastest for a bundle on this machine, kept in the bundle.

Which drafter pays depends on the device: a draft model that wins on a GPU loses to prompt lookup on a 2-core
CPU. `specdec tune` measures and writes its winner to BUNDLE/tuned.json under a key of everything the timing
depends on (the bundle's files, provider, device, threads, this machine, onnxruntime's version), like the
step-cost cache. Engines that are not told a drafter use the record for their key; on another machine, another
provider or another onnxruntime the key differs and the bundle's own default applies. A record only ever picks
among lossless configurations, so it changes speed, never a greedy output.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import onnxruntime as ort

from specdec.runtime.manifest import Manifest
from specdec.runtime.session import RuntimeOptions
from specdec.runtime.step_costs import machine_key, read_entries

TUNED_FILE = "tuned.json"
FORMAT = "specdec-tuned"
VERSION = 1


@dataclass(frozen=True)
class TunedChoice:
    drafter: str
    draft_len: int | str
    tok_s: float  # end-to-end tokens per second it measured
    speedup: float  # over plain decoding on the same prompts
    prompts: int
    sampled: bool  # tuned on sampled (temperature > 0) generations, else greedy

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, str) or not (self.draft_len == "auto" or
                                                     (isinstance(self.draft_len, int) and self.draft_len >= 0)):
            raise ValueError(f"not a tuned choice: {self.drafter!r}, {self.draft_len!r}")


def _entries(bundle: Path) -> dict:
    return read_entries(Path(bundle) / TUNED_FILE, FORMAT, VERSION)


def read_tuned(bundle: Path, manifest: Manifest, opts: RuntimeOptions) -> TunedChoice | None:
    """This machine's tuned choice for the bundle, or None (never tuned here, or an unreadable record)."""
    entry = _entries(bundle).get(machine_key(manifest, opts))
    try:
        return TunedChoice(**{k: entry[k] for k in TunedChoice.__dataclass_fields__})
    except (TypeError, KeyError, ValueError):
        return None


def write_tuned(bundle: Path, manifest: Manifest, opts: RuntimeOptions, choice: TunedChoice) -> Path:
    """Record (atomically) `choice` for this machine; other machines' records are kept."""
    path = Path(bundle) / TUNED_FILE
    entries = _entries(bundle)
    entries[machine_key(manifest, opts)] = {**asdict(choice), "machine": platform.node(), "provider": opts.provider,
                                            "threads": opts.threads or os.cpu_count(), "onnxruntime": ort.__version__}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "entries": entries}, indent=1))
    os.replace(tmp, path)
    return path
