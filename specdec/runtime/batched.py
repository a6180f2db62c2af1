"""Batched speculative decoding: B sequences share one target graph, each at its own pace.

Every round, each active row proposes up to k tokens with its own drafter; the target verifies all rows
in one forward over a [B, T] input (T = 1 + the longest row's draft, shorter rows right-padded) and each
row keeps its own number of tokens (ragged acceptance). A finished row is refilled with the next request
at once (continuous batching), so the batch stays full until the queue runs dry.

What makes that exact (each row's greedy output equals what the row gets alone) is onnxruntime's
GroupQueryAttention with `query_lens` (its `query_seqlens` input), checked on the CPU provider
(onnxruntime 1.32) against batch-1 runs:

- per-row pasts: `seqlens_k[b] = length[b] + query_lens[b] - 1`, K/V of row b written in place at
  [length[b], length[b] + query_lens[b]); each row attends only to its own valid prefix;
- right padding: a row's tokens past query_lens[b] are not written to its KV, and their positions are
  ignored (even out of the rotary cache's range); their logits are garbage and never read;
- idle rows: query_lens[b] = 0 leaves row b's KV untouched, but seqlens_k[b] must still be >= 0 (the
  kernel checks it against the rotary cache), so an idle row passes 0;
- the padded width must fit every *active* row: length[b] + T <= max_len (the kernel refuses otherwise),
  so a round's drafts are capped by the fullest active row's room (only near the end of the KV buffer);
  idle rows, passing seqlens_k 0, do not constrain it.

Rejected drafts cost nothing to roll back: a row's length advances by 1 + its accepted count, and the
stale K/V past it are overwritten next round (as at batch 1, see kv.py).

A new request's prompt is prefilled at batch 1: on the CPU a second IOBinding of the same session binds
that row's slice of the KV slab ([1, kv_heads, max_len, head_dim], contiguous), so a refill neither pads
B-1 idle rows through the matmuls nor loads the weights twice. The same binding runs a round when only
one row is left. (On a GPU provider, where the KV has no host slab, the prefill runs through the batched
graph with the other rows idle.)

Drafters: "none", "ngram" and "corpus" (one NgramDrafter or CorpusDrafter per row, the corpus loaded once and
the learnt reliabilities shared by every row; deterministic, so with a fixed draft length sampled rows are also
exactly what the row gets alone with the same seed), "model" (the bundle's draft graph batched
the same way, one draft step for all rows at once, see BatchedModelDrafter; the int8 draft's kernels differ
between 1 and several rows, so its sampled drafts, not the target's distribution, differ from batch 1).
"hybrid" is batch-1 only.

Draft length: a fixed k per row, or "auto": one width per round for the whole batch (_auto_widths), since on
a CPU a step of B rows x (1+k) positions is compute-bound and one row's long draft costs every row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import onnxruntime as ort

from specdec.errors import SpecdecError
from specdec.runtime.acceptance import greedy_accept, greedy_accept_choices, speculative_accept
from specdec.runtime.decoder import MAX_STEP, NO_ROWS, Decoder
from specdec.runtime.draft_len import (ACCEPT_EMA, ACCEPT_PRIOR, AdaptiveDraftLen, DraftLenPolicy, choose_policy,
                                       median_seconds)
from specdec.runtime.drafters.base import Draft
from specdec.runtime.manifest import ARGMAX_ROWS, ATTENTION_BIAS, LOGITS_ROWS
from specdec.runtime.drafters.draft_model import CONFIDENCE_STOP, draft_confidence
from specdec.runtime.drafters.corpus import CorpusDrafter
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.engine import (AUTO_K_MAX, Engine, Generation, GenerationConfig, OutputText,
                                   batch_default_drafter, corpus_drafter)
from specdec.runtime.kv import KVCache
from specdec.runtime.manifest import Manifest, read_manifest
from specdec.runtime.sampling import probs_from_logits, sample, select_token
from specdec.runtime.session import RuntimeOptions, provider_list
from specdec.runtime.speculative import NO_DRAFT, SpecStats
from specdec.runtime.tokenizer import TextCodec

BATCH_DRAFTERS = ("none", "ngram", "corpus", "model")


@dataclass(frozen=True)
class BatchRequest:
    key: object  # the caller's handle, returned with the result (not hashed)
    prompt_ids: tuple[int, ...]
    cfg: GenerationConfig


class _RowBinding:
    """Batch-1 runs of one row of a batched decoder: the same session, the row's slice of the KV slab."""

    def __init__(self, decoder: Decoder, row: int, logits: np.ndarray, hidden: dict[int, np.ndarray]) -> None:
        """`logits` [MAX_STEP*vocab] and `hidden` are shared by all rows' bindings (one runs at a time)."""
        kv = decoder.kv
        self.decoder, self.row = decoder, row
        self.binding = decoder.session.io_binding()
        for i in range(kv.n_layers):
            for j, kind in enumerate(("key", "value")):
                view = ort.OrtValue.ortvalue_from_numpy(kv.slab[i, j, row:row + 1])  # [1,KV,M,H], contiguous
                self.binding.bind_ortvalue_input(f"past.{i}.{kind}", view)
                self.binding.bind_ortvalue_output(f"present.{i}.{kind}", view)
        self._logits, self._hidden = logits, hidden
        self._argmax = np.empty(MAX_STEP, dtype=np.int64)  # the graph's greedy choices (forward(choices_only=True))
        self._views: dict[tuple[int, int, int], list[tuple[str, np.ndarray, ort.OrtValue]]] = {}  # (T, rows, choices)

    def _outputs(self, T: int, choices_only: bool = False) -> list[tuple[str, np.ndarray, ort.OrtValue]]:
        # A graph that computes its argmax without logits (argmax_rows) gives either, not both.
        split = self.decoder.spec.has_argmax_rows
        rows, choices = (0 if split and choices_only else T), (0 if split and not choices_only else T)
        if (T, rows, choices) not in self._views:
            m = self.decoder.model
            views = [("logits", self._logits[: rows * m.vocab_size].reshape(1, rows, m.vocab_size))]
            views += [("argmax", self._argmax[:choices].reshape(1, choices))] if self.decoder.spec.has_argmax else []
            views += [(f"hidden.{t}", b[: T * m.hidden_size].reshape(1, T, m.hidden_size))
                      for t, b in self._hidden.items()]
            self._views[(T, rows, choices)] = [(n, v, ort.OrtValue.ortvalue_from_numpy(v)) for n, v in views]
        return self._views[(T, rows, choices)]

    def forward(self, tokens: Sequence[int], choices_only: bool = False) -> np.ndarray:
        """Run tokens at the row's length (not advanced); return logits [T, vocab] (a reused buffer), or with
        `choices_only` the greedy choices [T] (a graph with argmax_rows then computes no logits)."""
        real_T = len(tokens)
        kv = self.decoder.kv
        kv.check_room(real_T, self.row)
        # A graph with min_step_tokens > 1 computes a 1-token step on another kernel path: pad as Decoder does.
        tokens = list(tokens) + [tokens[-1]] * max(0, self.decoder.spec.min_step_tokens - real_T)
        T = len(tokens)
        length = int(kv.lengths[self.row])
        b = self.binding
        b.bind_cpu_input("input_ids", np.asarray([tokens], dtype=np.int64))
        b.bind_cpu_input("position_ids", (length + np.arange(T, dtype=np.int64))[None, :])
        b.bind_cpu_input("seqlens_k", np.array([length + T - 1], dtype=np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(length + T, dtype=np.int32))
        b.bind_cpu_input("query_lens", np.array([T], dtype=np.int32))
        if self.decoder.spec.has_tree_bias:  # a tree-capable graph run as a plain causal step
            b.bind_cpu_input(ATTENTION_BIAS, np.zeros((1, 1, T, length + T), dtype=self.decoder.bias_dtype))
        every = np.arange(T, dtype=np.int64)
        split = self.decoder.spec.has_argmax_rows
        if self.decoder.spec.has_logits_rows:
            b.bind_cpu_input(LOGITS_ROWS, NO_ROWS if split and choices_only else every)
        if split:
            b.bind_cpu_input(ARGMAX_ROWS, every if choices_only else NO_ROWS)
        outputs = self._outputs(T, choices_only)
        for name, _, value in outputs:
            b.bind_ortvalue_output(name, value)
        self.decoder.session.run_with_iobinding(b)
        if choices_only:
            return self._argmax[:real_T] if self.decoder.spec.has_argmax else outputs[0][1][0, :real_T].argmax(-1)
        return outputs[0][1][0, :real_T]


class BatchedDecoder:
    """A Decoder over KVCache(batch=B) plus ragged-row helpers: prefill one row, run any subset of rows."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder, self.kv = decoder, decoder.kv
        self.B = decoder.kv.batch
        self.rows = None
        if decoder.kv.slab is not None:
            m = decoder.model
            out_types = {o.name: o.type for o in decoder.session.get_outputs()}
            dtype = np.float16 if out_types.get("logits") == "tensor(float16)" else np.float32
            logits = np.empty(MAX_STEP * m.vocab_size, dtype=dtype)
            hidden = {t: np.empty(MAX_STEP * m.hidden_size, dtype=np.float32) for t in decoder.spec.hidden_layers}
            self.rows = [_RowBinding(decoder, r, logits, hidden) for r in range(self.B)]

    def forward_rows(self, inputs: dict[int, Sequence[int]], choices_only: bool = False) -> dict[int, np.ndarray]:
        """Run each row's tokens at its length (rows not in `inputs` idle); return each row's logits [q_b, vocab],
        or with `choices_only` its greedy choices [q_b] (all rows greedy: a graph with argmax_rows reads no fp32 head).

        Lengths are not advanced. Results are views of a reused buffer: read them before the next call.
        """
        if len(inputs) == 1 and self.rows is not None:  # one row: batch 1, no padded rows through the matmuls
            (r, toks), = inputs.items()
            return {r: self.rows[r].forward(toks, choices_only)}
        T = max(len(t) for t in inputs.values())
        if len(inputs) > 1 and any(int(self.kv.lengths[r]) + T > self.kv.max_len for r in inputs):
            # The padded width must fit every active row (GQA); near the end of the buffer run rows one by one.
            return {r: self.forward_rows({r: toks}, choices_only)[r].copy() for r, toks in inputs.items()}
        tokens = np.zeros((self.B, T), dtype=np.int64)  # [B,T]
        q = np.zeros(self.B, dtype=np.int64)  # [B] 0 = idle row
        for r, toks in inputs.items():
            tokens[r, :len(toks)] = toks
            q[r] = len(toks)
        # Padding and idle positions are ignored by the kernel; give them the row's last real position anyway.
        positions = self.kv.lengths[:, None] + np.minimum(np.arange(T), np.maximum(q - 1, 0)[:, None])  # [B,T]
        if choices_only:
            choices = self.decoder.forward_choices(tokens, positions, query_lens=q)  # [B,T]
            return {r: choices[r, :q[r]] for r in inputs}
        logits = self.decoder.forward(tokens, positions, query_lens=q)  # [B,T,vocab]
        return {r: logits[r, :q[r]] for r in inputs}

    def prefill_row(self, row: int, ids: Sequence[int]) -> np.ndarray:
        """Make `ids` valid in `row` after its current length, in MAX_STEP chunks; return the last logits [vocab]."""
        self.kv.check_room(len(ids), row)
        last = None
        for start in range(0, len(ids), MAX_STEP):
            chunk = list(ids[start:start + MAX_STEP])
            last = self.forward_rows({row: chunk})[row][-1].copy()
            self.kv.lengths[row] += len(chunk)
        return last


class BatchedModelDrafter:
    """The bundle's draft model drafting for all rows at once: one [B, 1..2] step per drafted position.

    Per row it keeps what ModelDrafter keeps (`ids` mirrors the row's draft KV): a round first feeds the
    row's tokens the draft KV lacks (the target's correction, or the last draft and the bonus token after
    a fully accepted round), then drafts one token per step. Rows drafting fewer tokens go idle
    (query_lens 0) for the remaining steps.
    """

    def __init__(self, decoder: Decoder, confidence_stop: float = CONFIDENCE_STOP) -> None:
        self.dec = BatchedDecoder(decoder)
        self.kv = decoder.kv
        self.confidence_stop = confidence_stop  # as ModelDrafter's: a row stops drafting after an unsure token
        B = self.kv.batch
        self.ids: list[list[int]] = [[] for _ in range(B)]
        self._proposed: list[list[int]] = [[] for _ in range(B)]

    def begin(self, row: int) -> None:
        self.ids[row] = []
        self._proposed[row] = []
        self.kv.lengths[row] = 0

    def propose(self, rows: dict[int, tuple[Sequence[int], int, object, np.random.Generator]]) -> dict[int, Draft]:
        """rows: row -> (context, k, sampling, rng). Returns each row's Draft (possibly empty)."""
        kv, vocab = self.kv, self.dec.decoder.model.vocab_size
        steps: dict[int, list[int]] = {}  # first step's input per drafting row
        want: dict[int, int] = {}
        for r, (context, k, _, _) in rows.items():
            pending = list(context[len(self.ids[r]):])
            k = min(k, kv.max_len - int(kv.lengths[r]) - len(pending) + 1)
            if k <= 0 or not pending:
                continue
            if len(pending) > 2:  # a new prompt: prefill all but the last token at batch 1
                self.dec.prefill_row(r, pending[:-1])
                pending = pending[-1:]
            self.ids[r] += list(context[len(self.ids[r]):])
            steps[r], want[r] = pending, k
        tokens = {r: np.empty(k, dtype=np.int64) for r, k in want.items()}
        p_draft = {r: None if rows[r][2].greedy else np.empty((k, vocab), dtype=np.float32) for r, k in want.items()}
        for i in range(max(want.values(), default=0)):
            inputs = {r: steps[r] for r in want if i < want[r]}
            if not inputs:
                break
            logits = self.dec.forward_rows(inputs)
            for r, lo in logits.items():
                kv.lengths[r] += len(inputs[r])
                sampling, rng = rows[r][2], rows[r][3]
                if p_draft[r] is None:
                    tokens[r][i] = int(np.argmax(lo[-1]))
                else:
                    p_draft[r][i] = probs_from_logits(lo[-1], sampling)
                    tokens[r][i] = sample(p_draft[r][i], rng)
                steps[r] = [int(tokens[r][i])]
                p_row = None if p_draft[r] is None else p_draft[r][i]
                if draft_confidence(lo[-1], int(tokens[r][i]), p_row) < self.confidence_stop:
                    want[r] = i + 1  # the row goes idle for the remaining steps
        for r, k in want.items():
            tokens[r] = tokens[r][:k]  # [k]
            p_draft[r] = None if p_draft[r] is None else p_draft[r][:k]  # [k, vocab]
        out = {}
        for r in rows:
            if r not in want:
                out[r] = NO_DRAFT
                self._proposed[r] = []
                continue
            # The KV now holds pending + tokens[:k-1]; the last draft was never fed.
            self._proposed[r] = tokens[r][:-1].tolist()
            self.ids[r] += self._proposed[r]
            out[r] = Draft(tokens=tokens[r], p_draft=p_draft[r])
        return out

    def accept(self, row: int, n_accepted: int) -> None:
        n_kept = min(n_accepted, len(self._proposed[row]))
        keep = len(self.ids[row]) - len(self._proposed[row]) + n_kept
        self.ids[row] = self.ids[row][:keep]
        self.kv.lengths[row] = min(int(self.kv.lengths[row]), keep)


class _Row:
    """One sequence in flight: its request, drafter, policy, rng, output text and stats."""

    def __init__(self, req: BatchRequest, codec: TextCodec, eos: set[int]) -> None:
        self.req, self.cfg = req, req.cfg
        self.rng = np.random.default_rng(req.cfg.seed)
        self.stats = SpecStats()
        self.out = OutputText(codec, eos, req.cfg)
        self.context: list[int] = []
        self.token = -1  # the last emitted token: the next round's first input, not yet in the KV
        self.drafter: NgramDrafter | CorpusDrafter | None = None
        self.policy: DraftLenPolicy | None = None
        self.t_decode = 0.0
        self.done = False
        self.index = -1  # its row in the batch
        self.piece = ""  # the text the last round added (streamed by the server)

    def emit(self, tokens: list[int]) -> bool:
        """Take one round's tokens exactly as Engine.stream does; True when finished."""
        self.piece = self.out.push(tokens)
        self.stats.new_tokens = len(self.out.ids)
        return self.out.done

    def result(self) -> Generation:
        if not self.out.done:
            self.out.finish()  # ended by a full KV buffer
        return self.out.result(self.stats)


class BatchedEngine:
    """Generates many requests, up to `batch_size` at once, with continuous refill.

        engine = BatchedEngine("bundles/smollm2", batch_size=4, drafter="ngram")
        cfg = GenerationConfig(max_new_tokens=64)
        reqs = [BatchRequest(i, tuple(engine.encode(p)), cfg) for i, p in enumerate(prompts)]
        for req, result in engine.run(reqs):   # in finishing order; result is a Generation or a SpecdecError
            ...
    """

    encode = Engine.encode  # needs only .codec and .manifest: one definition of how prompts become ids

    def __init__(self, bundle: str | Path, batch_size: int, max_len: int | None = None,
                 runtime: RuntimeOptions | None = None, drafter: str | None = None,
                 verify_checksums: bool = True) -> None:
        if batch_size < 1:
            raise SpecdecError(f"batch size must be >= 1, got {batch_size}")
        self.path = Path(bundle)
        self.manifest: Manifest = read_manifest(self.path, verify_checksums=verify_checksums)
        self.runtime = runtime or RuntimeOptions()
        provider_list(self.runtime)
        m = self.manifest
        self.max_len = m.default_max_len if max_len is None else max_len
        if not 0 < self.max_len <= m.model.max_position:
            raise SpecdecError(f"--max-len {self.max_len} is outside 1..{m.model.max_position} (the model's positions)")
        self.batch_size = batch_size
        self.codec = TextCodec(self.path / m.tokenizer.file, m.tokenizer.chat_template, m.tokenizer.bos_token_id,
                               m.tokenizer.eos_token_ids)
        self.drafter_kind = drafter or batch_default_drafter(self.path, m, self.runtime, BATCH_DRAFTERS)
        if self.drafter_kind not in BATCH_DRAFTERS:
            raise SpecdecError(f"drafter {self.drafter_kind!r} is not supported with batch size > 1",
                               f"choose {', '.join(BATCH_DRAFTERS)}, or batch size 1")
        self.target = BatchedDecoder(self._decoder("target"))
        self.draft_model: BatchedModelDrafter | None = None
        if self.drafter_kind == "model":
            if m.drafter.graph is None:
                raise SpecdecError(f"bundle {self.path} has no draft model", "use --drafter ngram or none")
            self.draft_model = BatchedModelDrafter(self._decoder(m.drafter.graph))
        # Corpus rows: one index of the corpus, and the reliabilities every row learns into.
        self._corpus_drafter = corpus_drafter(self.path, m) if self.drafter_kind == "corpus" else None
        # (target step seconds by width 1..k_max+1, draft step seconds at width 1, at width 2), full batch
        self._costs: tuple[list[float], float, float] | None = None
        # target step seconds by width when one row is active: it runs at batch 1 (_RowBinding), where a wider
        # step costs far less than B rows of it; None where rows have no batch-1 binding (GPU providers)
        self._single_costs: list[float] | None = None

    def _decoder(self, name: str) -> Decoder:
        g = self.manifest.graphs[name]
        kv = KVCache.for_graph(g, self.batch_size, self.max_len, device=self.runtime.device,
                               device_id=self.runtime.device_id)
        return Decoder(self.path / g.file, g, g.model, kv, self.runtime)

    # ------------------------------------------------------------------------------------------ policy

    def _policy(self, cfg: GenerationConfig) -> DraftLenPolicy | None:
        draft_len = self.manifest.drafter.draft_len if cfg.draft_len is None else cfg.draft_len
        return choose_policy(draft_len, self.drafter_kind != "none", self._cached_costs)

    def calibrate(self) -> None:
        """Time the step widths "auto" weighs now (a server before it takes requests), not during the first request."""
        if self.drafter_kind != "none":
            self._cached_costs()

    def _cached_costs(self) -> tuple[list[float], float, float]:
        if self._costs is None:
            self._costs = self._measure_costs()
        return self._costs

    def _measure_costs(self) -> tuple[list[float], float, float]:
        """Seconds of a full-batch target step of each width 1..AUTO_K_MAX+1, and of a full-batch draft step of
        width 1 and 2 (a round's first draft step feeds 2 tokens per row after a fully accepted round).

        Measured when the first "auto" request starts (usually before any row holds a sequence). The K/V
        written lie past every row's valid length, so nothing is lost (rollback is free).
        """
        kv = self.target.kv
        room = kv.max_len - int(kv.lengths.max())
        if self.draft_model is not None:
            room = min(room, kv.max_len - int(self.draft_model.kv.lengths.max()))
        n = max(min(AUTO_K_MAX + 1, room), 2)
        B = self.batch_size
        # A full-batch step of width 9 is B*9 positions (compute-bound): time a few widths, interpolate the rest.
        timed = sorted({t for t in (1, 2, 3, 5, n) if t <= n})
        # Greedy steps, as the default runs them (no logits from a target with argmax_rows); sampled rows pay more.
        steps = {t: (lambda t=t: self.target.decoder.forward_choices(np.zeros((B, t), dtype=np.int64))) for t in timed}
        for step in steps.values():  # the first runs of a new session are slow (allocation, page faults): warm all
            step()
        cost = [median_seconds(steps[t]) for t in timed]
        verify = [float(v) for v in np.interp(np.arange(1, n + 1), timed, cost)]
        row = int(np.argmin(kv.lengths))
        if self.target.rows is not None and kv.max_len - int(kv.lengths[row]) >= n:
            one = [median_seconds(lambda t=t: self.target.rows[row].forward([0] * t, choices_only=True))
                   for t in timed]
            self._single_costs = [float(v) for v in np.interp(np.arange(1, n + 1), timed, one)]
        draft1 = draft2 = 0.0
        if self.draft_model is not None:
            dec = self.draft_model.dec.decoder
            dec.forward(np.zeros((B, 2), dtype=np.int64))
            draft1 = median_seconds(lambda: dec.forward(np.zeros((B, 1), dtype=np.int64)))
            draft2 = median_seconds(lambda: dec.forward(np.zeros((B, 2), dtype=np.int64)))
        return verify, draft1, draft2

    # ------------------------------------------------------------------------------------------ the loop

    def run(self, requests: Iterable[BatchRequest]) -> Iterator[tuple[BatchRequest, Generation | SpecdecError]]:
        """Yield (request, Generation) as rows finish, or (request, SpecdecError) for one that cannot run
        (an empty or too long prompt). Rows are refilled from `requests` as they free up."""
        queue = iter(requests)
        self.open()
        exhausted = False
        while True:
            # Refill free rows; a request can also finish (or fail) at its prefill.
            while self.free_rows() and not exhausted:
                req = next(queue, None)
                if req is None:
                    exhausted = True
                    break
                try:
                    row = self.admit(req)
                except SpecdecError as e:
                    yield req, e
                    continue
                if row.done:
                    yield req, row.result()
            if not self.active:
                return
            for row in self.step():
                yield row.req, row.result()

    # ------------------------------------------------------------------------------------------ step by step
    # A caller that takes requests as they come (the HTTP server) drives the loop itself: admit into free rows,
    # step, read each row's new text, drop a row whose client went away.

    def open(self) -> None:
        """Empty every row: the start of a run (KV lengths to 0; the buffers are reused)."""
        self.target.kv.reset()
        if self.draft_model is not None:
            self.draft_model.kv.reset()
        self.rows: list[_Row | None] = [None] * self.batch_size
        self._eos = set(self.manifest.tokenizer.eos_token_ids)

    def free_rows(self) -> list[int]:
        return [r for r, row in enumerate(self.rows) if row is None]

    @property
    def active(self) -> list[_Row]:
        return [row for row in self.rows if row is not None]

    def admit(self, req: BatchRequest) -> _Row:
        """Prefill `req` into a free row and return it; it holds the row until it is done or dropped (a row done
        at its prefill, by EOS or max_new_tokens=1, is not kept). SpecdecError for a prompt that cannot run."""
        free = self.free_rows()
        if not free:
            raise SpecdecError("every row of the batch is busy", "step until a row finishes")
        row = self._start(free[0], req, self._eos)
        row.index = free[0]
        if not row.done:
            self.rows[free[0]] = row
        return row

    def drop(self, row: _Row) -> None:
        """Free a row before it is done (its client went away); its K/V are overwritten by the next request."""
        if self.rows[row.index] is row:
            self.rows[row.index] = None

    def step(self) -> list[_Row]:
        """One draft / verify / accept round over every active row; return the rows that finished (freed).
        Each active row's `piece` is the text it gained this round."""
        active = {r: row for r, row in enumerate(self.rows) if row is not None}
        if not active:
            return []
        done = [active[r] for r in self._round(active)]
        for row in done:
            self.rows[row.index] = None
        return done

    def _start(self, r: int, req: BatchRequest, eos: set[int]) -> _Row:
        prompt = list(req.prompt_ids)
        if not prompt:
            raise SpecdecError("the prompt is empty", "pass some text")
        if len(prompt) >= self.max_len:
            raise SpecdecError(f"the prompt has {len(prompt)} tokens but the KV buffer holds {self.max_len}",
                               f"raise it with --max-len (the model allows up to {self.manifest.model.max_position})")
        row = _Row(req, self.codec, eos)
        row.policy = self._policy(req.cfg)
        kv = self.target.kv
        kv.lengths[r] = 0
        t0 = time.perf_counter()
        logits = self.target.prefill_row(r, prompt)  # [vocab]
        token = select_token(logits, req.cfg.sampling, row.rng)
        row.stats.prompt_tokens, row.stats.prefill_s = len(prompt), time.perf_counter() - t0
        row.context, row.token = [*prompt, token], token
        if row.policy is not None:
            if self.drafter_kind == "ngram":
                row.drafter = NgramDrafter(max_ngram=self.manifest.drafter.max_ngram)
            elif self.drafter_kind == "corpus":
                shared = self._corpus_drafter
                row.drafter = CorpusDrafter(NgramDrafter(max_ngram=self.manifest.drafter.max_ngram,
                                                         min_ngram=shared.lookup.config.min_ngram),
                                            shared.corpus, shared.reliability)
            else:
                self.draft_model.begin(r)
            if row.drafter is not None:
                row.drafter.begin(prompt, req.cfg.sampling, row.rng)
        row.done = row.emit([token]) or kv.max_len - int(kv.lengths[r]) <= 0
        row.t_decode = time.perf_counter()
        return row

    def _auto_widths(self, rows: dict[int, _Row], limit: int, drafts: dict[int, Draft],
                     alone: bool = False, left: dict[int, int] | None = None) -> dict[int, int]:
        """draft_len "auto" for a batch: one draft count m for the round, maximising the batch's expected tokens
        per second, sum over rows of (1 - a_r^(m_r+1)) / (1 - a_r), over the measured cost of a full-batch step
        of width m+1 plus m full-batch draft steps (the first at width 2). The width is shared: one row drafting 8 makes every row pay for 9
        positions, which is why rows cannot choose alone as they do at batch 1. a_r is each row's running
        acceptance (its AdaptiveDraftLen). n-gram rows look up first (free) so that m_r = min(m, what the
        lookup found); their drafts, cut to m_r, are put in `drafts`. Returns each row's draft count.
        """
        verify_s, draft1_s, draft2_s = self._costs
        if alone and self._single_costs is not None:  # the only active row: its step runs at batch 1
            verify_s = self._single_costs
        k_max = min(len(verify_s) - 1, limit)
        found = {r: k_max for r in rows}
        if self.draft_model is None:
            looked = {r: row.drafter.propose(row.context, k_max) for r, row in rows.items()}
            found = {r: d.k for r, d in looked.items()}
        if left is not None:  # drafts past a row's budget would be verified only to be cut
            found = {r: max(min(n, left[r]), 0) for r, n in found.items()}

        def cost(m: int) -> float:  # the first draft step is charged at width 2 (see _measure_costs)
            return verify_s[m] + (draft2_s + (m - 1) * draft1_s if m > 0 else 0.0)

        def expected(r: int) -> np.ndarray:
            """Row r's expected tokens from a round of width m = 0..k_max: by its draft's confidences where it has
            them (token i survives with the product of those up to it), else by its running acceptance rate."""
            m = np.minimum(np.arange(k_max + 1), found[r])  # [k_max+1] the row drafts at most what it found
            if self.draft_model is None and looked[r].confidence is not None:
                return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(looked[r].confidence))])[m]
            a = min(rows[r].policy.estimate().acceptance, 0.999)
            return (1 - a ** (m + 1)) / (1 - a)

        gain = sum(expected(r) for r in rows)  # [k_max+1] the batch's expected tokens by round width
        best = max(range(k_max + 1), key=lambda m: gain[m] / cost(m))
        ks = {r: min(best, found[r]) for r in rows}
        for r, row in rows.items():
            if ks[r] == 0 and found[r] > 0:  # written off this round: drift back toward the prior (see draft_len.py)
                est = row.policy.estimate()
                est.acceptance += ACCEPT_EMA * (ACCEPT_PRIOR - est.acceptance)
            if self.draft_model is None and ks[r] > 0:
                drafts[r] = looked[r].head(ks[r])
        return ks

    def _round(self, rows: dict[int, _Row]) -> list[int]:
        """One draft / verify / accept round over the active rows; return the rows that finished."""
        kv = self.target.kv
        # GQA needs length + T <= max_len for every active row: the fullest row caps everyone's draft.
        limit = min(min(kv.max_len - int(kv.lengths[r]) for r in rows) - 1, MAX_STEP - 1)
        auto = {r for r, row in rows.items() if isinstance(row.policy, AdaptiveDraftLen)}
        # and no row drafts past its budget: a round emits its accepted drafts and one token of the target's
        left = {r: row.cfg.max_new_tokens - len(row.out.ids) - 1 for r, row in rows.items()}
        ks = {r: (row.policy.next_k(max(min(limit, left[r]), 0)) if row.policy is not None and r not in auto else 0)
              for r, row in rows.items()}
        drafts: dict[int, Draft] = {}
        if auto:
            ks.update(self._auto_widths({r: rows[r] for r in auto}, limit, drafts, alone=len(rows) == 1, left=left))
        if self.draft_model is not None:
            want = {r: (rows[r].context, k, rows[r].cfg.sampling, rows[r].rng) for r, k in ks.items() if k > 0}
            drafts = self.draft_model.propose(want) if want else {}
        else:
            drafts.update({r: rows[r].policy.cut(rows[r].drafter.propose(rows[r].context, k)) for r, k in ks.items()
                           if k > 0 and r not in drafts})
        drafts = {r: drafts.get(r, NO_DRAFT) for r in rows}
        all_greedy = all(row.cfg.sampling.greedy for row in rows.values())
        out = self.target.forward_rows({r: [rows[r].token, *map(int, drafts[r].tokens)] for r in rows},
                                       choices_only=all_greedy)  # choices [q_r] or logits [q_r, vocab] per row
        finished = []
        now = time.perf_counter()
        for r, row in rows.items():
            draft = drafts[r]
            if all_greedy:
                n_accepted, token = greedy_accept_choices(draft.tokens, out[r])
            elif row.cfg.sampling.greedy:
                n_accepted, token = greedy_accept(draft.tokens, out[r])
            else:
                p_target = probs_from_logits(out[r], row.cfg.sampling)  # [k+1, vocab]
                n_accepted, token = speculative_accept(draft.tokens, draft.p_draft, p_target, row.rng)
            kv.lengths[r] += 1 + n_accepted
            if row.drafter is not None:  # also after a draft cut to nothing: the target's token says if it was right
                row.drafter.accept(n_accepted, token)
            if ks[r] > 0:
                if self.draft_model is not None:
                    self.draft_model.accept(r, n_accepted)
                row.policy.update(draft.k, n_accepted)
            row.stats.record(draft.k, n_accepted)
            new = [*map(int, draft.tokens[:n_accepted]), token]
            row.context += new
            row.token = token
            row.stats.decode_s = now - row.t_decode
            if row.emit(new) or kv.max_len - int(kv.lengths[r]) <= 0:
                finished.append(r)
        return finished
