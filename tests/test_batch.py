"""`specdec batch` (the resumable JSONL job) and the batched speculative loop behind --batch-size.

The job: every id exactly once across kills and reruns, whole lines only (disk full, Ctrl-C, a crash
mid-line), bad lines reported with their line numbers without stopping the job, and no mixing of outputs
from different bundles or settings. The loop: every row of a batch is token-identical to the same request
decoded alone (greedy; and seeded sampling with deterministic drafters), with ragged prompts, ragged
acceptance, different budgets, stop strings, a full KV buffer and continuous refill.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specdec.batch import AppendLog, BatchJob, meta_path
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.runtime.batched import BatchedEngine, BatchRequest
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.sampling import SamplingConfig

WORDS = "the quick brown fox jumps over the lazy dog speculative decoding drafts tokens and the target verifies".split()


def prompts(n: int, seed: int = 0) -> list[str]:
    """Ragged prompts from the tiny tokenizer's corpus: 1 to 14 words."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 15)))) for _ in range(n)]


def write_input(path: Path, n: int = 6, **extra) -> list[dict]:
    rows = [{"id": f"r{i}", "prompt": p, "max_new_tokens": 8 + 5 * (i % 4), **extra} for i, p in enumerate(prompts(n))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError("".join(traceback.format_exception(result.exception)))
    return result.exit_code, result.stdout, result.stderr


def assert_one_error(outcome, *needles: str) -> str:
    code, out, err = outcome
    assert code != 0, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    return lines[0]


def records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "the output must hold whole lines only"
    return [json.loads(line) for line in data.decode().splitlines()]


def by_id(path: Path) -> dict:
    recs = records(path)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"duplicate ids in the output: {ids}"
    return {r["id"]: (r["text"], r["finish_reason"]) for r in recs}


@pytest.fixture(scope="module")
def job_input(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    write_input(path, n=7)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_bundle, job_input) -> dict:
    """The uninterrupted batch-size-1 run of job_input: id -> (text, finish_reason)."""
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    code, stdout, err = run_cli("batch", tiny_bundle, job_input, out, "--batch-size", 1)
    assert code == 0, err
    assert "done: 7 of 7" in stdout and "0 errors" in stdout
    return by_id(out)


# ------------------------------------------------------------------------------------------- the job

def test_job_output_and_meta(tmp_path, tiny_bundle, job_input, reference):
    assert len(reference) == 7
    out = tmp_path / "out.jsonl"
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out, "--batch-size", 1)
    assert code == 0
    recs = records(out)
    assert {r["id"] for r in recs} == set(reference)
    assert all(set(r) == {"id", "text", "finish_reason", "stats"} and r["stats"]["new_tokens"] > 0 for r in recs)
    meta = json.loads(meta_path(out).read_text())
    assert meta["format"] == "specdec-batch" and len(meta["bundle_sha256"]) == 64
    assert meta["settings"] == {"drafter": "model", "draft_len": "auto", "max_new_tokens": 256, "max_len": 256}
    assert (tmp_path / "out.jsonl.errors.jsonl").read_text() == ""
    # A second run has nothing left to do and changes nothing.
    before = out.read_bytes()
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out)
    assert code == 0 and "0 this run, 7 already there" in stdout and out.read_bytes() == before


@pytest.mark.parametrize("batch_size", [1, 3])
def test_resume_after_interrupt(tmp_path, tiny_bundle, job_input, reference, batch_size):
    """Ctrl-C after 2 records: exit 130 and a line saying how to resume; the rerun completes the rest."""
    out = tmp_path / "out.jsonl"
    calls = []
    real_append = AppendLog.append

    def interrupting(self, record):
        real_append(self, record)
        if self.path == out:
            calls.append(record["id"])
            if len(calls) == 2:
                raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AppendLog, "append", interrupting)
        code, _, err = run_cli("batch", tiny_bundle, job_input, out, "--batch-size", batch_size)
    assert code == 130
    assert "interrupted: 2 of 7 requests done" in err and "rerun the same command to resume" in err
    assert len(records(out)) == 2
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out, "--batch-size", batch_size)
    assert code == 0 and "5 this run, 2 already there" in stdout
    assert by_id(out) == reference  # every id once, the same texts as an uninterrupted run


