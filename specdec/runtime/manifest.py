"""The bundle manifest (`specdec.json`): frozen, validated dataclasses and their JSON form.

Loading checks the format version, every field, and every file's SHA-256, and names exactly what is
wrong. Behaviour is chosen from these fields, never by looking at file names.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from specdec.errors import SpecdecError

MANIFEST_NAME = "specdec.json"
FORMAT = "specdec-bundle"
# 2: a target graph may take `argmax_rows` (export/exact_argmax.py), which a runtime reading only version 1 would
# not feed. 3: that path's activations are 7-bit; version 2's 8-bit ones overflow onnxruntime's u8 x s8 kernel
# on CPUs without VNNI and pick wrong tokens there, so a version-2 bundle with the path is refused (re-export).
# This runtime reads 1 to 3; what it writes is version 3.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
ARGMAX_ROWS_SINCE = 3  # the first version whose argmax_rows path is exact on every CPU
PRECISIONS = ("fp32", "fp16", "int8", "int4")
# Precisions whose graphs need a GPU to be worth running: the CPU provider has fp16 kernels, but they are
# slower than fp32 there (FACTS: 100 vs 44 us for one attention node) and less exact.
GPU_PRECISIONS = ("fp16",)
DRAFTER_KINDS = ("none", "ngram", "model", "layerskip", "eagle", "medusa")
FEATURES = "features"  # an EAGLE head graph's input: the residual stream it drafts from
ATTENTION_BIAS = "attention_bias"  # a tree-verifying graph's input: additive attention mask [B,1,T,P+T]
LOGITS_ROWS = "logits_rows"  # target graphs: the step positions that get logits [R] (prefill: the last)
ARGMAX_ROWS = "argmax_rows"  # fp32 targets: the step positions whose argmax comes from 8-bit scores (export/exact_argmax)
# GraphSpec.min_step_tokens above this is no kernel's need; padding every step to it would only waste work.
MAX_MIN_STEP_TOKENS = 8


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape: what the graph writer built and what the runtime allocates KV for."""

    model_type: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rms_eps: float
    tie_embeddings: bool
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "max_position"):
            _require(getattr(self, f) > 0, f"model.{f} must be > 0, got {getattr(self, f)}")
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"model.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        _require(self.rms_eps > 0, "model.rms_eps must be > 0")


@dataclass(frozen=True)
class TokenizerSpec:
    file: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None
    # SHA-256 of the vocabulary (token -> id) and special tokens: two bundles can share drafts iff equal.
    vocab_digest: str = ""

    def __post_init__(self) -> None:
        _require(len(self.eos_token_ids) > 0, "tokenizer.eos_token_ids must not be empty")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


