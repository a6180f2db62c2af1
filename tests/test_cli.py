"""The real `specdec` CLI on bad input: one `error:` line on stderr, a non-zero exit, no traceback, nothing lost.

Most cases run in-process with click's CliRunner; a few run the installed console script in a subprocess,
which proves that nothing (not even a library's exception) prints a traceback to the terminal.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdec.cli import main

from conftest import make_checkpoint, make_tokenizer

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 4


# ----------------------------------------------------------------------------------------------- helpers

def _script() -> list[str]:
    exe = Path(sys.executable).with_name("specdec")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "specdec.cli"]


def run_cli(*args, input: str | None = None, subprocess_: bool = False):
    """Run `specdec ARGS`; return (exit code, stdout, stderr)."""
    args = [str(a) for a in args]
    if subprocess_:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(_script() + args, capture_output=True, text=True, input=input, env=env, timeout=300)
        return proc.returncode, proc.stdout, proc.stderr
    result = CliRunner().invoke(main, args, input=input)
    # Anything but SystemExit escaping the command is a crash (CliRunner would hide its traceback).
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("the CLI raised " + "".join(traceback.format_exception(
            type(result.exception), result.exception, result.exception.__traceback__)))
    return result.exit_code, result.stdout, result.stderr


def assert_one_error(outcome, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one non-empty stderr line that starts with `error:` (after any
    `- step` progress lines of export) and mentions every needle (case-insensitive). Returns that line."""
    code, out, err = outcome
    assert code != 0, f"exit 0 on bad input; stdout={out!r} stderr={err!r}"
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, f"want exactly one error: line, got stderr:\n{err}"
    others = [line for line in lines if not line.startswith("error:")]
    assert all(line.startswith("- ") for line in others), f"stray stderr output besides progress:\n{err}"
    assert lines[-1] == errors[0], f"the error line must come last:\n{err}"
    line = errors[0]
    assert len(line) > len("error: ") + 10, line
    for needle in needles:
        assert needle.lower() in line.lower(), f"{needle!r} not in {line!r}"
    return line


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rehash(bundle: Path, rel: str) -> None:
    """Make the manifest's checksum of `rel` match the file again (so the graph loader sees the damage)."""
    m = json.loads((bundle / "specdec.json").read_text())
    m["files"][rel] = hashlib.sha256((bundle / rel).read_bytes()).hexdigest()
    (bundle / "specdec.json").write_text(json.dumps(m, indent=2))


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def other_vocab_bundle(tmp_path_factory) -> Path:
    """A tiny bundle whose tokenizer has a different vocabulary from tiny_bundle's."""
    from specdec.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("other_vocab")
    ckpt = make_checkpoint(root / "ckpt", seed=1, n_layers=1, hidden=32, heads=2, kv_heads=1,
                           tokenizer=make_tokenizer(vocab_size=290))
    out = root / "bundle"
    export_bundle(ckpt, out, ExportConfig(drafter="none", max_len=64))
    return out


@pytest.fixture
def truncated_gguf(tmp_path) -> Path:
    """The first 1 MB of the default GGUF (when cached), else a GGUF header that promises more than it has."""
    from specdec.export.source import DEFAULT_MEMBER, cache_dir

    real = cache_dir() / "models" / Path(DEFAULT_MEMBER).name
    out = tmp_path / "truncated.gguf"
    if real.is_file():
        with open(real, "rb") as f:
            out.write_bytes(f.read(1 << 20))
    else:  # no network in tests: magic, version 3, 272 tensors, 30 metadata entries, then nothing
        out.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 272, 30) + struct.pack("<Q", 40) + b"general.arch")
    return out


# ----------------------------------------------------------------------------------------------- export

def test_export_model_path_missing(tmp_path):
    assert_one_error(run_cli("export", tmp_path / "no-such-model", "-o", tmp_path / "out"), "does not exist")
    assert not (tmp_path / "out").exists()


