"""`specdec verify`: passes on a correct bundle, fails on a broken acceptance rule and on a multi-token step that
rounds differently from single steps (the failures a GPU provider or fast kernels could bring)."""
from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from specdec.cli import main
from specdec.runtime import speculative
from specdec.runtime.decoder import Decoder

from sampled_checks import accept_every_draft

# At 0.3 the tiny random target puts about a third of its mass on its top token: drafts fail often, and 400
# answers fill enough cells for the check to have power (a flatter law pools them away).
ARGS = ["--prompts", "2", "--new-tokens", "16", "--samples", "400", "--temperature", "0.3"]


def run_verify(bundle, tmp_path, *extra):
    out = tmp_path / "verify.json"
    r = CliRunner().invoke(main, ["verify", str(bundle), *ARGS, "--json", str(out), *extra])
    report = json.loads(out.read_text()) if out.exists() else None
    return r, report


def test_verify_passes_on_a_correct_bundle(tiny_bundle, tmp_path):
    r, report = run_verify(tiny_bundle, tmp_path)
    assert r.exit_code == 0, r.output
    assert report["passed"] and "all" in r.output and "checks passed" in r.output
    kinds = {(c["kind"], c["subject"]) for c in report["checks"]}
    assert {("greedy", "ngram"), ("greedy", "model"), ("sampled", "model"), ("t-invariance", "T=9")} <= kinds
    sampled = next(c for c in report["checks"] if c["kind"] == "sampled" and c["subject"] == "model")
    assert sampled["answers"] == 400 and 0 < sampled["accepted"] < sampled["drafted"]


def test_verify_fails_on_an_acceptance_rule_that_accepts_every_draft(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(speculative, "speculative_accept", accept_every_draft)
    # n-gram drafts of the tiny random model are mostly wrong: accepting them all shifts the law visibly (the
    # int8 self-draft agrees with the target too often for that rule to show at this size)
    r, report = run_verify(tiny_bundle, tmp_path, "--drafters", "ngram")
    assert r.exit_code == 1
    failed = [c for c in report["checks"] if not c["passed"]]
    assert [(c["kind"], c["subject"]) for c in failed] == [("sampled", "ngram")]
    assert failed[0]["pvalue"] < 1e-6
    assert "error: 1 check failed: sampled ngram" in r.output


def test_verify_fails_where_a_multi_token_step_rounds_differently(tiny_bundle, tmp_path, monkeypatch):
    original = Decoder.forward

    def skewed(self, tokens, *args, **kwargs):
        logits = original(self, tokens, *args, **kwargs)
        if logits is not None and np.asarray(tokens).shape[1] > 1:  # a T-token step: one token's logit lifted
            logits[..., 7] += 50.0
        return logits

    monkeypatch.setattr(Decoder, "forward", skewed)
    r, report = run_verify(tiny_bundle, tmp_path, "--samples", "0")
    assert r.exit_code == 1
    flips = [c for c in report["checks"] if c["kind"] == "t-invariance"]
    assert flips and not any(c["passed"] for c in flips) and all(c["argmax_changes"] > 0 for c in flips)


def test_verify_bad_input(tiny_bundle, tmp_path):
    r = CliRunner().invoke(main, ["verify", str(tiny_bundle), "--drafters", "eagle,model"])
    assert r.exit_code != 0 and r.output.strip().startswith("error:") and "cannot run drafter eagle" in r.output
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "missing")])
    assert r.exit_code != 0 and r.output.strip().startswith("error:")
