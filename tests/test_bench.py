"""`specdec bench`: the side-by-side table, greedy (outputs compared) and sampled (same seed per config)."""
from __future__ import annotations

import json

import pytest

from test_cli import run_cli


def _questions(path):
    rows = [{"question_id": i, "category": cat, "turns": [text]}
            for i, (cat, text) in enumerate([("writing", "the quick brown fox"), ("writing", "hello world, this is"),
                                             ("qa", "a small model proposes"), ("qa", "the lazy dog")])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_greedy_bench_compares_outputs(tiny_bundle, tmp_path):
    out = tmp_path / "greedy.json"
    code, stdout, err = run_cli("bench", tiny_bundle, "--questions", _questions(tmp_path / "q.jsonl"), "--limit", 0,
                                "--configs", "ngram:3,model:2", "--max-new-tokens", 16, "--out", out)
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["configs"] == ["plain", "ngram:3", "model:2"]
    assert result["categories"] == ["writing", "qa", "overall"]
    assert all(r["identical"] is True for r in result["runs"])  # lossless: the tiny bundle's drafts are exact
    overall = result["table"]["model:2"]["overall"]
    assert overall["prompts"] == 4 and overall["not_identical"] == 0
    # The table's figures are the runs' totals, recomputed here by hand.
    mine = [r for r in result["runs"] if r["config"] == "model:2"]
    plain = [r for r in result["runs"] if r["config"] == "plain"]
    forwards, accepted = sum(r["forwards"] for r in mine), sum(r["accepted"] for r in mine)
    assert accepted > 0 and overall["tau"] == pytest.approx((accepted + forwards) / forwards)
    tok_s = sum(r["new_tokens"] for r in mine) / sum(r["wall_s"] for r in mine)
    plain_tok_s = sum(r["new_tokens"] for r in plain) / sum(r["wall_s"] for r in plain)
    assert overall["tok_s"] == pytest.approx(tok_s)
    assert overall["speedup"] == pytest.approx(tok_s / plain_tok_s)
    assert result["table"]["plain"]["overall"]["speedup"] == 1.0
    assert "greedy" in stdout
    assert result["max_new_tokens"] == 16 and "at most 16 new tokens" in stdout  # the budget moves the ratios


def test_summary_formulas_by_hand():
    from specdec.benchmark import summarize

    def run(config, category, new_tokens, wall_s, forwards, accepted):
        return {"config": config, "category": category, "new_tokens": new_tokens, "wall_s": wall_s,
                "forwards": forwards, "accepted": accepted, "identical": True}

    runs = [run("plain", "qa", 20, 2.0, 20, 0), run("plain", "code", 30, 2.0, 30, 0),
            run("ngram:3", "qa", 20, 1.0, 8, 12), run("ngram:3", "code", 30, 0.5, 10, 20)]
    table = summarize(runs, ["plain", "ngram:3"])["table"]
    assert table["plain"]["overall"]["tok_s"] == 50 / 4.0
    assert table["ngram:3"]["qa"] == {"prompts": 1, "tokens": 20, "tok_s": 20.0, "tau": 20 / 8,
                                           "not_identical": 0, "speedup": 20.0 / 10.0}
    assert table["ngram:3"]["code"]["tau"] == (20 + 10) / 10 and table["ngram:3"]["code"]["speedup"] == 60.0 / 15.0
    overall = table["ngram:3"]["overall"]
    assert overall["tok_s"] == 50 / 1.5 and overall["tau"] == (32 + 18) / 18
    assert overall["speedup"] == pytest.approx((50 / 1.5) / (50 / 4.0))


def test_sampled_bench_runs_every_config_with_one_seed(tiny_bundle, tmp_path):
    out = tmp_path / "sampled.json"
    args = ["bench", tiny_bundle, "--questions", _questions(tmp_path / "q.jsonl"), "--limit", 1,
            "--configs", "model:2", "--max-new-tokens", 16, "--temperature", 0.8, "--top-p", 0.9, "--seed", 5]
    code, stdout, err = run_cli(*args, "--out", out)
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9}
    assert all(r["identical"] is None for r in result["runs"])  # sampled outputs are not compared
    assert "sampling" in stdout
    assert result["table"]["model:2"]["overall"]["prompts"] == 2
    again = tmp_path / "again.json"
    assert run_cli(*args, "--out", again)[0] == 0
    tokens = lambda r: [(x["config"], x["new_tokens"], x["accepted"]) for x in r["runs"]]  # noqa: E731
    assert tokens(json.loads(again.read_text())) == tokens(result)  # the seed fixes every run


