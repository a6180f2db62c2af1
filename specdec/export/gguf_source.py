"""A GGUF file read lazily: config from its metadata, weights one tensor at a time from the memory-mapped file.

`GGUFSource.weights(carry_codes=True)` gives the graph writer a DecoderWeights-like object whose layers are read
when the writer reaches them (export/streamed.py): quantized tensors as their own codes (export/gguf_blocks.py's
Carried), or, with carry_codes=False, dequantized to float32. Nothing holds more than one layer's weights.
`reference_logits` (export/streamed.py) runs the same weights through a plain numpy forward, one layer resident at
a time: the export's check of the graph it wrote.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.gguf_blocks import CARRIED, FLOAT_TYPES, Carried, carry
from specdec.export.graph import LayerWeights
from specdec.export.streamed import LazyWeights, cat_rows
from specdec.runtime.manifest import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "mistral")  # pre-norm decoders with RMSNorm, rotary, GQA and SwiGLU


def _hf_unpermute(n_rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's permutation of Q/K rows in Llama GGUFs (its rotary pairs adjacent values;
    Hugging Face's, and GroupQueryAttention's non-interleaved rotary, pair the two halves of a head)."""
    idx = np.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(n_rows)


@dataclass
class GGUFTensor:
    name: str
    fmt: str  # ggml type name: Q4_K, F32, ...
    shape: tuple[int, ...]  # numpy order: [rows, K] for matrices
    data: np.ndarray  # memory-mapped: quantized [rows, bytes per row] uint8, float types as their numpy arrays


