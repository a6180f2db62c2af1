"""Corpus lookup: hand-checked continuations, agreement with a brute-force search, the bundle command, and lossless
greedy decoding with the corpus drafter on a tiny model."""
from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.errors import SpecdecError
from specdec.runtime.drafters.base import Drafter
from specdec.runtime.drafters.corpus import Continuation, Corpus, CorpusDrafter
from specdec.runtime.drafters.ngram import NgramDrafter
from specdec.runtime.sampling import SamplingConfig

VOCAB = 50


def test_majority_continuation_of_the_longest_match():
    corpus = Corpus.from_texts([[1, 2, 3, 4], [1, 2, 3, 5], [7, 2, 3, 5, 6], [9, 3, 8]], VOCAB)
    # "2 3" is followed by 4 once and by 5 twice: the majority wins, then the surviving texts go on
    assert corpus.continuation([0, 2, 3], 3) == ([5, 6], 2)
    # "1 2 3" (longer) occurs twice, 4 and 5 once each: the tie goes to the smaller id
    assert corpus.continuation([1, 2, 3], 1) == ([4], 3)
    # a text's end stops the draft; a one-token match is used when nothing longer is there
    assert corpus.continuation([9, 9, 3], 4) == ([8], 2)
    assert corpus.continuation([0, 3], 4) == ([5, 6], 1)
    assert corpus.continuation([3], 4, min_ngram=2) == ([], 0)
    assert corpus.continuation([42], 2) == ([], 0)


def test_matches_never_span_two_texts():
    corpus = Corpus.from_texts([[1, 2], [3, 4]], VOCAB)
    assert corpus.continuation([2, 3], 1) == ([4], 1)  # "2 3" is not in the corpus; "3" is


def test_wide_vocabularies_pack_fewer_tokens_per_key():
    assert Corpus.from_texts([[1]], 49152).max_ngram == 4
    assert Corpus.from_texts([[1]], 151936).max_ngram == 3  # Qwen2's 18-bit ids
    big = Corpus.from_texts([[151935, 151934, 151935, 7]], 151936)
    assert big.continuation([151935, 151934, 151935], 2) == ([7], 3)


def _brute(texts, context, k, max_ngram):
    for n in range(min(max_ngram, len(context)), 0, -1):
        tail = list(context[-n:])
        alive = [(t, i + n) for t in texts for i in range(len(t) - n + 1) if list(t[i:i + n]) == tail]
        if not alive:
            continue
        out = []
        while len(out) < k:
            counts = Counter(t[j] for t, j in alive if j < len(t))
            if not counts:
                break
            token = min(counts, key=lambda x: (-counts[x], x))
            out.append(token)
            alive = [(t, j + 1) for t, j in alive if j < len(t) and t[j] == token]
        return out, n
    return [], 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=12), min_size=1, max_size=6),
       st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(1, 5))
def test_agrees_with_brute_force(texts, context, k):
    corpus = Corpus.from_texts(texts, 6)
    assert corpus.continuation(context, k) == _brute(texts, context, k, corpus.max_ngram)


def test_saved_corpus_loads_only_for_its_tokenizer(tmp_path):
    corpus = Corpus.from_texts([[1, 2, 3], [4, 5]], VOCAB)
    corpus.save(tmp_path / "c.npz", "digest-a")
    again = Corpus.load(tmp_path / "c.npz", VOCAB, "digest-a")
    assert again.continuation([1, 2], 2) == corpus.continuation([1, 2], 2)
    with pytest.raises(SpecdecError, match="another tokenizer"):
        Corpus.load(tmp_path / "c.npz", VOCAB, "digest-b")
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    with pytest.raises(SpecdecError, match="unreadable"):
        Corpus.load(tmp_path / "bad.npz", VOCAB, "digest-a")


def test_drafter_prefers_the_prompt_then_the_corpus():
    corpus = Corpus.from_texts([[10, 11, 12, 13]], VOCAB)
    drafter = CorpusDrafter(NgramDrafter(max_ngram=3, min_ngram=2), corpus)
    assert isinstance(drafter, Drafter)
    drafter.begin([5, 6, 7, 5, 6], SamplingConfig(), np.random.default_rng(0))
    assert drafter.source([5, 6, 7, 5, 6]) == "lookup"
    assert drafter.propose([5, 6, 7, 5, 6], 2).tokens.tolist() == [7, 5]
    assert drafter.source([5, 6, 7, 5, 6, 10]) == "corpus"
    assert drafter.propose([5, 6, 7, 5, 6, 10], 2).tokens.tolist() == [11, 12]
    with pytest.raises(ValueError, match="min_ngram"):
        CorpusDrafter(NgramDrafter(max_ngram=3, min_ngram=1), corpus)