def test_resume_after_interrupt_via_on_record(tmp_path, tiny_bundle, job_input, reference):
    out = tmp_path / "out.jsonl"

    def stop_after_3(rec, counts):
        if counts.written == 3:
            raise KeyboardInterrupt

    job = BatchJob(tiny_bundle, job_input, out, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        job.run(on_record=stop_after_3)
    assert job.counts.written == 3 and len(records(out)) == 3
    again = BatchJob(tiny_bundle, job_input, out, batch_size=2).run()
    assert again.done_before == 3 and again.written == 4
    assert by_id(out) == reference


def test_trailing_partial_line_is_discarded_and_redone(tmp_path, tiny_bundle, job_input, reference):
    out = tmp_path / "out.jsonl"
    assert run_cli("batch", tiny_bundle, job_input, out)[0] == 0
    lines = out.read_bytes().splitlines(keepends=True)
    lost = json.loads(lines[-1])["id"]
    out.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a crash in the middle of a line
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out)
    assert code == 0 and "1 this run, 6 already there" in stdout and "partial last line" in stdout
    assert by_id(out) == reference and lost in reference


def test_killed_subprocess_resumes_without_loss_or_duplicates(tmp_path, tiny_bundle):
    """SIGKILL at a random moment of a real run, then the same command again: every id exactly once."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": i, "prompt": p, "max_new_tokens": 64} for i, p in enumerate(prompts(40, seed=1))]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exe = Path(sys.executable).with_name("specdec")
    cmd = ([str(exe)] if exe.is_file() else [sys.executable, "-m", "specdec.cli"]) + \
        ["batch", str(tiny_bundle), str(inp), str(out), "--batch-size", "2", "--drafter", "ngram"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the job ended before the kill: nothing was tested"
    n_before = len(records(out)) if out.exists() else 0
    assert 3 <= n_before < 40, f"the kill must land mid-job, after {n_before} records"
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    got = by_id(out)
    assert sorted(got) == list(range(40)), f"killed after {n_before} records"


def test_bad_lines_go_to_the_errors_file(tmp_path, tiny_bundle):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        json.dumps({"id": "ok1", "prompt": "the quick brown fox", "max_new_tokens": 5}),
        "{not json",
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "noprompt"}),
        "",  # blank lines are skipped, not errors
        json.dumps({"id": "ok1", "prompt": "a duplicate"}),
        json.dumps({"id": "typo", "prompt": "x y", "max_token": 5}),
        json.dumps({"id": "badtemp", "prompt": "x y", "temperature": -1}),
        json.dumps({"id": "toolong", "prompt": "the lazy dog " * 200}),
        json.dumps(["a", "list"]),
        json.dumps({"id": 7, "messages": [{"role": "user", "content": "hello world"}], "max_new_tokens": 5}),
    ]
    inp.write_text("\n".join(lines) + "\n")
    code, stdout, err = run_cli("batch", tiny_bundle, inp, out, "--batch-size", 2)
    # every good line is written, then one line names the first bad one and the exit says the job is not whole
    assert code == 1, err
    assert "done: 2 of" in stdout and "8 errors" in stdout
    assert err.count("\n") == 1 and err.startswith("error: line 2: not valid JSON") and "7 more" in err, err
    assert set(by_id(out)) == {"ok1", 7}
    errors = records(tmp_path / "out.jsonl.errors.jsonl")
    by_line = {e["line"]: e for e in errors}
    assert sorted(by_line) == [2, 3, 4, 6, 7, 8, 9, 10]
    assert "not valid JSON" in by_line[2]["error"]
    assert 'missing "id"' in by_line[3]["error"]
    assert "prompt" in by_line[4]["error"] and by_line[4]["id"] == "noprompt"
    assert "duplicate id" in by_line[6]["error"] and "line 1" in by_line[6]["error"]
    assert "unknown field 'max_token'" in by_line[7]["error"]
    assert "temperature" in by_line[8]["error"]
    assert "KV buffer" in by_line[9]["error"] and by_line[9]["id"] == "toolong"
    assert "JSON object" in by_line[10]["error"]
    # The errors file describes the last run: a rerun rewrites it, it does not pile up.
    assert run_cli("batch", tiny_bundle, inp, out, "--batch-size", 2)[0] == 1
    assert len(records(tmp_path / "out.jsonl.errors.jsonl")) == 8


def test_custom_errors_path(tmp_path, tiny_bundle):
    inp, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errs" / "e.jsonl"
    errs.parent.mkdir()
    inp.write_text("nope\n")
    code, stdout, err = run_cli("batch", tiny_bundle, inp, out, "--errors", errs)
    assert code == 1 and "1 error " in stdout and str(errs) in err and "more" not in err
    assert records(errs)[0]["line"] == 1


def test_unreadable_input(tmp_path, tiny_bundle):
    assert_one_error(run_cli("batch", tiny_bundle, tmp_path / "missing.jsonl", tmp_path / "out.jsonl"),
                     "cannot read input", "missing.jsonl")
    assert_one_error(run_cli("batch", tiny_bundle, tmp_path, tmp_path / "out.jsonl"), "cannot read input")
    if os.geteuid() != 0:  # root reads anything
        f = tmp_path / "secret.jsonl"
        f.write_text('{"id": 1, "prompt": "x"}\n')
        f.chmod(0)
        assert_one_error(run_cli("batch", tiny_bundle, f, tmp_path / "out.jsonl"), "cannot read input")
    assert not (tmp_path / "out.jsonl").exists()


def test_same_path_for_input_and_output(tmp_path, tiny_bundle, job_input):
    assert_one_error(run_cli("batch", tiny_bundle, job_input, job_input), "same file")


def test_refuses_other_settings_or_bundle_unless_forced(tmp_path, tiny_bundle, job_input):
    out = tmp_path / "out.jsonl"
    assert run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 16)[0] == 0
    before = out.read_bytes()
    line = assert_one_error(run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 32),
                            "another bundle or settings", "max_new_tokens", "--force")
    assert "16 -> 32" in line
    assert_one_error(run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 16, "--drafter", "none"),
                     "drafter")
    # Same settings spelt differently (the defaults given explicitly, another batch size) are the same job.
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 16, "--drafter", "model",
                              "--draft-len", "auto", "--batch-size", 2)
    assert code == 0 and "0 this run" in stdout
    # Another bundle: a copy whose manifest differs.
    other = tmp_path / "other"
    shutil.copytree(tiny_bundle, other)
    m = json.loads((other / "specdec.json").read_text())
    m["drafter"]["draft_len"] = 3
    (other / "specdec.json").write_text(json.dumps(m, indent=2))
    assert_one_error(run_cli("batch", other, job_input, out, "--max-new-tokens", 16), "bundle")
    assert out.read_bytes() == before
    # --force mixes: the old records stay, their ids are skipped, the meta keeps the old identity as history.
    code, stdout, _ = run_cli("batch", other, job_input, out, "--max-new-tokens", 16, "--force")
    assert code == 0 and "7 already there" in stdout and out.read_bytes() == before
    meta = json.loads(meta_path(out).read_text())
    assert meta["bundle"] == str(other) and meta["previous"][0]["bundle"] == str(tiny_bundle)


def test_settings_can_change_while_the_output_is_still_empty(tmp_path, tiny_bundle, job_input):
    out = tmp_path / "out.jsonl"
    assert_one_error(run_cli("batch", tiny_bundle, job_input, out, "--drafter", "hybrid", "--batch-size", 2), "hybrid")
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out, "--drafter", "ngram", "--max-new-tokens", 4)
    assert code == 0 and "7 this run" in stdout
    assert json.loads(meta_path(out).read_text())["settings"]["drafter"] == "ngram"


def test_refuses_an_output_not_written_by_batch(tmp_path, tiny_bundle, job_input):
    out = tmp_path / "notes.jsonl"
    out.write_text('{"something": "else"}\n')
    assert_one_error(run_cli("batch", tiny_bundle, job_input, out), "not written by `specdec batch`", "--force")
    assert out.read_text() == '{"something": "else"}\n'


def test_a_second_concurrent_run_is_refused(tmp_path, tiny_bundle, job_input):
    out = tmp_path / "out.jsonl"
    assert run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 4)[0] == 0
    holder = AppendLog(out)
    holder.lock()  # another run in progress
    try:
        assert_one_error(run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 4),
                         "being written by another")
    finally:
        holder.close()
    assert run_cli("batch", tiny_bundle, job_input, out, "--max-new-tokens", 4)[0] == 0


def test_disk_full_leaves_no_partial_line(tmp_path, tiny_bundle, job_input):
    """ENOSPC on the 3rd record, after half of it reached the file: the half is removed, one error line."""
    out = tmp_path / "out.jsonl"
    real_write = os.write
    state = {"records": 0}
    out_fds = set()
    real_open = os.open

    def tracking_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        if Path(path) == out:
            out_fds.add(fd)
        return fd

    def failing_write(fd, data):
        if fd in out_fds:
            state["records"] += 1
            if state["records"] == 3:
                real_write(fd, bytes(data[: len(data) // 2]))  # the disk fills up in the middle of the line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", tracking_open)
        mp.setattr(os, "write", failing_write)
        outcome = run_cli("batch", tiny_bundle, job_input, out)
    line = assert_one_error(outcome, "disk is full", "no partial line", "rerun")
    assert str(out) in line
    assert len(records(out)) == 2  # records() also checks that the file ends with a whole line
    # After space is freed the same command finishes the job.
    code, stdout, _ = run_cli("batch", tiny_bundle, job_input, out)
    assert code == 0 and "5 this run, 2 already there" in stdout


@pytest.fixture
def sigint_delivered():
    """Python's own Ctrl-C handler for the test: a shell starts background jobs (`pytest &`) with SIGINT ignored,
    and then nothing is there to hold."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_write_is_held_until_the_line_is_whole(tmp_path, monkeypatch, sigint_delivered):
    log = AppendLog(tmp_path / "x.jsonl")
    real_fsync = os.fsync

    def fsync_with_sigint(fd):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives after the write, before fsync returns
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_with_sigint)
    with pytest.raises(KeyboardInterrupt):
        log.append({"id": 1, "text": "whole"})
    log.close()
    assert records(tmp_path / "x.jsonl") == [{"id": 1, "text": "whole"}]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_batched_job_matches_batch_1_job(tmp_path, tiny_bundle, job_input, reference):
    for b in (2, 3):
        out = tmp_path / f"out{b}.jsonl"
        code, _, err = run_cli("batch", tiny_bundle, job_input, out, "--batch-size", b)
        assert code == 0, err
        assert by_id(out) == reference


