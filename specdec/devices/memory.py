"""Memory arithmetic: weights + KV + workspace must fit a budget; how long may the KV buffers be?

    KV bytes per token = n_layers x 2 (K and V) x n_kv_heads x head_dim x bytes(dtype) x batch
    room for KV        = budget - weights - workspace
    KV length          = min(model positions, floor(room / KV bytes per token) rounded down to a multiple of 256)

SmolLM2-135M in fp32: 30 x 2 x 3 x 64 x 4 B = 46,080 B per token. Every graph the engine loads (the target
and a draft model) has its own KV buffers of the same length, so their per-token bytes add up.

Weights are the bundle's graph files (the .onnx and its external data), or, without a bundle, an estimate
from the model's shape at a precision. Pure arithmetic: stdlib + the manifest dataclasses.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from specdec.errors import SpecdecError
from specdec.runtime.manifest import GraphSpec, Manifest, ModelConfig

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
KV_MULTIPLE = 256  # KV lengths are rounded down to this: TensorRT/CUDA kernels and engine caches like round shapes

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
# Bytes per weight of a MatMul at each precision. int8/int4 are MatMulNBits weights with one fp32 scale per
# block of 32: 1 + 4/32 and 0.5 + 4/32 (the export's block size; zero points are ignored: < 2%).
WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}

# The default model's shape (Llama architecture; FACTS and bundles/smollm2/specdec.json), for `specdec devices`
# without a bundle and for the tests.
SMOLLM2_135M = ModelConfig(model_type="llama", n_layers=30, hidden_size=576, n_heads=9, n_kv_heads=3, head_dim=64,
                           intermediate_size=1536, vocab_size=49152, max_position=8192, rms_eps=1e-5,
                           tie_embeddings=True)


def fmt_bytes(n: float) -> str:
    """1.50 GiB, 540.2 MiB, 45.0 KiB, 12 B."""
    n = float(n)
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{sign}{n / KiB:.1f} KiB"
    return f"{sign}{n:.0f} B"


def kv_dtype(precision: str) -> str:
    """The KV dtype of a graph: specdec's int8/int4 are weight-only (fp32 activations), so only fp16 graphs
    keep fp16 K/V."""
    return "fp16" if precision == "fp16" else "fp32"


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "fp32", batch: int = 1) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"KV dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    for what, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim), ("batch", batch)):
        if v <= 0:
            raise ValueError(f"{what} must be > 0, got {v}")
    return n_layers * 2 * n_kv_heads * head_dim * DTYPE_BYTES[dtype] * batch


@dataclass(frozen=True)
class KVShape:
    """One graph's KV buffers: what one more token of KV length costs."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "fp32"
    batch: int = 1

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, self.dtype, self.batch)

    def formula(self) -> str:
        s = (f"{self.n_layers} layers x 2 (K,V) x {self.n_kv_heads} kv heads x {self.head_dim} head_dim x "
             f"{DTYPE_BYTES[self.dtype]} B ({self.dtype})")
        return s + (f" x batch {self.batch}" if self.batch != 1 else "")

    @classmethod
    def of_graph(cls, name: str, g: GraphSpec, batch: int = 1) -> "KVShape":
        return cls(name, g.n_layers, g.model.n_kv_heads, g.model.head_dim, kv_dtype(g.precision), batch)


@dataclass(frozen=True)
class WeightPart:
    name: str
    nbytes: int
    how: str  # where the number comes from: files, or parameters x bytes


def estimate_params(model: ModelConfig) -> tuple[int, int]:
    """(MatMul weights, embedding weights) of a Llama-style decoder; norms are counted with the MatMuls.

    SmolLM2-135M: 106.2M + 28.3M = 134.5M.
    """
    D, hd, F = model.hidden_size, model.head_dim, model.intermediate_size
    qkv = D * (model.n_heads + 2 * model.n_kv_heads) * hd
    o = model.n_heads * hd * D
    mlp = 3 * D * F  # gate, up, down
    per_layer = qkv + o + mlp + 2 * D + (model.n_heads + 2 * model.n_kv_heads) * hd * model.attention_bias
    matmul = model.n_layers * per_layer + D  # + the final norm
    embedding = model.vocab_size * D
    if not model.tie_embeddings:
        matmul += model.vocab_size * D  # an LM head of its own
    return matmul, embedding