def test_bundle_corpus_decodes_identically_to_plain(tiny_bundle, tiny_distill_data, tmp_path):
    from click.testing import CliRunner

    import specdec
    from specdec.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    r = CliRunner().invoke(main, ["corpus", str(bundle), "--data", str(tiny_distill_data)])
    assert r.exit_code == 0, r.output
    assert "corpus of" in r.output
    engine = specdec.load(bundle, drafter="corpus")
    prompts = ["hello world", "the cat sat on the mat and the cat"]
    drafted_fixed = 0  # "auto" may rightly decide not to draft on a loaded machine: count fixed lengths only
    for prompt in prompts:
        for k in (1, 3, 6, "auto"):
            plain = engine.generate(prompt, specdec.GenerationConfig(max_new_tokens=24, draft_len=0)).token_ids
            spec = engine.generate(prompt, specdec.GenerationConfig(max_new_tokens=24, draft_len=k))
            assert spec.token_ids == plain
            drafted_fixed += spec.stats.drafted if k != "auto" else 0
    assert drafted_fixed > 0  # the corpus did propose
    n_first = len(engine.drafter.corpus)
    r = CliRunner().invoke(main, ["corpus", str(bundle), "--data", str(tiny_distill_data), "--keep"])
    assert r.exit_code == 0, r.output
    grown = specdec.load(bundle, drafter="corpus").drafter.corpus
    assert len(grown) == 2 * n_first and (grown.tokens[:n_first] == engine.drafter.corpus.tokens).all()
    bad = CliRunner().invoke(main, ["corpus", str(bundle), "--data", str(tmp_path / "none")])
    assert bad.exit_code != 0 and "no distillation shards" in bad.output + (bad.stderr if bad.stderr_bytes else "")


def test_export_copies_the_corpus_shipped_for_its_target(tiny_checkpoint, tiny_distill_data, tmp_path, monkeypatch):
    import specdec
    from specdec.export import eagle
    from specdec.export.bundle import ExportConfig, export_bundle
    from specdec.export.corpus import write_shipped_corpus

    monkeypatch.setattr(eagle, "SHIPPED_HEADS", tmp_path / "heads")
    (tmp_path / "heads").mkdir()
    shipped = tmp_path / "heads" / "tiny.corpus.npz"
    first = write_shipped_corpus(tiny_checkpoint, [tiny_distill_data], shipped)
    grown = write_shipped_corpus(tiny_checkpoint, [tiny_distill_data], shipped, base=shipped)  # grown in place
    assert grown["tokens"] == 2 * first["tokens"]
    m = export_bundle(tiny_checkpoint, tmp_path / "b", ExportConfig(drafter="ngram", max_len=128))
    assert m.drafter.corpus == "corpus.npz"
    assert m.drafter.draft_len == "auto"  # lookup and corpus drafts are scored: cut by measured costs
    engine = specdec.load(tmp_path / "b")
    assert engine.drafter_kind == "corpus"  # the default where the bundle's drafter is ngram
    from specdec.runtime.draft_len import AdaptiveDraftLen

    assert isinstance(engine._draft_len_policy(None), AdaptiveDraftLen)
    g = engine.generate("the quick brown fox", specdec.GenerationConfig(max_new_tokens=12))
    assert g.token_ids == engine.generate("the quick brown fox",
                                          specdec.GenerationConfig(max_new_tokens=12, draft_len=0)).token_ids
    m2 = export_bundle(tiny_checkpoint, tmp_path / "b2", ExportConfig(drafter="ngram", max_len=128, corpus=False))
    assert m2.drafter.corpus is None
    with pytest.raises(SpecdecError, match="no corpus"):
        specdec.load(tmp_path / "b2", drafter="corpus")
    from specdec.export.corpus import add_corpus

    with pytest.raises(SpecdecError, match="no corpus to keep"):
        add_corpus(tmp_path / "b2", [tiny_distill_data], keep=True)


