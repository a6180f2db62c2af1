"""Hugging Face safetensors checkpoints streamed into bundles (export/hf_source.py): the same graph as the torch path,
bf16 widened exactly, checks that refuse, bounded memory, no torch in the export's process."""
from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig
from specdec.errors import SpecdecError
from specdec.export.bundle import ExportConfig, export_bundle
from specdec.export.verify import graph_logits

sys.path.insert(0, str(Path(__file__).parent))
from conftest import break_streamed_graphs, make_checkpoint  # noqa: E402

IDS = np.random.default_rng(7).integers(0, 320, size=(1, 40))  # the tiny tokenizer's 320 ids


def converted(src: Path, dst: Path, dtype: str, shards: int = 1) -> Path:
    """A copy of checkpoint `src` whose safetensors hold `dtype` ("bfloat16", "float16"; config.json says so), split
    into `shards` files with an index as save_pretrained writes them."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(dst / "model.safetensors").items()}
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for j in range(shards):
        file = f"model-{j + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[j::shards]
        save_file({k: tensors[k] for k in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def transformers_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """The checkpoint's logits [1, n, V] from transformers' own forward, in float32 (bf16 widened exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-stream")
    fp32 = make_checkpoint(root / "qwen2-fp32", seed=1, model_type="qwen2", tokenizer=tiny_tokenizer)
    llama = make_checkpoint(root / "llama-untied", seed=2, model_type="llama", tokenizer=tiny_tokenizer, tied=False)
    return {"qwen2-fp32": fp32, "qwen2-bf16": converted(fp32, root / "qwen2-bf16", "bfloat16", shards=2),
            "llama-untied-bf16": converted(llama, root / "llama-untied-bf16", "bfloat16"),
            "llama-untied-fp16": converted(llama, root / "llama-untied-fp16", "float16")}


@pytest.fixture(scope="module")
def streamed_bundle(checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-stream-bundle") / "b"
    export_bundle(checkpoints["qwen2-bf16"], out, ExportConfig(drafter="ngram", max_len=256))
    return out


def _target(bundle: Path):
    from specdec.runtime.manifest import read_manifest

    return read_manifest(bundle).graphs["target"]


@pytest.mark.parametrize("name", ["qwen2-fp32", "qwen2-bf16", "llama-untied-bf16", "llama-untied-fp16"])
def test_streamed_graph_equals_transformers_forward(checkpoints, tmp_path, name):
    """fp32, bf16 and fp16 safetensors, one file or sharded, tied and untied heads, with and without QKV biases: the
    streamed graph's logits are transformers' own, within fp32 rounding, and its check ran against the reference
    forward (the streamed path)."""
    m = export_bundle(checkpoints[name], tmp_path / "b", ExportConfig(drafter="none", max_len=128))
    spec = m.graphs["target"]
    assert spec.checks["max_abs_logit_diff_vs_reference_forward"] <= spec.checks["tolerance"]
    assert spec.model.tie_embeddings == (not name.startswith("llama-untied"))
    got = graph_logits(tmp_path / "b" / "target.onnx", spec, IDS)
    want = transformers_logits(checkpoints[name], IDS)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    if name == "llama-untied-fp16":  # an fp16 table is kept fp16 (widened after the Gather): half the bytes
        import onnx

        g = onnx.load_model(str(tmp_path / "b" / "target.onnx"), load_external_data=False)
        table = next(t for t in g.graph.initializer if t.name == "embed.weight")
        assert table.data_type == onnx.TensorProto.FLOAT16


def test_streamed_bundle_equals_the_torch_path_bundle(checkpoints, streamed_bundle, tmp_path):
    """The same checkpoint through the torch path (stream=False): the same logits, tokenizer and model config."""
    legacy = export_bundle(checkpoints["qwen2-bf16"], tmp_path / "torch", ExportConfig(drafter="ngram", max_len=256,
                                                                                         stream=False))
    assert "max_abs_logit_diff_vs_transformers" in legacy.graphs["target"].checks  # it did take the torch path
    streamed = specdec.runtime.manifest.read_manifest(streamed_bundle)
    assert streamed.tokenizer == legacy.tokenizer
    assert streamed.graphs["target"].model == legacy.graphs["target"].model
    assert streamed.graphs["target"].inputs == legacy.graphs["target"].inputs
    assert (streamed_bundle / "tokenizer.json").read_bytes() == (tmp_path / "torch" / "tokenizer.json").read_bytes()
    a = graph_logits(streamed_bundle / "target.onnx", streamed.graphs["target"], IDS)
    b = graph_logits(tmp_path / "torch" / "target.onnx", legacy.graphs["target"], IDS)
    assert np.abs(a - b).max() < 1e-4 * max(1.0, np.abs(b).max())


def test_streamed_fp16_export(checkpoints, tmp_path):
    m = export_bundle(checkpoints["qwen2-bf16"], tmp_path / "b", ExportConfig(drafter="none", precision="fp16",
                                                                               max_len=64))
    checks = m.graphs["target"].checks
    assert m.graphs["target"].precision == "fp16" and "tolerance" not in checks
    assert checks["top1_agreement_vs_reference_forward"] >= 0.9


def test_streamed_bundle_speculates_losslessly(streamed_bundle):
    plain = specdec.load(streamed_bundle, drafter="none")
    spec = specdec.load(streamed_bundle, drafter="ngram")
    for prompt in ["the quick brown fox", "hello world, this is"]:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
        got = spec.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=3))
        assert got.token_ids == want