# ------------------------------------------------------------------------------------------- the loop

def _requests(engine, cfgs, texts):
    return [BatchRequest(i, tuple(engine.encode(t)), c) for i, (t, c) in enumerate(zip(texts, cfgs))]


def _alone(bundle, drafter, texts, cfgs, max_len=None) -> list:
    eng = Engine(bundle, drafter=drafter, max_len=max_len)
    out = []
    for t, c in zip(texts, cfgs):
        eng.reset()
        out.append(eng.generate(t, c))
    return out


@pytest.mark.parametrize("drafter,draft_len", [("none", None), ("ngram", None), ("model", None),
                                               ("ngram", "auto"), ("model", "auto")])
@pytest.mark.parametrize("batch_size", [2, 3])
def test_batched_rows_identical_to_batch_1_greedy(tiny_bundle, drafter, draft_len, batch_size):
    texts = prompts(7, seed=2)
    stops = [(), (), ("the",), (), (), ("fox",), ()]
    cfgs = [GenerationConfig(max_new_tokens=m, stop=s, draft_len=draft_len)
            for m, s in zip([30, 5, 40, 17, 1, 24, 33], stops)]
    ref = _alone(tiny_bundle, drafter, texts, cfgs)
    eng = BatchedEngine(tiny_bundle, batch_size, drafter=drafter)
    got = {req.key: g for req, g in eng.run(_requests(eng, cfgs, texts))}
    assert sorted(got) == list(range(len(texts)))
    for i, g in got.items():
        assert g.finish_reason == ref[i].finish_reason, (i, drafter)
        if draft_len is None:  # the same k: the same rounds, so even the streamed text is the same
            assert (g.token_ids, g.text) == (ref[i].token_ids, ref[i].text), (i, drafter)
        elif g.finish_reason == "stop":  # token_ids run to the end of the round that hit the stop string
            n = min(len(g.token_ids), len(ref[i].token_ids))
            assert g.token_ids[:n] == ref[i].token_ids[:n] and g.text == ref[i].text
        else:  # (Generation.text may differ in a held-back last character: see BatchJob._text)
            assert g.token_ids == ref[i].token_ids, (i, drafter)
        assert g.stats.prompt_tokens == ref[i].stats.prompt_tokens
    if drafter != "none" and draft_len is None:  # (auto may rightly decide that drafting does not pay here)
        assert sum(g.stats.accepted for g in got.values()) > 0  # rows really did accept drafts, raggedly


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_batched_rows_identical_to_batch_1_sampled(tiny_bundle, drafter):
    """Deterministic drafters: a seeded sampled row draws exactly what it draws alone."""
    texts = prompts(5, seed=3)
    cfgs = [GenerationConfig(max_new_tokens=20, seed=i, sampling=SamplingConfig(temperature=0.8, top_p=0.9, top_k=50))
            for i in range(5)]
    ref = _alone(tiny_bundle, drafter, texts, cfgs)
    eng = BatchedEngine(tiny_bundle, 3, drafter=drafter)
    got = {req.key: g for req, g in eng.run(_requests(eng, cfgs, texts))}
    assert [got[i].token_ids for i in range(5)] == [r.token_ids for r in ref]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_batched_rows_reaching_a_full_kv_buffer(tiny_bundle, drafter):
    """Rows of different lengths fill a short KV buffer at different rounds; drafts are capped near the end."""
    texts = ["the fox", "the quick brown fox jumps over the lazy dog", "tokens", "the target verifies drafts",
             "speculative decoding drafts tokens and the target verifies them"]
    cfgs = [GenerationConfig(max_new_tokens=100) for _ in texts]
    ref = _alone(tiny_bundle, drafter, texts, cfgs, max_len=64)
    assert all(r.finish_reason == "kv_full" for r in ref)
    eng = BatchedEngine(tiny_bundle, 3, drafter=drafter, max_len=64)
    got = {req.key: g for req, g in eng.run(_requests(eng, cfgs, texts))}
    assert [(got[i].token_ids, got[i].finish_reason) for i in range(5)] == \
        [(r.token_ids, r.finish_reason) for r in ref]