def test_min_share_stops_where_the_occurrences_disagree():
    corpus = Corpus.from_texts([[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 6, 7]], VOCAB)
    assert corpus.continuation([1], 3) == ([2, 3], 1)
    # 3 of 4 continue "1" with 2; then 3, 4 and 5 each have a third
    assert corpus.continuation([1], 3, min_share=0.5) == ([2], 1)
    assert corpus.continuation([1], 3, min_share=0.8) == ([], 1)


def test_a_continuation_records_how_the_occurrences_voted():
    corpus = Corpus.from_texts([[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 9, 9]], VOCAB)
    found = corpus.draft([40, 41, 1], 3)
    # "1" is followed by 2 in 3 of 4 texts (runner-up 9: 1/4), then by 3 in 2 of those 3 (runner-up 4: 1/3), then
    # every voter reaches the end of its text
    assert (found.n, found.tokens, found.voters) == (1, [2, 3], [4, 3])
    assert found.shares == pytest.approx([3 / 4, 2 / 3])
    assert found.runner_up == pytest.approx([1 / 4, 1 / 3])
    assert corpus.draft([42], 3) == Continuation(n=0)


def test_confidence_is_the_fitted_logistic_model_of_the_votes(monkeypatch):
    import specdec.runtime.drafters.corpus as corpus_module

    weights = {"bias": -1.0, "share": 2.0, "log_voters": 0.5, "depth": 0.25, "runner_up": -1.0,
               "matched": (0.0, 0.5, 1.0, 1.5)}
    monkeypatch.setattr(corpus_module, "CONFIDENCE_WEIGHTS", weights)
    found = Continuation(n=6, tokens=[7, 8], voters=[3, 1], shares=[0.5, 1.0], runner_up=[0.25, 0.0])
    z = np.array([-1 + 1.0 + 0.5 * np.log(4) + 0 - 0.25 + 1.5, -1 + 2.0 + 0.5 * np.log(2) + 0.25 - 0 + 1.5])
    np.testing.assert_allclose(found.confidence(), 1 / (1 + np.exp(-z)))
    # The shipped weights: more agreement, more voters and a longer match each make a token more likely
    monkeypatch.undo()
    base = Continuation(n=1, tokens=[7], voters=[20], shares=[0.6], runner_up=[0.2]).confidence()[0]
    for better in (Continuation(n=1, tokens=[7], voters=[20], shares=[0.9], runner_up=[0.1]),
                   Continuation(n=1, tokens=[7], voters=[200], shares=[0.6], runner_up=[0.2]),
                   Continuation(n=4, tokens=[7], voters=[20], shares=[0.6], runner_up=[0.2])):
        assert better.confidence()[0] > base


def test_drafts_carry_a_confidence_that_learns_from_what_the_target_kept(monkeypatch):
    """A corpus token's confidence is its fitted probability times the learnt reliability of corpus tokens after
    that long a match (1 at first); a drafted token the target did not keep lowers it, whether it was rejected or
    cut before verification (the target's own token tells which)."""
    import specdec.runtime.drafters.corpus as corpus_module
    from specdec.runtime.drafters.base import PRIOR_TRIALS

    monkeypatch.setattr(corpus_module, "CONFIDENCE_WEIGHTS", {"bias": 0.0, "share": 2.0, "log_voters": 0.0, "depth": 0.0,
                                                              "runner_up": 0.0, "matched": (0.0, 0.0, 0.0, 0.0)})
    corpus = Corpus.from_texts([[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 9, 9]], VOCAB)
    drafter = CorpusDrafter(NgramDrafter(max_ngram=3, min_ngram=2), corpus)
    drafter.begin([40, 41], SamplingConfig(), np.random.default_rng(0))
    rel = drafter.reliability[("corpus", 1)]
    assert rel.rate == pytest.approx(1.0)
    d = drafter.propose([40, 41, 1], 3)
    scores = 1 / (1 + np.exp(-2 * np.array([3 / 4, 2 / 3])))  # shares 3/4 then 2/3 (see the test above)
    assert d.tokens.tolist() == [2, 3]
    np.testing.assert_allclose(d.confidence, scores)
    hits, tried = rel.hits, rel.scores
    drafter.accept(1, 7)  # 2 kept, then the target wrote 7 where 3 was drafted
    assert (rel.hits, rel.scores) == pytest.approx((hits + 1, tried + scores.sum()))
    assert rel.rate == pytest.approx((PRIOR_TRIALS + 1) / (PRIOR_TRIALS + scores.sum()))
    np.testing.assert_allclose(drafter.propose([40, 41, 1], 3).confidence, scores * rel.rate)
    hits = rel.hits
    drafter.accept(0, 2)  # cut before verification, but 2 was the target's token: a hit
    assert rel.hits == pytest.approx(hits + 1)
    lookup = drafter.propose([40, 41, 5, 40, 41], 2)  # the prompt repeats: lookup tokens, scored 1 each
    assert lookup.confidence.tolist() == [drafter.reliability[("lookup", 2)].rate] * 2


