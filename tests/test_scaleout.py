"""`specdec batch --ray`: the job's generation on a local Ray cluster (Ray Data map_batches, one worker per CPU
slot) writes the same records as the single-process run, and resumes like it: ids already in the output are
not sent to the workers, a Ray run interrupted mid-way resumes without loss or duplicates.

The cluster is started here (2 CPUs, no dashboard) once for the module and shut down after it.
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from specdec.batch import BatchJob, EngineSpec
from specdec.errors import SpecdecError
from specdec.runtime.session import RuntimeOptions
from specdec.scaleout import RayOptions, plan_workers

from test_batch import assert_one_error, by_id, prompts, records, run_cli

# Ray Data's own DataContext copies warn about its deprecated fields: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")

# Timings differ from run to run; every other stat is decided by the tokens and must match.
TIMING_STATS = ("ttft_s", "decode_s", "decode_tok_s")
# Fixed draft length: "auto" picks widths from measured step times, which would make `drafted`/`accepted`
# (not the text) differ between any two runs.
JOB_FLAGS = ("--batch-size", 2, "--drafter", "ngram", "--draft-len", 2)


def decided(path: Path) -> dict:
    """id -> the record less its timings (id, text, finish reason, token counts, drafts, acceptance)."""
    by_id(path)  # every id once, whole lines only
    return {r["id"]: {**r, "stats": {k: v for k, v in r["stats"].items() if k not in TIMING_STATS}}
            for r in records(path)}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'specdec[ray]' (in the test extra)")
    pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'specdec[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_input(tmp_path_factory) -> Path:
    """Good lines of mixed id types (strings and integers), a chat, a bad line and a prompt too long for the
    KV buffer (refused by a worker, reported with its line number by the driver)."""
    path = tmp_path_factory.mktemp("ray") / "in.jsonl"
    rows = [{"id": f"r{i}" if i % 2 else i, "prompt": p, "max_new_tokens": 8 + 5 * (i % 4)}
            for i, p in enumerate(prompts(7))]
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "{not json")
    lines.append(json.dumps({"id": "chat", "messages": [{"role": "user", "content": "the quick brown fox"}],
                             "max_new_tokens": 12}))
    lines.append(json.dumps({"id": "toolong", "prompt": "the lazy dog " * 200}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_bundle, ray_input) -> Path:
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    code, stdout, err = run_cli("batch", tiny_bundle, ray_input, out, *JOB_FLAGS)
    assert code == 1 and err.startswith("error: line 4: "), err  # two bad lines: the good ones written, exit 1
    assert "done: 8 of 9" in stdout and "2 errors" in stdout
    return out


def errors_of(out: Path) -> list[dict]:
    return sorted(records(out.with_name(out.name + ".errors.jsonl")), key=lambda e: e["line"])


@pytest.mark.slow
def test_ray_run_identical_to_local_run(tmp_path, tiny_bundle, ray_input, local_run, ray_cluster):
    """Two workers, calls of 2 rows: requests spread over both, each row what the local run wrote."""
    out = tmp_path / "out.jsonl"
    job = BatchJob(tiny_bundle, ray_input, out, batch_size=2, drafter="ngram", draft_len=2,
                   ray=RayOptions(workers=2, rows_per_call=2))
    c = job.run()
    assert (c.total, c.written, c.errors) == (9, 8, 2)
    assert decided(out) == decided(local_run)
    assert c.tokens == sum(r["stats"]["new_tokens"] for r in records(local_run))
    assert errors_of(out) == errors_of(local_run)
    assert [e["line"] for e in errors_of(out)] == [4, 10]
    assert "KV buffer" in errors_of(out)[1]["error"] and errors_of(out)[1]["id"] == "toolong"
    # One job whatever ran it: the same identity, so local and Ray runs resume each other.
    meta = lambda p: {k: v for k, v in json.loads(p.with_name(p.name + ".meta.json").read_text()).items()
                      if k not in ("started", "input")}
    assert meta(out) == meta(local_run)


@pytest.mark.slow
def test_ray_cli_resumes_a_local_run_and_skips_done_ids(tmp_path, tiny_bundle, ray_input, local_run, ray_cluster):
    out = tmp_path / "out.jsonl"

    def stop_after_3(rec, counts):
        if counts.written == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        BatchJob(tiny_bundle, ray_input, out, batch_size=2, drafter="ngram", draft_len=2).run(on_record=stop_after_3)
    before = out.read_bytes()
    assert len(records(out)) == 3
    code, stdout, err = run_cli("batch", tiny_bundle, ray_input, out, *JOB_FLAGS, "--ray", "--workers", 1)
    assert code == 1, err
    assert "5 this run, 3 already there" in stdout and "2 errors" in stdout
    assert out.read_bytes().startswith(before)  # the done records untouched, the rest appended after them
    assert decided(out) == decided(local_run)
    # Only the line that failed is left: the rerun tries it again on Ray and changes nothing else.
    code, stdout, _ = run_cli("batch", tiny_bundle, ray_input, out, *JOB_FLAGS, "--ray")
    assert code == 1 and "0 this run, 8 already there" in stdout and "2 errors" in stdout
    assert decided(out) == decided(local_run)


@pytest.mark.slow
def test_interrupted_ray_run_resumes_on_ray(tmp_path, tiny_bundle, ray_input, local_run, ray_cluster):
    """Ctrl-C while Ray workers are busy: whole lines only, and the rerun on Ray completes the rest."""
    out = tmp_path / "out.jsonl"
    opts = RayOptions(workers=2, rows_per_call=2)

    def stop_after_2(rec, counts):
        if counts.written == 2:
            raise KeyboardInterrupt

    job = BatchJob(tiny_bundle, ray_input, out, batch_size=2, drafter="ngram", draft_len=2, ray=opts)
    with pytest.raises(KeyboardInterrupt):
        job.run(on_record=stop_after_2)
    assert job.counts.written == 2 and len(records(out)) == 2
    again = BatchJob(tiny_bundle, ray_input, out, batch_size=2, drafter="ngram", draft_len=2, ray=opts).run()
    assert (again.done_before, again.written) == (2, 6)
    assert decided(out) == decided(local_run)


# ------------------------------------------------------------------------------------- without a cluster

def test_missing_ray_is_one_line_with_the_install_hint(tmp_path, tiny_bundle, ray_input, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "out.jsonl"
    assert_one_error(run_cli("batch", tiny_bundle, ray_input, out, "--ray"), "Ray", "pip install 'specdec[ray]'")
    assert not out.exists()


def test_ray_flags_need_ray(tmp_path, tiny_bundle, ray_input):
    assert_one_error(run_cli("batch", tiny_bundle, ray_input, tmp_path / "o.jsonl", "--workers", 2), "--ray")
    assert_one_error(run_cli("batch", tiny_bundle, ray_input, tmp_path / "o.jsonl", "--ray", "--workers", 0),
                     "--workers")


def test_plan_one_worker_per_cpu_slot(tmp_path):
    spec = EngineSpec(bundle=tmp_path, batch_size=4, drafter=None, max_len=None, runtime=RuntimeOptions())
    p = plan_workers(spec, RayOptions(), n_pending=100, cluster={"CPU": 6.0})
    assert (p.workers, p.num_cpus, p.num_gpus, p.rows_per_call, p.calls) == (6, 1, 0, 16, 7)
    threaded = EngineSpec(tmp_path, 4, None, None, RuntimeOptions(threads=2))
    assert plan_workers(threaded, RayOptions(), 100, {"CPU": 7.0}).workers == 3  # 2 CPUs each, no oversubscription
    assert plan_workers(spec, RayOptions(), 20, {"CPU": 6.0}).workers == 2  # no more workers than calls
    assert plan_workers(spec, RayOptions(workers=2, rows_per_call=1), 20, {"CPU": 6.0}).workers == 2
    gpu = EngineSpec(tmp_path, 4, None, None, RuntimeOptions(provider="cuda"))
    g = plan_workers(gpu, RayOptions(), 100, {"CPU": 32.0, "GPU": 2.0})
    assert (g.workers, g.num_gpus, g.num_cpus) == (2, 1, 1)
    with pytest.raises(SpecdecError, match="has none"):
        plan_workers(gpu, RayOptions(), 100, {"CPU": 32.0})
    with pytest.raises(SpecdecError, match="--threads"):
        plan_workers(threaded, RayOptions(), 100, {"CPU": 1.0})
    with pytest.raises(ValueError, match="--workers"):
        RayOptions(workers=0)


@pytest.mark.slow
def test_a_worker_that_cannot_load_the_bundle_is_one_line(tmp_path, tiny_bundle, ray_input, ray_cluster):
    """The driver reads only the manifest; a graph that fails its checksum fails in the workers, and that
    comes back as one `error:` line naming the cause, with nothing written."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_bundle, broken)
    graph = next(p for p in broken.iterdir() if p.suffix == ".onnx")
    data = bytearray(graph.read_bytes())
    data[-1] ^= 0xFF
    graph.write_bytes(bytes(data))
    out = tmp_path / "out.jsonl"
    line = assert_one_error(run_cli("batch", broken, ray_input, out, *JOB_FLAGS, "--ray"), "Ray worker failed")
    assert "checksum" in line.lower() or "sha" in line.lower(), line
    assert records(out) == []
