"""One worker thread owns the BatchedEngine; HTTP handlers hand it requests and read their text as it comes.

The loop, each round: drop the rows whose client went away, admit waiting requests into free rows (their
prefill), run one draft/verify round over every active row, and post each row's new text to its request's
asyncio queue. A finished row is refilled at the next round (continuous batching). onnxruntime sessions and
the KV slab are touched by this thread only.

Each request's greedy output is what it gets alone (batched rows are exact, see runtime/batched.py). A seeded
sampled request runs a fixed draft length (the server's, or SEEDED_DRAFT_LEN when that is "auto"): the
adaptive width is chosen for the whole batch, so it would make the draws depend on the other requests.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specdec.errors import SpecdecError
from specdec.runtime.batched import BatchedEngine, BatchRequest
from specdec.runtime.engine import Generation
from specdec.openai_api import ApiError, CompletionRequest

SEEDED_DRAFT_LEN = 4


@dataclass
class Ticket:
    """A request in the server: its ids and config, where its events go, and whether its client left."""

    prompt_ids: list[int]
    request: CompletionRequest
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    created: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None

    def post(self, event: tuple) -> None:
        """From the worker thread: ("text", piece, n_tokens) ... then ("done", Generation) or ("error", ApiError)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Runs the engine on its own thread. `submit` from the event loop; `stop` drains or cancels and joins."""

    def __init__(self, make_engine: Callable[[], BatchedEngine], queue_size: int, draft_len: int | str,
                 on_finish: Callable[[Ticket, Generation], None] | None = None,
                 on_round: Callable[[BatchedEngine, int], None] | None = None) -> None:
        self._make_engine = make_engine
        self.queue_size, self.draft_len = queue_size, draft_len
        self.engine: BatchedEngine | None = None
        self.load_error: BaseException | None = None
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._rows: dict[int, Ticket] = {}  # id(row) -> its ticket
        self._wake = threading.Condition()
        self._stopping = False
        self._on_finish, self._on_round = on_finish, on_round
        self._thread = threading.Thread(target=self._main, name="specdec-engine", daemon=True)

    # ------------------------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self._stopping

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def check_ready(self) -> None:
        """ApiError 503 unless the engine is loaded and the server is not stopping."""
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", kind="server_error")
        if self.engine is None:
            raise ApiError(503, "the model is still loading; retry shortly", code="loading", kind="server_error")
        if self._stopping:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error")

    def submit(self, ticket: Ticket) -> None:
        """Queue a request, or ApiError 503 (loading / stopping) or 429 (queue full)."""
        self.check_ready()
        with self._wake:
            if len(self._waiting) >= self.queue_size:
                raise ApiError(429, f"the queue is full ({self.queue_size} waiting); retry shortly",
                               code="queue_full", kind="rate_limit_error")
            self._waiting.append(ticket)
            self._wake.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: its row is freed at the next round."""
        ticket.cancelled = True
        with self._wake:
            self._wake.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, cancel waiting ones, let active rows finish, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------------ worker side

    def _main(self) -> None:
        try:
            engine = self._make_engine()
            engine.open()
        except BaseException as e:  # reported to every request as a 503 (and by /health)
            self.load_error = e
            return
        self.engine = engine
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not engine.active:
                    self._wake.wait()
                if self._stopping:
                    self._refuse_waiting()
                    if not engine.active:
                        return
            try:
                self._drop_cancelled(engine)
                self._admit(engine)
                if engine.active:
                    self._round(engine)
            except Exception as e:  # a fault in one round fails the rows in it, never the server
                self._fail_active(engine, e)

    def _fail_active(self, engine: BatchedEngine, error: Exception) -> None:
        for row in engine.active:
            engine.drop(row)
            self._rows.pop(id(row)).post(("error", ApiError(500, f"generation failed: {type(error).__name__}: "
                                                                 f"{error}", kind="server_error")))

    def _refuse_waiting(self) -> None:
        while self._waiting:
            self._waiting.popleft().post(("error", ApiError(503, "the server is shutting down",
                                                            code="shutting_down", kind="server_error")))

    def _drop_cancelled(self, engine: BatchedEngine) -> None:
        for row in engine.active:
            ticket = self._rows[id(row)]
            if ticket.cancelled:
                engine.drop(row)
                del self._rows[id(row)]

    def _admit(self, engine: BatchedEngine) -> None:
        while engine.free_rows():
            with self._wake:
                if not self._waiting:
                    return
                ticket = self._waiting.popleft()
            if ticket.cancelled:
                continue
            req = ticket.request
            draft_len = self.draft_len
            if req.seed is not None and not req.sampling.greedy and draft_len == "auto":
                draft_len = SEEDED_DRAFT_LEN
            try:
                row = engine.admit(BatchRequest(None, tuple(ticket.prompt_ids),
                                                req.config(ticket.max_new_tokens, draft_len)))
            except SpecdecError as e:
                ticket.post(("error", ApiError(400, str(e))))
                continue
            self._first_text(ticket, row)
            if row.done:
                self._finish(ticket, row.result())
            else:
                self._rows[id(row)] = ticket

    def _round(self, engine: BatchedEngine) -> None:
        active = engine.active
        finished = {id(row) for row in engine.step()}
        if self._on_round is not None:
            self._on_round(engine, len(active))
        for row in active:
            ticket = self._rows[id(row)]
            if row.piece:
                ticket.post(("text", row.piece, row.stats.new_tokens))
            if id(row) in finished:
                del self._rows[id(row)]
                self._finish(ticket, row.result())

    def _first_text(self, ticket: Ticket, row) -> None:
        ticket.first_token_s = time.perf_counter() - ticket.created
        if row.piece:
            ticket.post(("text", row.piece, row.stats.new_tokens))

    def _finish(self, ticket: Ticket, result: Generation) -> None:
        if self._on_finish is not None:
            self._on_finish(ticket, result)
        ticket.post(("done", result))
