"""`specdec tune`: the race's rules under an injected cost model, the record, and the engines that use it."""
from __future__ import annotations

import json
import platform
import shutil

import pytest
from click.testing import CliRunner

from specdec.benchmark import BenchConfig
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.runtime.batched import BatchedEngine
from specdec.runtime.engine import Engine
from specdec.runtime.session import RuntimeOptions
from specdec.runtime.tuned import TUNED_FILE, TunedChoice, read_tuned, write_tuned
from specdec.tune import DROP_BELOW, MARGIN, candidate_configs, read_prompts, run_tune

PLAIN = BenchConfig("none", 0)
PROMPTS = [[{"role": "user", "content": f"question {i}"}] for i in range(40)]


class FakeDevice:
    """A cost model: each configuration makes 50 tokens at a fixed speed; a clock that only they advance."""

    def __init__(self, tok_s: dict[str, float], wrong: set[str] = frozenset()) -> None:
        self.tok_s, self.wrong, self.now, self.calls = tok_s, wrong, 0.0, []

    def clock(self) -> float:
        return self.now

    def measure(self, cfg: BenchConfig, messages: list[dict]):
        self.calls.append((cfg.name, messages[0]["content"]))
        secs = 50 / self.tok_s[cfg.name]
        self.now += secs
        ids = list(range(50)) if cfg.name not in self.wrong else [1] * 50
        return ids, secs, 25, 25


def race(device: FakeDevice, configs, budget_s: float = 1e9, greedy: bool = True, incumbent=None):
    return run_tune(configs, PROMPTS, device.measure, budget_s, greedy=greedy, clock=device.clock,
                    incumbent=incumbent)


def test_the_fastest_configuration_wins_and_losers_are_dropped_by_the_stated_rule():
    configs = [PLAIN, BenchConfig("ngram", 3), BenchConfig("ngram", "auto"), BenchConfig("model", 3)]
    device = FakeDevice({"plain": 100, "ngram:3": 150, "ngram:auto": 170, "model:3": 0.79 * 170})
    result = race(device, configs)
    assert result.winner.config == BenchConfig("ngram", "auto")
    by_name = {t.config.name: t for t in result.trials}
    assert by_name["model:3"].dropped.startswith("round 1") and len(by_name["model:3"].per_prompt) == 2
    assert by_name["ngram:3"].dropped is None  # 150 >= 0.8 x 170
    assert result.prompts == len(PROMPTS) and len(by_name["plain"].per_prompt) == len(PROMPTS)
    assert result.speedup(result.winner) == pytest.approx(1.7)
    assert result.speedup(by_name["model:3"]) == pytest.approx(0.79 * 1.7)
    # every prompt ran under every configuration still in the race, interleaved prompt by prompt
    assert device.calls[:4] == [(c.name, "question 0") for c in configs]
    choice = result.choice(sampled=False)
    assert (choice.drafter, choice.draft_len, choice.speedup) == ("ngram", "auto", pytest.approx(1.7))
    assert DROP_BELOW == 0.8


def test_the_bundles_default_stays_unless_beaten_by_the_margin():
    configs = [PLAIN, BenchConfig("corpus", "auto"), BenchConfig("corpus", 3)]
    near = FakeDevice({"plain": 100, "corpus:auto": 120, "corpus:3": 120 * (1 + MARGIN) - 0.5})
    assert race(near, configs, incumbent=configs[1]).winner.config == configs[1]
    far = FakeDevice({"plain": 100, "corpus:auto": 120, "corpus:3": 120 * (1 + MARGIN) + 0.5})
    assert race(far, configs, incumbent=configs[1]).winner.config == configs[2]
    # the incumbent is never dropped: a slow first round cannot take it out of the race
    slow = FakeDevice({"plain": 100, "corpus:auto": 60, "corpus:3": 120})
    result = race(slow, configs, incumbent=configs[1])
    assert next(t for t in result.trials if t.config == configs[1]).dropped is None
    assert result.winner.config == configs[2]


def test_plain_wins_where_nothing_pays():
    device = FakeDevice({"plain": 100, "model:3": 90})
    assert race(device, [PLAIN, BenchConfig("model", 3)]).winner.config == PLAIN


def test_a_configuration_whose_greedy_output_differs_is_dropped_at_once():
    device = FakeDevice({"plain": 100, "ngram:3": 300, "ngram:5": 150}, wrong={"ngram:3"})
    result = race(device, [PLAIN, BenchConfig("ngram", 3), BenchConfig("ngram", 5)])
    fast = next(t for t in result.trials if t.config.name == "ngram:3")
    assert "differs from plain decoding" in fast.dropped and len(fast.per_prompt) == 1
    assert result.winner.config.name == "ngram:5"
    # sampled outputs differ by nature: not a reason to drop
    device = FakeDevice({"plain": 100, "ngram:3": 300}, wrong={"ngram:3"})
    assert race(device, [PLAIN, BenchConfig("ngram", 3)], greedy=False).winner.config.name == "ngram:3"


