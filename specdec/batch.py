"""`specdec batch`: generate for every line of a JSONL file, resumably.

Input, one JSON object per line (blank lines are skipped):

    {"id": "q1", "prompt": "Write a haiku."}
    {"id": 2, "messages": [{"role": "user", "content": "Hi!"}], "max_new_tokens": 64,
     "temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 1, "stop": ["\\n\\n"]}

`id` (string or integer, unique in the file) and exactly one of `prompt` (text; the chat template is applied
when the bundle has one) or `messages` (a chat) are required; the rest are optional per-request settings
(`max_new_tokens` defaults to the job's). Any other field is an error, so a misspelt setting is never
silently ignored.

`max_tokens` is taken as another name of `max_new_tokens`. OpenAI Batch API lines are read too (as vLLM's
`run_batch` does), validated by the server's own rules (specdec/openai_api.py; an unset temperature is 1 there,
as OpenAI's):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64, "temperature": 0}}

Output, one line per finished request, in the order requests finish (not input order when batching):

    {"id": "q1", "text": "...", "finish_reason": "eos", "stats": {...}}

and for an OpenAI Batch API line, OpenAI's output line with the completion object as the response body:

    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...",
     "body": {"object": "chat.completion", "choices": [...], "usage": {...}, ...}}, "error": null}

Guarantees:
- Atomic lines: a record is built in memory and appended with one write on an O_APPEND descriptor, then
  fsync'd; if the write fails (disk full...) the file is cut back to its previous size, so no partial line
  is ever left behind, and the job stops with one `error:` line. Ctrl-C is held off while a line is written.
- Resumable: rerunning the same command skips every id already in the output and does the rest; a trailing
  partial line (a crash mid-write: power loss, SIGKILL) is cut off and its request redone. No id is ever
  written twice, none is lost.
- One job per output: `OUT.meta.json`, written when the job starts, records the bundle (SHA-256 of its
  `specdec.json`, which holds every file's hash) and the job-level settings that change outputs (drafter,
  draft length, default max_new_tokens, KV length). A rerun with another bundle or other settings is
  refused, unless --force (which keeps the existing records and adds to them under the new settings).
  Batch size and threads are not part of it: batched rows are identical to batch-1 runs.
- Bad lines (not JSON, missing or duplicate id, no prompt, bad settings, a prompt too long for the KV
  buffer...) go to the errors file (default `OUT.errors.jsonl`) as {"line", "id", "error"} and the job
  goes on. The errors file is rewritten by every run (it describes the last run). Every good line is
  written; then the command exits 1 with one line naming the first bad one, so scripts notice. Requests
  that failed are not in the output, so a rerun tries them again.
- The same with --ray (specdec/scaleout.py): Ray workers only generate and return results; this process
  reads the input, skips done ids and writes every line, so a Ray run and a local run resume each other.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from specdec.errors import SpecdecError
from specdec.runtime.batched import BATCH_DRAFTERS
from specdec.runtime.engine import GenerationConfig, batch_default_drafter, default_drafter
from specdec.runtime.tuned import read_tuned
from specdec.runtime.manifest import MANIFEST_NAME, read_manifest
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.session import RuntimeOptions


META_FORMAT = "specdec-batch"
META_VERSION = 1
# From bench/batch.py (bench/results/batch.json: 200 Spec-Bench prompts, 32 new tokens, greedy, SmolLM2-135M fp32,
# 2-core AVX2 CPU, one run): total tok/s for B = 1/2/4/8 was 36.8/56.5/79.0/105.4 plain, 45.5/61.2/75.5/87.0 with a
# fixed n-gram draft of 4, and 45.8/63.1/87.5/107.3 with the draft length on "auto": B=8 with "auto" is the best
# (2.92x one request after another). Every row was token-identical to its batch-1 output. B=16 measured only
# 1.05-1.15x more than B=8, for twice the KV memory (8 rows x 2048 positions = 755 MB here).
DEFAULT_BATCH_SIZE = 8
# A fixed draft length is a poor default when batching on a CPU: a step of B rows x (1+k) positions is
# compute-bound, so at B=8 a fixed k=4 is 19% slower than plain batching (87.0 vs 105.4 tok/s above). "auto"
# times full-batch steps of each width once and picks one width per round: it drafts where drafting pays.
DEFAULT_DRAFT_LEN = "auto"

SETTING_KEYS = ("max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
INPUT_KEYS = ("id", "prompt", "messages") + SETTING_KEYS
OPENAI_KEYS = ("custom_id", "method", "url", "body")
OPENAI_URLS = {"/v1/chat/completions": True, "/v1/completions": False}  # url -> chat template applied


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def default_errors_path(out: Path) -> Path:
    return out.with_name(out.name + ".errors.jsonl")


# ------------------------------------------------------------------------------------------------- input

@dataclass(frozen=True)
class JobSettings:
    """Job-level settings that change what is generated: part of the output's identity."""

    drafter: str
    draft_len: int | str
    max_new_tokens: int
    max_len: int


