"""Native llama.cpp's `llama-server`, built once from the llama.cpp source vendored in PyPI's llama-cpp-python sdist.

Peers are measured against the engine people actually run, not a Python loop over it (llama-cpp-python runs the
135M model at about half llama.cpp's own speed). The build is cached in $SPECDEC_CACHE/llama.cpp (default
~/.cache/specdec/llama.cpp); it takes ~6 minutes on 2 cores and needs cmake, ninja and a C++ compiler.

    python bench/llama_native.py        # prints the path of llama-server, building it first if needed

On CPUs with AMX, llama.cpp's weight repacking dies with "Illegal instruction" on these hosts: the server is
started with --no-repack (see peers.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"


def cache() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "llama.cpp"


def llama_server() -> Path:
    """The built llama-server binary (built on first use)."""
    exe = cache() / "build" / "bin" / "llama-server"
    if exe.is_file():
        return exe
    root = cache()
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                            "-d", tmp, "--quiet"], check=True)
            sdist = next(Path(tmp).glob("*.tar.gz"))
            with tarfile.open(sdist) as tf:
                tf.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            vendored.rename(src)
    subprocess.run(["cmake", "-S", str(src), "-B", str(root / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(root / "build"), "-j2", "--target", "llama-server", "llama-bench"],
                   check=True, stdout=subprocess.DEVNULL)
    return exe


if __name__ == "__main__":
    print(llama_server())
