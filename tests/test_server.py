"""`specdec serve`: the OpenAI-compatible server, driven by the official `openai` client over loopback.

A server runs in a thread of the test process (uvicorn on a free port) over the tiny bundle; the CLI's own
process (signals, exit codes) is tested at the end.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

import specdec
from specdec import GenerationConfig
from specdec.runtime.batched import BatchedEngine
from specdec.runtime.sampling import SamplingConfig
from specdec.server.app import ServerOptions, create_app
from specdec.openai_api import ApiError, parse_request

PROMPTS = ["the quick brown fox", "hello world, this is", "a small model proposes", "speculative decoding drafts",
           "the target verifies them", "a large model decides", "tiny tokenizer for tests", "jumps over the lazy"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(make_engine, options: ServerOptions | None = None, wait_ready: bool = True):
    """A server in a thread; yields (base URL, app)."""
    app = create_app(make_engine, options or ServerOptions(model_name="tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health").status_code == (200 if wait_ready else 503) or not wait_ready:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    try:
        yield base, app
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_bundle):
    with running(lambda: BatchedEngine(tiny_bundle, 4, drafter="ngram", max_len=256)) as (base, app):
        yield base, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def solo(tiny_bundle):
    """What `specdec generate` gives alone: the batch-1 engine, plain decoding."""
    engine = specdec.load(tiny_bundle, drafter="none", max_len=256)

    def generate(prompt, max_tokens: int, chat: bool = True, stop=()):
        cfg = GenerationConfig(max_new_tokens=max_tokens, draft_len=0, chat=chat, stop=tuple(stop))
        return engine.generate(prompt if chat else prompt, cfg)
    return generate


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# ------------------------------------------------------------------------------------------------ answers

def test_chat_greedy_equals_solo_generate_with_usage(client, solo):
    want = solo(_chat(PROMPTS[0]), 24)
    r = client.chat.completions.create(model="tiny", messages=_chat(PROMPTS[0]), max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[want.finish_reason]
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == want.stats.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculation"]
    assert spec["target_passes"] >= 1 and 0 <= spec["accepted"] <= spec["drafted"]


def test_completions_endpoint_takes_raw_text(client, solo):
    want = solo(PROMPTS[1], 16, chat=False)
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    assert r.choices[0].text == want.text
    assert r.object == "text_completion" and r.usage.completion_tokens == len(want.token_ids)


def test_streamed_equals_whole_and_ends_with_usage(client):
    kwargs = dict(model="tiny", messages=_chat(PROMPTS[2]), max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_ends_with_done_marker(server):
    body = {"messages": _chat(PROMPTS[3]), "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_max_tokens_and_stop_strings(client, solo):
    r = client.chat.completions.create(model="tiny", messages=_chat(PROMPTS[4]), max_tokens=5, temperature=0)
    want = solo(_chat(PROMPTS[4]), 5)
    assert r.usage.completion_tokens == len(want.token_ids) <= 5
    long = solo(_chat(PROMPTS[4]), 40).text
    stop = long[len(long) // 2: len(long) // 2 + 2]  # a stop string the answer certainly holds
    assert len(stop) == 2
    kwargs = dict(model="tiny", messages=_chat(PROMPTS[4]), max_tokens=40, temperature=0, stop=[stop])
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == long[:long.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))
    assert streamed == r.choices[0].message.content  # nothing of the stop string was sent early


def test_eight_concurrent_greedy_requests_each_equal_their_solo_output(server, solo):
    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        r = await c.chat.completions.create(model="tiny", messages=_chat(prompt), max_tokens=32, temperature=0)
        return r.choices[0].message.content

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    got = asyncio.run(all_at_once())
    assert got == [solo(_chat(p), 32).text for p in PROMPTS]


def test_seeded_sampled_request_is_reproducible_under_concurrency(client, server):
    kwargs = dict(model="tiny", messages=_chat(PROMPTS[5]), max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    alone = client.chat.completions.create(**kwargs).choices[0].message.content

    async def crowd() -> str:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
            others = [c.chat.completions.create(model="tiny", messages=_chat(p), max_tokens=24, temperature=0)
                      for p in PROMPTS[:3]]
            results = await asyncio.gather(c.chat.completions.create(**kwargs), *others)
            return results[0].choices[0].message.content

    assert asyncio.run(crowd()) == alone
    other_seed = client.chat.completions.create(**{**kwargs, "seed": 8}).choices[0].message.content
    assert other_seed != alone  # the seed does decide the draws


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["batch_size"] == 4 and health["drafter"] == "ngram"
    text = httpx.get(server[0] + "/metrics").text
    for name in ("specdec_requests_total", "specdec_generated_tokens_total", "specdec_queue_depth",
                 "specdec_batch_active_rows", "specdec_tokens_per_target_pass", "specdec_accepted_tokens_total",
                 "specdec_drafted_tokens_total", "specdec_time_to_first_token_seconds_bucket",
                 "specdec_request_duration_seconds_bucket"):
        assert name in text, name


def test_chat_page_is_served(server):
    r = httpx.get(server[0] + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "<script" in r.text and "http" not in r.text.split("<script")[0]


# ------------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("body, status, needle", [
    (b"{", 400, "not valid JSON"),
    (b"[1]", 400, "JSON object"),
    (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), 400, "'n' must be 1"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(), 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}).encode(), 400, "frobnicate"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}).encode(), 400,
     "presence_penalty"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ""}).encode(), 400, "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x " * 400}]}).encode(), 400, "KV buffer"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode(), 413, "over"),
])
def test_bad_requests_get_openai_errors(server, body, status, needle):
    r = httpx.post(server[0] + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_route_and_method_are_json_errors(server):
    r = httpx.get(server[0] + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server[0] + "/v1/chat/completions").status_code == 405


def test_the_server_survives_bad_requests(client, solo):
    for _ in range(3):
        httpx.post(client.base_url.join("chat/completions").__str__(), content=b"{nope")
    r = client.chat.completions.create(model="tiny", messages=_chat(PROMPTS[6]), max_tokens=8, temperature=0)
    assert r.choices[0].message.content == solo(_chat(PROMPTS[6]), 8).text


def test_parse_request_unit():
    req = parse_request({"messages": _chat("hi"), "max_completion_tokens": 5, "top_k": 3, "seed": 1}, chat=True)
    assert req.max_tokens == 5 and req.sampling == SamplingConfig(temperature=1.0, top_k=3) and req.seed == 1
    assert parse_request({"prompt": ["one"], "stream": True, "stream_options": {"include_usage": True}},
                         chat=False).include_usage
    with pytest.raises(ApiError, match="stream_options"):
        parse_request({"prompt": "x", "stream_options": {"include_usage": True}}, chat=False)
    with pytest.raises(ApiError, match="only text parts"):
        parse_request({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True)


# ------------------------------------------------------------------------------------------------ scheduling

class SlowEngine(BatchedEngine):
    """A model that never ends an answer by itself and takes at least 50 ms a round: queue and disconnect tests
    then do not race it."""

    def open(self):
        super().open()
        self._eos = set()

    def step(self):
        time.sleep(0.05)
        return super().step()


def test_full_queue_answers_429_and_disconnect_frees_the_row(tiny_bundle):
    opts = ServerOptions(model_name="tiny", queue_size=1)
    with running(lambda: SlowEngine(tiny_bundle, 1, drafter="none", max_len=256), opts) as (base, _):
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            with c1.stream("POST", base + "/v1/completions", json=body) as first:
                lines = first.iter_lines()  # kept: dropping the iterator closes the connection
                next(lines)  # admitted: it holds the only row
                deadline = time.monotonic() + 10
                while httpx.get(base + "/health").json()["active_rows"] != 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
                with c2.stream("POST", base + "/v1/completions", json=body) as second:  # waits in the queue
                    deadline = time.monotonic() + 10
                    while httpx.get(base + "/health").json()["queue_depth"] != 1 and time.monotonic() < deadline:
                        time.sleep(0.02)
                    third = httpx.post(base + "/v1/completions", json={**body, "stream": False})
                    assert third.status_code == 429 and third.headers["retry-after"] == "1"
                    assert third.json()["error"]["code"] == "queue_full"
                    assert second.status_code == 200
            # Both clients went away mid-answer: their rows are freed, and the server answers the next one.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            h = httpx.get(base + "/health").json()
            if h["active_rows"] == 0 and h["queue_depth"] == 0:
                break
            time.sleep(0.05)
        assert (h["active_rows"], h["queue_depth"]) == (0, 0)
        r = httpx.post(base + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_503_with_retry_after_while_loading_and_api_key(tiny_bundle):
    loaded = threading.Event()

    def make():
        loaded.wait(30)
        return BatchedEngine(tiny_bundle, 2, drafter="ngram", max_len=256)

    with running(make, ServerOptions(model_name="tiny", api_key="sekrit"), wait_ready=False) as (base, _):
        r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "loading" in r.json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 503
        loaded.set()
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(base + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(base + "/metrics").status_code == 401
        c = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert c.completions.create(model="tiny", prompt="hello", max_tokens=3).usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_import_specdec_does_not_import_the_web_stack():
    code = "import sys, specdec; bad = [m for m in ('starlette', 'uvicorn', 'prometheus_client') if m in sys.modules]; " \
           "print(bad); sys.exit(1 if bad else 0)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


# ------------------------------------------------------------------------------------------------ the command

def _start_cli(bundle: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", str(bundle), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return proc, base


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_command_shuts_down_gracefully_on_signals(tiny_bundle, sig):
    proc, base = _start_cli(tiny_bundle, "--max-batch", "2", "--model-name", "tiny")
    try:
        assert proc.poll() is None, proc.stderr.read()
        body = {"prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(sig)  # mid-answer: the answer in flight is finished, then the server exits
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def test_serve_command_bad_input_is_one_line(tmp_path, tiny_bundle):
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", str(tiny_bundle), "--drafter", "eagle"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", str(tiny_bundle), "--host", "0.0.0.0",
                        "--port", "1", "--max-len", "99999"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "without --api-key" in r.stderr and "Traceback" not in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", str(tiny_bundle), "--port",
                            str(taken.getsockname()[1])], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "address already in use" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------ the chat page

def test_chat_page_streams_in_a_real_browser(tiny_bundle):
    """Headless Chromium (Debian's chromium + chromium-driver, installed by .ci/run) loads /, sends a message, sees
    the streamed answer and the stats line."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    driver_path = shutil.which("chromedriver")
    if driver_path is None or shutil.which("chromium") is None:
        pytest.skip("no chromium / chromedriver here (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    with running(lambda: BatchedEngine(tiny_bundle, 2, drafter="ngram", max_len=256)) as (base, _):
        browser = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            browser.get(base + "/")
            budget = browser.find_element(By.ID, "max_tokens")
            budget.clear()
            budget.send_keys("16")  # two turns and their answers fit the tiny KV buffer
            browser.find_element(By.ID, "input").send_keys("the quick brown fox")
            browser.find_element(By.ID, "send").click()
            wait = WebDriverWait(browser, 60)
            wait.until(lambda b: "tok/s" in b.find_element(By.ID, "stats").text)
            answer = browser.find_elements(By.CSS_SELECTOR, "#log .assistant")[0].text
            stats = browser.find_element(By.ID, "stats").text
            assert browser.find_elements(By.CSS_SELECTOR, "#log .user")[0].text == "> the quick brown fox"
            assert answer.strip() and "tau" in stats and not browser.find_elements(By.CSS_SELECTOR, "#log .error")
            # The conversation is kept: a second turn sends both.
            browser.find_element(By.ID, "input").send_keys("hello world")
            browser.find_element(By.ID, "send").click()
            wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#log .assistant")) == 2
                       and b.find_element(By.ID, "send").is_enabled())
            assert browser.execute_script("return messages.length") == 4
        finally:
            browser.quit()