def test_the_budget_stops_between_prompts_and_survivors_share_their_prompts():
    device = FakeDevice({"plain": 100, "ngram:3": 120})
    result = race(device, [PLAIN, BenchConfig("ngram", 3)], budget_s=10.0)  # ~0.9 s a prompt
    assert 5 <= result.prompts < len(PROMPTS)
    assert {len(t.per_prompt) for t in result.trials} == {result.prompts}
    assert device.now <= 10.0 + 1.0


def test_a_budget_too_small_to_measure_anything_says_so():
    device = FakeDevice({"plain": 1, "ngram:3": 1})  # 100 s for the first prompt
    with pytest.raises(SpecdecError, match="too short to compare anything"):
        race(device, [PLAIN, BenchConfig("ngram", 3)], budget_s=60)


def test_prompt_files(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "hi"}\nnot json\n{"messages": [{"role": "user", "content": "yo"}]}\n{"x": 1}\n')
    assert read_prompts(good) == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n[]\n')
    with pytest.raises(SpecdecError, match="no usable prompt lines"):
        read_prompts(bad)


# ------------------------------------------------------------------------------------------------ the record

@pytest.fixture
def own_bundle(tmp_path, tiny_bundle):
    """A copy: a tuned record written into the shared bundle would change other tests' engines."""
    return shutil.copytree(tiny_bundle, tmp_path / "bundle")


def test_candidates_are_what_the_bundle_can_run(tiny_bundle):
    names = [c.name for c in candidate_configs(Engine(tiny_bundle, drafter="none").manifest)]
    assert names[0] == "plain" and "ngram:auto" in names and "model:3" in names and "hybrid:5" in names
    assert not any(n.startswith(("eagle", "medusa", "layerskip", "corpus")) for n in names)


def test_engines_use_the_record_for_this_machine_only(own_bundle, monkeypatch):
    engine = Engine(own_bundle)
    assert engine.drafter_kind == "model" and engine.tuned is None  # the bundle's own default
    write_tuned(own_bundle, engine.manifest, engine.runtime,
                TunedChoice(drafter="ngram", draft_len=3, tok_s=1.0, speedup=1.2, prompts=4, sampled=False))
    tuned = Engine(own_bundle)
    assert (tuned.drafter_kind, tuned.default_draft_len) == ("ngram", 3)
    assert Engine(own_bundle, drafter="model").drafter_kind == "model"  # a named drafter wins
    assert BatchedEngine(own_bundle, 2).drafter_kind == "ngram"
    # another thread count, another machine: the record is not theirs
    assert Engine(own_bundle, runtime=RuntimeOptions(threads=7)).drafter_kind == "model"
    monkeypatch.setattr(platform, "node", lambda: "another-host")
    assert read_tuned(own_bundle, engine.manifest, engine.runtime) is None
    assert Engine(own_bundle).drafter_kind == "model"


def test_a_record_the_bundle_cannot_run_falls_back(own_bundle):
    engine = Engine(own_bundle)
    write_tuned(own_bundle, engine.manifest, engine.runtime,
                TunedChoice(drafter="eagle", draft_len=4, tok_s=1.0, speedup=1.2, prompts=4, sampled=False))
    again = Engine(own_bundle)
    assert again.drafter_kind == "model" and again.tuned is None


def test_tune_command_records_and_dry_run_does_not(own_bundle, tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["tune", str(own_bundle), "--minutes", "0.5", "--new-tokens", "8", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "nothing recorded" in r.output and not (own_bundle / TUNED_FILE).exists()
    out = tmp_path / "tune.json"
    r = runner.invoke(main, ["tune", str(own_bundle), "--minutes", "0.5", "--new-tokens", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    engine = Engine(own_bundle)
    winner = result["winner"]
    assert engine.tuned is not None and (winner == "plain") == (engine.drafter_kind == "none")
    if winner != "plain":
        assert winner == f"{engine.drafter_kind}:{engine.default_draft_len}"
    assert {c["config"] for c in result["configs"]} >= {"plain", "ngram:auto"}


def test_tune_command_bad_input_is_one_line(own_bundle, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("nothing here\n")
    r = CliRunner().invoke(main, ["tune", str(own_bundle), "--prompts", str(empty)])
    assert r.exit_code != 0 and r.output.strip().startswith("error:") and "no usable prompt" in r.output
    r = CliRunner().invoke(main, ["tune", str(tmp_path / "nope")])
    assert r.exit_code != 0 and r.output.strip().startswith("error:")


def test_bench_runs_the_tuned_choice_by_name(own_bundle, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["the quick brown fox"]}) + "\n")
    runner = CliRunner()
    args = ["--questions", str(questions), "--limit", "1", "--max-new-tokens", "8"]
    r = runner.invoke(main, ["bench", str(own_bundle), *args, "--configs", "tuned"])
    assert r.exit_code == 0 and "no `specdec tune` record" in r.output
    engine = Engine(own_bundle)
    write_tuned(own_bundle, engine.manifest, engine.runtime,
                TunedChoice(drafter="ngram", draft_len=3, tok_s=1.0, speedup=1.2, prompts=4, sampled=False))
    r = runner.invoke(main, ["bench", str(own_bundle), *args, "--configs", "ngram:3,tuned"])
    assert r.exit_code == 0, r.output
    assert r.output.count("ngram:3") == 1  # the tuned choice is the same config: run once