def test_export_folder_without_config(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    assert_one_error(run_cli("export", tmp_path / "notes", "-o", tmp_path / "out"), "config.json", ".gguf")


def test_export_random_bytes_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(os.urandom(4096))
    assert_one_error(run_cli("export", f, "-o", tmp_path / "out"), "GGUF", "checkpoint folder")


def test_export_truncated_gguf(tmp_path, truncated_gguf):
    """The GGUF reader's own exception must still end as one line."""
    line = assert_one_error(run_cli("export", truncated_gguf, "-o", tmp_path / "out"),
                            str(truncated_gguf.name))
    assert "truncated" in line or "corrupt" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_export_unsupported_architecture(tmp_path, tiny_checkpoint, arch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = arch
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_one_error(run_cli("export", ckpt, "-o", tmp_path / "out"), f"unsupported architecture {arch}",
                     "llama", "mistral", "qwen2")
    assert not (tmp_path / "out").exists()


def test_export_existing_output_needs_force(tmp_path, tiny_checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = _tree(out)
    assert_one_error(run_cli("export", tiny_checkpoint, "-o", out), "already exists", "--force")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_unknown_drafter(tmp_path, tiny_checkpoint):
    assert_one_error(run_cli("export", tiny_checkpoint, "-o", tmp_path / "out", "--drafter", "hydra"),
                     "unknown drafter 'hydra'", "ngram", "self-int8", "model:PATH")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["0", "soon"])
def test_export_bad_draft_len(tmp_path, tiny_checkpoint, bad):
    assert_one_error(run_cli("export", tiny_checkpoint, "-o", tmp_path / "out", "--draft-len", bad), "draft-len")
    assert not (tmp_path / "out").exists()


def test_export_unknown_precision(tmp_path, tiny_checkpoint):
    assert_one_error(run_cli("export", tiny_checkpoint, "-o", tmp_path / "out", "--precision", "fp8"),
                     "unknown precision 'fp8'", "fp32", "int8", "int4")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", ["missing", "empty folder", "checkpoint not streamed"])
def test_export_drafter_model_path_not_a_bundle(tmp_path, tiny_checkpoint, what):
    """A draft model is a bundle, a GGUF file or a checkpoint folder the streaming export reads (tests/
    test_hf_stream.py); anything else is one error naming the path."""
    path = {"missing": tmp_path / "nope", "empty folder": tmp_path / "empty",
            "checkpoint not streamed": tmp_path / "gpt2"}[what]
    if what == "empty folder":
        path.mkdir()
    if what == "checkpoint not streamed":
        shutil.copytree(tiny_checkpoint, path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["model_type"] = "gpt2"
        (path / "config.json").write_text(json.dumps(cfg))
    line = assert_one_error(run_cli("export", tiny_checkpoint, "-o", tmp_path / "out", "--drafter", f"model:{path}"),
                            str(path))
    assert ("not a specdec bundle" in line) or ("does not exist" in line), line
    assert not (tmp_path / "out").exists()


def test_export_drafter_bundle_with_other_vocabulary(tmp_path, tiny_checkpoint, other_vocab_bundle):
    out = tmp_path / "out"
    assert_one_error(run_cli("export", tiny_checkpoint, "-o", out, "--max-len", 256,
                             "--drafter", f"model:{other_vocab_bundle}"), "vocabulary", "tokenizer")
    assert not out.exists() and not out.with_name("out.partial").exists()


# ----------------------------------------------------------------------------------------------- generate

def test_generate_bundle_missing(tmp_path):
    assert_one_error(run_cli("generate", tmp_path / "no-bundle", "hi"), "does not exist", "specdec export")


def test_generate_checksum_mismatch(tmp_path, tiny_bundle):
    bundle = _copy_bundle(tiny_bundle, tmp_path / "b")
    with open(bundle / "target.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    assert_one_error(run_cli("generate", bundle, "hi"), "target.onnx.data", "checksum", "re-export")


def test_generate_corrupt_graph_with_valid_checksum_in_a_subprocess(tmp_path, tiny_bundle):
    bundle = _copy_bundle(tiny_bundle, tmp_path / "b")
    graph = bundle / "target.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    _rehash(bundle, "target.onnx")
    assert_one_error(run_cli("generate", bundle, "hi", subprocess_=True), "cannot load graph", "target.onnx",
                     "re-export")


def test_generate_prompt_longer_than_kv_buffer(tiny_bundle):
    line = assert_one_error(run_cli("generate", tiny_bundle, LONG_PROMPT, "--max-len", 16), "--max-len")
    assert "16" in line


@pytest.mark.parametrize("prompt", ["", "   "])
def test_generate_empty_prompt(tiny_bundle, prompt):
    assert_one_error(run_cli("generate", tiny_bundle, prompt), "empty")


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "-1", "temperature"),
    ("--temperature", "warm", "--temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
    ("--draft-len", "-1", "--draft-len"),
    ("--draft-len", "abc", "--draft-len"),
    ("--max-new-tokens", "0", "max_new_tokens"),
])
def test_generate_bad_flag_values(tiny_bundle, flag, value, needle):
    assert_one_error(run_cli("generate", tiny_bundle, "hi", flag, value), needle)


def test_generate_max_len_beyond_model_positions(tiny_bundle):
    assert_one_error(run_cli("generate", tiny_bundle, "hi", "--max-len", 100000), "100000", "512")


def test_generate_missing_prompt_is_one_line(tiny_bundle):
    assert_one_error(run_cli("generate", tiny_bundle), "PROMPT", "--help")


def test_generate_unavailable_provider_in_a_subprocess(tiny_bundle):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    assert_one_error(run_cli("generate", tiny_bundle, "hi", "--provider", "cuda", subprocess_=True),
                     "cuda", "not available", "--provider cpu")


def test_help_and_version_still_exit_zero():
    code, out, _ = run_cli("--help")
    assert code == 0 and "generate" in out
    code, out, _ = run_cli("--version")
    assert code == 0 and "version" in out


# ----------------------------------------------------------------------------------------------- good input

def test_generate_prints_text_and_stats(tiny_bundle):
    code, out, err = run_cli("generate", tiny_bundle, "the quick brown fox", "--max-new-tokens", 8)
    assert code == 0, err
    assert out.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "tok/s" in lines[0] and "tau" in lines[0], err


def test_generate_json(tiny_bundle):
    code, out, err = run_cli("generate", tiny_bundle, "the quick brown fox", "--max-new-tokens", 8, "--json")
    assert code == 0, err
    g = json.loads(out)
    assert set(g) >= {"text", "finish_reason", "stats"}
    # The tiny model's answer to this prompt has no EOS in its first 8 tokens: the budget ends it.
    assert g["finish_reason"] == "length"
    assert g["stats"]["new_tokens"] == 8 and "tau" in g["stats"]


def test_generate_reads_stdin_and_takes_a_system_prompt(tiny_bundle):
    args = ("generate", tiny_bundle, "--max-new-tokens", 6, "--json")
    direct = json.loads(run_cli(*args[:2], "the quick brown fox", *args[2:])[1])
    code, out, err = run_cli(*args[:2], "-", *args[2:], input="the quick brown fox")
    assert code == 0, err
    assert json.loads(out)["text"] == direct["text"]
    code, out, err = run_cli(*args[:2], "the quick brown fox", *args[2:], "--system", "be brief")
    assert code == 0, err
    assert json.loads(out)["stats"]["prompt_tokens"] > direct["stats"]["prompt_tokens"]
    assert_one_error(run_cli(*args[:2], "hi", "--raw", "--system", "be brief"), "--system", "--raw")
    assert_one_error(run_cli(*args[:2], "-", input="  \n"), "empty")
    # bytes that are not UTF-8 reach Python as lone surrogates (argv, stdin), which the tokenizer cannot take
    assert_one_error(run_cli(*args[:2], "caf\udce9"), "not UTF-8", "iconv")
    assert_one_error(run_cli(*args[:2], "caf\udce9", "--raw"), "not UTF-8")


def test_chat_session(tiny_bundle):
    code, out, err = run_cli("chat", tiny_bundle, "--max-new-tokens", 8, input="hello\n/reset\nthe quick\n/exit\n")
    assert code == 0, err
    assert "Traceback" not in err
    stats = [line for line in err.splitlines() if "tok/s" in line and "tau" in line]
    assert len(stats) == 2, err
    assert "(conversation cleared)" in err


def test_chat_takes_a_message_of_several_lines_between_triple_quotes(tiny_bundle, monkeypatch):
    from specdec.runtime.engine import Engine

    sent = []
    stream = Engine.stream

    def spy(self, prompt, cfg=None):
        sent.append(prompt[-1]["content"])
        return stream(self, prompt, cfg)

    monkeypatch.setattr(Engine, "stream", spy)
    code, out, err = run_cli("chat", tiny_bundle, "--max-new-tokens", 4,
                             input='"""Summarize:\nline one\n\nline two"""\n"""one line"""\n"""\nfirst\n"""\n/exit\n')
    assert code == 0, err
    assert sent == ["Summarize:\nline one\n\nline two", "one line", "first"]


def test_a_long_chat_goes_on_past_the_kv_buffer(tiny_bundle):
    turns = "".join(f"question {i}: the quick brown fox jumps over the lazy dog\n" for i in range(8))
    code, out, err = run_cli("chat", tiny_bundle, "--max-new-tokens", 8, "--max-len", 96, "--system", "be brief",
                             input=turns + "/exit\n")
    assert code == 0, err
    assert "Traceback" not in err and "error:" not in err
    assert len([line for line in err.splitlines() if "tok/s" in line]) == 8, err
    assert "earliest exchange" in err and "96-token KV buffer" in err


# ----------------------------------------------------------------------------------------------- fp16

def test_export_and_quantize_fp16_then_generate_needs_a_gpu(tmp_path, tiny_checkpoint, tiny_bundle, monkeypatch):
    code, out, err = run_cli("export", tiny_checkpoint, "-o", tmp_path / "e16", "--precision", "fp16",
                             "--drafter", "none", "--max-len", 128)
    assert code == 0, err
    assert "target fp16" in out
    code, out, err = run_cli("quantize", tiny_bundle, "--to", "fp16", "-o", tmp_path / "q16")
    assert code == 0, err
    assert "target fp16" in out
    for bundle in ("e16", "q16"):
        manifest = json.loads((tmp_path / bundle / "specdec.json").read_text())
        assert manifest["graphs"]["target"]["precision"] == "fp16"
        assert_one_error(run_cli("generate", tmp_path / bundle, "hello"), "fp16 is a GPU precision",
                         "--provider cuda", "--precision fp32|int8|int4")
    assert_one_error(run_cli("quantize", tmp_path / "q16", "--to", "int8", "-o", tmp_path / "q8"), "is fp16",
                     "fp32 bundles only")
    monkeypatch.setenv("SPECDEC_ALLOW_CPU_FP16", "1")  # the tests' override: ORT's CPU kernels do run fp16
    code, out, err = run_cli("generate", tmp_path / "e16", "the quick brown fox", "--max-new-tokens", 6)
    assert code == 0, err
    assert out.strip() and "tok/s" in err


def test_an_int8_weight_only_bundle_is_written_with_a_note_on_cpu_speed(tmp_path, tiny_bundle):
    """int8 weights with fp32 activations have no fast CPU kernel (~10x slower than fp32): said when one is
    written; the fast-kernel int8 and int4 bundles get no such note."""
    code, out, err = run_cli("quantize", tiny_bundle, "--to", "int8", "-o", tmp_path / "q8")
    assert code == 0, err
    assert "target int8" in out and "no fast CPU kernel" in err and "--fast-kernels" in err
    for extra in (["--to", "int8", "--fast-kernels"], ["--to", "int4"]):
        code, out, err = run_cli("quantize", tiny_bundle, *extra, "-o", tmp_path / "-".join(extra).strip("-"))
        assert code == 0, err
        assert "no fast CPU kernel" not in err
