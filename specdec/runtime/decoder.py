"""Runs one decoder graph of a bundle over a KVCache with IOBinding.

The KV buffers are bound once, as both past input and present output. Per step only the small control
inputs are bound; logits (and hidden taps) land in preallocated buffers, one OrtValue view per step
width, so a decode step allocates nothing of size vocab or KV.

On a GPU provider (cuda, tensorrt) the logits stay on the device, in one slab bound by address, and only
the rows the caller reads come back: a verification step's k+1 rows, a prefill's last row (the other
chunks of a prompt are never copied at all). The CPU path is unchanged: logits are written straight into
host memory, where the caller reads them without a copy.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec.errors import SpecdecError
from specdec.runtime.greedy_path import GRAPH, LOGITS, GreedyPaths
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import (ARGMAX_ROWS, ATTENTION_BIAS, FEATURES, GPU_PRECISIONS, LOGITS_ROWS, GraphSpec,
                                      ModelConfig)
from specdec.runtime.session import RuntimeOptions, make_session
from specdec.runtime.trt_engines import claim_engine_cache

# Widest step the output buffers hold. Verification steps are k+1 <= this; prefill runs in chunks of
# this many tokens, which bounds the logits buffer (64 x 49k vocab x 4 B = 12.6 MB) while keeping the
# matmuls wide enough to be compute-bound.
MAX_STEP = 64
# Prefill chunk of a graph that computes logits for each chunk's last row only (logits_rows): wider matmuls run
# nearer the CPU's peak (768 prompt tokens: 1,147 ms in chunks of 64, 1,043 in 128, 1,014 in 256; fp32, 2 cores),
# and no logits buffer grows with the chunk (K/V and taps: a few MB).
PREFILL_CHUNK = 256
NO_ROWS = np.zeros(0, dtype=np.int64)  # logits_rows / argmax_rows of a step that wants none
NO_ROWS.setflags(write=False)  # shared by every decoder
_FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def logits_on_device(opts: RuntimeOptions) -> bool:
    """Keep logits on the device (and copy back only the rows read) exactly when the provider is a GPU's."""
    return opts.device != "cpu"


def check_precision_fits_provider(path: Path, spec: GraphSpec, opts: RuntimeOptions) -> None:
    """An fp16 graph on the CPU provider is one clear error, unless opts.runs_fp16_on_cpu (tests, export checks).

    onnxruntime's CPU kernels do take fp16, so it would run: slower than the fp32 graph (FACTS: 100 vs 44 us
    for one attention node) and less exact, which is never what someone choosing fp16 wanted.
    """
    if spec.precision in GPU_PRECISIONS and opts.provider == "cpu" and not opts.runs_fp16_on_cpu:
        raise SpecdecError(f"graph {Path(path).name} is {spec.precision}, and this run uses the CPU provider",
                           f"{spec.precision} is a GPU precision; use --provider cuda or a GPU --device profile, "
                           "or re-export/quantize with --precision fp32|int8|int4")