def test_batched_bad_prompt_does_not_stop_the_batch(tiny_bundle):
    eng = BatchedEngine(tiny_bundle, 2, drafter="ngram", max_len=32)
    cfg = GenerationConfig(max_new_tokens=4)
    reqs = [BatchRequest("ok", tuple(eng.encode("the fox")), cfg),
            BatchRequest("long", tuple(range(5, 45)), cfg),
            BatchRequest("empty", (), cfg),
            BatchRequest("ok2", tuple(eng.encode("the dog")), cfg)]
    got = dict((req.key, g) for req, g in eng.run(reqs))
    assert isinstance(got["long"], SpecdecError) and "KV buffer" in str(got["long"])
    assert isinstance(got["empty"], SpecdecError)
    assert got["ok"].stats.new_tokens == 4 and got["ok2"].stats.new_tokens == 4


def test_batched_hybrid_drafter_is_refused(tiny_bundle):
    with pytest.raises(SpecdecError, match="not supported with batch size > 1"):
        BatchedEngine(tiny_bundle, 2, drafter="hybrid")


def test_gqa_ragged_rows_idle_rows_and_padding(tiny_bundle):
    """What the batched loop relies on, checked on the graph itself: per-row pasts, right padding not
    written, idle rows (query_lens 0) untouched, each row's logits equal to its batch-1 logits."""
    from specdec.runtime.decoder import Decoder
    from specdec.runtime.kv import KVCache
    from specdec.runtime.manifest import read_manifest
    from specdec.runtime.session import RuntimeOptions

    m = read_manifest(tiny_bundle)
    g = m.graphs["target"]

    def decoder(batch):
        kv = KVCache(g.model.n_layers, batch, g.model.n_kv_heads, 32, g.model.head_dim)
        return Decoder(tiny_bundle / g.file, g, g.model, kv, RuntimeOptions())

    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 300, size=n) for n in (9, 4, 6)]
    ref = []
    for s in seqs:
        d1 = decoder(1)
        ref.append(d1.forward(s[None]).copy()[0])  # [n, vocab]
    d = decoder(3)
    d.kv.slab[:] = 7.0
    d.kv.lengths[:] = [0, 0, 0]
    # Step 1: rows 0 and 1 take their first 5 and 2 tokens; row 2 idles.
    tokens = np.zeros((3, 5), dtype=np.int64)
    tokens[0], tokens[1, :2] = seqs[0][:5], seqs[1][:2]
    lo = d.forward(tokens, query_lens=np.array([5, 2, 0])).copy()
    s = d.kv.slab  # [L, 2, B, KV, M, H]
    assert (s[:, :, 2] == 7.0).all(), "an idle row's KV was written"
    assert (s[:, :, 1, :, 2:] == 7.0).all(), "padding was written to the KV"
    assert (s[:, :, 0, :, :5] != 7.0).all() and (s[:, :, 1, :, :2] != 7.0).all()
    np.testing.assert_allclose(lo[0, :5], ref[0][:5], atol=1e-4)
    np.testing.assert_allclose(lo[1, :2], ref[1][:2], atol=1e-4)
    d.kv.advance(np.array([5, 2, 0]))
    # Step 2: ragged continuation from per-row pasts (5, 2, 0).
    rest = [seqs[0][5:], seqs[1][2:], seqs[2]]
    T = max(len(r) for r in rest)
    tokens = np.zeros((3, T), dtype=np.int64)
    for i, r in enumerate(rest):
        tokens[i, :len(r)] = r
    lo = d.forward(tokens, query_lens=np.array([len(r) for r in rest])).copy()
    for i, r in enumerate(rest):
        np.testing.assert_allclose(lo[i, :len(r)], ref[i][len(seqs[i]) - len(r):], atol=1e-4)
        assert (lo[i, :len(r)].argmax(-1) == ref[i][len(seqs[i]) - len(r):].argmax(-1)).all()
    # An idle row does not constrain the step's width even when its own buffer is nearly full (the kernel
    # requires length + T <= max_len only of rows that run: Decoder passes seqlens_k 0 for idle rows).
    d.kv.lengths[:] = [3, 31, 3]
    before = s[:, :, 1].copy()
    d.forward(np.ones((3, 6), dtype=np.int64), query_lens=np.array([6, 0, 2]))
    assert (s[:, :, 1] == before).all()