@dataclass
class Request:
    line: int
    id: str | int
    prompt: str | list  # text or chat messages
    cfg: GenerationConfig
    url: str | None = None  # an OpenAI Batch API line's endpoint: its output line is OpenAI's too

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value: Any) -> str:
    """Ids compare by JSON value: 1 and "1" are different ids."""
    return json.dumps(value, ensure_ascii=False)


class LineError(ValueError):
    pass


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_line(obj: Any, line: int, settings: JobSettings) -> Request:
    """One input object -> Request, or LineError saying what is wrong with it."""
    if not isinstance(obj, dict):
        raise LineError(f"a line must be a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj:
        return parse_openai_line(obj, line, settings)
    unknown = [k for k in obj if k not in INPUT_KEYS]
    if unknown:
        raise LineError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                        f"(allowed: {', '.join(INPUT_KEYS)})")
    if "id" not in obj:
        raise LineError('missing "id"')
    rid = obj["id"]
    if not (isinstance(rid, str) or _is_int(rid)):
        raise LineError(f'"id" must be a string or an integer, got {json.dumps(rid)}')
    if ("prompt" in obj) == ("messages" in obj):
        raise LineError('need exactly one of "prompt" (text) or "messages" (a chat)')
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise LineError('"prompt" must be a non-empty string')
    else:
        prompt = obj["messages"]
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            raise LineError('"messages" must be a non-empty list of {"role": str, "content": str}')
    if "max_new_tokens" in obj and "max_tokens" in obj:
        raise LineError('give one of "max_new_tokens" or "max_tokens" (two names of one setting)')
    name = "max_tokens" if "max_tokens" in obj else "max_new_tokens"
    mnt = obj.get(name, settings.max_new_tokens)
    if not _is_int(mnt) or mnt <= 0:
        raise LineError(f'"{name}" must be an integer > 0, got {json.dumps(mnt)}')
    for k in ("temperature", "top_p"):
        if k in obj and not _is_number(obj[k]):
            raise LineError(f'"{k}" must be a number, got {json.dumps(obj[k])}')
    for k in ("top_k",):
        if k in obj and not _is_int(obj[k]):
            raise LineError(f'"{k}" must be an integer, got {json.dumps(obj[k])}')
    seed = obj.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise LineError(f'"seed" must be an integer >= 0 or null, got {json.dumps(seed)}')
    stop = obj.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise LineError('"stop" must be a non-empty string or a list of them')
    try:
        sampling = SamplingConfig(temperature=float(obj.get("temperature", 0.0)), top_k=int(obj.get("top_k", 0)),
                                  top_p=float(obj.get("top_p", 1.0)))
        cfg = GenerationConfig(max_new_tokens=mnt, sampling=sampling, seed=seed, stop=tuple(stop),
                               draft_len=settings.draft_len)
    except (ValueError, SpecdecError) as e:
        raise LineError(str(e)) from None
    return Request(line=line, id=rid, prompt=prompt, cfg=cfg)


