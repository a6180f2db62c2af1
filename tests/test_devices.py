"""Device profiles, memory arithmetic, detection with faked machines, provider selection, the GPU logits path.

Everything here runs on a CPU. The GPU code paths run on the CPU through fakes (the device-resident logits
path with device "cpu", detection from faked nvidia-smi / Jetson / meminfo text); the tests at the end run
the real CUDA / TensorRT paths and skip cleanly where onnxruntime has no such provider.
"""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

import specdec
from specdec import GenerationConfig, SpecdecError
from specdec.cli import main
from specdec.devices import PROFILES, DeviceProfile, get_profile
from specdec.devices import detect as det
from specdec.devices.memory import (GiB, MiB, SMOLLM2_135M, KVShape, WeightPart, estimate_params,
                                    estimate_weight_bytes, kv_bytes_per_token, plan_for_model, plan_kv)
from specdec.devices.setup import check_provider, device_setup, plan_for_bundle
from specdec.runtime import decoder as decoder_mod
from specdec.runtime.greedy_path import GRAPH, LOGITS, OnePath
from specdec.runtime import trt_engines as trt
from specdec.runtime.decoder import MAX_STEP, Decoder, logits_on_device
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import ModelConfig, read_manifest
from specdec.runtime.session import RuntimeOptions, provider_list

CPU = ["CPUExecutionProvider"]
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TRT = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
HAS_TRT = "TensorrtExecutionProvider" in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="onnxruntime has no CUDAExecutionProvider here")
needs_trt = pytest.mark.skipif(not HAS_TRT, reason="onnxruntime has no TensorrtExecutionProvider here")

SMOL_KV = 46_080  # 30 layers x 2 x 3 kv heads x 64 head_dim x 4 B
# Llama-3.1-8B's shape: large enough that the budgets matter.
LLAMA_8B = ModelConfig(model_type="llama", n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                       intermediate_size=14336, vocab_size=128256, max_position=131072, rms_eps=1e-5,
                       tie_embeddings=False)


