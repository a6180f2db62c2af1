"""A Hugging Face checkpoint folder (config.json + *.safetensors) read lazily, one tensor at a time.

`SafetensorsSource` gives the streaming graph writer (export/gguf_export.py) and its reference forward
(export/streamed.py) the interface a GGUF file gives them: the config from config.json, and `layers[i]` read from
the memory-mapped safetensors files when the writer reaches layer i, widened to float32. No torch, no
transformers: the weights never pass through a framework model. A checkpoint quantized by AWQ or GPTQ
(config.json's quantization_config) gives its linear layers' own codes (export/hf_quant.py).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.graph import LayerWeights
from specdec.export.hf_quant import QuantScheme, carried, dequantize
from specdec.export.streamed import LazyWeights, cat_rows
from specdec.runtime.manifest import ModelConfig

ARCHITECTURES = ("llama", "qwen2")  # pre-norm decoders with RMSNorm, rotary, GQA and SwiGLU
PREFIX = "model."
# safetensors dtypes read through safe_open(framework="numpy"); BF16, which numpy has no type for, is read as raw
# uint16 and widened here.
NUMPY_DTYPES = ("F32", "F16", "F64")
BF16 = "BF16"
MAPPED_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, BF16: np.uint16}
PACKED_SUFFIXES = (".qweight", ".qzeros", ".g_idx")  # the int32 tensors of AWQ/GPTQ linear layers


def _config_json(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SpecdecError(f"cannot read {Path(folder) / 'config.json'}: {str(e).splitlines()[0][:200]}",
                           "the checkpoint folder may be incomplete; download it again") from None


def _rope(hf: dict) -> tuple[float, str]:
    """(rope theta, rope type) from a transformers 5 `rope_parameters` or an older `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def why_not_streamed(folder: Path) -> str | None:
    """Why the checkpoint folder cannot be streamed (the torch export then writes it), or None when it can."""
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        return "it has no .safetensors files"
    hf = _config_json(folder)
    if hf.get("model_type") not in ARCHITECTURES:
        return f"architecture {hf.get('model_type')!r} (streamed: {', '.join(ARCHITECTURES)})"
    _theta, kind = _rope(hf)
    if kind != "default":
        return f"rope scaling {kind!r}"
    if hf.get("mlp_bias"):
        return "MLP biases"
    if hf.get("use_sliding_window"):
        return "sliding-window attention"
    return None


def _weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names when it has one (a folder may hold other copies of
    the weights beside them), else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise SpecdecError(f"cannot read {index}: {str(e).splitlines()[0][:200]}",
                               "the checkpoint folder may be incomplete; download it again") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise SpecdecError(f"{folder} lacks {missing[0]} ({len(missing)} of the {len(names)} files its index "
                               "names)",
                               "the checkpoint folder may be incomplete; download it again")
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def _base(name: str) -> str:
    """A linear layer's name without its tensor suffix ("...q_proj.weight" -> "...q_proj")."""
    return name.rsplit(".", 1)[0]


class SafetensorsSource:
    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.path = Path(folder)
        reason = why_not_streamed(self.path)
        if reason is not None:
            raise SpecdecError(f"{self.path} cannot be streamed: {reason}", "export it with the torch path")
        self.hf = _config_json(self.path)
        self._open: dict[Path, object] = {}  # safe_open handles, dropped by release()
        self._headers: dict[Path, tuple[int, dict]] = {}
        # tensor name -> (file, safetensors dtype, shape)
        self.index: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for file in _weight_files(self.path):
            try:
                with safe_open(str(file), framework="numpy") as f:
                    for name in f.keys():
                        s = f.get_slice(name)
                        self.index[name] = (file, s.get_dtype(), tuple(int(d) for d in s.get_shape()))
            except Exception as e:  # a truncated or corrupt file: safetensors raises its own error types
                first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                raise SpecdecError(f"cannot read {file}: {first}",
                                   "the file may be truncated or corrupt; download it again") from None
        q0 = PREFIX + "layers.0.self_attn.q_proj"
        missing = [n for n in (self.embed_name, self.final_norm_name, q0 + ".weight")
                   if n not in self.index and not (n == q0 + ".weight" and q0 + ".qweight" in self.index)]
        if missing:
            raise SpecdecError(f"{self.path} lacks tensors {missing}", "the checkpoint may be incomplete")
        qc = self.hf.get("quantization_config")
        self.scheme = QuantScheme.from_config(qc, str(self.path)) if qc else None
        bad = sorted({d for n, (_f, d, _s) in self.index.items() if d not in NUMPY_DTYPES + (BF16,)
                      and not (self.scheme is not None and d == "I32" and n.endswith(PACKED_SUFFIXES))})
        if bad:
            raise SpecdecError(f"{self.path} holds tensors of type {', '.join(bad)}, which specdec does not read",
                               "convert the checkpoint to float32, float16 or bfloat16")
        self.config = self._config()

    # ------------------------------------------------------------------------------------------ metadata
    def _config(self) -> ModelConfig:
        hf = self.hf
        n_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        V, D = self.index[self.embed_name][2]
        if D != hidden:
            raise SpecdecError(f"{self.path}: embedding width {D} != hidden_size {hidden}", "the config does not match")
        return ModelConfig(
            model_type=hf["model_type"],
            n_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or hidden // n_heads),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf.get("vocab_size") or V),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=self.head_name is None,
            attention_bias=PREFIX + "layers.0.self_attn.q_proj.bias" in self.index,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.get("eos_token_id")
        return tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None)

    @property
    def rope_theta(self) -> float:
        return _rope(self.hf)[0]

    def inv_freq(self) -> np.ndarray:
        H = self.config.head_dim
        return (1.0 / self.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)).astype(np.float32)

    def release(self) -> None:
        """Close the memory maps: the pages of the tensors read so far (converted and written by now) leave this
        process's resident memory; a later read maps its file again."""
        self._open.clear()

    # ------------------------------------------------------------------------------------------ tensors
    embed_name, final_norm_name = PREFIX + "embed_tokens.weight", PREFIX + "norm.weight"

    @property
    def quantized(self) -> bool:
        """Whether its linear layers are stored quantized (AWQ/GPTQ): its own precision is then not fp32."""
        return self.scheme is not None

    @property
    def quant_method(self) -> str:
        return self.scheme.method if self.scheme is not None else "none"

    @property
    def head_name(self) -> str | None:
        """The LM head's tensor; None when tied to the embedding (config.json's tie_word_embeddings, or no head)."""
        if self.hf.get("tie_word_embeddings", False) or not {"lm_head.weight", "lm_head.qweight"} & set(self.index):
            return None
        return "lm_head.weight"

    def quantized_tensor(self, name: str) -> bool:
        return self.scheme is not None and name.endswith(".weight") and _base(name) + ".qweight" in self.index

    def formats(self) -> dict[str, int]:
        """Linear layers per storage: the quantization scheme's label, or the float dtype."""
        out: dict[str, int] = {}
        for name, (_f, dtype, shape) in self.index.items():
            if name.endswith(".qweight"):
                key = self.scheme.label
            elif name.endswith(".weight") and len(shape) == 2:
                key = dtype
            else:
                continue
            out[key] = out.get(key, 0) + 1
        return out

    def not_carried(self) -> list[tuple[str, str]]:
        """Every AWQ/GPTQ layer specdec reads is carried (export/hf_quant.py refuses the rest when reading config)."""
        return []

    def stored_dtype(self, name: str) -> str:
        """The tensor's safetensors dtype ("F16", "BF16", "F32", "I32")."""
        return self.index[name][1]

    def _tensor(self, name: str) -> np.ndarray | None:
        """A tensor as stored (numpy), or None when the checkpoint lacks it."""
        if name not in self.index:
            return None
        return self._handle(self.index[name][0]).get_tensor(name)

    def _packed(self, base: str) -> tuple:
        """(qweight, qzeros, scales, g_idx) of a quantized linear layer `base` (qzeros, g_idx may be None)."""
        return (self._tensor(base + ".qweight"), self._tensor(base + ".qzeros"), self._tensor(base + ".scales"),
                self._tensor(base + ".g_idx"))

    def _handle(self, file: Path):
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="numpy")
        return self._open[file]

    def _mapped(self, name: str) -> np.ndarray:
        """A float tensor memory-mapped from its file as stored (bfloat16 as its uint16 bit patterns): nothing is
        read until used (safetensors' header gives where the bytes lie)."""
        file, dtype, shape = self.index[name]
        if file not in self._headers:
            with open(file, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self._headers[file] = (8 + n, json.loads(f.read(n)))
        start, header = self._headers[file]
        begin, end = header[name]["data_offsets"]
        np_dtype = MAPPED_DTYPES[dtype]
        count = (end - begin) // np.dtype(np_dtype).itemsize
        return np.memmap(file, dtype=np_dtype, mode="r", offset=start + begin, shape=(count,)).reshape(shape)

    def _widened(self, name: str, arr: np.ndarray) -> np.ndarray:
        """Stored values (a mapped view, any layout) as a new C-ordered float32 array: one allocation."""
        if self.index[name][1] == BF16:
            bits = np.ascontiguousarray(arr, dtype=np.uint32)
            bits <<= 16  # bfloat16 is float32's high half
            return bits.view(np.float32)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def floats(self, name: str) -> np.ndarray:
        """A tensor as float32, its stored shape ([out, in] for matrices)."""
        if self.quantized_tensor(name):
            return dequantize(self.scheme, *self._packed(_base(name)))  # [out, in]
        return self._widened(name, self._mapped(name))

    def float_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a matrix as float32 [len(rows), K], without reading the rest."""
        if self.quantized_tensor(name):
            return self.floats(name)[np.asarray(rows)]
        return self._widened(name, self._mapped(name)[np.asarray(rows)])

    def matrix(self, name: str, carry_codes: bool = False, rows: np.ndarray | None = None):
        """A weight stored [out, in], as float32 [in, out] for MatMul, or (carry_codes, AWQ/GPTQ layers) as its own
        codes (Carried [out, nb, block]); `rows` reorders its output rows. A float matrix is transposed and widened
        in one copy from the mapped file (an LM head of 150k rows is the largest array an export holds)."""
        if carry_codes and self.quantized_tensor(name):
            c = carried(self.scheme, *self._packed(_base(name)))
            return c if rows is None else c.rows(rows)
        if self.quantized_tensor(name):
            w = self.floats(name)
            return np.ascontiguousarray((w if rows is None else w[rows]).T)
        stored = self._mapped(name)
        return self._widened(name, (stored if rows is None else stored[rows]).T)

    def layer(self, i: int, carry_codes: bool = False) -> LayerWeights:
        """Layer i's weights, every matrix float32 [in, out] or (carry_codes) a quantized layer's Carried codes."""
        p = f"{PREFIX}layers.{i}."
        attn = p + "self_attn."
        bias = None
        if attn + "q_proj.bias" in self.index:
            bias = np.concatenate([self.floats(attn + f"{x}_proj.bias") for x in "qkv"])  # [(N+2KV)H]
        return LayerWeights(
            input_norm=self.floats(p + "input_layernorm.weight"),
            qkv=cat_rows([self.matrix(attn + f"{x}_proj.weight", carry_codes) for x in "qkv"]),  # [D, (N+2KV)H]
            qkv_bias=bias,
            o_proj=self.matrix(attn + "o_proj.weight", carry_codes),  # [N*H, D]
            post_norm=self.floats(p + "post_attention_layernorm.weight"),
            gate=self.matrix(p + "mlp.gate_proj.weight", carry_codes),  # [D, F]
            up=self.matrix(p + "mlp.up_proj.weight", carry_codes),  # [D, F]
            down=self.matrix(p + "mlp.down_proj.weight", carry_codes),  # [F, D]
        )

    def weights(self, carry_codes: bool = False) -> LazyWeights:
        return LazyWeights(self, carry_codes)