def test_bench_refuses_bad_sampling(tiny_bundle, tmp_path):
    from test_cli import assert_one_error

    assert_one_error(run_cli("bench", tiny_bundle, "--questions", _questions(tmp_path / "q.jsonl"),
                             "--temperature", -1), "temperature")


@pytest.mark.parametrize("command", ["bench", "quant-report"])
def test_bad_questions_are_one_error_line(tiny_bundle, command, tmp_path):
    from test_cli import assert_one_error

    args = [command, tiny_bundle] + ([tiny_bundle] if command == "quant-report" else [])
    assert_one_error(run_cli(*args, "--limit", -2), "--limit")
    (tmp_path / "empty.jsonl").write_text("")
    assert_one_error(run_cli(*args, "--questions", tmp_path / "empty.jsonl"), "no questions")
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    assert_one_error(run_cli(*args, "--questions", tmp_path / "bad.jsonl"), "bad.jsonl:1", "Spec-Bench")


def test_one_time_costs_stay_out_of_the_timed_runs(tiny_bundle, tmp_path, monkeypatch):
    """draft_len=auto times the target's step widths on first use: that happens in the warm-up, not in the first
    prompt's wall time (where it made the first category of a real run look 25% slower)."""
    import time

    import specdec
    from specdec.benchmark import BenchConfig, run_bench
    from specdec.runtime.engine import Engine
    from specdec.spec_bench import load_spec_bench

    calls = []
    measure = Engine._measure_costs

    def slow_measure(self):
        calls.append(1)
        time.sleep(1.0)
        return measure(self)

    monkeypatch.setattr(Engine, "_measure_costs", slow_measure)
    engine = specdec.load(tiny_bundle, drafter="ngram")
    prompts = load_spec_bench(_questions(tmp_path / "q.jsonl"))
    result = run_bench(engine, prompts, [BenchConfig("ngram", "auto")], max_new_tokens=8)
    assert calls == [1]
    assert max(r["wall_s"] for r in result["runs"]) < 1.0


def test_default_configs_skip_what_the_bundle_cannot_run(tiny_bundle, tmp_path):
    """The tiny bundle has a draft model and no corpus: the default configs run plain, ngram:4 and model:4, and
    say that corpus:auto was skipped."""
    out = tmp_path / "default.json"
    code, stdout, err = run_cli("bench", tiny_bundle, "--questions", _questions(tmp_path / "q.jsonl"), "--limit", 1,
                                "--max-new-tokens", 8, "--out", out)
    assert code == 0, err
    assert json.loads(out.read_text())["configs"] == ["plain", "ngram:4", "model:4"]
    assert "without a corpus; skipping corpus:auto" in err


def test_spec_bench_ships_with_specdec():
    """`specdec bench` works outside this checkout: its default questions are package data, all 480 of them."""
    import hashlib
    from pathlib import Path

    from specdec.spec_bench import DEFAULT_QUESTIONS, categories, load_spec_bench

    assert DEFAULT_QUESTIONS.is_relative_to(Path(__import__("specdec").__file__).parent)
    prompts = load_spec_bench(DEFAULT_QUESTIONS)
    assert len(prompts) == 480 and len(categories(prompts)) == 13
    readme = (DEFAULT_QUESTIONS.parent / "README.md").read_text()
    assert hashlib.sha256(DEFAULT_QUESTIONS.read_bytes()).hexdigest() in readme
    assert '"specdec" = ["data/*.jsonl"' in (Path(__file__).parents[1] / "pyproject.toml").read_text()


def test_distill_data_refuses_a_missing_questions_file(tmp_path):
    """A questions file given but absent is an error, not "no questions to keep out of the data"."""
    import pytest

    from specdec.errors import SpecdecError
    from specdec.export.distill_data import benchmark_texts

    assert benchmark_texts(None) == set()
    with pytest.raises(SpecdecError, match="not found"):
        benchmark_texts(tmp_path / "nope.jsonl")