def parse_openai_line(obj: dict, line: int, settings: JobSettings) -> Request:
    """An OpenAI Batch API line -> Request: its body is checked exactly as the server checks a request."""
    from specdec.openai_api import ApiError, parse_request

    unknown = [k for k in obj if k not in OPENAI_KEYS]
    if unknown:
        raise LineError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in an "
                        f"OpenAI batch line (allowed: {', '.join(OPENAI_KEYS)})")
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid:
        raise LineError(f'"custom_id" must be a non-empty string, got {json.dumps(cid)}')
    if obj.get("method", "POST") != "POST":
        raise LineError(f'"method" must be "POST", got {json.dumps(obj.get("method"))}')
    url = obj.get("url")
    if url not in OPENAI_URLS:
        raise LineError(f'"url" must be one of {", ".join(OPENAI_URLS)}, got {json.dumps(url)}')
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError('"body" must be a JSON object (the request\'s body)')
    if body.get("stream"):
        raise LineError('"stream" cannot be true in a batch (each answer is written whole)')
    try:
        req = parse_request(body, chat=OPENAI_URLS[url])
    except ApiError as e:
        raise LineError(f"body: {e.message}") from None
    cfg = req.config(req.max_tokens or settings.max_new_tokens, settings.draft_len)
    return Request(line=line, id=cid, prompt=req.prompt, cfg=cfg, url=url)