# A layerskip bundle's target runs as these two slices (layers [0, exit_layer) and [exit_layer, n_layers)).
SPLIT_GRAPHS = ("exit", "tail")


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX graph of the bundle. Inputs/outputs are listed so the runtime binds by name, not by guess."""

    file: str
    model: ModelConfig  # the decoder this graph runs (a draft model's differs from the target's)
    precision: str
    n_layers: int  # the graph runs layers [first_layer, n_layers) and reads/writes their K/V
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    hidden_layers: tuple[int, ...] = ()  # residual-stream taps exposed as outputs `hidden.{i}`
    quant: dict[str, Any] = field(default_factory=dict)  # quantizer settings, recorded for reports
    checks: dict[str, Any] = field(default_factory=dict)  # export-time measurements (e.g. max logit diff)
    # > 0: a slice of the target starting at this layer, fed the residual stream (`hidden_in`), not token ids
    first_layer: int = 0
    # Float type of activations and K/V where the weights' precision does not say it (int8 heads in an fp16
    # bundle compute in fp16). None: fp16 for an fp16 graph, fp32 for the others.
    activations: str | None = None
    # Every step of this graph runs at least this many positions per row; shorter steps are padded.
    # GroupQueryAttention computes a 1-token step on its decoding path, which rounds ~1e-7 apart from its
    # multi-token path; int8-activation kernels (MatMulNBits accuracy_level 4) amplify that to whole logits, while
    # multi-token steps agree bit for bit. With 2 every step takes the multi-token path, so a T-token step
    # computes exactly what T single steps do. `specdec quantize --fast-kernels` measures this (checks).
    min_step_tokens: int = 1
    # True: min_step_tokens pads the attention's step only. The graph takes the T real tokens, and positions (and
    # query_lens) for max(T, min_step_tokens) positions; it pads Q/K/V with zero rows before GroupQueryAttention and
    # drops them after, so every matmul runs the T real rows alone (MatMulNBits computes a row the same at any M;
    # only the attention kernel picks its path by the step's width). False: whole steps are padded with tokens.
    pads_attention_only: bool = False

    def __post_init__(self) -> None:
        _require(self.precision in PRECISIONS, f"graph precision must be one of {PRECISIONS}, got {self.precision!r}")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "hidden_layers", tuple(int(i) for i in self.hidden_layers))
        _require(self.has_logits or self.n_layers in self.hidden_layers,
                 f"graph {self.file} has neither a 'logits' output nor a hidden.{self.n_layers} tap")
        _require(0 < self.n_layers <= self.model.n_layers,
                 f"graph {self.file}: n_layers must be in 1..{self.model.n_layers}, got {self.n_layers}")
        _require(self.activations in (None, "fp32", "fp16"),
                 f"graph {self.file}: activations must be fp32 or fp16, got {self.activations!r}")
        _require(0 <= self.first_layer < self.n_layers,
                 f"graph {self.file}: first_layer must be in 0..{self.n_layers - 1}, got {self.first_layer}")
        _require(not self.has_argmax_rows or (self.has_argmax and self.has_logits_rows),
                 f"graph {self.file}: an argmax_rows input needs the argmax output and the logits_rows input")
        _require(isinstance(self.min_step_tokens, int) and 1 <= self.min_step_tokens <= MAX_MIN_STEP_TOKENS,
                 f"graph {self.file}: min_step_tokens must be an integer in 1..{MAX_MIN_STEP_TOKENS}, "
                 f"got {self.min_step_tokens!r}")

    @property
    def has_logits(self) -> bool:
        return "logits" in self.outputs

    @property
    def has_logits_rows(self) -> bool:
        """Whether the graph computes logits only for the step positions it is given (input `logits_rows`)."""
        return LOGITS_ROWS in self.inputs

    @property
    def has_argmax_rows(self) -> bool:
        """Whether the graph's argmax covers the positions it is given (input `argmax_rows`), computed without its
        logits (export/exact_argmax.py): a greedy step then asks for no logits row."""
        return ARGMAX_ROWS in self.inputs

    @property
    def has_argmax(self) -> bool:
        """Whether the graph outputs its logits' argmax (`argmax` [B,T] int64) beside them."""
        return "argmax" in self.outputs

    @property
    def has_features(self) -> bool:
        """An EAGLE head's graph: it takes a residual stream (`features`) beside the token ids."""
        return FEATURES in self.inputs

    @property
    def has_tree_bias(self) -> bool:
        """Whether the graph takes an attention bias, i.e. can verify a token tree in one step."""
        return ATTENTION_BIAS in self.inputs

    @property
    def entry(self) -> str:
        """The graph's first input: token ids, or (a slice starting past layer 0) the residual stream."""
        return "hidden_in" if self.first_layer else "input_ids"

    @property
    def t_invariant(self) -> bool:
        """Whether a T-token step computes what T single steps do, which lossless speculation relies on.
        Only int8-activation kernels (MatMulNBits accuracy_level 4, `quantize --fast-kernels`) break it, between
        1-token and wider steps (see min_step_tokens): a graph run with min_step_tokens 2 never takes the 1-token
        path."""
        return self.quant.get("accuracy_level") != 4 or self.min_step_tokens >= 2

    @property
    def kv_dtype(self) -> np.dtype:
        """The dtype of this graph's K/V buffers, which a KVCache for it must be allocated in: an fp16 graph
        keeps everything in fp16; int8/int4 are weight-only (fp32 activations, so fp32 K/V)."""
        return np.dtype(np.float16 if (self.activations or self.precision) == "fp16" else np.float32)