@pytest.fixture(scope="module")
def fast_int4(tiny_bundle, tmp_path_factory):
    from specdec.quant.bundle import quantize_bundle

    return quantize_bundle(tiny_bundle, tmp_path_factory.mktemp("fast") / "int4f", "int4", fast_kernels=True)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_batched_fast_kernel_bundle_matches_the_engine_to_a_full_buffer(fast_int4, batch_size):
    """A fast-kernel bundle pads every 1-token step to 2 tokens (its rows would round apart otherwise): batched
    rows, run alone or side by side and up to the last KV slot, give the single-stream engine's tokens."""
    from specdec.runtime.manifest import read_manifest

    assert read_manifest(fast_int4).graphs["target"].min_step_tokens == 2
    texts = ["the fox", "the quick brown fox jumps over the lazy dog", "tokens", "the target verifies drafts"]
    cfgs = [GenerationConfig(max_new_tokens=100) for _ in texts]
    for drafter in ("none", "ngram"):
        ref = _alone(fast_int4, drafter, texts, cfgs, max_len=48)
        assert all(r.finish_reason == "kv_full" for r in ref)
        eng = BatchedEngine(fast_int4, batch_size, drafter=drafter, max_len=48)
        got = {req.key: g for req, g in eng.run(_requests(eng, cfgs, texts))}
        assert [got[i].token_ids for i in range(len(texts))] == [r.token_ids for r in ref], drafter


