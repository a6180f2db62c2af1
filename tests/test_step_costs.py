"""`--draft-len auto`'s step costs kept between runs: measured once per bundle, drafter and machine, refined by the
rounds a generation runs, read back by the next process; a bad or missing cache is measured again."""
from __future__ import annotations

import json

import pytest

from specdec.runtime.engine import AUTO_K_MAX, Engine, GenerationConfig
from specdec.runtime.session import RuntimeOptions
from specdec.runtime.step_costs import MAX_ENTRIES, StepCostCache, cost_key

PROMPT = "the quick brown fox jumps over the lazy dog"


class Measurements(list):
    """Drafter kinds measured, in order; `.verify_s`: each measurement's target step costs."""

    verify_s: list


def _count_measurements(monkeypatch) -> Measurements:
    calls = Measurements()
    calls.verify_s = []
    real = Engine._measure_costs

    def counted(self):
        costs = real(self)
        calls.append(self.drafter_kind)
        calls.verify_s.append(list(costs[0]))
        return costs

    monkeypatch.setattr(Engine, "_measure_costs", counted)
    return calls


def test_a_second_process_starts_from_the_costs_the_first_refined(tiny_bundle, tmp_path, monkeypatch):
    calls = _count_measurements(monkeypatch)
    cache = StepCostCache(tmp_path / "costs.json")
    first = Engine(tiny_bundle, drafter="ngram", step_costs=cache)
    first.generate(PROMPT, GenerationConfig(max_new_tokens=24, draft_len="auto"))
    assert calls == ["ngram"]
    key = cost_key(first.manifest, "ngram", first.runtime)
    kept = cache.load(key)
    assert kept is not None and len(kept[0]) == AUTO_K_MAX + 1
    assert kept[0] == pytest.approx(first._costs["ngram"][0], abs=1e-6)
    assert kept[0] != pytest.approx(calls.verify_s[0], abs=1e-6)  # what the rounds refined, not the calibration
    second = Engine(tiny_bundle, drafter="ngram", step_costs=cache)  # a new process, in effect
    g = second.generate(PROMPT, GenerationConfig(max_new_tokens=24, draft_len="auto"))
    assert calls == ["ngram"]  # not measured again
    assert g.token_ids == second.generate(PROMPT, GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
    # Another drafter or another thread count is another entry, measured for itself
    Engine(tiny_bundle, drafter="model", step_costs=cache).generate(PROMPT, GenerationConfig(max_new_tokens=8,
                                                                                             draft_len="auto"))
    Engine(tiny_bundle, drafter="ngram", step_costs=cache, runtime=RuntimeOptions(threads=1)).generate(
        PROMPT, GenerationConfig(max_new_tokens=8, draft_len="auto"))
    assert calls == ["ngram", "model", "ngram"]
    assert len(json.loads(cache.path.read_text())["entries"]) == 3


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": "specdec-step-costs", "version": 1,
                                                 "entries": {"k": {"verify_s": [0.01, -1.0], "draft_s": 0.0}}})])
def test_an_unreadable_or_invalid_cache_is_measured_again(tiny_bundle, tmp_path, monkeypatch, content):
    calls = _count_measurements(monkeypatch)
    cache = StepCostCache(tmp_path / "costs.json")
    cache.path.write_text(content)
    assert cache.load("k") is None
    Engine(tiny_bundle, drafter="ngram", step_costs=cache).generate(PROMPT, GenerationConfig(max_new_tokens=8,
                                                                                             draft_len="auto"))
    assert calls == ["ngram"]
    assert json.loads(cache.path.read_text())["format"] == "specdec-step-costs"  # rewritten whole


def test_an_unwritable_cache_only_costs_the_next_start_its_timing(tiny_bundle, tmp_path, monkeypatch):
    calls = _count_measurements(monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = StepCostCache(blocker / "costs.json")  # its folder is a file: nothing can be written
    for _ in range(2):
        g = Engine(tiny_bundle, drafter="ngram", step_costs=cache).generate(
            PROMPT, GenerationConfig(max_new_tokens=8, draft_len="auto"))
        assert g.stats.new_tokens == 8
    assert calls == ["ngram", "ngram"]


def test_the_least_recently_written_entries_go_first(tmp_path):
    cache = StepCostCache(tmp_path / "costs.json")
    for i in range(MAX_ENTRIES + 2):
        cache.store(f"k{i}", [0.01, 0.02], 0.0)
    cache.store("k1", [0.03, 0.04], 0.0)  # rewritten: now the newest
    entries = json.loads(cache.path.read_text())["entries"]
    assert len(entries) == MAX_ENTRIES
    assert "k0" not in entries and "k2" not in entries and "k3" in entries
    assert cache.load("k1") == ([0.03, 0.04], 0.0)
    assert not list(tmp_path.glob("*.tmp"))