def run_cli(*args, input: str | None = None):
    result = CliRunner().invoke(main, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def one_error(outcome, *needles: str) -> str:
    code, out, err = outcome
    assert code != 0, (out, err)
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert all(line.startswith("- ") for line in lines[:-1]), err
    for needle in needles:
        assert needle.lower() in errors[0].lower(), (needle, errors[0])
    return errors[0]


# ----------------------------------------------------------------------------------------------- arithmetic

def test_kv_bytes_per_token_smollm2():
    assert kv_bytes_per_token(30, 3, 64, "fp32") == SMOL_KV == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_token(30, 3, 64, "fp16") == SMOL_KV // 2
    assert kv_bytes_per_token(30, 3, 64, "fp32", batch=4) == 4 * SMOL_KV
    shape = KVShape("target", 30, 3, 64)
    assert shape.bytes_per_token == SMOL_KV
    assert shape.formula() == "30 layers x 2 (K,V) x 3 kv heads x 64 head_dim x 4 B (fp32)"
    with pytest.raises(ValueError):
        kv_bytes_per_token(30, 3, 64, "fp8")
    with pytest.raises(ValueError):
        kv_bytes_per_token(0, 3, 64)


def test_parameter_estimate_matches_the_real_bundle():
    matmul, emb = estimate_params(SMOLLM2_135M)
    assert abs(matmul + emb - 134.5e6) < 0.1e6  # FACTS: 134.5 M parameters
    fp32 = estimate_weight_bytes(SMOLLM2_135M, "fp32").nbytes
    assert fp32 == (matmul + emb) * 4
    # The exported default bundle: target.onnx(.data) 540.2 MB fp32, draft int8 266.9 MB.
    assert abs(fp32 - 540.2e6) / 540.2e6 < 0.01
    assert abs(estimate_weight_bytes(SMOLLM2_135M, "int8").nbytes - 266.9e6) / 266.9e6 < 0.02
    assert estimate_weight_bytes(SMOLLM2_135M, "int4").nbytes < estimate_weight_bytes(SMOLLM2_135M, "int8").nbytes


def _parts(weights=100 * MiB, workspace=50 * MiB):
    return [WeightPart("target", weights, "test")], workspace, [KVShape("target", 30, 3, 64)]


def test_budget_that_fits_exactly():
    w, ws, kv = _parts()
    budget = 100 * MiB + 50 * MiB + 512 * SMOL_KV
    plan = plan_kv(budget, w, ws, kv, max_position=8192)
    assert plan.kv_len == 512 and plan.unused == 0 and plan.room == 512 * SMOL_KV
    assert plan_kv(budget - 1, w, ws, kv, 8192).kv_len == 256  # one byte short: down to the next multiple of 256
    assert plan_kv(budget + 255 * SMOL_KV, w, ws, kv, 8192).kv_len == 512
    assert plan_kv(budget, w, ws, kv, 8192, requested_len=512).kv_len == 512  # asked for exactly what fits


def test_kv_length_capped_at_model_positions():
    w, ws, kv = _parts()
    plan = plan_kv(64 * GiB, w, ws, kv, max_position=8192)
    assert plan.kv_len == 8192 and "8,192 positions" in plan.kv_len_how
    assert plan_kv(64 * GiB, w, ws, kv, max_position=300).kv_len == 300  # a cap below one multiple


def test_breakdown_shows_the_arithmetic():
    w, ws, kv = _parts()
    plan = plan_kv(512 * MiB, w, ws, kv + [KVShape("draft", 30, 3, 64)], 8192)
    text = plan.breakdown()
    assert plan.room == 362 * MiB
    assert plan.kv_len == 4096 == (plan.room // (2 * SMOL_KV)) // 256 * 256  # 4,118 fit
    for needle in ("budget", "- weights", "- workspace", "= room for KV", "46,080 B", "92,160 B",
                   "30 layers x 2 (K,V) x 3 kv heads x 64 head_dim x 4 B (fp32)", "4,096", "4,118 fit", "512.0 MiB", "362.0 MiB"):
        assert needle in text, (needle, text)


def test_budget_too_small_for_the_weights():
    w, ws, kv = _parts(weights=3 * GiB, workspace=1 * GiB)
    with pytest.raises(SpecdecError) as e:
        plan_kv(3 * GiB + 512 * MiB, w, ws, kv, 8192)
    msg = str(e.value)
    assert "512.0 MiB missing" in msg and "lower precision" in msg and "profile" in msg


def test_budget_too_small_for_256_tokens():
    w, ws, kv = _parts()
    room = 100 * SMOL_KV
    with pytest.raises(SpecdecError) as e:
        plan_kv(150 * MiB + room, w, ws, kv, 8192)
    msg = str(e.value)
    assert "256 tokens" in msg and "room for 100 tokens" in msg
    assert f"{(256 - 100) * SMOL_KV / MiB:.1f} MiB missing" in msg


def test_requested_kv_length_that_does_not_fit():
    w, ws, kv = _parts()
    budget = 150 * MiB + 1000 * SMOL_KV  # 1000 tokens fit: 768 after rounding
    with pytest.raises(SpecdecError) as e:
        plan_kv(budget, w, ws, kv, 8192, requested_len=2048)
    msg = str(e.value)
    assert "not enough memory for KV length 2048" in msg and "missing" in msg
    assert f"{1048 * SMOL_KV / MiB:.1f} MiB missing" in msg
    assert "--max-len 768 or less" in msg and "lower precision" in msg
    with pytest.raises(SpecdecError, match="exceeds the model's 8192 positions"):
        plan_kv(64 * GiB, w, ws, kv, 8192, requested_len=10_000)


# ----------------------------------------------------------------------------------------------- profiles

def test_registry_has_the_named_profiles():
    assert {"cpu", "rtx-laptop-8gb", "rtx-desktop-24gb", "orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb"} <= set(PROFILES)
    for p in PROFILES.values():
        assert p.notes, f"{p.name} gives no reasons for its numbers"
        if p.shared_memory:
            assert any("budget" in n for n in p.notes)


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_validates_and_sizes_kv_for_smollm2(name):
    p = get_profile(name)
    again = dataclasses.replace(p)  # runs __post_init__'s checks again
    assert again.providers == p.providers
    assert p.providers[-1] == "cpu"
    memory = 16 * GiB if p.budget is None else None  # a fractional budget needs detected memory
    budget = p.budget_bytes(memory)
    plan = plan_for_model(SMOLLM2_135M, p.precision, budget, p.workspace, draft=True)
    target_kv = SMOL_KV // 2 if p.precision == "fp16" else SMOL_KV  # only fp16 graphs keep fp16 K/V
    assert plan.kv_bytes_per_token == target_kv + SMOL_KV  # + the int8 self-draft's fp32 K/V
    assert plan.kv_len == 8192  # a 135M model fits everywhere: the positions cap it
    assert plan.weight_bytes + p.workspace + plan.kv_bytes <= budget
    provider_list(RuntimeOptions(provider=p.provider, cuda_options=dict(p.cuda_options),
                                 trt_options=dict(p.trt_options)), available=TRT)


def test_an_8b_model_on_the_profiles():
    # Llama-3.1-8B's shape in fp16: ~15 GiB of weights, 128 KiB of KV per token (32 x 2 x 8 x 128 x 2 B).
    assert kv_bytes_per_token(32, 8, 128, "fp16") == 128 * 1024
    laptop, desktop, agx, nano = (get_profile(n) for n in ("rtx-laptop-8gb", "rtx-desktop-24gb", "agx-orin-64gb",
                                                           "orin-nano-8gb"))
    with pytest.raises(SpecdecError, match="missing before any KV"):
        plan_for_model(LLAMA_8B, "fp16", laptop.budget, laptop.workspace)
    with pytest.raises(SpecdecError, match="missing before any KV"):
        plan_for_model(LLAMA_8B, "int4", nano.budget, nano.workspace)  # 4.9 GiB of int4 weights > 4.5 GiB
    plan = plan_for_model(LLAMA_8B, "fp16", desktop.budget, desktop.workspace)
    assert abs(plan.weight_bytes / GiB - 14.96) < 0.05
    assert plan.kv_len == plan.room // (128 * 1024) // 256 * 256 == 33_024 < LLAMA_8B.max_position  # 33,115 fit; not capped
    assert plan_for_model(LLAMA_8B, "fp16", agx.budget, agx.workspace).kv_len == LLAMA_8B.max_position


@pytest.mark.parametrize("change,needle", [
    ({"providers": ("rocm", "cpu")}, "unknown provider"),
    ({"providers": ("cuda",)}, "end with cpu"),
    ({"providers": ("tensorrt", "cpu")}, "needs cuda after it"),
    ({"providers": ("cpu",), "precision": "fp16"}, "slower than fp32"),
    ({"precision": "fp8"}, "precision"),
    ({"budget_fraction": 0.5}, "exactly one"),
    ({"budget": 9 * GiB}, "exceeds the memory"),
    ({"workspace": 7 * GiB}, "below the budget"),
    ({"draft_len": 9}, "draft_len"),
    ({"draft_len": "long"}, "draft_len"),
    ({"max_draft_len": 64}, "max_draft_len"),
    ({"trt_options": {"trt_warp_speed": True}}, "unknown TensorRT option"),
    ({"cuda_options": {"fast": 1}}, "unknown CUDA option"),
    ({"providers": ("tensorrt", "cuda", "cpu"), "trt_options": {"trt_max_workspace_size": 2 * GiB}}, "workspace reserve"),
    ({"name": "RTX Laptop"}, "lowercase"),
])
def test_profile_validation(change, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(get_profile("rtx-laptop-8gb"), **change)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(SpecdecError) as e:
        get_profile("rtx-5090")
    assert all(name in str(e.value) for name in PROFILES)


def test_fractional_budget_needs_detected_memory():
    cpu = get_profile("cpu")
    assert cpu.budget_bytes(8 * GiB) == 4 * GiB
    with pytest.raises(SpecdecError, match="--max-len"):
        cpu.budget_bytes(None)


# ----------------------------------------------------------------------------------------------- detection

MEMINFO = "MemTotal:       {kb} kB\nMemFree:         1000 kB\n"


def fake(*, providers=CPU, smi=None, tegra=None, model=None, ram_gib=None):
    meminfo = MEMINFO.format(kb=int(ram_gib * (1 << 20))) if ram_gib else None
    return det.detect(providers=providers, nvidia_smi=smi, tegra_release=tegra, device_tree_model=model,
                      meminfo=meminfo)


def test_detect_plain_cpu_machine():
    d = fake(ram_gib=23.5)
    assert d.suggested == "cpu" and not d.gpus and not d.is_jetson
    assert d.ram_bytes == int(23.5 * (1 << 20)) * 1024
    assert d.memory_for(get_profile("cpu")) == d.ram_bytes
    assert "suggested profile: cpu" in d.summary()


@pytest.mark.parametrize("smi,expected", [
    ("NVIDIA GeForce RTX 4060 Laptop GPU, 8188\n", "rtx-laptop-8gb"),
    ("NVIDIA GeForce RTX 4090, 24564\n", "rtx-desktop-24gb"),
    ("NVIDIA GeForce RTX 3090, 24576\nNVIDIA GeForce RTX 3090, 24576\n", "rtx-desktop-24gb"),
    ("NVIDIA H200, 143771\n", "nvidia-gpu"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU, 16376\n", "nvidia-gpu"),
])
def test_detect_nvidia_gpus(smi, expected):
    d = fake(providers=CUDA, smi=smi, ram_gib=31)
    assert d.suggested == expected, d.reasons
    assert d.gpus[0].memory_bytes == int(smi.split(",")[1].split()[0]) * MiB
    if expected == "nvidia-gpu":
        assert d.memory_for(get_profile("nvidia-gpu")) == d.gpus[0].memory_bytes


def test_detect_gpu_without_onnxruntime_gpu_suggests_cpu():
    d = fake(providers=CPU, smi="NVIDIA GeForce RTX 4060 Laptop GPU, 8188\n")
    assert d.suggested == "cpu"
    assert any("onnxruntime-gpu" in r and "rtx-laptop-8gb" in r for r in d.reasons)


def test_detect_cuda_provider_without_nvidia_smi():
    d = fake(providers=CUDA)
    assert d.suggested == "nvidia-gpu" and any("--max-len" in r for r in d.reasons)
    assert d.memory_for(get_profile("nvidia-gpu")) is None


TEGRA = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"


@pytest.mark.parametrize("model,ram,providers,expected", [
    ("NVIDIA Jetson Orin Nano Developer Kit\x00", 7.4, CUDA, "orin-nano-8gb"),
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00", 7.4, CUDA, "orin-nano-8gb"),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit\x00", 15.3, TRT, "orin-nx-16gb"),
    ("NVIDIA Jetson AGX Orin Developer Kit\x00", 61.4, TRT, "agx-orin-64gb"),
    ("NVIDIA Jetson AGX Orin Developer Kit\x00", 29.8, TRT, "orin-nx-16gb"),  # the 32 GB module
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit\x00", 7.4, CUDA, "orin-nano-8gb"),  # NX 8GB
    (None, 15.3, CUDA, "orin-nx-16gb"),  # release file only: chosen by RAM
    ("NVIDIA Jetson Orin Nano Developer Kit\x00", 7.4, CPU, "cpu"),  # no CUDA build of onnxruntime
])
def test_detect_jetson(model, ram, providers, expected):
    d = fake(providers=providers, tegra=TEGRA, model=model, ram_gib=ram, smi="Orin (nvgpu), [N/A]\n")
    assert d.is_jetson and d.l4t_release == "R36.4.3"
    assert d.suggested == expected, d.reasons
    assert d.memory_for(get_profile("orin-nano-8gb")) == d.ram_bytes  # shared memory: the board's RAM
    assert d.gpus[0].memory_bytes is None


def test_detect_jetson_without_tensorrt_says_use_cuda():
    d = fake(providers=CUDA, tegra=TEGRA, model="NVIDIA Jetson AGX Orin Developer Kit", ram_gib=61.4)
    assert d.suggested == "agx-orin-64gb"
    assert any("--provider cuda" in r for r in d.reasons)


def test_parsers_on_odd_input():
    assert det.parse_nvidia_smi("") == () and det.parse_nvidia_smi(None) == ()
    assert det.parse_nvidia_smi("NVIDIA A100-SXM4-80GB, 81920\n\n") == (det.GpuInfo("NVIDIA A100-SXM4-80GB", 80 * GiB),)
    assert det.parse_nvidia_smi("Tesla, Inc. GPU, 1024") == (det.GpuInfo("Tesla, Inc. GPU", 1024 * MiB),)
    assert det.parse_meminfo("garbage") is None and det.parse_meminfo(None) is None
    assert det.parse_l4t_release("not a release file") is None
    assert det.parse_device_tree_model("Raspberry Pi 5 Model B Rev 1.0\x00") is None
    d = fake(tegra="unexpected format\n", ram_gib=7.4)  # the file exists: a Jetson all the same
    assert d.is_jetson and d.l4t_release == "unknown"


def test_nvidia_smi_through_a_fake_executable(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 4090, 24564'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert det.parse_nvidia_smi(det.read_nvidia_smi()) == (det.GpuInfo("NVIDIA GeForce RTX 4090", 24564 * MiB),)
    exe.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert det.read_nvidia_smi() is None
    exe.write_text("#!/bin/sh\nsleep 5\n")
    assert det.read_nvidia_smi(timeout=0.2) is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert det.read_nvidia_smi() is None


def test_detect_this_machine_does_not_fail():
    d = det.detect()
    assert d.suggested in PROFILES and d.providers
    if not HAS_CUDA:
        assert d.suggested == "cpu"


# ----------------------------------------------------------------------------------------------- provider selection

def test_gpu_profile_on_a_cpu_machine_says_cuda_and_suggests_cpu(tiny_bundle):
    with pytest.raises(SpecdecError) as e:
        device_setup("rtx-laptop-8gb", tiny_bundle, available=CPU)
    msg = str(e.value)
    assert "rtx-laptop-8gb" in msg and "CUDA" in msg and "--device cpu" in msg
    with pytest.raises(SpecdecError) as e:
        device_setup("orin-nx-16gb", tiny_bundle, available=CUDA)  # CUDA but no TensorRT
    assert "TensorRT" in str(e.value) and "--provider cuda" in str(e.value)
    with pytest.raises(SpecdecError, match="--provider cpu"):
        check_provider("cuda", CPU)  # an explicit --provider: the runtime's own hint


def test_profile_to_runtime_options(tiny_bundle):
    s = device_setup("cpu", tiny_bundle, available=CPU)
    assert s.runtime.provider == "cpu" and s.max_len == 512 and s.draft_len == 4  # tiny model: 512 positions
    assert s.plan.kv_bytes_per_token == 2 * 2 * 2 * 2 * 16 * 4  # target + draft: 2 layers, 2 kv heads, head_dim 16

    s = device_setup("rtx-laptop-8gb", tiny_bundle, available=CUDA)
    assert s.runtime.provider == "cuda" and s.runtime.device == "cuda" and s.draft_len == "auto"
    assert provider_list(s.runtime, available=CUDA)[0] == (
        "CUDAExecutionProvider", {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"})

    s = device_setup("orin-nx-16gb", tiny_bundle, available=TRT)
    trt_name, trt = provider_list(s.runtime, available=TRT)[0]
    assert trt_name == "TensorrtExecutionProvider"
    assert trt["trt_engine_cache_path"] == str(Path(tiny_bundle) / "trt_cache")
    assert trt["trt_max_workspace_size"] == 1 * GiB and trt["trt_fp16_enable"] is True

    s = device_setup("orin-nx-16gb", tiny_bundle, provider="cpu", max_len=300, available=CPU)  # explicit flags win
    assert s.runtime.provider == "cpu" and s.max_len == 300 and s.plan.kv_len == 300


def test_explicit_kv_length_beyond_the_budget(tiny_bundle):
    manifest = read_manifest(tiny_bundle, verify_checksums=False)
    weights = sum((tiny_bundle / f).stat().st_size for f in manifest.files if f.endswith((".onnx", ".data")))
    per_token = 1024  # target + draft of the tiny model
    small = DeviceProfile(name="small", description="test", providers=("cpu",), precision="fp32",
                          budget=weights + 1 * MiB + 300 * per_token, workspace=1 * MiB)
    assert plan_for_bundle(small, tiny_bundle, manifest).kv_len == 256
    with pytest.raises(SpecdecError) as e:
        plan_for_bundle(small, tiny_bundle, manifest, requested_len=512)
    assert "not enough memory for KV length 512" in str(e.value) and "--max-len 256 or less" in str(e.value)


def test_fractional_budget_with_unknown_memory_takes_an_explicit_length(tiny_bundle):
    unknown = fake(providers=CPU)  # no meminfo
    s = device_setup("cpu", tiny_bundle, max_len=128, available=CPU, detected=unknown)
    assert s.max_len == 128 and s.plan is None
    with pytest.raises(SpecdecError, match="could not be read"):
        device_setup("cpu", tiny_bundle, available=CPU, detected=unknown)


# ----------------------------------------------------------------------------------------------- CLI

@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_cli_gpu_profile_without_cuda(tiny_bundle):
    one_error(run_cli("generate", tiny_bundle, "hi", "--device", "rtx-laptop-8gb"), "CUDA", "--device cpu")
    one_error(run_cli("chat", tiny_bundle, "--device", "orin-nano-8gb", input="hi\n"), "CUDA", "--device cpu")


def test_cli_unknown_profile(tiny_bundle):
    line = one_error(run_cli("generate", tiny_bundle, "hi", "--device", "rtx-9090"), "rtx-9090")
    assert all(name in line for name in PROFILES)


def test_cli_generate_with_cpu_profile(tiny_bundle):
    code, out, err = run_cli("generate", tiny_bundle, "the quick brown fox", "--max-new-tokens", 8, "--device", "cpu")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("- device cpu: provider cpu, KV 512 tokens") and "tok/s" in lines[1], err
    plain = run_cli("generate", tiny_bundle, "the quick brown fox", "--max-new-tokens", 8)[1]
    assert out == plain  # the profile changes where and how long, not what


def test_cli_explicit_max_len_beyond_positions_with_profile(tiny_bundle):
    one_error(run_cli("generate", tiny_bundle, "hi", "--device", "cpu", "--max-len", 100000), "100000", "512")


def test_cli_devices(tiny_bundle):
    code, out, err = run_cli("devices")
    assert code == 0, err
    for name in PROFILES:
        assert name in out
    assert "This machine:" in out and "suggested profile:" in out
    code, out, err = run_cli("devices", "--bundle", tiny_bundle, "--notes")
    assert code == 0, err
    assert "= room for KV" in out and "2 layers x 2 (K,V) x 2 kv heads x 16 head_dim x 4 B (fp32)" in out
    assert "orin-nano-8gb: KV length 512" in out and "L4T/Ubuntu" in out
    one_error(run_cli("devices", "--bundle", tiny_bundle / "missing"), "does not exist")


# ----------------------------------------------------------------------------------------------- the device logits path

def _decoder(bundle, graph="target", device_logits=None, max_len=256, opts=None, dtype=np.float32):
    m = read_manifest(bundle, verify_checksums=False)
    g = m.graphs[graph]
    opts = opts or RuntimeOptions()
    kv = KVCache(g.model.n_layers, 1, g.model.n_kv_heads, max_len, g.model.head_dim, device=opts.device,
                 device_id=opts.device_id, dtype=dtype)
    return Decoder(bundle / g.file, g, g.model, kv, opts, device_logits=device_logits)


def test_logits_placement_follows_the_provider():
    assert logits_on_device(RuntimeOptions()) is False
    assert logits_on_device(RuntimeOptions(provider="cuda")) is True
    assert logits_on_device(RuntimeOptions(provider="tensorrt")) is True


def test_cpu_path_is_unchanged(tiny_bundle):
    d = _decoder(tiny_bundle)
    assert d.device_logits is False and d._logits is not None
    out = d.forward(np.array([[1, 2, 3]]))
    assert np.shares_memory(out, d._logits)  # written in place by the graph: no copy on the CPU


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_device_logits_path_matches_the_host_path(tiny_bundle, graph):
    """The GPU branch (logits slab bound by address, rows copied back) run with device 'cpu'."""
    host, dev = _decoder(tiny_bundle, graph), _decoder(tiny_bundle, graph, device_logits=True)
    assert dev.device_logits and dev._logits is None
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, host.model.vocab_size, size=(1, 2 * MAX_STEP + 7))  # three chunks
    assert np.array_equal(host.prefill(prompt), dev.prefill(prompt))
    for T in (1, 5, 9):
        step = rng.integers(3, host.model.vocab_size, size=(1, T))
        a, b = host.forward(step).copy(), dev.forward(step)
        assert b.shape == (1, T, host.model.vocab_size) and np.array_equal(a, b)
        host.kv.advance(T)
        dev.kv.advance(T)


@pytest.mark.parametrize("device_logits", [False, True])
def test_greedy_choices_come_from_the_graph_argmax(tiny_bundle, device_logits):
    """The target graph's `argmax` output (bound to host memory even when the logits stay on the device) is the
    logits' argmax at every position; a graph without it (the draft graph) gives the same from its logits."""
    target = _decoder(tiny_bundle, "target", device_logits=device_logits)
    draft = _decoder(tiny_bundle, "draft", device_logits=device_logits)
    assert target.spec.has_argmax and not draft.spec.has_argmax
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, target.model.vocab_size, size=(1, 20))
    target.prefill(prompt)
    draft.prefill(prompt)
    for T in (1, 5, 9):
        step = rng.integers(3, target.model.vocab_size, size=(1, T))
        # The target's own argmax output, and its choices read from (device) logits (greedy_path.py's other way).
        for dec, path in ((target, GRAPH), (target, LOGITS), (draft, None)):
            if path is not None:
                dec.greedy_paths = OnePath(path)
            choices = dec.forward_choices(step).copy()  # [1, T]
            assert choices.shape == (1, T) and choices.dtype == np.int64
            np.testing.assert_array_equal(choices, np.argmax(dec.forward(step), axis=-1))
        target.kv.advance(T)
        draft.kv.advance(T)


@pytest.mark.parametrize("device_logits", [False, True])
def test_prefill_computes_only_the_last_rows_logits(tiny_bundle, device_logits):
    """A target graph with `logits_rows` gives prefill's last logits from that row alone (the LM head runs on one
    row per chunk, so its chunks are PREFILL_CHUNK wide); they match the last row of steps that compute every row
    (MAX_STEP wide), and the draft graph (without the input) keeps MAX_STEP chunks."""
    from specdec.runtime.decoder import PREFILL_CHUNK

    n = PREFILL_CHUNK + 9  # two chunks
    target = _decoder(tiny_bundle, "target", device_logits=device_logits, max_len=n)
    full = _decoder(tiny_bundle, "target", max_len=n)
    assert target.spec.has_logits_rows and target.max_step == PREFILL_CHUNK
    assert _decoder(tiny_bundle, "draft").max_step == MAX_STEP
    prompt = np.random.default_rng(2).integers(3, target.model.vocab_size, size=(1, n))
    last = target.prefill(prompt)  # [1, vocab]
    for start in range(0, n, MAX_STEP):
        reference = full.forward(prompt[:, start:start + MAX_STEP])[:, -1, :].copy()  # [1, vocab] all rows computed
        full.kv.advance(min(MAX_STEP, n - start))
    np.testing.assert_allclose(last, reference, rtol=0, atol=1e-5)
    assert np.argmax(last) == np.argmax(reference)
    assert target.kv.lengths[0] == prompt.shape[1]


def test_device_logits_rows_for_several_batch_rows(tiny_bundle):
    dev = _decoder(tiny_bundle, device_logits=True)
    V = dev.model.vocab_size
    dev._logits_dev.update_inplace(np.arange(MAX_STEP * V, dtype=np.float32))
    ref = np.arange(2 * 3 * V, dtype=np.float32).reshape(2, 3, V)  # as if a [2,3,V] step had written the slab
    assert np.array_equal(dev._read_logits(2, 3), ref)
    assert np.array_equal(dev._read_logits(2, 3, first=1), ref[:, 1:, :])
    assert np.array_equal(dev._read_logits(2, 3, first=2), ref[:, 2:, :])


def test_engine_on_the_device_path_is_token_identical(tiny_bundle, monkeypatch):
    cfgs = [GenerationConfig(max_new_tokens=24, draft_len=0), GenerationConfig(max_new_tokens=24, draft_len=4)]
    ref = specdec.load(tiny_bundle, drafter="model")
    want = [ref.generate("the quick brown fox", c).token_ids for c in cfgs]
    monkeypatch.setattr(decoder_mod, "logits_on_device", lambda opts: True)
    dev = specdec.load(tiny_bundle, drafter="model")
    assert dev.target.device_logits and dev.drafter.decoder.device_logits
    assert [dev.generate("the quick brown fox", c).token_ids for c in cfgs] == want == [want[0], want[0]]


def test_kv_dtype_must_match_the_graph(tiny_bundle):
    with pytest.raises(ValueError, match="float32"):
        _decoder(tiny_bundle, dtype=np.float16)
    kv16 = KVCache(2, 1, 2, 256, 16, dtype=np.float16)
    assert kv16.nbytes == KVCache(2, 1, 2, 256, 16).nbytes // 2 == 2 * 2 * 2 * 256 * 16 * 2


# ----------------------------------------------------------------------------------------------- real GPUs (skipped here)

@needs_cuda
def test_cuda_decoder_keeps_kv_and_logits_on_the_device(tiny_bundle):
    cpu = _decoder(tiny_bundle)
    gpu = _decoder(tiny_bundle, opts=RuntimeOptions(provider="cuda"))
    assert gpu.device_logits and gpu.kv.slab is None
    assert gpu.kv.values[0][0].device_name().lower() == "cuda"
    assert gpu._logits_dev.device_name().lower() == "cuda"
    prompt = np.random.default_rng(1).integers(3, cpu.model.vocab_size, size=(1, 70))
    np.testing.assert_allclose(gpu.prefill(prompt), cpu.prefill(prompt), atol=2e-3, rtol=1e-3)
    step = np.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(gpu.forward(step), cpu.forward(step), atol=2e-3, rtol=1e-3)


@needs_cuda
def test_cuda_greedy_speculation_is_token_identical(tiny_bundle):
    e = specdec.load(tiny_bundle, drafter="model", runtime=RuntimeOptions(provider="cuda"))
    plain = e.generate("the quick brown fox", GenerationConfig(max_new_tokens=32, draft_len=0))
    spec = e.generate("the quick brown fox", GenerationConfig(max_new_tokens=32, draft_len=4))
    assert spec.token_ids == plain.token_ids and spec.stats.target_forwards < plain.stats.target_forwards


@needs_cuda
def test_cuda_profile_through_the_cli(tiny_bundle):
    code, out, err = run_cli("generate", tiny_bundle, "the quick brown fox", "--max-new-tokens", 8,
                             "--device", "nvidia-gpu", "--max-len", 256)
    assert code == 0, err
    assert "provider cuda" in err


@needs_trt
def test_tensorrt_runs_and_caches_engines_in_the_bundle(tiny_bundle, tmp_path):
    import shutil

    bundle = shutil.copytree(tiny_bundle, tmp_path / "b")
    s = device_setup("orin-nx-16gb", bundle)
    e = specdec.load(bundle, max_len=s.max_len, runtime=s.runtime, drafter="none")
    g = e.generate("the quick brown fox", GenerationConfig(max_new_tokens=8, draft_len=0))
    assert g.token_ids and (bundle / "trt_cache").is_dir()


def test_devices_package_stays_off_torch():
    code = ("import sys, specdec.devices.setup, specdec.devices.report; "
            "bad=[m for m in ('torch','transformers','optimum','specdec.export','specdec.quant') if m in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------- bench/gpu_check.sh

GPU_CHECK = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.sh"


def _gpu_check(**env):
    env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_gpu_check_fails_fast_without_cuda():
    proc = _gpu_check()
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "onnxruntime-gpu" in proc.stderr
    assert proc.stdout == ""


def test_gpu_check_dry_run_on_cpu(tiny_bundle):
    """The script's own logic (decode, identity check, table) with its 'cuda' rows on the CPU provider."""
    proc = _gpu_check(DRY_RUN_ON_CPU="1", BUNDLE=str(tiny_bundle))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("cuda ")]
    assert [r[1] for r in rows] == ["plain", "model:4", "ngram:4"]
    assert rows[1][-1] == "yes" and rows[2][-1] == "yes" and float(rows[1][3]) > 1.5  # identical; tau of the self-draft
    assert "tensorrt" in proc.stdout and "DRY RUN" in proc.stderr


# ----------------------------------------------------------------------------------------------- TensorRT engine records


RTX4090 = trt.EngineBuilder("NVIDIA GeForce RTX 4090", "8.9", "10.3.0", "1.32.0")
ORIN = trt.EngineBuilder("Orin", "8.7", "10.3.0", "1.32.0")


@pytest.fixture
def fake_gpu(monkeypatch):
    """This machine as an RTX 4090 with TensorRT 10.3.0; tests change the returned values to move it."""
    machine = {"gpu": ("NVIDIA GeForce RTX 4090", "8.9"), "trt": "10.3.0"}
    monkeypatch.setattr(trt, "read_gpu", lambda device_id=0: machine["gpu"])
    monkeypatch.setattr(trt, "read_tensorrt_version", lambda: machine["trt"])
    monkeypatch.setattr(trt, "read_onnxruntime_version", lambda: "1.32.0")
    return machine


def _fake_graph(tmp_path, weights=b"weights v1") -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "target.onnx").write_bytes(b"graph")
    (bundle / "target.onnx.data").write_bytes(weights)
    return bundle / "target.onnx"


def test_engine_record_validates_and_round_trips():
    rec = trt.EngineCacheRecord(RTX4090, {"target.onnx": "a" * 64, "draft.onnx": "b" * 64}, created_by="specdec x")
    back = trt.EngineCacheRecord.from_dict(json.loads(rec.to_json()))
    assert back == rec and list(json.loads(rec.to_json())["graphs"]) == ["draft.onnx", "target.onnx"]
    with pytest.raises(TypeError):
        rec.graphs["x"] = "c" * 64  # frozen all the way down
    for bad, needle in [(dict(compute_capability="sm89"), "compute_capability"), (dict(gpu_name=" "), "gpu_name"),
                        (dict(tensorrt_version="ten"), "tensorrt_version")]:
        with pytest.raises(ValueError, match=needle):
            dataclasses.replace(RTX4090, **bad)
    with pytest.raises(ValueError, match="sha256"):
        trt.EngineCacheRecord(RTX4090, {"target.onnx": "xyz"})
    with pytest.raises(ValueError, match="not be empty"):
        trt.EngineCacheRecord(RTX4090, {})
    with pytest.raises(ValueError, match="unknown field"):
        trt.EngineCacheRecord.from_dict({**json.loads(rec.to_json()), "extra": 1})
    assert ORIN.mismatches(RTX4090) == ["GPU NVIDIA GeForce RTX 4090 here, Orin in the record",
                                        "compute capability 8.9 here, 8.7 in the record"]
    assert not RTX4090.mismatches(dataclasses.replace(RTX4090, onnxruntime_version="1.33.0"))  # recorded only


def test_machine_readers_parse_and_fail_soft():
    assert trt.tensorrt_version_from_int(100300) == "10.3.0"  # TensorRT 10: major*10000 + minor*100 + patch
    assert trt.tensorrt_version_from_int(8601) == "8.6.1"  # TensorRT 8: major*1000 + minor*100 + patch
    assert trt.parse_nvidia_smi_gpu("NVIDIA GeForce RTX 4090, 8.9\n") == ("NVIDIA GeForce RTX 4090", "8.9")
    assert trt.parse_nvidia_smi_gpu("Orin, [N/A]") is None and trt.parse_nvidia_smi_gpu(None) is None
    if not HAS_CUDA:  # this machine: no driver, no TensorRT; None, never an exception
        assert trt.read_gpu() is None


def test_current_builder_says_what_is_missing(fake_gpu):
    assert trt.current_builder() == RTX4090
    fake_gpu["trt"] = None
    with pytest.raises(SpecdecError, match="TensorRT is not installed"):
        trt.current_builder()
    fake_gpu["gpu"] = None
    with pytest.raises(SpecdecError, match="no NVIDIA GPU 0 found"):
        trt.current_builder()


def test_first_claim_records_the_device_and_graph(tmp_path, fake_gpu):
    graph = _fake_graph(tmp_path)
    cache = graph.parent / "trt_cache"
    rec = trt.claim_engine_cache(cache, graph)
    assert rec.builder == RTX4090 and rec.graphs == {"target.onnx": trt.graph_digest(graph)}
    assert trt.read_engine_record(cache) == rec
    on_disk = json.loads((cache / "engines.json").read_text())
    assert on_disk["builder"] == {"gpu_name": "NVIDIA GeForce RTX 4090", "compute_capability": "8.9",
                                  "tensorrt_version": "10.3.0", "onnxruntime_version": "1.32.0"}
    assert trt.claim_engine_cache(cache, graph) == rec  # same machine, same graph: nothing to do
    (graph.parent / "draft").mkdir()
    draft = graph.parent / "draft" / "draft.onnx"
    draft.write_bytes(b"draft graph")
    assert set(trt.claim_engine_cache(cache, draft).graphs) == {"target.onnx", "draft/draft.onnx"}


@pytest.mark.parametrize("move,needle", [
    (lambda m: m.update(gpu=("NVIDIA GeForce RTX 3090", "8.6")), "GPU NVIDIA GeForce RTX 3090 here"),
    (lambda m: m.update(gpu=("NVIDIA GeForce RTX 4090", "9.0")), "compute capability 9.0 here, 8.9 in the record"),
    (lambda m: m.update(trt="10.4.0"), "TensorRT 10.4.0 here, 10.3.0 in the record"),
])
def test_engines_of_another_device_are_one_error_with_a_rebuild_hint(tmp_path, fake_gpu, move, needle):
    graph = _fake_graph(tmp_path)
    cache = graph.parent / "trt_cache"
    trt.claim_engine_cache(cache, graph)
    move(fake_gpu)
    with pytest.raises(SpecdecError) as e:
        trt.claim_engine_cache(cache, graph)
    msg = str(e.value)
    assert needle in msg and "were built for NVIDIA GeForce RTX 4090" in msg
    assert f"delete {cache}" in msg and f"specdec build-engines {graph.parent} --rebuild" in msg


def test_engines_of_another_graph_version_are_refused(tmp_path, fake_gpu):
    graph = _fake_graph(tmp_path)
    cache = graph.parent / "trt_cache"
    trt.claim_engine_cache(cache, graph)
    (graph.parent / "target.onnx.data").write_bytes(b"weights v2")  # same graph file, new weights
    with pytest.raises(SpecdecError, match="built from another target.onnx"):
        trt.claim_engine_cache(cache, graph)


def test_engines_without_a_record_or_with_a_corrupt_one_are_refused(tmp_path, fake_gpu):
    graph = _fake_graph(tmp_path)
    cache = graph.parent / "trt_cache"
    cache.mkdir()
    (cache / "TensorrtExecutionProvider_TRTKernel_graph_1_0_sm89.engine").write_bytes(b"?")
    with pytest.raises(SpecdecError, match="holds engines .* but no engines.json"):
        trt.claim_engine_cache(cache, graph)
    (cache / "engines.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="engines.json is invalid"):
        trt.claim_engine_cache(cache, graph)


def test_a_tensorrt_decoder_checks_the_record_before_its_session(tiny_bundle, tmp_path, fake_gpu, monkeypatch):
    import shutil

    bundle = shutil.copytree(tiny_bundle, tmp_path / "b")
    cache = bundle / "trt_cache"
    g = read_manifest(bundle).graphs["target"]
    trt.write_engine_record(cache, trt.EngineCacheRecord(ORIN, {g.file: trt.graph_digest(bundle / g.file)}))
    sessions = []
    monkeypatch.setattr(decoder_mod, "make_session", lambda *a: sessions.append(a))
    opts = RuntimeOptions(provider="tensorrt", trt_cache_dir=str(cache))
    kv = KVCache(g.model.n_layers, 1, g.model.n_kv_heads, 64, g.model.head_dim)
    with pytest.raises(SpecdecError, match="built for Orin"):
        Decoder(bundle / g.file, g, g.model, kv, opts)
    assert sessions == []  # no session, so no engine was loaded


def test_build_engines_refuses_without_tensorrt_or_gpu(tiny_bundle, fake_gpu):
    from specdec.devices.setup import build_engines

    with pytest.raises(SpecdecError) as e:
        build_engines(tiny_bundle, available=CPU)
    assert "cannot build TensorRT engines" in str(e.value) and "onnxruntime-gpu" in str(e.value)
    with pytest.raises(SpecdecError, match="cannot build TensorRT engines"):
        build_engines(tiny_bundle, available=CUDA)
    fake_gpu["gpu"] = None
    with pytest.raises(SpecdecError, match="no NVIDIA GPU"):
        build_engines(tiny_bundle, available=TRT)
    fake_gpu["gpu"] = ("Orin", "8.7")
    with pytest.raises(SpecdecError, match="profile cpu has no GPU"):
        build_engines(tiny_bundle, device="cpu", available=TRT)
    assert not (tiny_bundle / "trt_cache").exists()


@pytest.mark.skipif(HAS_TRT, reason="this onnxruntime has TensorRT")
def test_cli_build_engines_without_tensorrt(tiny_bundle):
    one_error(run_cli("build-engines", tiny_bundle), "cannot build TensorRT engines", "TensorRT")


def test_cli_provider_tensorrt_keeps_engines_in_the_bundle(tiny_bundle):
    from specdec.cli.common import device_runtime as _device_setup

    runtime, _, _ = _device_setup(None, tiny_bundle, "tensorrt", None, 0)
    assert runtime.trt_cache_dir == str(Path(tiny_bundle) / "trt_cache")
    assert _device_setup(None, tiny_bundle, "cuda", None, 0)[0].trt_cache_dir is None


def test_engine_building_runs_the_narrowest_and_widest_steps_and_keeps_nothing(tiny_bundle):
    """TensorRT engines are built for the shapes onnxruntime sees: build-engines runs a 1-token step and a whole
    prefill chunk (256 wide for a graph computing one logits row per chunk, 64 otherwise) on each graph."""
    from specdec.devices.setup import run_every_step_width
    from specdec.runtime.decoder import PREFILL_CHUNK

    target, draft = _decoder(tiny_bundle, "target"), _decoder(tiny_bundle, "draft")
    target.prefill(np.array([[5, 6, 7]]))
    assert run_every_step_width(target) == (1, min(PREFILL_CHUNK, 256 - 3))
    assert run_every_step_width(draft) == (1, MAX_STEP)
    assert target.kv.lengths[0] == 3 and draft.kv.lengths[0] == 0