def read_requests(path: Path, settings: JobSettings) -> tuple[list[Request], list[dict]]:
    """All good requests of the input file and an error record for every bad line (duplicates included)."""
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        raise SpecdecError(f"cannot read input {path}: {e.strerror or e}", "pass a readable JSONL file") from None
    requests: list[Request] = []
    errors: list[dict] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        rid = None
        try:
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise LineError("not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise LineError(f"not valid JSON ({e.msg} at column {e.colno})") from None
            key = "custom_id" if isinstance(obj, dict) and "custom_id" in obj else "id"
            if isinstance(obj, dict) and (isinstance(obj.get(key), str) or _is_int(obj.get(key))):
                rid = obj[key]
            req = parse_line(obj, n, settings)
            if req.key in seen:
                raise LineError(f"duplicate id {req.key} (first on line {seen[req.key]})")
            seen[req.key] = n
            requests.append(req)
        except LineError as e:
            errors.append({"line": n, "id": rid, "error": str(e)})
    return requests, errors


# ------------------------------------------------------------------------------------------------ output

@contextlib.contextmanager
def _hold_sigint() -> Iterator[None]:
    """Delay Ctrl-C until the block is done (a line is never half written because of it)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    caught: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


class AppendLog:
    """A JSONL file that only ever grows by whole lines."""

    def __init__(self, path: Path, truncate: bool = False) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self.appended = 0  # whole lines written by this object
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise SpecdecError(f"cannot open {path} for writing: {e.strerror or e}") from None

    def append(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        with _hold_sigint():
            size = os.fstat(self.fd).st_size
            try:
                view = memoryview(data)
                while view:  # one write in practice; a short write is continued, and undone on failure
                    view = view[os.write(self.fd, view):]
                os.fsync(self.fd)
                self.appended += 1
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, size)
                what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
                raise SpecdecError(f"cannot write {self.path}: {what}; no partial line was left",
                                   "free some space and rerun the same command to resume") from None

    def lock(self) -> None:
        """Hold an exclusive advisory lock on the file until close (POSIX; a no-op where fcntl is missing)."""
        try:
            import fcntl
        except ImportError:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SpecdecError(f"{self.path} is being written by another `specdec batch` run",
                               "wait for it to finish (or stop it) before rerunning") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def bundle_digest(bundle: Path) -> str:
    try:
        return hashlib.sha256((bundle / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError as e:
        raise SpecdecError(f"cannot read {bundle / MANIFEST_NAME}: {e.strerror or e}",
                           "pass a bundle folder written by `specdec export`") from None


def read_done(out: Path, force: bool) -> tuple[set[str], int]:
    """Ids already in the output, and the bytes of a trailing partial line cut off (a crash mid-write)."""
    try:
        data = out.read_bytes()
    except FileNotFoundError:
        return set(), 0
    except OSError as e:
        raise SpecdecError(f"cannot read output {out}: {e.strerror or e}") from None
    end = data.rfind(b"\n") + 1
    cut = len(data) - end
    if cut:
        try:
            with open(out, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        except OSError as e:
            raise SpecdecError(f"cannot repair {out} (its last line is partial): {e.strerror or e}") from None
    done: set[str] = set()
    for n, raw in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
            if isinstance(rec, dict) and "custom_id" in rec and "response" in rec:  # an OpenAI batch output line
                rec = {"id": rec["custom_id"], "text": None}
            if not isinstance(rec, dict) or "id" not in rec or "text" not in rec:
                raise ValueError
        except ValueError:
            if force:
                continue
            raise SpecdecError(f"{out} line {n} is not a `specdec batch` record",
                               "write to a new output file, or pass --force to append to this one anyway") from None
        done.add(id_key(rec["id"]))
    return done, cut


def _diff(old: dict, new: dict) -> str:
    parts = []
    if old.get("bundle_sha256") != new["bundle_sha256"]:
        parts.append(f"bundle {old.get('bundle', '?')} (sha256 {str(old.get('bundle_sha256'))[:12]}) -> "
                     f"{new['bundle']} (sha256 {new['bundle_sha256'][:12]})")
    o, s = old.get("settings") or {}, new["settings"]
    parts += [f"{k} {o.get(k)!r} -> {s[k]!r}" for k in s if o.get(k) != s[k]]
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------- generating

@dataclass(frozen=True)
class Result:
    """What one request came to: its output record, or the error for the errors file."""

    record: dict | None = None
    tokens: int = 0  # new tokens generated (the summary's tok/s)
    error: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    """How to load the engine; picklable, so a Ray worker loads the same engine as a local run."""

    bundle: Path
    batch_size: int
    drafter: str | None
    max_len: int | None
    runtime: RuntimeOptions


class Generator:
    """Loads the bundle once and turns requests into output records: the one code path of local runs and of
    Ray workers, so both write the same lines."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        if spec.batch_size == 1:
            from specdec.runtime.engine import Engine

            self.engine = Engine(spec.bundle, max_len=spec.max_len, runtime=spec.runtime, drafter=spec.drafter)
        else:
            from specdec.runtime.batched import BatchedEngine

            self.engine = BatchedEngine(spec.bundle, spec.batch_size, max_len=spec.max_len, runtime=spec.runtime,
                                        drafter=spec.drafter)
        self.codec = self.engine.codec

    def results(self, requests: list[Request]) -> Iterator[tuple[Request, Result]]:
        """(request, Result) for every request, in finishing order."""
        for req, g in self._generations(requests):
            if isinstance(g, SpecdecError):
                yield req, Result(error=str(g))
            else:
                rec = self._openai_record(req, g) if req.url else {
                    "id": req.id, "text": self._text(g), "finish_reason": g.finish_reason, "stats": g.stats.to_dict()}
                yield req, Result(record=rec, tokens=len(g.token_ids))

    def _openai_record(self, req: Request, g) -> dict:
        from specdec.openai_api import completion_object

        request_id = "batch_req_" + secrets.token_hex(12)
        body = completion_object(OPENAI_URLS[req.url], g, self._text(g), request_id, int(time.time()),
                                 self.spec.bundle.resolve().name)
        return {"id": request_id, "custom_id": req.id,
                "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}

    def _text(self, g) -> str:
        """The record's text: all of the generated tokens decoded (EOS left out), or the streamed text cut before
        the stop string. The streamed text (Generation.text) holds back a piece that ends in an incomplete UTF-8
        character until the next tokens complete it, and is never flushed when the generation ends, so its
        last characters depend on how tokens were grouped into rounds, i.e. on the drafts; the record must not.
        """
        if g.finish_reason == "stop":
            return g.text
        eos = set(self.codec.eos_token_ids)
        return self.codec.decode([t for t in g.token_ids if t not in eos])

    def _generations(self, pending: list[Request]) -> Iterator[tuple[Request, Any]]:
        """(request, Generation | SpecdecError) for every pending request, in finishing order."""
        engine = self.engine
        if self.spec.batch_size == 1:
            for req in pending:
                try:
                    yield req, engine.generate(req.prompt, req.cfg)
                except SpecdecError as e:
                    yield req, e
            return
        from specdec.runtime.batched import BatchRequest

        failed: list[tuple[Request, SpecdecError]] = []

        def encoded() -> Iterator[BatchRequest]:
            for req in pending:
                try:
                    ids = engine.encode(req.prompt, req.cfg.chat)
                except SpecdecError as e:
                    failed.append((req, e))
                    continue
                yield BatchRequest(key=req, prompt_ids=tuple(ids), cfg=req.cfg)

        for breq, result in engine.run(encoded()):
            while failed:
                yield failed.pop(0)
            yield breq.key, result
        yield from failed


# --------------------------------------------------------------------------------------------------- job

@dataclass
class JobCounts:
    total: int = 0  # good requests in the input
    done_before: int = 0  # already in the output when this run started
    written: int = 0  # written by this run
    errors: int = 0  # lines in the errors file
    first_error: str = ""  # "line N: what was wrong" of the first of them
    tokens: int = 0  # new tokens generated by this run
    cut_partial: int = 0  # bytes of a trailing partial line removed at start
    elapsed_s: float = 0.0

    @property
    def done(self) -> int:
        return self.done_before + self.written


class Runner(Protocol):
    """Generates elsewhere what Generator generates here (specdec.scaleout.RayOptions: on Ray workers). The job
    knows only this method, so the Ray side imports this module and never the other way round."""

    def results(self, spec: EngineSpec, pending: list[Request]) -> Iterator[tuple[Request, Result]]: ...


@dataclass
class BatchJob:
    bundle: Path
    input: Path
    output: Path
    errors_path: Path | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    drafter: str | None = None
    draft_len: int | str | None = DEFAULT_DRAFT_LEN  # None = the bundle's default
    max_new_tokens: int = 256
    max_len: int | None = None
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    force: bool = False
    # Where the generation runs when not in this process (specdec.scaleout.RayOptions: a Ray cluster); None = here.
    ray: Runner | None = None
    counts: JobCounts = field(default_factory=JobCounts)

    def __post_init__(self) -> None:
        self.bundle, self.input, self.output = Path(self.bundle), Path(self.input), Path(self.output)
        self.errors_path = Path(self.errors_path) if self.errors_path else default_errors_path(self.output)
        if self.batch_size < 1:
            raise SpecdecError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens <= 0:
            raise SpecdecError(f"--max-new-tokens must be > 0, got {self.max_new_tokens}")
        if self.batch_size > 1 and self.drafter == "hybrid":
            raise SpecdecError("drafter 'hybrid' is not supported with batch size > 1",
                               "choose none, ngram, corpus or model, or --batch-size 1")
        paths = {"input": self.input, "output": self.output, "errors file": self.errors_path,
                 "meta file": meta_path(self.output)}
        resolved = {}
        for name, p in paths.items():
            r = p.resolve()
            if r in resolved:
                raise SpecdecError(f"the {name} and the {resolved[r]} are the same file ({p})", "pass different paths")
            resolved[r] = name

    # -- identity

    def settings(self) -> JobSettings:
        m = read_manifest(self.bundle, verify_checksums=False)  # checksums are verified when the engine loads
        # The drafter the engine will use when none is named: the tuned one (a batched engine only where it batches).
        if self.drafter is None:
            tuned = read_tuned(self.bundle, m, self.runtime)
            drafter = (batch_default_drafter(self.bundle, m, self.runtime, BATCH_DRAFTERS) if self.batch_size > 1
                       else tuned.drafter if tuned is not None else default_drafter(m))
        return JobSettings(drafter=self.drafter or drafter,
                           draft_len=m.drafter.draft_len if self.draft_len is None else self.draft_len,
                           max_new_tokens=self.max_new_tokens, max_len=self.max_len or m.default_max_len)

    def identity(self, settings: JobSettings) -> dict:
        return {"format": META_FORMAT, "version": META_VERSION, "bundle": str(self.bundle),
                "bundle_sha256": bundle_digest(self.bundle), "settings": asdict(settings)}

    def _check_identity(self, ident: dict) -> None:
        mp = meta_path(self.output)
        old = None
        if mp.exists():
            try:
                old = json.loads(mp.read_text(encoding="utf-8"))
                if not isinstance(old, dict) or old.get("format") != META_FORMAT:
                    raise ValueError
            except (OSError, ValueError):
                if not self.force:
                    raise SpecdecError(f"{mp} is not a `specdec batch` meta file",
                                       "write to a new output file, or pass --force") from None
                old = None
        elif self.output.exists() and self.output.stat().st_size > 0 and not self.force:
            raise SpecdecError(f"{self.output} exists but has no {mp.name}, so it was not written by `specdec batch`",
                               "write to a new output file, or pass --force to append to it")
        has_records = self.output.exists() and self.output.stat().st_size > 0
        if old is not None and not self.force and has_records:  # an empty output mixes nothing: take the new identity
            diff = _diff(old, ident)
            if diff:
                raise SpecdecError(f"{self.output} was written with another bundle or settings ({diff})",
                                   "write to a new output file, rerun with the old settings, or pass --force to mix")
        meta = dict(ident, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), input=str(self.input))
        if old is not None and _diff(old, ident) and has_records:
            meta["previous"] = [*old.get("previous", []), {k: v for k, v in old.items() if k != "previous"}]
        tmp = mp.with_name(mp.name + ".tmp")
        try:
            tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, mp)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise SpecdecError(f"cannot write {mp}: {e.strerror or e}") from None

    # -- running

    def run(self, on_start: Callable[[int], None] | None = None,
            on_record: Callable[[dict, JobCounts], None] | None = None) -> JobCounts:
        """Run (or resume) the job. `on_start(n_pending)` is called once the work is known, `on_record` after
        every output line. KeyboardInterrupt passes through with nothing half written; counts stay valid."""
        c = self.counts
        t0 = time.perf_counter()
        settings = self.settings()
        requests, bad = read_requests(self.input, settings)
        ident = self.identity(settings)
        self._check_identity(ident)
        out = AppendLog(self.output)
        try:
            out.lock()  # before reading what is done: two runs of one job would write ids twice
            done, c.cut_partial = read_done(self.output, self.force)
        except BaseException:
            out.close()
            raise
        c.total = len(requests)
        pending = [r for r in requests if r.key not in done]
        c.done_before = c.total - len(pending)
        try:
            errors = AppendLog(self.errors_path, truncate=True)
        except BaseException:
            out.close()
            raise
        try:
            for e in bad:
                errors.append(e)
                c.errors = errors.appended
                c.first_error = c.first_error or f"line {e['line']}: {e['error']}"
            if on_start is not None:
                on_start(len(pending))
            if not pending:
                return c
            # The driver alone writes (also on Ray, where workers only return results), so the lock, the
            # atomic appends and the resume bookkeeping are the same whatever generated the records.
            # closing(): on Ctrl-C or an error the results are closed at once (on Ray: the cluster this job
            # started is shut down), not whenever the traceback lets go of the generator.
            with contextlib.closing(self._results(pending)) as results:
                for req, result in results:
                    if result.record is None:
                        try:
                            errors.append({"line": req.line, "id": req.id, "error": result.error})
                        finally:
                            c.errors = errors.appended
                            c.first_error = c.first_error or f"line {req.line}: {result.error}"
                        continue
                    rec = result.record
                    try:
                        out.append(rec)
                    finally:  # a Ctrl-C held during the write is raised after the line is whole: count it
                        if out.appended > c.written:
                            c.written = out.appended
                            c.tokens += result.tokens
                    c.elapsed_s = time.perf_counter() - t0
                    if on_record is not None:
                        on_record(rec, c)
        finally:
            c.elapsed_s = time.perf_counter() - t0
            out.close()
            errors.close()
        return c

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(bundle=self.bundle, batch_size=self.batch_size, drafter=self.drafter, max_len=self.max_len,
                          runtime=self.runtime)

    def _results(self, pending: list[Request]) -> Iterator[tuple[Request, Result]]:
        """(request, Result) for every pending request, in finishing order: here, or on Ray workers."""
        if self.ray is not None:
            yield from self.ray.results(self.engine_spec(), pending)
            return
        yield from Generator(self.engine_spec()).results(pending)