@dataclass(frozen=True)
class DrafterSpec:
    kind: str = "none"
    graph: str | None = None  # key into Manifest.graphs for kinds "model" and "eagle" (the head's graph)
    max_ngram: int = 3
    draft_len: int | str = 4  # tokens drafted per round by default, or "auto" (measured costs, see draft_len.py)
    # kind == "layerskip": the target is split at exit_layer into graphs "exit" (layers [0, E)) and "tail"
    # (layers [E, L) + head) over one cache; exit_head is the ONNX file mapping the residual stream after
    # layer E to logits over the draft vocabulary, draft_vocab the .npy file of the token ids they stand for.
    exit_layer: int = 0
    exit_head: str | None = None
    draft_vocab: str | None = None
    calibration: dict[str, Any] = field(default_factory=dict)  # export-time curve / training report figures
    heads: str | None = None  # kind == "medusa": the ONNX file mapping the target's last state to [K, N] logits
    # Any kind: the target's own answers (drafters/corpus.py), for the "corpus" drafter (prompt lookup, then this)
    corpus: str | None = None

    def __post_init__(self) -> None:
        _require(self.kind in DRAFTER_KINDS, f"drafter.kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        _require((self.graph is not None) == (self.kind in ("model", "eagle")),
                 "drafter.graph is required for kinds 'model' and 'eagle' and only for them")
        _require(self.max_ngram >= 1, "drafter.max_ngram must be >= 1")
        _require(self.draft_len == "auto" or (type(self.draft_len) is int and self.draft_len >= 1),
                 f"drafter.draft_len must be an integer >= 1 or 'auto', got {self.draft_len!r}")
        layerskip = self.kind == "layerskip"
        _require(layerskip == (self.exit_layer > 0) == (self.exit_head is not None),
                 "drafter.exit_layer and exit_head are required for kind 'layerskip' and only for it")
        _require((self.draft_vocab is not None) == (self.kind in ("layerskip", "eagle", "medusa")),
                 "drafter.draft_vocab is required for kinds 'layerskip', 'eagle' and 'medusa' and only for them")
        _require((self.heads is not None) == (self.kind == "medusa"),
                 "drafter.heads is required for kind 'medusa' and only for it")


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerSpec
    graphs: dict[str, GraphSpec]
    drafter: DrafterSpec
    files: dict[str, str]  # relative path -> sha256 of every file the bundle needs
    default_max_len: int = 2048
    source: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION
    created_by: str = ""

    def __post_init__(self) -> None:
        _require(self.format == FORMAT, f"format is {self.format!r}, expected {FORMAT!r}")
        _require(self.version in READABLE_VERSIONS,
                 f"bundle format version {self.version}, this specdec reads versions "
                 f"{', '.join(map(str, READABLE_VERSIONS))}")
        _require("target" in self.graphs, "graphs has no 'target'")
        _require(self.version >= ARGMAX_ROWS_SINCE or not any(g.has_argmax_rows for g in self.graphs.values()),
                 f"bundle format version {self.version} takes greedy choices from 8-bit scores that overflow on CPUs "
                 "without VNNI")
        if self.drafter.graph is not None:
            _require(self.drafter.graph in self.graphs, f"drafter.graph {self.drafter.graph!r} is not in graphs")
        for name, g in self.graphs.items():
            _require(g.file in self.files, f"graph {name}: file {g.file} is not listed in files")
        if self.drafter.kind == "layerskip":
            E, L = self.drafter.exit_layer, self.model.n_layers
            _require(0 < E < L, f"drafter.exit_layer must be in 1..{L - 1}, got {E}")
            _require(all(n in self.graphs for n in SPLIT_GRAPHS), "a layerskip bundle needs graphs 'exit' and 'tail'")
            ex, tail = self.graphs["exit"], self.graphs["tail"]
            _require(ex.first_layer == 0 and ex.n_layers == E and E in ex.hidden_layers,
                     f"graph 'exit' must run layers [0, {E}) and output hidden.{E}")
            _require(tail.first_layer == E and tail.n_layers == L and tail.has_logits,
                     f"graph 'tail' must run layers [{E}, {L}) and the LM head")
            for f in (self.drafter.exit_head, self.drafter.draft_vocab):
                _require(f in self.files, f"drafter file {f} is not listed in files")
        if self.drafter.kind in ("eagle", "medusa"):
            L = self.model.n_layers
            _require(L in self.graphs["target"].hidden_layers,
                     f"an {self.drafter.kind} bundle's target graph must output hidden.{L} (the residual stream its heads read)")
            for f in (self.drafter.draft_vocab, self.drafter.heads):
                _require(f is None or f in self.files, f"drafter file {f} is not listed in files")
        if self.drafter.kind == "eagle":
            head = self.graphs[self.drafter.graph]
            _require(head.has_features,
                     f"graph {self.drafter.graph!r} is not an EAGLE head (no 'features' input)")
            _require(head.model.hidden_size == self.model.hidden_size,
                     f"the EAGLE head's hidden size {head.model.hidden_size} differs from the target's {self.model.hidden_size}")
        _require(self.tokenizer.file in self.files, f"tokenizer file {self.tokenizer.file} is not listed in files")
        _require(0 < self.default_max_len <= self.model.max_position,
                 f"default_max_len must be in (0, {self.model.max_position}], got {self.default_max_len}")

    @property
    def model(self) -> ModelConfig:
        """The target's config."""
        return self.graphs["target"].model

    @property
    def split_target(self) -> bool:
        """Whether the runtime runs the target as its exit and tail slices (LayerSkip), whatever the drafter."""
        return self.drafter.kind == "layerskip"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        d = dict(d)
        d["tokenizer"] = _build(TokenizerSpec, d["tokenizer"], "tokenizer")
        d["graphs"] = {k: _build(GraphSpec, {**v, "model": _build(ModelConfig, v.get("model"), f"graphs.{k}.model")},
                                 f"graphs.{k}") for k, v in d["graphs"].items()}
        d["drafter"] = _build(DrafterSpec, d.get("drafter", {}), "drafter")
        return _build(cls, d, "manifest")


