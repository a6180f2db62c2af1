"""The Starlette application: OpenAI's chat and completions endpoints, models, health, metrics, a chat page.

    app = create_app(lambda: BatchedEngine("bundles/smollm2", batch_size=4), ServerOptions())
    uvicorn.run(app)            # or `specdec serve BUNDLE`

Every error is OpenAI's {"error": {...}} body with a 4xx status (5xx only for a model that failed to load or
a server shutting down); a handler never leaves the worker in a bad state: the engine runs on the scheduler's
thread only, and a request that fails before it is queued never reaches it.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec.errors import SpecdecError
from specdec.runtime.batched import BatchedEngine
from specdec.runtime.engine import Generation
from specdec.server.metrics import Metrics
from specdec.server.scheduler import Scheduler, Ticket
from specdec.openai_api import (FINISH_REASONS, ApiError, CompletionRequest, completion_object, parse_request,
                                speculation, usage)

CHAT_PAGE = Path(__file__).with_name("chat.html")
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerOptions:
    model_name: str = "specdec"
    queue_size: int = 64  # requests waiting for a row; one more is answered 429
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* and /metrics when set
    draft_len: int | str = "auto"
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise SpecdecError(f"the queue must hold at least 1 request, got {self.queue_size}")
        if self.max_body_bytes < 1024:
            raise SpecdecError(f"the request size limit must be >= 1024 bytes, got {self.max_body_bytes}")


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _read_json(request: Request, limit: int) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


class _Answer:
    """Builds one request's OpenAI-shaped bodies (whole, or as stream chunks)."""

    def __init__(self, req: CompletionRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _base(self) -> dict:
        kind = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, result: Generation) -> dict:
        return completion_object(self.req.chat, result, result.text, self.id, self.created, self.model)

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False) -> dict:
        if self.req.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return {**self._base(), "choices": [choice]}

    def usage_chunk(self, result: Generation) -> dict:
        return {**self._base(), "choices": [], "usage": usage(result), "speculation": speculation(result)}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(make_engine: Callable[[], BatchedEngine], options: ServerOptions | None = None) -> Starlette:
    """The server's application; the engine is built on the scheduler's thread when the app starts."""
    opts = options or ServerOptions()
    metrics = Metrics()

    def finished(ticket: Ticket, result: Generation) -> None:
        metrics.finished(result, ticket.first_token_s, time.perf_counter() - ticket.created)

    def round_done(engine: BatchedEngine, n_active: int) -> None:
        metrics.active_rows.set(n_active)

    scheduler = Scheduler(make_engine, opts.queue_size, opts.draft_len, on_finish=finished, on_round=round_done)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    def authorized(request: Request) -> None:
        if opts.api_key is not None and not secrets.compare_digest(
                request.headers.get("authorization", ""), f"Bearer {opts.api_key}"):
            raise ApiError(401, "a valid API key is required (header 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def events(ticket: Ticket, request: Request | None) -> AsyncIterator[tuple]:
        """The ticket's events; with `request`, a client that disconnects cancels the ticket."""
        while True:
            try:
                event = await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S if request else None)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(ticket)
                    return
                continue
            yield event
            if event[0] in ("done", "error"):
                return

    async def completions(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            authorized(request)
            req = parse_request(await _read_json(request, opts.max_body_bytes), chat)
            scheduler.check_ready()
            engine = scheduler.engine
            try:
                ids = engine.encode(req.prompt, chat=req.chat)
            except SpecdecError as e:
                raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
            room = engine.max_len - len(ids)
            if room <= 0:
                raise ApiError(400, f"the prompt has {len(ids)} tokens but the server's KV buffer holds "
                                    f"{engine.max_len}; shorten it, or restart the server with a larger --max-len",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            ticket = Ticket(ids, req, min(req.max_tokens or room, room), asyncio.get_running_loop())
            scheduler.submit(ticket)
            metrics.queue_depth.set(scheduler.queue_depth)
        except ApiError as e:
            metrics.requests.labels(endpoint, str(e.status)).inc()
            return _error(e)
        answer = _Answer(req, opts.model_name)
        if req.stream:
            metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(stream(ticket, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for event in events(ticket, request):
            if event[0] == "error":
                metrics.requests.labels(endpoint, str(event[1].status)).inc()
                return _error(event[1])
            if event[0] == "done":
                metrics.requests.labels(endpoint, "200").inc()
                return JSONResponse(answer.whole(event[1]))
        return Response(status_code=499)  # the client went away; nobody reads this

    async def stream(ticket: Ticket, answer: _Answer) -> AsyncIterator[str]:
        """SSE chunks. Text is held back by the longest stop string less one character: a stop string that
        straddles two rounds would otherwise be half-sent before it is found."""
        hold = max((len(s) for s in answer.req.stop), default=1) - 1
        text, sent = "", 0
        try:
            if answer.req.chat:
                yield _sse(answer.chunk(None, role=True))
            async for event in events(ticket, None):
                if event[0] == "error":
                    yield _sse({"error": event[1].body()["error"]})
                    break
                if event[0] == "text":
                    text += event[1]
                    if len(text) - hold > sent:
                        yield _sse(answer.chunk(text[sent:len(text) - hold]))
                        sent = len(text) - hold
                    continue
                result: Generation = event[1]
                if len(result.text) > sent:
                    yield _sse(answer.chunk(result.text[sent:]))
                yield _sse(answer.chunk(None, FINISH_REASONS[result.finish_reason]))
                if answer.req.include_usage:
                    yield _sse(answer.usage_chunk(result))
            yield _sse("[DONE]")
        finally:  # also when the client disconnects (the response task is cancelled); harmless once done
            scheduler.cancel(ticket)

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        try:
            authorized(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": opts.model_name, "object": "model", "created": 0, "owned_by": "specdec"}]})

    async def health(request: Request) -> Response:
        if scheduler.load_error is not None:
            return JSONResponse({"status": "error", "error": str(scheduler.load_error)}, status_code=503)
        if not scheduler.ready:
            return JSONResponse({"status": "loading" if scheduler.engine is None else "stopping"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        engine = scheduler.engine
        return JSONResponse({"status": "ok", "model": opts.model_name, "batch_size": engine.batch_size,
                             "active_rows": len(engine.active), "queue_depth": scheduler.queue_depth,
                             "max_len": engine.max_len, "drafter": engine.drafter_kind})

    async def metrics_page(request: Request) -> Response:
        try:
            authorized(request)
        except ApiError as e:
            return _error(e)
        metrics.queue_depth.set(scheduler.queue_depth)
        if scheduler.engine is not None:
            metrics.batch_size.set(scheduler.engine.batch_size)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def chat_page(request: Request) -> Response:
        return FileResponse(CHAT_PAGE, media_type="text/html")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}", "type": kind,
                                       "param": None, "code": None}}, status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    routes = [
        Route("/", chat_page),
        Route("/health", health),
        Route("/metrics", metrics_page),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.scheduler, app.state.metrics = scheduler, metrics
    return app


# Seconds a SIGTERM / Ctrl-C waits for streams in flight before they are cancelled (each cancelled row is freed).
GRACEFUL_SHUTDOWN_S = 10


def run_server(make_engine: Callable[[], BatchedEngine], options: ServerOptions, host: str, port: int,
               log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's handlers: stop accepting, let streams end, then return)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # A signal is how a server is stopped: once the graceful shutdown is done the process exits 0,
            # instead of uvicorn raising the signal again.
            self._captured_signals.clear()

    config = uvicorn.Config(create_app(make_engine, options), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
    server = Server(config)
    server.run()
    if not server.started:  # the port could not be bound (uvicorn has said why)
        raise SpecdecError(f"could not listen on {host}:{port}", "pick another --port, or stop what holds it")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve_bundle(bundle: Path, host: str, port: int, max_batch: int, options: ServerOptions, max_len: int | None,
                 drafter: str | None, runtime=None, echo: Callable[[str], None] = print) -> None:
    """`specdec serve`: load the bundle (errors surface here, before the port is bound), then serve."""
    if host not in LOOPBACK and options.api_key is None:
        echo(f"warning: serving on {host} without --api-key: anyone who can reach this machine can use the model")
    engine = BatchedEngine(bundle, max_batch, max_len=max_len, runtime=runtime, drafter=drafter)
    if options.draft_len == "auto":
        echo("- timing the target's step widths for --draft-len auto")
        engine.calibrate()  # seconds on a large model: paid here, not by the first request
    echo(f"- {bundle}: {engine.drafter_kind} drafter, draft length {options.draft_len}, {max_batch} rows of "
         f"{engine.max_len} tokens; OpenAI API at http://{host}:{port}/v1, chat page at http://{host}:{port}/")
    run_server(lambda: engine, options, host, port, log_level="warning")