def estimate_weight_bytes(model: ModelConfig, precision: str, n_layers: int | None = None) -> WeightPart:
    """Weights of a graph at `precision`, from the model's shape.

    The embedding table stays in float (a Gather reads it: fp16 in an fp16 graph, else fp32); a quantized
    graph with tied embeddings carries a quantized copy of it as its LM head.
    """
    if precision not in WEIGHT_BYTES:
        raise ValueError(f"precision must be one of {', '.join(WEIGHT_BYTES)}, got {precision!r}")
    matmul, embedding = estimate_params(model)
    if n_layers is not None and n_layers != model.n_layers:  # an early-exit draft: fewer layers
        per_layer = (matmul - model.hidden_size) // model.n_layers
        matmul -= per_layer * (model.n_layers - n_layers)
    emb_bytes = embedding * (2 if precision == "fp16" else 4)
    head = embedding if (model.tie_embeddings and precision in ("int8", "int4")) else 0
    total = int(emb_bytes + (matmul + head) * WEIGHT_BYTES[precision])
    how = (f"estimate: {(matmul + head) / 1e6:.1f}M matmul weights x {WEIGHT_BYTES[precision]:g} B ({precision}) + "
           f"{embedding / 1e6:.1f}M embedding x {2 if precision == 'fp16' else 4} B")
    return WeightPart("weights", total, how)


def graph_files(manifest: Manifest, g: GraphSpec) -> list[str]:
    """The files of one graph: the .onnx and its external data (`X.onnx.data`)."""
    return [rel for rel in manifest.files if rel == g.file or rel.startswith(g.file + ".")]


def graphs_loaded(manifest: Manifest, drafter: str | None = None) -> list[str]:
    """Which graphs the engine loads: the target, and the draft graph for drafter model/hybrid."""
    kind = drafter or manifest.drafter.kind
    names = ["target"]
    if kind in ("model", "hybrid") and manifest.drafter.graph is not None:
        names.append(manifest.drafter.graph)
    return names


def bundle_parts(bundle: Path, manifest: Manifest, graphs: Iterable[str]) -> tuple[list[WeightPart], list[KVShape], int]:
    """Weights (file sizes; an estimate for a file that is missing), KV shapes and the positions cap."""
    weights, kv = [], []
    max_position = None
    for name in graphs:
        g = manifest.graphs[name]
        files = graph_files(manifest, g)
        paths = [Path(bundle) / f for f in files]
        if paths and all(p.is_file() for p in paths):
            weights.append(WeightPart(name, sum(p.stat().st_size for p in paths), " + ".join(files)))
        else:
            est = estimate_weight_bytes(g.model, g.precision, g.n_layers)
            weights.append(WeightPart(name, est.nbytes, est.how))
        kv.append(KVShape.of_graph(name, g))
        max_position = g.model.max_position if max_position is None else min(max_position, g.model.max_position)
    return weights, kv, int(max_position)


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    weights: tuple[WeightPart, ...]
    workspace: int
    kv: tuple[KVShape, ...]
    max_position: int
    kv_len: int
    budget_how: str = ""
    kv_len_how: str = ""

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(k.bytes_per_token for k in self.kv)

    @property
    def room(self) -> int:
        """What the KV buffers may take: budget - weights - workspace."""
        return self.budget - self.weight_bytes - self.workspace

    @property
    def kv_bytes(self) -> int:
        return self.kv_len * self.kv_bytes_per_token

    @property
    def unused(self) -> int:
        return self.room - self.kv_bytes

    def breakdown(self) -> str:
        """The arithmetic, one step a line."""
        w = 14
        lines = [f"  budget        {fmt_bytes(self.budget):>{w}}" + (f"  ({self.budget_how})" if self.budget_how else "")]
        for i, part in enumerate(self.weights):
            lead = "- weights     " if i == 0 else "              "
            lines.append(f"  {lead}{fmt_bytes(part.nbytes):>{w}}  {part.name}: {part.how}")
        lines.append(f"  - workspace   {fmt_bytes(self.workspace):>{w}}")
        lines.append(f"  = room for KV {fmt_bytes(self.room):>{w}}")
        for i, k in enumerate(self.kv):
            lead = "KV per token  " if i == 0 else "            + "
            lines.append(f"  {lead}{k.bytes_per_token:>{w - 2},} B  {k.name}: {k.formula()}")
        if len(self.kv) > 1:
            lines.append(f"              = {self.kv_bytes_per_token:>{w - 2},} B")
        lines.append(f"  KV length     {self.kv_len:>{w},}  {self.kv_len_how}")
        lines.append(f"  KV buffers    {fmt_bytes(self.kv_bytes):>{w}}  ({self.kv_len:,} x {self.kv_bytes_per_token:,} B), "
                     f"{fmt_bytes(self.unused)} of the room unused")
        return "\n".join(lines)