def test_a_fixed_length_stops_a_scored_draft_at_an_unlikely_token(monkeypatch):
    """With no step costs to weigh, a fixed length verifies a scored draft up to the first token below
    MIN_CONFIDENCE (shares 3/4 then 1/3: sigmoid(-4 + 9 * 3/4) = 0.94, sigmoid(-4 + 3) = 0.27 < 0.3); the drafter
    itself proposes both."""
    import specdec.runtime.draft_len as draft_len
    import specdec.runtime.drafters.corpus as corpus_module
    from specdec.runtime.draft_len import FixedDraftLen

    monkeypatch.setattr(corpus_module, "CONFIDENCE_WEIGHTS", {"bias": -4.0, "share": 9.0, "log_voters": 0.0, "depth": 0.0,
                                                              "runner_up": 0.0, "matched": (0.0, 0.0, 0.0, 0.0)})
    monkeypatch.setattr(draft_len, "MIN_CONFIDENCE", 0.3)
    corpus = Corpus.from_texts([[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 6, 7]], VOCAB)
    drafter = CorpusDrafter(NgramDrafter(max_ngram=3, min_ngram=2), corpus)
    drafter.begin([40, 41], SamplingConfig(), np.random.default_rng(0))
    found = corpus.draft([1], 3)
    assert found.tokens == [2, 3] and found.shares == pytest.approx([3 / 4, 1 / 3])
    d = drafter.propose([40, 41, 1], 3)
    assert d.tokens.tolist() == [2, 3]
    kept = FixedDraftLen(3).cut(d)
    assert kept.tokens.tolist() == [2]
    np.testing.assert_allclose(kept.confidence, [1 / (1 + np.exp(-(-4 + 9 * 3 / 4)))])
    monkeypatch.setattr(draft_len, "MIN_CONFIDENCE", 0.95)
    assert FixedDraftLen(3).cut(d).k == 0


def test_adaptive_length_asks_a_scored_source_for_its_longest_draft():
    """A source whose drafts carry confidences gets k_max (the cut decides where to stop); the others keep the
    length the running acceptance rate gives."""
    from specdec.runtime.draft_len import AdaptiveDraftLen
    from specdec.runtime.drafters.base import Draft

    policy = AdaptiveDraftLen(verify_s=[1.0, 1.5, 1.6, 1.7, 2.0], draft_s=0.0, acceptance=0.3)
    assert policy.next_k(4, "corpus") < 4  # acceptance 0.3: a short draft pays best at first
    policy.cut(Draft(tokens=np.array([5, 6]), confidence=np.array([0.9, 0.2])), "corpus")
    assert policy.next_k(4, "corpus") == 4
    assert policy.next_k(2, "corpus") == 2  # never past the room left
    assert policy.next_k(4, "lookup") < 4
    policy.cut(Draft(tokens=np.array([5, 6])), "lookup")  # unscored: still capped by its rate
    assert policy.next_k(4, "lookup") < 4