class GGUFSource:
    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path, "r")
        except Exception as e:  # a truncated or corrupt file: gguf raises ValueError, IndexError, struct errors
            raise SpecdecError(f"cannot read GGUF file {self.path}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}",
                               "the file may be truncated or corrupt; download it again") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        # The metadata's scalars; its arrays (the tokenizer's ~150k tokens and merges, ~0.5 GB as Python objects)
        # are dropped here: the tokenizer is read separately (load_tokenizer).
        self.meta = {k: f.contents() for k, f in self.reader.fields.items() if len(f.data) == 1 and
                     not k.startswith("tokenizer.ggml.") or k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id")}
        self.reader.fields.clear()
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise SpecdecError(f"unsupported architecture {self.arch!r} in {self.path.name}",
                               f"supported: {', '.join(ARCHITECTURES)}")
        missing = [n for n in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight") if n not in self.tensors]
        if missing:
            raise SpecdecError(f"{self.path.name} lacks tensors {missing}", "the file may be truncated or corrupt")
        self.config = self._config()

    # ------------------------------------------------------------------------------------------ metadata
    def field(self, key: str, default=None):
        """A metadata scalar (e.g. "qwen2.block_count"), or `default`."""
        return self.meta.get(key, default)

    def release(self) -> None:
        """Drop the mapped file's pages from this process's resident memory (they stay in the page cache): the
        tensors read so far are converted and written, and RSS stays one layer deep."""
        import mmap

        m = getattr(self.reader.data, "_mmap", None)
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)

    def _config(self) -> ModelConfig:
        a = self.arch
        n_heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        scaling = self.field(f"{a}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise SpecdecError(f"{self.path.name} uses rope scaling {scaling!r}, which the exporter does not carry",
                               "please report this model")
        return ModelConfig(
            model_type=a,
            n_layers=int(self.field(f"{a}.block_count")),
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=int(self.field(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // n_heads)),
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),
            max_position=int(self.field(f"{a}.context_length", 2048)),
            rms_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.field("tokenizer.ggml.eos_token_id")
        return () if eos is None else (int(eos),)

    @property
    def rope_theta(self) -> float:
        return float(self.field(f"{self.arch}.rope.freq_base", 10000.0))

    def inv_freq(self) -> np.ndarray:
        H = self.config.head_dim
        return (1.0 / self.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)).astype(np.float32)

    def formats(self) -> dict[str, int]:
        """Tensor count per ggml type."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out

    @property
    def quantized(self) -> bool:
        """Whether its matrices are stored quantized (its own precision is then not fp32)."""
        return any(fmt not in FLOAT_TYPES for fmt in self.formats())

    def not_carried(self) -> list[tuple[str, str]]:
        """(tensor, type) of the matrices whose type has no exact MatMulNBits form."""
        return [(t.name, t.tensor_type.name) for t in self.tensors.values()
                if len(t.shape) == 2 and t.tensor_type.name not in CARRIED and t.tensor_type.name not in FLOAT_TYPES]

    # ------------------------------------------------------------------------------------------ tensors
    embed_name, final_norm_name = "token_embd.weight", "output_norm.weight"
    quant_method = "gguf"  # where carried codes come from (the manifest's quant.method)

    @property
    def head_name(self) -> str | None:
        """The LM head's tensor; None when tied to the embedding."""
        return "output.weight" if "output.weight" in self.tensors else None

    def quantized_tensor(self, name: str) -> bool:
        return self.tensor(name).fmt not in FLOAT_TYPES

    def carries(self, name: str) -> bool:
        """Whether the tensor's codes go into onnxruntime's kernels exactly (matrix(name, carry_codes=True))."""
        return self.tensor(name).fmt in CARRIED

    def stored_dtype(self, name: str) -> str:
        """The tensor's ggml type name ("F16", "Q4_K", ...)."""
        return self.tensors[name].tensor_type.name

    def tensor(self, name: str) -> GGUFTensor:
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return GGUFTensor(name, t.tensor_type.name, shape, t.data)

    def floats(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, numpy order ([rows, K] for matrices)."""
        t = self.tensor(name)
        if t.fmt in ("F32", "F16"):
            return np.asarray(t.data, dtype=np.float32).reshape(t.shape)
        if t.fmt in CARRIED:  # decoded a slice of rows at a time: the intermediates stay small
            return _carry_chunked(t.fmt, np.asarray(t.data).reshape(t.shape[0], -1), t.shape[-1]).dequantize()
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(np.asarray(t.data), GGMLQuantizationType[t.fmt]).astype(np.float32).reshape(t.shape)

    def float_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a matrix dequantized to float32 [len(rows), K], without dequantizing the rest."""
        t = self.tensor(name)
        if t.fmt in CARRIED:
            return carry(t.fmt, np.asarray(t.data).reshape(t.shape[0], -1)[rows], t.shape[1]).dequantize()
        if t.fmt in FLOAT_TYPES[:2]:
            return np.asarray(t.data, dtype=np.float32).reshape(t.shape)[rows]
        return self.floats(name)[rows]

    def matrix(self, name: str, carry_codes: bool = False, rows: np.ndarray | None = None):
        """A weight [out, in] as Carried codes (carry_codes, quantized types) or as float32 [in, out] for MatMul;
        `rows` reorders its output rows."""
        t = self.tensor(name)
        if carry_codes and t.fmt not in FLOAT_TYPES:
            if t.fmt not in CARRIED:
                raise SpecdecError(f"tensor {name} is {t.fmt}, which specdec cannot carry exactly into onnxruntime's "
                                   f"kernels (carried: {', '.join(CARRIED)})",
                                   "export with --precision fp32 to dequantize it (a larger, slower bundle)")
            raw = np.asarray(t.data).reshape(t.shape[0], -1)
            return _carry_chunked(t.fmt, raw if rows is None else raw[rows], t.shape[1])
        w = self.floats(name)
        return np.ascontiguousarray((w if rows is None else w[rows]).T)

    def layer(self, i: int, carry_codes: bool) -> LayerWeights:
        """Layer i's weights: matrices as Carried codes (carry_codes, quantized types) or float32 [in, out]."""
        cfg, p = self.config, f"blk.{i}."
        perm_q = perm_k = None
        if self.arch == "llama":
            perm_q = _hf_unpermute(cfg.n_heads * cfg.head_dim, cfg.n_heads)
            perm_k = _hf_unpermute(cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads)
        q = self.matrix(p + "attn_q.weight", carry_codes, perm_q)
        k = self.matrix(p + "attn_k.weight", carry_codes, perm_k)
        v = self.matrix(p + "attn_v.weight", carry_codes)
        bias = None
        if p + "attn_q.bias" in self.tensors:
            bias = np.concatenate([self.floats(p + "attn_q.bias"), self.floats(p + "attn_k.bias"),
                                   self.floats(p + "attn_v.bias")])
        return LayerWeights(
            input_norm=self.floats(p + "attn_norm.weight"),
            qkv=cat_rows([q, k, v]),
            qkv_bias=bias,
            o_proj=self.matrix(p + "attn_output.weight", carry_codes),
            post_norm=self.floats(p + "ffn_norm.weight"),
            gate=self.matrix(p + "ffn_gate.weight", carry_codes),
            up=self.matrix(p + "ffn_up.weight", carry_codes),
            down=self.matrix(p + "ffn_down.weight", carry_codes),
        )

    def weights(self, carry_codes: bool) -> LazyWeights:
        return LazyWeights(self, carry_codes)


CHUNK_ROWS = 4096  # rows decoded at a time: an embedding's decoding intermediates stay ~50 MB, not GBs


def _carry_chunked(fmt: str, raw: np.ndarray, K: int) -> Carried:
    """carry() a slice of rows at a time into preallocated grids."""
    first = carry(fmt, raw[:CHUNK_ROWS], K)
    if raw.shape[0] <= CHUNK_ROWS:
        return first
    n = raw.shape[0]
    q = np.empty((n, *first.q.shape[1:]), dtype=np.uint8)  # [rows, nb, block]
    scale = np.empty((n, first.scale.shape[1]), dtype=np.float32)  # [rows, nb]
    offset = None if first.offset is None else np.empty_like(scale)
    for r0 in range(0, n, CHUNK_ROWS):
        c = first if r0 == 0 else carry(fmt, raw[r0:r0 + CHUNK_ROWS], K)
        q[r0:r0 + CHUNK_ROWS], scale[r0:r0 + CHUNK_ROWS] = c.q, c.scale
        if offset is not None:
            offset[r0:r0 + CHUNK_ROWS] = c.offset
    return Carried(q, scale, offset, first.bits, fmt)


def load_tokenizer(path: Path):
    """The tokenizer of a GGUF file (its metadata only; no tensor is read) or of a Hugging Face checkpoint folder
    (its tokenizer files, as the torch export reads them), as a transformers fast tokenizer."""
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    try:
        if Path(path).is_dir():
            tok = AutoTokenizer.from_pretrained(str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    except Exception as e:
        raise SpecdecError(f"cannot read the tokenizer of {path}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}",
                           "the file may be truncated or corrupt, or carry a tokenizer transformers cannot convert") from None
    if not getattr(tok, "is_fast", False):
        raise SpecdecError(f"{path} has no tokenizer convertible to the tokenizers format")
    return tok


def _save_tokenizer_main(path: str, folder: str) -> None:
    """Child process: convert and save the tokenizer, print its ids and chat template as one JSON line."""
    import json

    try:
        tok = load_tokenizer(Path(path))
    except SpecdecError as e:
        print(json.dumps({"error": str(e), "hint": e.hint}))
        return
    tok.backend_tokenizer.save(str(Path(folder) / "tokenizer.json"))
    print(json.dumps({"bos": tok.bos_token_id, "eos": tok.eos_token_id,
                      "chat_template": tok.chat_template if isinstance(tok.chat_template, str) else None}))


def save_tokenizer(path: Path, folder: Path) -> dict:
    """Write the tokenizer of a GGUF file or checkpoint folder (load_tokenizer) as `folder`/tokenizer.json; return
    {bos, eos, chat_template}. The conversion (transformers, and the torch it imports: ~0.3 GB resident, ~0.8 GB at
    its peak for a 150k vocabulary) runs in a child process, so the export's own memory stays what the weights
    need."""
    import json
    import subprocess
    import sys

    code = "import sys; from specdec.export.gguf_source import _save_tokenizer_main as m; m(sys.argv[1], sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(folder)], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise SpecdecError(f"cannot read the tokenizer of {path}: {last[:300]}")
    out = json.loads(lines[-1])
    if "error" in out:
        raise SpecdecError(out["error"], out.get("hint"))
    return out