def plan_kv(budget: int, weights: Sequence[WeightPart], workspace: int, kv: Sequence[KVShape], max_position: int,
            requested_len: int | None = None, budget_how: str = "", multiple: int = KV_MULTIPLE) -> MemoryPlan:
    """The longest KV buffers that fit (or check that `requested_len` fits); SpecdecError when nothing fits."""
    if not kv:
        raise ValueError("no KV shapes: at least the target graph's")
    weights, kv = tuple(weights), tuple(kv)
    weight_bytes = sum(w.nbytes for w in weights)
    per_token = sum(k.bytes_per_token for k in kv)
    room = budget - weight_bytes - workspace
    ways = "use a lower precision (int8/int4), a smaller model, or a profile with more memory"
    if room <= 0:
        raise SpecdecError(
            f"weights ({fmt_bytes(weight_bytes)}) and workspace ({fmt_bytes(workspace)}) need "
            f"{fmt_bytes(weight_bytes + workspace)} but the memory budget is {fmt_bytes(budget)}: "
            f"{fmt_bytes(-room)} missing before any KV", ways)
    fits = room // per_token  # tokens of KV that fit
    if requested_len is not None:
        if requested_len <= 0:
            raise SpecdecError(f"KV length must be > 0, got {requested_len}")
        if requested_len > max_position:
            raise SpecdecError(f"KV length {requested_len} exceeds the model's {max_position} positions",
                               f"use --max-len {max_position} or less")
        need = requested_len * per_token
        if need > room:
            largest = min(max_position, fits // multiple * multiple) or fits
            raise SpecdecError(
                f"not enough memory for KV length {requested_len}: it needs {fmt_bytes(need)} "
                f"({requested_len:,} x {per_token:,} B per token) but {fmt_bytes(room)} is left after weights "
                f"({fmt_bytes(weight_bytes)}) and workspace ({fmt_bytes(workspace)}) in the {fmt_bytes(budget)} "
                f"budget: {fmt_bytes(need - room)} missing",
                (f"use --max-len {largest} or less, or " if largest > 0 else "") + ways)
        return MemoryPlan(budget, weights, workspace, kv, max_position, requested_len, budget_how,
                          f"requested; {fits:,} would fit")
    least = min(multiple, max_position)
    if fits < least:
        raise SpecdecError(
            f"not enough memory for a KV buffer of {least} tokens: {fmt_bytes(room)} is left after weights "
            f"({fmt_bytes(weight_bytes)}) and workspace ({fmt_bytes(workspace)}) in the {fmt_bytes(budget)} budget, "
            f"room for {fits:,} tokens at {per_token:,} B each; {fmt_bytes(least * per_token - room)} missing", ways)
    rounded = fits // multiple * multiple
    if rounded >= max_position:
        kv_len, how = max_position, f"the model's {max_position:,} positions (room for {fits:,})"
    else:
        kv_len, how = rounded, f"{fits:,} fit, rounded down to a multiple of {multiple}"
    return MemoryPlan(budget, weights, workspace, kv, max_position, kv_len, budget_how, how)


def plan_for_model(model: ModelConfig, precision: str, budget: int, workspace: int, draft: bool = False,
                   draft_precision: str = "int8", requested_len: int | None = None, budget_how: str = "") -> MemoryPlan:
    """Without a bundle: the target at `precision` (and optionally its self-draft) estimated from the shape."""
    parts = [WeightPart("target", *_est(model, precision))]
    kv = [KVShape("target", model.n_layers, model.n_kv_heads, model.head_dim, kv_dtype(precision))]
    if draft:
        parts.append(WeightPart("draft", *_est(model, draft_precision)))
        kv.append(KVShape("draft", model.n_layers, model.n_kv_heads, model.head_dim, kv_dtype(draft_precision)))
    return plan_kv(budget, parts, workspace, kv, model.max_position, requested_len, budget_how)


def _est(model: ModelConfig, precision: str) -> tuple[int, str]:
    w = estimate_weight_bytes(model, precision)
    return w.nbytes, w.how