def test_adaptive_cut_keeps_what_pays_for_its_verification():
    """Hand-computed: costs 1, 1.5, 1.6, 1.7, 2.0 for T = 1..5 and confidences 0.9, 0.9, 0.1, 0.9 give expected
    tokens 1, 1.9, 2.71, 2.791, 2.8639 when keeping 0..4, per cost 1, 1.267, 1.694, 1.642, 1.432: keep 2."""
    from specdec.runtime.draft_len import AdaptiveDraftLen, FixedDraftLen
    from specdec.runtime.drafters.base import Draft

    policy = AdaptiveDraftLen(verify_s=[1.0, 1.5, 1.6, 1.7, 2.0], draft_s=0.0)
    draft = Draft(tokens=np.array([5, 6, 7, 8]), confidence=np.array([0.9, 0.9, 0.1, 0.9]))
    assert policy.cut(draft).tokens.tolist() == [5, 6]
    assert policy.cut(draft).confidence.tolist() == [0.9, 0.9]
    shaky = Draft(tokens=np.array([5, 6]), confidence=np.array([0.3, 0.3]))  # (1 + 0.3 + 0.09) / 1.6 < 1
    assert policy.cut(shaky).k == 0
    # A width timed cheaper than a narrower one (noise) is costed as the narrower: at 1.2, keeping both tokens
    # would look best (1.39 / 1.2 > 1); at 1.5, neither pays.
    noisy = AdaptiveDraftLen(verify_s=[1.0, 1.5, 1.2], draft_s=0.0)
    assert noisy.cut(Draft(tokens=np.array([5, 6]), confidence=np.array([0.3, 0.3]))).k == 0
    no_confidence = Draft(tokens=np.array([5, 6]))
    assert policy.cut(no_confidence) is no_confidence
    assert FixedDraftLen(4).cut(no_confidence) is no_confidence
    with pytest.raises(ValueError, match="probabilities"):
        Draft(tokens=np.array([5]), confidence=np.array([1.5]))
    with pytest.raises(ValueError, match="one value per token"):
        Draft(tokens=np.array([5, 6]), confidence=np.array([0.5]))


def test_adaptive_cut_keeps_the_tree_nodes_that_pay_for_their_verification():
    """Hand-computed, costs as above. Tree: a (0.9) and b (0.05) under the root, c (0.9) under a, d (0.1) under c,
    e (0.08) under a; reach 0.9, 0.05, 0.81, 0.081, 0.072. Best four by reach a, c, d, e: expected tokens 1, 1.9,
    2.71, 2.791, 2.863 per cost 1, 1.267, 1.694, 1.642, 1.432: keep a, c. With b at 0.5 (reach 0.5): a, c, b, d
    give 1, 1.9, 2.71, 3.21, 3.291 per cost 1, 1.267, 1.694, 1.888, 1.646: keep a, c, b."""
    from specdec.runtime.draft_len import AdaptiveDraftLen, FixedDraftLen
    from specdec.runtime.drafters.base import Draft

    policy = AdaptiveDraftLen(verify_s=[1.0, 1.5, 1.6, 1.7, 2.0], draft_s=0.0)
    parents = np.array([-1, -1, 0, 2, 0])
    tree = Draft(tokens=np.array([10, 11, 12, 13, 14]), parents=parents, confidence=np.array([0.9, 0.05, 0.9, 0.1, 0.08]))
    np.testing.assert_allclose(tree.reach(), [0.9, 0.05, 0.81, 0.081, 0.072])
    kept = policy.cut(tree)
    assert kept.tokens.tolist() == [10, 12] and kept.parents.tolist() == [-1, 0]
    np.testing.assert_allclose(kept.confidence, [0.9, 0.9])
    wide = Draft(tokens=tree.tokens, parents=parents, confidence=np.array([0.9, 0.5, 0.9, 0.1, 0.08]))
    kept = policy.cut(wide)
    assert kept.tokens.tolist() == [10, 11, 12] and kept.parents.tolist() == [-1, -1, 0]
    assert FixedDraftLen(4).cut(tree) is tree  # a fixed length verifies the tree its drafter built
    shaky = Draft(tokens=np.array([5, 6]), parents=np.array([-1, -1]), confidence=np.array([0.2, 0.2]))
    assert policy.cut(shaky).k == 0 and policy.cut(shaky).parents is None  # nothing pays: a plain step
    with pytest.raises(ValueError, match="parent was not kept"):
        tree.subtree(np.array([0, 3]))