class Decoder:
    def __init__(self, path: Path, spec: GraphSpec, model: ModelConfig, kv: KVCache, opts: RuntimeOptions,
                 device_logits: bool | None = None) -> None:
        """`device_logits` overrides logits_on_device(opts); tests set it to run the device path on the CPU."""
        self.spec, self.model, self.kv = spec, model, kv
        check_precision_fits_provider(path, spec, opts)
        if opts.provider == "tensorrt" and opts.trt_cache_dir:  # before the session loads or builds engines
            claim_engine_cache(Path(opts.trt_cache_dir), Path(path), opts.device_id)
        self.session = make_session(path, opts)
        names = {i.name for i in self.session.get_inputs()}
        # The runtime feeds exactly what the manifest lists: a graph that disagrees is refused here, not mid-run.
        missing = [n for n in spec.inputs if n not in names]
        unlisted = sorted(names - set(spec.inputs))
        if missing or unlisted:
            what = f"lacks inputs {missing} listed in the manifest" if missing else \
                f"takes inputs {unlisted} that the manifest does not list"
            raise SpecdecError(f"graph {path.name} {what}", "the manifest and graph differ: re-export the bundle")
        if kv.n_layers != spec.model.n_layers:
            raise ValueError(f"KV cache has {kv.n_layers} layers, graph {path.name}'s model has {spec.model.n_layers}")
        types = {i.name: i.type for i in self.session.get_inputs()}
        graph_kv = _FLOAT_TYPES.get(types.get("past.0.key", ""))
        if graph_kv is not None and getattr(kv, "dtype", None) is not None and np.dtype(graph_kv) != kv.dtype:
            raise ValueError(f"graph {path.name} keeps K/V in {np.dtype(graph_kv)}, the KV cache is {kv.dtype}")
        out_types = {o.name: o.type for o in self.session.get_outputs()}
        self._logits_dtype = np.dtype(_FLOAT_TYPES.get(out_types.get("logits", ""), np.float32))
        self._entry_dtype = np.dtype(_FLOAT_TYPES.get(types.get(spec.entry, ""), np.int64))
        self.binding = self.session.io_binding()
        # A slice graph (LayerSkip exit or tail) binds only its layers of the one shared cache.
        for i in range(spec.first_layer, spec.n_layers):
            k_buf, v_buf = kv.values[i]
            self.binding.bind_ortvalue_input(f"past.{i}.key", k_buf)
            self.binding.bind_ortvalue_input(f"past.{i}.value", v_buf)
            self.binding.bind_ortvalue_output(f"present.{i}.key", k_buf)
            self.binding.bind_ortvalue_output(f"present.{i}.value", v_buf)
        B = kv.batch
        self.device_logits = spec.has_logits and (logits_on_device(opts) if device_logits is None else device_logits)
        if not spec.has_logits:
            self._logits = None
        elif self.device_logits:
            # One device slab; each step binds its [B,T,vocab] output at the slab's address. A second binding,
            # never run, turns (address, shape) into OrtValues over rows of the slab for the copy back.
            self._where = (opts.device, opts.device_id)
            self._logits_dev = ort.OrtValue.ortvalue_from_shape_and_type(
                [B * MAX_STEP * model.vocab_size], self._logits_dtype, opts.device, opts.device_id)
            self._row_binding = self.session.io_binding()
            self._logits = None
        else:
            self._logits = np.empty(B * MAX_STEP * model.vocab_size, dtype=self._logits_dtype)
        # The argmax output is bound to host memory even when the logits stay on the device: a greedy step then
        # brings back T ids, not T x vocab floats.
        self._argmax = np.empty(B * MAX_STEP if spec.has_argmax else 0, dtype=np.int64)
        # Widest step: a verification's (logits for every row) or a prefill chunk's (logits for its last row).
        self.max_step = PREFILL_CHUNK if spec.has_logits_rows else MAX_STEP
        self._hidden = {t: np.empty(B * self.max_step * model.hidden_size,
                                    dtype=_FLOAT_TYPES.get(out_types.get(f"hidden.{t}", ""), np.float32))
                        for t in spec.hidden_layers}
        self._out_views: dict[tuple[int, int], list[tuple[str, np.ndarray, ort.OrtValue]]] = {}
        self._features_dtype = np.dtype(_FLOAT_TYPES.get(types.get(FEATURES, ""), np.float32))
        self._tap_store: dict[int, np.ndarray] = {}  # tap -> [max_len, hidden], see keep_tap
        self.bias_dtype = np.dtype(_FLOAT_TYPES.get(types.get(ATTENTION_BIAS, ""), np.float32))
        self._zero_bias = np.zeros(kv.batch * self.max_step * kv.capacity if spec.has_tree_bias else 0, self.bias_dtype)
        if kv.capacity - kv.max_len < spec.min_step_tokens - 1:
            raise ValueError(f"graph {path.name} pads steps to {spec.min_step_tokens} tokens: its KV cache needs "
                             f"slack={spec.min_step_tokens - 1}")
        self._T_run = 0  # width the last step ran at (>= its real width when padded to spec.min_step_tokens)
        # Two exact ways to a greedy step's choices where the graph has the exact-argmax path; else its one way.
        self.greedy_paths = GreedyPaths() if spec.has_argmax_rows else None

    def keep_path(self, start: int, slots: np.ndarray) -> None:
        """After a tree step at cache length `start`, move the K/V (and kept taps) of the accepted nodes' slots
        (offsets from `start`, in path order) to start, start+1, ...: the cache then reads as if the path had been
        decoded as a chain. One fancy-index move per buffer (FACTS: ~17 us for 4 rows x 30 layers)."""
        slots = np.asarray(slots, dtype=np.int64)
        self.kv.compact(start, slots)
        for store in self._tap_store.values():
            store[start:start + len(slots)] = store[start + slots]

    def keep_tap(self, tap: int) -> None:
        """Keep tap `tap` by position, the way the cache keeps K/V: every forward also writes its T rows at the
        cache slots [length, length+T), so rows below kv.lengths[0] are always the tap of the tokens the cache
        holds (rejected drafts' rows are overwritten like their K/V). What an EAGLE head reads. Batch 1 only."""
        if tap not in self.spec.hidden_layers:
            raise ValueError(f"graph has no tap hidden.{tap} (taps: {self.spec.hidden_layers})")
        if self.kv.batch != 1:
            raise ValueError("keep_tap needs a batch-1 cache")
        if tap not in self._tap_store:
            self._tap_store[tap] = np.zeros((self.kv.max_len, self.model.hidden_size), dtype=self._hidden[tap].dtype)

    def kept_tap(self, tap: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a kept tap: [stop-start, hidden] (a view; valid below kv.lengths[0])."""
        return self._tap_store[tap][start:stop]

    def _outputs_for(self, T: int, rows: int, choice_rows: int | None = None) -> list[tuple[str, np.ndarray, ort.OrtValue]]:
        """Output buffers of a step of T positions whose last `rows` get logits and `choice_rows` (default: the same)
        an argmax; logits first."""
        choice_rows = rows if choice_rows is None else choice_rows
        key = (T, rows, choice_rows)
        if key not in self._out_views:
            B = self.kv.batch
            views = [] if self._logits is None else \
                [("logits", self._logits[: B * rows * self.model.vocab_size].reshape(B, rows, self.model.vocab_size))]
            views += [(f"hidden.{t}", buf[: B * T * self.model.hidden_size].reshape(B, T, self.model.hidden_size))
                      for t, buf in self._hidden.items()]
            views += [("argmax", self._argmax[: B * choice_rows].reshape(B, choice_rows))] if self.spec.has_argmax else []
            self._out_views[key] = [(n, v, ort.OrtValue.ortvalue_from_numpy(v)) for n, v in views]
        return self._out_views[key]

    def forward(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                query_lens: np.ndarray | None = None, features: np.ndarray | None = None,
                bias: np.ndarray | None = None) -> np.ndarray | None:
        """Run tokens [B,T] at the rows' current lengths; return logits [B,T,vocab] (a reused buffer).

        A slice graph starting past layer 0 takes the residual stream [B,T,hidden] instead of tokens; a
        graph without a head returns None (read its output with hidden()).

        K/V for the T tokens are written at [length, length+T) but not made valid: the caller decides
        how many to keep with kv.advance(). `positions` default to length + arange(T) (tree steps pass
        their own). `query_lens` [B] (default: T for every row) runs ragged rows: row b's first query_lens[b]
        tokens are real, the rest padding (not written to the KV, logits meaningless); 0 = an idle row,
        whose KV is untouched. GroupQueryAttention still needs length + T <= max_len for every active row.
        `features` [B,T,hidden] feeds an EAGLE head's graph (spec.has_features), and only that. `bias` [B,1,T,P+T]
        (a graph with spec.has_tree_bias) masks attention for a token-tree step; without it the step is causal.
        """
        B, T = self._run(tokens, positions, query_lens, features, bias)
        if not self.spec.has_logits:
            return None
        T_run = self._T_run
        logits = self._read_logits(B, T_run) if self.device_logits else self._outputs_for(T_run, T_run)[0][1]
        return logits if T_run == T else logits[:, :T]

    def forward_choices(self, tokens: np.ndarray, positions: np.ndarray | None = None,
                        bias: np.ndarray | None = None, query_lens: np.ndarray | None = None) -> np.ndarray:
        """Run a step like forward() and return the target's greedy choice at each position: the argmax of its
        logits [B,T] int64 (may be a reused buffer). A graph with an `argmax` output computes it where the logits
        are; one with the exact-argmax path also from full logits where that is faster here (greedy_path.py)."""
        if self.greedy_paths is None:
            return self._choices(GRAPH if self.spec.has_argmax else LOGITS, tokens, positions, bias, query_lens)
        shape = tokens.shape[:2]
        path = self.greedy_paths.pick(shape)
        t0 = time.perf_counter()
        choices = self._choices(path, tokens, positions, bias, query_lens)
        self.greedy_paths.record(shape, path, time.perf_counter() - t0)
        return choices

    def _choices(self, path: str, tokens: np.ndarray, positions: np.ndarray | None, bias: np.ndarray | None,
                 query_lens: np.ndarray | None) -> np.ndarray:
        if path == LOGITS:
            return np.argmax(self.forward(tokens, positions, query_lens=query_lens, bias=bias), axis=-1)
        B, T = self._run(tokens, positions, query_lens=query_lens, bias=bias, choices_only=True)
        return self._argmax[: B * self._T_run].reshape(B, self._T_run)[:, :T]

    def _run(self, tokens: np.ndarray, positions: np.ndarray | None,
             query_lens: np.ndarray | None = None, features: np.ndarray | None = None,
             bias: np.ndarray | None = None, last_rows: int | None = None,
             choices_only: bool = False) -> tuple[int, int]:
        """Run a step; `last_rows`: logits for the step's last rows only (graphs with spec.has_logits_rows; the
        others compute all T and the caller reads the rows it wants). `choices_only`: the caller reads the argmax
        of every row and no logits (a graph with spec.has_argmax_rows then computes no logits row). Returns (B, T)
        of the real step; a step padded to spec.min_step_tokens ran at self._T_run >= T positions, its real ones
        first."""
        B, T = tokens.shape[:2]
        if T > self.max_step or (last_rows or T) > MAX_STEP:
            raise ValueError(f"step of {T} tokens with logits for {last_rows or T} exceeds this graph's widest step "
                             f"({self.max_step} tokens, logits for {MAX_STEP}); prefill in chunks")
        q = np.full(B, T, dtype=np.int64) if query_lens is None else np.asarray(query_lens, dtype=np.int64)  # [B]
        for row in range(B):
            if q[row] > 0:
                self.kv.check_room(T, row)
        lengths = self.kv.lengths
        if positions is None:
            positions = lengths[:, None] + np.arange(T, dtype=np.int64)[None, :]  # [B,T]
        real_T, rows_idx = T, None
        if last_rows is not None and self.spec.has_logits_rows:
            rows_idx = np.arange(T - last_rows, T, dtype=np.int64)  # the real step's last rows, padded or not
        if T < self.spec.min_step_tokens and self.spec.pads_attention_only:  # the graph pads the attention alone
            _, positions, q, _, _ = _pad_step(self.spec.min_step_tokens, tokens, positions, q, None, None)
        elif T < self.spec.min_step_tokens:  # per row: GroupQueryAttention picks its path by T, not by B x T
            tokens, positions, q, features, bias = _pad_step(self.spec.min_step_tokens, tokens, positions, q,
                                                             features, bias)
            T = tokens.shape[1]
        self._T_run = T
        if rows_idx is None:
            rows_idx = np.arange(T, dtype=np.int64)
        choice_rows = None
        if self.spec.has_argmax_rows:  # the argmax without logits, or logits without the argmax
            choice_idx, rows_idx = (rows_idx, NO_ROWS) if choices_only else (NO_ROWS, rows_idx)
            choice_rows = len(choice_idx)
        rows = len(rows_idx)
        b = self.binding
        b.bind_cpu_input(self.spec.entry, np.ascontiguousarray(tokens, dtype=self._entry_dtype))
        b.bind_cpu_input("position_ids", np.ascontiguousarray(positions, dtype=np.int64))
        # An idle row's seqlens_k must still be a valid index (>= 0, GQA checks it against the rotary cache).
        b.bind_cpu_input("seqlens_k", np.where(q > 0, lengths + q - 1, 0).astype(np.int32))
        total = int(np.where(q > 0, lengths + q, 1).max())
        b.bind_cpu_input("total_sequence_length", np.array(total, dtype=np.int32))
        b.bind_cpu_input("query_lens", q.astype(np.int32))
        if (features is not None) != self.spec.has_features:
            raise ValueError("features are the input of an EAGLE head's graph, and it needs them")
        if features is not None:
            b.bind_cpu_input(FEATURES, np.ascontiguousarray(features, dtype=self._features_dtype))
        if bias is not None and not self.spec.has_tree_bias:
            raise ValueError("this graph has no attention_bias input: it cannot verify a token tree")
        if self.spec.has_tree_bias:
            if bias is None:  # a plain causal step: an all-zero bias, a view of one preallocated zero buffer
                bias = self._zero_bias[: B * T * total].reshape(B, 1, T, total)
            b.bind_cpu_input(ATTENTION_BIAS, np.ascontiguousarray(bias, dtype=self.bias_dtype))
        if self.spec.has_logits_rows:
            b.bind_cpu_input(LOGITS_ROWS, rows_idx)
        if self.spec.has_argmax_rows:
            b.bind_cpu_input(ARGMAX_ROWS, choice_idx)
        for name, _, value in self._outputs_for(T, rows, choice_rows):
            b.bind_ortvalue_output(name, value)
        if self.device_logits:
            b.bind_output("logits", self._where[0], self._where[1], self._logits_dtype,
                          [B, rows, self.model.vocab_size], self._logits_dev.data_ptr())
        self.session.run_with_iobinding(b)
        for tap, store in self._tap_store.items():  # batch 1: the real rows are the first real_T
            start = int(lengths[0])
            store[start:start + real_T] = self._hidden[tap][: real_T * self.model.hidden_size].reshape(real_T, -1)
        return B, real_T

    def _read_logits(self, B: int, T: int, first: int = 0) -> np.ndarray:
        """Rows [first, T) of every batch row of the last step's device logits [B,T,vocab], on the host."""
        V, size = self.model.vocab_size, self._logits_dtype.itemsize
        base = self._logits_dev.data_ptr()
        # (address, shape) of each contiguous block: the whole step, or the wanted rows of each batch row.
        blocks = [(base, [B, T, V])] if first == 0 else \
            [(base + (b * T + first) * V * size, [1, T - first, V]) for b in range(B)]
        out = []
        for ptr, shape in blocks:
            self._row_binding.bind_output("logits", self._where[0], self._where[1], self._logits_dtype, shape, ptr)
            out.append(self._row_binding.copy_outputs_to_cpu()[0])
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    def hidden(self, tap: int, T: int) -> np.ndarray:
        """The tap's output of the last forward of width T: [B,T,hidden] (a reused buffer)."""
        B, T_run = self.kv.batch, max(T, self._T_run)
        return self._hidden[tap][: B * T_run * self.model.hidden_size].reshape(B, T_run, self.model.hidden_size)[:, :T]

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Run a prompt [B,T] in max_step chunks, keep all of it, return the last position's logits [B,vocab].
        Only the last chunk's last row is read; a graph with `logits_rows` computes no other row's logits."""
        B, T = tokens.shape[:2]
        self.kv.check_room(T)
        last = None
        for start in range(0, T, self.max_step):
            chunk = tokens[:, start:start + self.max_step]
            b, t = self._run(chunk, None, last_rows=1)
            if start + self.max_step >= T:
                # The computed rows: the last real one alone (logits_rows), or every row of the step as run.
                rows, row = (1, 0) if self.spec.has_logits_rows else (self._T_run, t - 1)
                last = (self._read_logits(b, rows, row)[:, 0, :] if self.device_logits
                        else self._outputs_for(self._T_run, rows)[0][1][:, row, :]).copy()  # [B,vocab] (reused buffer)
            self.kv.advance(chunk.shape[1])
        return last


def _pad_step(T_run: int, tokens: np.ndarray, positions: np.ndarray, q: np.ndarray, features: np.ndarray | None,
              bias: np.ndarray | None) -> tuple:
    """A step [B,T] widened to T_run positions by repeating its last token (and feature row) at the next
    positions. The padding rows are ordinary tokens to the kernels: their K/V land past the valid length (the
    cache's slack), where nothing reads them before they are overwritten, and the real rows' attention never
    sees them (causal order, or -inf in a tree's bias). Rows' outputs are independent, so the real rows compute
    exactly what they would in any step of >= min_step_tokens positions."""
    B, T = tokens.shape[:2]
    pad = T_run - T
    tokens = np.concatenate([tokens, np.repeat(tokens[:, -1:], pad, axis=1)], axis=1)  # [B,T_run(,hidden)]
    positions = np.concatenate([positions, positions[:, -1:] + np.arange(1, pad + 1)[None, :]], axis=1)  # [B,T_run]
    q = np.where(q == T, T_run, q)  # [B] idle (0) rows stay idle
    if features is not None:
        features = np.concatenate([features, np.repeat(features[:, -1:], pad, axis=1)], axis=1)  # [B,T_run,hidden]
    if bias is not None:
        total = bias.shape[-1]
        padded = np.zeros(bias.shape[:2] + (T_run, total + pad), dtype=bias.dtype)  # [B,1,T_run,total+pad]
        padded[:, :, :T, :total] = bias
        padded[:, :, :T, total:] = np.finfo(bias.dtype).min
        bias = padded
    return tokens, positions, q, features, bias