@pytest.fixture(scope="module")
def corpus_bundle(tiny_bundle, tiny_distill_data, tmp_path_factory) -> Path:
    """The tiny bundle with a corpus of its target's answers."""
    from specdec.export.corpus import add_corpus

    out = tmp_path_factory.mktemp("corpus") / "tiny"
    shutil.copytree(tiny_bundle, out)
    add_corpus(out, [tiny_distill_data])
    return out


@pytest.mark.parametrize("draft_len", [3, "auto"])
def test_batched_corpus_rows_identical_to_batch_1(corpus_bundle, draft_len):
    """Corpus rows (one index, reliabilities shared by the rows) give each row what it gets alone: greedy, and
    seeded-sampled at a fixed length (with "auto" the batch chooses other widths than a row alone, so a sampled
    row consumes its random numbers differently: the same law, other draws)."""
    texts = prompts(7, seed=4)
    greedy = [GenerationConfig(max_new_tokens=m, draft_len=draft_len) for m in [30, 5, 40, 17, 1, 24, 33]]
    sampled = [GenerationConfig(max_new_tokens=20, seed=i, draft_len=draft_len,
                                sampling=SamplingConfig(temperature=0.8, top_p=0.9)) for i in range(4)]
    for cfgs in (greedy, sampled) if draft_len != "auto" else (greedy,):
        ref = _alone(corpus_bundle, "corpus", texts[:len(cfgs)], cfgs)
        eng = BatchedEngine(corpus_bundle, 3, drafter="corpus")
        got = {req.key: g for req, g in eng.run(_requests(eng, cfgs, texts))}
        assert [got[i].token_ids for i in range(len(cfgs))] == [r.token_ids for r in ref]
        if cfgs is greedy:
            assert sum(g.stats.drafted for g in got.values()) > 0
    assert eng._corpus_drafter.reliability[("corpus", 1)].scores > 30  # the shared estimates learnt