@pytest.mark.parametrize("probing", [True, False])
def test_adaptive_cut_recovers_from_costs_timed_on_a_busy_machine(monkeypatch, probing):
    """Kept costs that make every draft look too dear (2-token step at 4x its real cost) are timed again now and
    then, and the policy comes to draft; without the probes it never would."""
    import specdec.runtime.draft_len as draft_len
    from specdec.runtime.drafters.base import Draft

    if not probing:
        monkeypatch.setattr(draft_len, "PROBE_STALE_ROUNDS", 10 ** 9)
    real = [0.020, 0.022, 0.023, 0.024, 0.026]
    policy = draft_len.AdaptiveDraftLen(verify_s=[0.020, 0.080, 0.085, 0.090, 0.095], draft_s=0.0)
    draft = Draft(tokens=np.array([5, 6, 7, 8]), confidence=np.array([0.8, 0.8, 0.8, 0.8]))
    kept = []
    for _ in range(200):
        d = policy.cut(draft).k
        policy.update(d, d, verify_s=real[d], source="corpus")
        kept.append(d)
    if probing:
        assert sum(kept[-50:]) >= 100 and policy.verify_s[1] < 0.03  # drafting, at the costs it measured
    else:
        assert sum(kept) == 0 and policy.verify_s[1] == 0.080
    untimed = draft_len.AdaptiveDraftLen(verify_s=[0.020, 0.080, 0.085, 0.090, 0.095], draft_s=0.0)
    for _ in range(100):  # rounds whose steps are not timed (batched rows): no probe could teach anything
        d = untimed.cut(draft).k
        untimed.update(d, d)
        assert d == 0


@pytest.mark.parametrize("probing", [True, False])
def test_adaptive_length_recovers_from_stale_costs_without_confidences(monkeypatch, probing):
    """The same for a source whose drafts carry no confidences (the length comes from its acceptance rate)."""
    import specdec.runtime.draft_len as draft_len

    if not probing:
        monkeypatch.setattr(draft_len, "PROBE_STALE_ROUNDS", 10 ** 9)
    real = [0.020, 0.022, 0.023, 0.024, 0.026]
    policy = draft_len.AdaptiveDraftLen(verify_s=[0.020, 0.021, 0.085, 0.090, 0.095], draft_s=0.0, acceptance=0.8)
    ks = []
    for _ in range(300):
        k = policy.next_k(4, "lookup")
        policy.update(k, k, verify_s=real[k], source="lookup")  # every drafted token accepted
        ks.append(k)
    if probing:
        assert min(ks[-50:]) >= 3 and max(policy.verify_s[2:]) < 0.03
    else:
        assert max(ks) == 1 and policy.verify_s[2] == 0.085


def test_corpus_from_the_bundles_own_batch_answers(tiny_bundle, tmp_path):
    """`specdec batch` on the bundle, then `specdec corpus --answers`: its answers become the corpus (no torch, no
    distill-data); a bad answers line is one error naming the file and line, and the bundle is left as it was."""
    from click.testing import CliRunner

    import specdec
    from specdec.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    jobs = tmp_path / "in.jsonl"
    jobs.write_text("".join(json.dumps({"id": i, "prompt": p, "max_new_tokens": 24}) + "\n"
                            for i, p in enumerate(["hello world", "the cat sat", "once upon a time"])))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["batch", str(bundle), str(jobs), str(out), "--drafter", "none"])
    assert r.exit_code == 0, r.output
    before = (bundle / "specdec.json").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(out.read_text() + "{not json\n")
    r = CliRunner().invoke(main, ["corpus", str(bundle), "--answers", str(bad)])
    assert r.exit_code != 0 and f"{bad}:4 is not JSON" in r.output
    assert (bundle / "specdec.json").read_text() == before and not (bundle / "corpus.npz").exists()
    r = CliRunner().invoke(main, ["corpus", str(bundle)])
    assert r.exit_code != 0 and "--answers" in r.output

    r = CliRunner().invoke(main, ["corpus", str(bundle), "--answers", str(out)])
    assert r.exit_code == 0, r.output
    assert "3 answers" in r.output
    engine = specdec.load(bundle, drafter="corpus")
    answers = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    want = sum(len(engine.codec.encode(a)) for a in answers) + len(answers)  # + one separator per answer
    assert len(engine.drafter.corpus) == want
    for prompt in ("hello world", "once upon a time"):  # the corpus drafts its own answers back; output unchanged
        plain = engine.generate(prompt, specdec.GenerationConfig(max_new_tokens=24, draft_len=0))
        spec = engine.generate(prompt, specdec.GenerationConfig(max_new_tokens=24, draft_len=4))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.accepted > 0
