"""`specdec devices`: the profile table, what this machine is, and (with a bundle) each profile's arithmetic."""
from __future__ import annotations

from pathlib import Path

from specdec.devices.detect import DetectedDevice, detect
from specdec.devices.memory import SMOLLM2_135M, fmt_bytes, graphs_loaded, plan_for_model
from specdec.devices.profiles import PROFILES, DeviceProfile
from specdec.devices.setup import plan_for_bundle
from specdec.errors import SpecdecError
from specdec.runtime.manifest import read_manifest


def _default_model_kv(profile: DeviceProfile, detected: DetectedDevice) -> str:
    """KV length for the default model's target at the profile's precision (estimated weights)."""
    try:
        budget = profile.budget_bytes(detected.memory_for(profile))
        return f"{plan_for_model(SMOLLM2_135M, profile.precision, budget, profile.workspace).kv_len:,}"
    except SpecdecError:
        return "-"


def profile_table(detected: DetectedDevice) -> str:
    head = ("profile", "providers", "precision", "budget", "workspace", "draft", "KV*", "description")
    rows = [head]
    for p in PROFILES.values():
        mark = " <" if p.name == detected.suggested else ""
        draft = f"{p.draft_len} (max {p.max_draft_len})"
        rows.append((p.name + mark, ">".join(p.providers), p.precision, p.budget_text(), fmt_bytes(p.workspace), draft,
                     _default_model_kv(p, detected), p.description))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.append("* KV: longest KV buffer for the default model (SmolLM2-135M target at the profile's precision, "
                 "weights estimated); `--bundle DIR` shows the arithmetic for a real bundle. < = suggested here.")
    return "\n".join(lines)


def render(bundle: Path | None = None, detected: DetectedDevice | None = None, notes: bool = False) -> str:
    detected = detected or detect()
    out = ["Device profiles:", profile_table(detected), "", "This machine:", detected.summary()]
    if notes:
        for p in PROFILES.values():
            out += ["", f"{p.name}:"] + [f"  - {n}" for n in p.notes]
    if bundle is not None:
        manifest = read_manifest(Path(bundle), verify_checksums=False)
        graphs = graphs_loaded(manifest)
        out += ["", f"Memory for {bundle} (graphs the engine loads with its default drafter "
                    f"{manifest.drafter.kind!r}: {', '.join(graphs)}):"]
        for p in PROFILES.values():
            if p.budget is None and detected.memory_for(p) is None:
                out += ["", f"{p.name}: budget unknown ({p.budget_text()}, not detected here)"]
                continue
            try:
                plan = plan_for_bundle(p, Path(bundle), manifest, detected)
            except SpecdecError as e:
                out += ["", f"{p.name}: does not fit: {e}"]
                continue
            out += ["", f"{p.name}: KV length {plan.kv_len:,}", plan.breakdown()]
    return "\n".join(out)