def test_batched_corpus_drafter_needs_a_corpus(tiny_bundle, tmp_path):
    with pytest.raises(SpecdecError, match="no corpus"):
        BatchedEngine(tiny_bundle, 2, drafter="corpus")
    write_input(tmp_path / "in.jsonl", n=2)
    assert_one_error(run_cli("batch", tiny_bundle, tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--batch-size", 2,
                             "--drafter", "corpus"), "no corpus", "specdec corpus")


def test_sampled_corpus_rows_keep_the_targets_exact_law(corpus_bundle):
    """Corpus drafts (deterministic lookups into the target's greedy answers) verified in ragged sampled rows: the
    tokens after the first follow the target's own law (the check of tests/test_sampled_lossless.py)."""
    from sampled_checks import assert_lossless, check_batch
    from specdec.verify_stats import TargetLaw

    sampling = SamplingConfig(temperature=0.3)
    law = TargetLaw(Engine(corpus_bundle, drafter="none").target, sampling)
    eng = BatchedEngine(corpus_bundle, 3, drafter="corpus")
    from specdec.export.distill_data import DistillDataConfig, plan_prompts

    # Two of the prompts the corpus answers (conftest's tiny_distill_data): its lookups find their continuations.
    ids = [eng.encode(messages) for messages in plan_prompts(DistillDataConfig(n_prompts=24, seed=0), [], set())[:2]]
    cfg = GenerationConfig(max_new_tokens=3, draft_len=2, sampling=sampling)
    assert_lossless(*check_batch(eng, law, ids, cfg, 800))