def test_other_drafters_and_precisions_keep_the_torch_path(checkpoints, tmp_path):
    """A drafter built from the torch model (self-int8) takes the torch path, checked against transformers."""
    m = export_bundle(checkpoints["qwen2-fp32"], tmp_path / "b", ExportConfig(drafter="self-int8", precision="int8",
                                                                               max_len=64))
    assert "max_abs_logit_diff_vs_transformers" in m.graphs["target"].checks


def test_export_check_refuses_a_wrong_graph(checkpoints, tmp_path, monkeypatch):
    """One weight perturbed between writing and checking: `specdec export` prints one error line, exits non-zero and
    leaves no bundle behind."""
    from test_cli import assert_one_error, run_cli

    break_streamed_graphs(monkeypatch)
    out = tmp_path / "b"
    assert_one_error(run_cli("export", checkpoints["qwen2-bf16"], "-o", out, "--drafter", "none", "--max-len", "64"),
                     "disagrees with the reference forward")
    assert not out.exists() and not (tmp_path / "b.partial").exists()


def test_truncated_safetensors_is_one_error(checkpoints, tmp_path):
    import shutil

    bad = tmp_path / "cut"
    shutil.copytree(checkpoints["qwen2-fp32"], bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(SpecdecError) as e:
        export_bundle(bad, tmp_path / "b", ExportConfig(drafter="none", max_len=64))
    assert "truncated or corrupt" in str(e.value) + (e.value.hint or "")
    assert not (tmp_path / "b").exists()



def test_missing_shard_is_one_error(checkpoints, tmp_path):
    import shutil

    bad = tmp_path / "shards"
    shutil.copytree(checkpoints["qwen2-bf16"], bad)
    (bad / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SpecdecError) as e:
        export_bundle(bad, tmp_path / "b", ExportConfig(drafter="none", max_len=64))
    assert "lacks model-00002-of-00002.safetensors" in str(e.value)
    assert not (tmp_path / "b").exists()

NO_TORCH_SCRIPT = """
import sys
from specdec.export.bundle import ExportConfig, export_bundle
export_bundle(sys.argv[1], sys.argv[2], ExportConfig(drafter="ngram", max_len=64))
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_streamed_export_never_imports_torch(checkpoints, tmp_path):
    """The weights never pass through a framework: the export's process imports neither torch nor transformers
    (the tokenizer is converted in a child process)."""
    out = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT, str(checkpoints["qwen2-bf16"]), str(tmp_path / "b")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout


PEAK_SCRIPT = """
import sys
from pathlib import Path
if sys.argv[3] == "write":
    from specdec.export.gguf_export import write_gguf_graph
    from specdec.export.hf_source import SafetensorsSource
    Path(sys.argv[2]).mkdir()
    write_gguf_graph(SafetensorsSource(sys.argv[1]), Path(sys.argv[2]) / "target.onnx", "fp32")
else:
    from specdec.export.bundle import ExportConfig, export_bundle
    export_bundle(sys.argv[1], sys.argv[2], ExportConfig(drafter="none", max_len=64))
# VmHWM, not ru_maxrss: a child's ru_maxrss keeps its parent's size at fork across exec
print(next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM")) * 1024)
"""


def test_export_memory_is_flat_in_depth(tmp_path):
    """Peak RSS of streaming 2 and 10 layers of one width (fp32 safetensors, 512 wide, FFN 2048): the writer holds one
    layer, so its peak does not follow the weights; the whole export grows only by the check's onnxruntime session
    over the finished graph (about the bundle's size). The torch path holds the model several times over
    (bench/results/hf_stream_export.json: 5.2 GB against 1.0 GB for a 0.93 GB checkpoint)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    from hf_export_memory import write_checkpoint

    weights, peaks, bundles = {}, {}, {}
    for n in (2, 10):
        ckpt = tmp_path / f"d{n}"
        ckpt.mkdir()
        weights[n] = write_checkpoint(ckpt, n, 512, "fp32")
        for what in ("write", "export"):
            out = tmp_path / f"{what}{n}"
            proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ckpt), str(out), what],
                                  capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
            peaks[what, n] = int(proc.stdout.split()[-1])
        bundles[n] = (tmp_path / f"export{n}" / "target.onnx.data").stat().st_size
    grown = weights[10] - weights[2]  # ~116 MB
    assert peaks["write", 10] - peaks["write", 2] < 0.2 * grown, (peaks, grown)
    assert peaks["export", 10] - peaks["export", 2] < 1.15 * (bundles[10] - bundles[2]), (peaks, bundles)


def test_checkpoint_draft_model_in_one_command(checkpoints, tmp_path, tiny_tokenizer):
    """`--drafter model:FOLDER`: a checkpoint folder of the same vocabulary is streamed into the same bundle as the
    draft model; drafting is lossless. One of another vocabulary is refused before any graph is written."""
    from conftest import make_tokenizer

    draft = make_checkpoint(tmp_path / "draft", seed=5, n_layers=1, model_type="qwen2", tokenizer=tiny_tokenizer)
    out = tmp_path / "b"
    m = export_bundle(checkpoints["qwen2-bf16"], out, ExportConfig(drafter=f"model:{draft}", max_len=128))
    assert m.graphs["draft"].file == "draft/target.onnx" and m.drafter.kind == "model"
    assert "max_abs_logit_diff_vs_reference_forward" in m.graphs["draft"].checks
    plain = specdec.load(out, drafter="none")
    spec = specdec.load(out, drafter="model")
    want = plain.generate("the quick brown", GenerationConfig(max_new_tokens=16, draft_len=0)).token_ids
    assert spec.generate("the quick brown", GenerationConfig(max_new_tokens=16, draft_len=3)).token_ids == want

    other = make_checkpoint(tmp_path / "other", n_layers=1, model_type="qwen2",
                            tokenizer=make_tokenizer(vocab_size=300))
    with pytest.raises(SpecdecError) as e:
        export_bundle(checkpoints["qwen2-bf16"], tmp_path / "c", ExportConfig(drafter=f"model:{other}", max_len=64))
    assert "different vocabulary" in str(e.value)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("precision,fast", [("int4", False), ("int8", False), ("int4", True)])
def test_streamed_int8_int4_round_each_layer_as_it_is_read(checkpoints, tmp_path, precision, fast):
    """--precision int4/int8 of a checkpoint streams (export/rounded.py): no torch model, each layer rounded to
    the preset's grids as it is read. Its logits are those of the torch path's bundle of the same preset within
    the grids' rounding, its check ran against a reference forward of the rounded weights, and speculation is
    token-identical to plain decoding."""
    cfg = ExportConfig(drafter="ngram", precision=precision, fast_kernels=fast, max_len=128)
    m = export_bundle(checkpoints["qwen2-fp32"], tmp_path / "s", cfg)
    spec = m.graphs["target"]
    assert spec.precision == precision and spec.quant["method"] == "matmul_nbits_minmax"
    assert spec.quant["accuracy_level"] == (4 if fast else 0) and sum(spec.quant["formats"].values()) >= 2 * 5
    assert spec.checks["max_abs_logit_diff_vs_reference_forward"] <= spec.checks["tolerance"]
    assert "max_abs_logit_diff_vs_transformers" not in spec.checks  # not the torch path
    assert (spec.min_step_tokens == 2) == fast
    torch_path = export_bundle(checkpoints["qwen2-fp32"], tmp_path / "t", replace(cfg, stream=False))
    got = graph_logits(tmp_path / "s" / "target.onnx", spec, IDS)
    want = graph_logits(tmp_path / "t" / "target.onnx", torch_path.graphs["target"], IDS)
    fp32 = transformers_logits(checkpoints["qwen2-fp32"], IDS)
    # both roundings sit about as far from fp32 as each other (the torch path's int8 is onnxruntime's quantizer)
    assert np.abs(got - fp32).max() < 2.0 * np.abs(want - fp32).max() + 1e-3
    agree = {k: float(np.mean(v.argmax(-1) == fp32.argmax(-1))) for k, v in (("streamed", got), ("torch", want))}
    assert agree["streamed"] >= agree["torch"] - 0.1, agree
    plain = specdec.load(tmp_path / "s", drafter="none")
    spec_engine = specdec.load(tmp_path / "s", drafter="ngram")
    for prompt in ["the quick brown fox the quick brown fox", "hello world, this is"]:
        want_ids = plain.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
        assert spec_engine.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=3)).token_ids == want_ids
