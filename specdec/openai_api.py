"""OpenAI's request and response shapes, shared by `specdec serve` and `specdec batch`.

Request bodies become what the runtime generates, or an ApiError (a 4xx JSON answer of the server, an error
line of a batch job); Generations become OpenAI's completion objects.

Fields follow OpenAI's chat and completions APIs (`max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `seed`, `stop`, `n`, `stream`, `stream_options.include_usage`) with `top_k` as an extension, as
llama-server and vLLM take it. Fields the runtime has no use for but clients send routinely (`user`,
`presence_penalty` at 0, `logprobs` false...) are accepted and ignored; any other unknown field, or a known one
set to something the runtime cannot honour (`n` > 1, penalties != 0, `logprobs`), is refused: a silently
ignored setting would give an answer the client did not ask for.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from specdec.errors import SpecdecError
from specdec.runtime.engine import Generation, GenerationConfig
from specdec.runtime.sampling import SamplingConfig

# OpenAI's documented default: an unset temperature samples at 1.
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 4  # as OpenAI
# OpenAI's finish reasons: the end of the answer or a stop string is "stop"; a token budget or a full KV
# buffer is "length".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "kv_full": "length"}

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "user", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "metadata",
           "store", "service_tier", "parallel_tool_calls", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
# Settings accepted only at the value that means "off".
_OFF = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": (False, None), "top_logprobs": (0, None),
        "logit_bias": ({}, None), "echo": False, "best_of": (1, None), "suffix": (None, "")}


class ApiError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request: the prompt (text, or chat messages) and how to generate."""

    prompt: str | list[dict]
    chat: bool  # /v1/chat/completions (messages through the chat template) or /v1/completions (raw text)
    max_tokens: int | None  # None: until EOS or the KV buffer is full
    sampling: SamplingConfig
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool

    def config(self, max_new_tokens: int, draft_len: int | str | None) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max_new_tokens, sampling=self.sampling, seed=self.seed,
                                stop=self.stop, draft_len=draft_len, chat=self.chat)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
        raise _bad(f"'{key}' must be a number in [{low:g}, {high:g}], got {json.dumps(v)}", key)
    return float(v)


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise _bad("'messages' must be a non-empty array of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(body: Any, chat: bool) -> CompletionRequest:
    """A decoded JSON body of /v1/chat/completions (chat=True) or /v1/completions -> CompletionRequest."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise _bad(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}", unknown[0])
    for key, off in _OFF.items():
        if key in body and body[key] not in (off if isinstance(off, tuple) else (off,)):
            raise _bad(f"'{key}' is not supported (leave it unset)", key)
    if chat:
        if "messages" not in body:
            raise _bad("'messages' is required", "messages")
        prompt: str | list[dict] = _messages(body["messages"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    n = body.get("n", 1)
    if n != 1 or not _is_int(n):
        raise _bad(f"'n' must be 1 (one choice per request), got {json.dumps(n)}", "n")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise _bad(f"'{key}' must be an integer >= 1, got {json.dumps(max_tokens)}", key)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("'top_p' must be > 0", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < 0:
        raise _bad(f"'top_k' must be an integer >= 0 (0 = off), got {json.dumps(top_k)}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise _bad(f"'seed' must be an integer >= 0, got {json.dumps(seed)}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' must be a non-empty string or an array of up to {MAX_STOP_STRINGS} of them", "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or any(k != "include_usage" for k in options) \
            or not isinstance(options.get("include_usage", False), bool):
        raise _bad("'stream_options' may only hold 'include_usage' (true or false)", "stream_options")
    if options and not stream:
        raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if "model" in body and not isinstance(body["model"], str):
        raise _bad("'model' must be a string", "model")
    try:
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        GenerationConfig(max_new_tokens=max_tokens or 1, sampling=sampling, seed=seed, stop=tuple(stop))
    except (ValueError, SpecdecError) as e:
        raise _bad(str(e)) from None
    return CompletionRequest(prompt=prompt, chat=chat, max_tokens=max_tokens, sampling=sampling, seed=seed,
                             stop=tuple(stop), stream=stream, include_usage=bool(options.get("include_usage")))


# ------------------------------------------------------------------------------------------------ responses

def speculation(result: Generation) -> dict:
    """llama-server's `timings`, in specdec's terms: what speculation did for this request."""
    s = result.stats
    return {"tokens_per_target_pass": round(s.tau, 4), "drafted": s.drafted, "accepted": s.accepted,
            "target_passes": s.target_forwards, "prefill_s": round(s.prefill_s, 4),
            "decode_tok_s": round(s.decode_tok_s, 2)}


def usage(result: Generation) -> dict:
    prompt, completion = result.stats.prompt_tokens, len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_object(chat: bool, result: Generation, text: str, request_id: str, created: int, model: str) -> dict:
    """The whole answer: a chat.completion or a text_completion object, with usage and speculation."""
    reason = FINISH_REASONS[result.finish_reason]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(result), "speculation": speculation(result)}