# ------------------------------------------------------------------------------------------- OpenAI Batch API lines

def _openai_line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_openai_batch_lines_give_openai_output_lines_and_resume(tmp_path, tiny_bundle):
    """The server's request schema, read from a file: OpenAI Batch API lines in, OpenAI output lines out, the same
    answers as `specdec generate`; a rerun skips them by custom_id."""
    import specdec
    from specdec import GenerationConfig

    texts = prompts(3, seed=5)
    rows = [_openai_line("chat-0", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": texts[0]}], "max_completion_tokens": 12,
                          "temperature": 0}),
            _openai_line("text-1", "/v1/completions", {"prompt": texts[1], "max_tokens": 9,
                                                       "temperature": 0, "model": "ignored"}),
            {"id": "plain-2", "prompt": texts[2], "max_tokens": 7}]  # a plain line with the server's field name
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli("batch", tiny_bundle, src, out, "--batch-size", 2)
    assert code == 0, err
    got = {r.get("custom_id", r["id"]): r for r in records(out)}
    engine = specdec.load(tiny_bundle, drafter="none")
    chat = engine.generate(texts[0], GenerationConfig(max_new_tokens=12, draft_len=0))
    raw = engine.generate(texts[1], GenerationConfig(max_new_tokens=9, draft_len=0, chat=False))
    plain = engine.generate(texts[2], GenerationConfig(max_new_tokens=7, draft_len=0))
    line = got["chat-0"]
    assert line["id"].startswith("batch_req_") and line["error"] is None
    assert line["response"]["status_code"] == 200
    body = line["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == chat.text
    assert body["usage"]["completion_tokens"] == len(chat.token_ids) <= 12
    body = got["text-1"]["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == raw.text
    assert body["usage"]["completion_tokens"] == len(raw.token_ids) <= 9
    assert got["plain-2"]["text"] == plain.text and len(plain.token_ids) <= 7
    code, stdout, _ = run_cli("batch", tiny_bundle, src, out, "--batch-size", 2)
    assert code == 0 and len(records(out)) == 3  # nothing redone


@pytest.mark.parametrize("row, needle", [
    (_openai_line("a", "/v1/embeddings", {"input": "x"}), '"url" must be one of'),
    (_openai_line("a", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
     "stream"),
    (_openai_line("a", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}), "'n'"),
    (_openai_line("a", "/v1/completions", {"prompt": "x", "frobnicate": 1}), "frobnicate"),
    ({**_openai_line("a", "/v1/completions", {"prompt": "x"}), "extra": 1}, "extra"),
    (_openai_line("", "/v1/completions", {"prompt": "x"}), "custom_id"),
    ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, "POST"),
    ({"id": "a", "prompt": "x", "max_tokens": 3, "max_new_tokens": 3}, "one of"),
])
def test_bad_openai_batch_lines_go_to_the_errors_file(tmp_path, tiny_bundle, row, needle):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(row) + "\n" + json.dumps({"id": "ok", "prompt": "hello world", "max_tokens": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli("batch", tiny_bundle, src, out)
    assert code == 1
    errors = records(tmp_path / "out.jsonl.errors.jsonl")
    assert len(errors) == 1 and needle in errors[0]["error"], errors
    assert [r["id"] for r in records(out)] == ["ok"]