def _build(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**d)
    except TypeError as e:  # a missing required field
        raise ValueError(f"{where}: {e}") from None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(bundle: Path, verify_checksums: bool = True) -> Manifest:
    """Read and validate `bundle/specdec.json`; raise SpecdecError naming exactly what is wrong."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise SpecdecError(f"bundle folder {bundle} does not exist", "run `specdec export` first, or check the path")
    path = bundle / MANIFEST_NAME
    if not path.is_file():
        raise SpecdecError(f"{bundle} is not a specdec bundle: {MANIFEST_NAME} is missing",
                           "point at a folder written by `specdec export`")
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{path} is not valid JSON (line {e.lineno}): the manifest is corrupt",
                           "re-export the bundle") from None
    except (ValueError, KeyError) as e:
        raise SpecdecError(f"{path} is invalid: {e}", "re-export the bundle with this version of specdec") from None
    if verify_checksums:
        for rel, digest in manifest.files.items():
            f = bundle / rel
            if not f.is_file():
                raise SpecdecError(f"bundle file {f} is missing", "re-export the bundle")
            if sha256_file(f) != digest:
                raise SpecdecError(f"bundle file {f} does not match its checksum in {MANIFEST_NAME} (corrupt or modified)",
                                   "re-export the bundle")
    return manifest
