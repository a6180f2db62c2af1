"""The runtime on a tiny exported bundle: plain and speculative decoding, prefix reuse, bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import specdec
from specdec import GenerationConfig, SamplingConfig, SpecdecError

PROMPTS = ["the quick brown fox", "a small model proposes", "hello world, this is", "speculative decoding drafts"]


@pytest.fixture(scope="module")
def engines(tiny_bundle):
    return {d: specdec.load(tiny_bundle, drafter=d) for d in ("none", "ngram", "model", "hybrid")}


def test_runtime_does_not_import_torch():
    code = ("import sys, specdec, specdec.runtime.engine, specdec.cli; "
            "bad=[m for m in ('torch','transformers','optimum') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_greedy_matches_transformers(engines, tiny_checkpoint, prompt):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    engine = engines["none"]
    ids = engine.encode(prompt)
    g = engine.generate(prompt, GenerationConfig(max_new_tokens=24, draft_len=0))
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                             eos_token_id=engine.manifest.tokenizer.eos_token_ids[0], pad_token_id=0)
    assert g.token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("drafter", ["ngram", "model", "hybrid"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_speculative_greedy_is_token_identical(engines, drafter, k):
    for prompt in PROMPTS:
        plain = engines["none"].generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=0))
        spec = engines[drafter].generate(prompt, GenerationConfig(max_new_tokens=40, draft_len=k))
        assert spec.token_ids == plain.token_ids, (drafter, k, prompt)
        # each accepted draft is a token that needed no pass of its own (no round drafts past the budget)
        assert spec.stats.target_forwards == plain.stats.target_forwards - spec.stats.accepted, (drafter, k, prompt)


def test_self_draft_accepts_most_tokens(engines, monkeypatch):
    # A random tiny model is never confident: draft all k. The engine is shared by the module: set back after.
    monkeypatch.setattr(engines["model"].drafter, "confidence_stop", 0.0)
    g = engines["model"].generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, draft_len=4))
    assert g.stats.tau > 2.0  # an int8 copy of the target agrees with it almost always
    assert g.stats.target_forwards < len(g.token_ids)


def test_draft_model_runs_one_forward_per_drafted_token(engines, monkeypatch):
    # The tokens the target settled since the last round go in one step with the first draft's: a round of k
    # drafts runs k draft forwards, however many context tokens the draft KV lacked.
    drafter = engines["model"].drafter
    monkeypatch.setattr(drafter, "confidence_stop", 0.0)
    calls = []
    run = drafter.decoder._run
    monkeypatch.setattr(drafter.decoder, "_run", lambda *a, **kw: calls.append(a[0].shape[1]) or run(*a, **kw))
    g = engines["model"].generate(PROMPTS[2], GenerationConfig(max_new_tokens=24, draft_len=3))
    assert g.stats.tau > 1.5  # rounds after accepted drafts: the draft KV lacked the last draft and the bonus token
    prompt_feeds = 1  # begin() feeds the prompt but its last token in one prefill
    assert len(calls) <= prompt_feeds + 3 * g.stats.target_forwards
    assert any(width > 1 for width in calls[prompt_feeds:])  # settled tokens and the first draft's, together


def test_sampling_is_seeded_and_speculation_keeps_it_valid(engines):
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=0.8, top_p=0.95), seed=7, draft_len=3)
    a = engines["model"].generate(PROMPTS[1], cfg)
    b = engines["model"].generate(PROMPTS[1], cfg)
    assert a.token_ids == b.token_ids
    assert a.stats.accepted > 0
    c = engines["model"].generate(PROMPTS[1], GenerationConfig(**{**cfg.__dict__, "seed": 8}))
    assert len(c.token_ids) == 30 and c.token_ids != a.token_ids  # another seed, another answer


def test_prefix_reuse_gives_same_output(engines):
    e = engines["ngram"]
    first = e.generate(PROMPTS[2], GenerationConfig(max_new_tokens=16))
    e.generate(PROMPTS[3], GenerationConfig(max_new_tokens=16))  # different context in between
    again = e.generate(PROMPTS[2], GenerationConfig(max_new_tokens=16))
    e.reset()
    fresh = e.generate(PROMPTS[2], GenerationConfig(max_new_tokens=16))
    assert first.token_ids == again.token_ids == fresh.token_ids


def test_a_prompt_extending_the_last_answer_reuses_only_what_the_kv_holds(tiny_bundle):
    """generate() stops reading the stream at its budget; the answer's last token was never written to the KV.
    A next prompt holding the whole answer (a chat's next turn) must still see that token."""
    e, fresh = specdec.load(tiny_bundle, drafter="none"), specdec.load(tiny_bundle, drafter="none")
    first = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=12))
    assert first.finish_reason == "length"
    prompt = e.encode(PROMPTS[0]) + first.token_ids + e.encode(PROMPTS[1], chat=False)
    cfg = GenerationConfig(max_new_tokens=24)
    got = [t for chunk in e.stream_ids(prompt, cfg) for t in chunk]
    assert got == [t for chunk in fresh.stream_ids(prompt, cfg) for t in chunk]


def test_stop_string_and_max_tokens(engines):
    e = engines["none"]
    g = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=5))
    assert len(g.token_ids) == 5 and g.finish_reason == "length"
    full = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=30))
    assert len(full.text) > 4
    stop = full.text[2:4]
    g = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=30, stop=(stop,)))
    assert g.finish_reason == "stop" and g.text == full.text[:full.text.index(stop)]


def test_stream_yields_the_generated_text(engines):
    e = engines["ngram"]
    pieces = list(e.stream(PROMPTS[0], GenerationConfig(max_new_tokens=20)))
    assert "".join(pieces) == e.last_generation.text


def test_prompt_longer_than_kv_buffer(tiny_bundle):
    e = specdec.load(tiny_bundle, drafter="none", max_len=16)
    with pytest.raises(SpecdecError, match="--max-len"):
        e.generate("the quick brown fox " * 10)


def test_a_chat_that_outgrows_the_kv_buffer_loses_its_earliest_exchanges(tiny_bundle):
    e = specdec.load(tiny_bundle, drafter="none", max_len=120)
    system = [{"role": "system", "content": "be brief"}]
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"question {i}: the quick brown fox"},
                  {"role": "assistant", "content": f"answer {i}: jumps over the lazy dog"}]
    last = [{"role": "user", "content": "and now?"}]
    short = system + turns[:2] + last
    assert e.fit_conversation(short, 16) == (short, 0)  # fits: unchanged
    kept, dropped = e.fit_conversation(system + turns + last, 16)
    assert dropped > 0 and kept[0] == system[0] and kept[-1] == last[0]
    assert kept[1:] == (turns + last)[2 * dropped:]  # whole exchanges, earliest first
    assert len(e.encode(kept)) <= (120 - 16) // 2  # trimmed to half the budget: the next turns fit as they are
    with pytest.raises(SpecdecError, match="the last message needs"):
        e.fit_conversation(system + turns[:2] + [{"role": "user", "content": "the quick brown fox " * 30}], 16)


def test_generation_stops_when_kv_is_full(tiny_bundle):
    e = specdec.load(tiny_bundle, drafter="model", max_len=40)
    prompt = e.encode(PROMPTS[0])
    eos = set(e.manifest.tokenizer.eos_token_ids)
    plain = specdec.load(tiny_bundle, drafter="none").generate(PROMPTS[0], GenerationConfig(max_new_tokens=41))
    assert not eos & set(plain.token_ids[:41 - len(prompt)])  # the answer runs on past the buffer: it must fill
    g = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=200, draft_len=4))
    assert g.finish_reason == "kv_full"
    assert len(prompt) + len(g.token_ids) == 41  # the KV holds 40 tokens: all but the last one emitted
    assert g.token_ids == plain.token_ids[:41 - len(prompt)]


def test_empty_prompt(engines):
    with pytest.raises(SpecdecError, match="empty"):
        engines["none"].generate("   ")


@pytest.mark.parametrize("bad", [
    lambda: SamplingConfig(temperature=-1), lambda: SamplingConfig(top_p=0.0), lambda: SamplingConfig(top_p=1.5),
    lambda: SamplingConfig(temperature=float("inf")), lambda: SamplingConfig(temperature=float("nan")),
    lambda: SamplingConfig(top_k=-1), lambda: SamplingConfig(top_k=2.5), lambda: SamplingConfig(top_k=True),
    lambda: SamplingConfig(temperature="hot"), lambda: SamplingConfig(top_p=None),
])
def test_bad_sampling_settings(bad):
    with pytest.raises(ValueError, match="temperature|top_k|top_p"):
        bad()


@pytest.mark.parametrize("bad, message", [
    (dict(draft_len=-1), "draft length"), (dict(seed=-1), "seed"), (dict(stop=["END", ""]), "stop string"),
])
def test_bad_generation_settings(bad, message):
    with pytest.raises(SpecdecError, match=message):
        GenerationConfig(**bad)


def test_one_stop_string_is_not_split_into_characters():
    assert GenerationConfig(stop="END").stop == ("END",)
    assert GenerationConfig(stop=["a", "b"]).stop == ("a", "b")


def test_a_kv_buffer_of_zero_tokens_is_refused(tiny_bundle):
    with pytest.raises(SpecdecError, match="outside 1"):
        specdec.load(tiny_bundle, drafter="none", max_len=0)


def test_manifest_errors(tiny_bundle, tmp_path):
    from specdec.runtime.manifest import read_manifest

    with pytest.raises(SpecdecError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    broken = tmp_path / "b"
    shutil.copytree(tiny_bundle, broken)
    with open(broken / "target.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(SpecdecError, match="checksum"):
        read_manifest(broken)
    (broken / "specdec.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="not valid JSON"):
        read_manifest(broken)
    m = json.loads((tiny_bundle / "specdec.json").read_text())
    m["version"] = 99
    (broken / "specdec.json").write_text(json.dumps(m))
    with pytest.raises(SpecdecError, match="version 99"):
        read_manifest(broken)
    m["version"] = 1
    for bad in (0, 9, 1.5):
        m["graphs"]["target"]["min_step_tokens"] = bad
        (broken / "specdec.json").write_text(json.dumps(m))
        with pytest.raises(SpecdecError, match="min_step_tokens must be an integer in 1..8"):
            read_manifest(broken)
    del m["graphs"]["target"]["min_step_tokens"]
    for bad in (0, "long", 2.0):
        m["drafter"]["draft_len"] = bad
        (broken / "specdec.json").write_text(json.dumps(m))
        with pytest.raises(SpecdecError, match="draft_len must be an integer >= 1 or 'auto'"):
            read_manifest(broken)
    m["drafter"]["draft_len"] = 4
    m["drafter"]["kind"] = "telepathy"
    (broken / "specdec.json").write_text(json.dumps(m))
    with pytest.raises(SpecdecError, match="drafter.kind"):
        read_manifest(broken)
    (broken / "specdec.json").unlink()
    with pytest.raises(SpecdecError, match="specdec.json is missing"):
        read_manifest(broken)


def test_kv_buffer_allocated_once(engines):
    e = engines["model"]
    before = [id(v) for pair in e.target.kv.values for v in pair]
    e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=10))
    assert [id(v) for pair in e.target.kv.values for v in pair] == before
    assert np.shares_memory(e.target.kv.slab[0, 0], e.target.kv.values[0][0].numpy())


def test_adaptive_draft_len_is_lossless_and_adapts(engines):
    plain = engines["none"].generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, draft_len=0))
    e = engines["model"]
    g = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, draft_len="auto"))
    assert g.token_ids == plain.token_ids
    verify, _ = e._costs["model"]
    assert len(verify) >= 2 and all(t > 0 for t in verify)


def test_adaptive_policy_prefers_long_drafts_when_acceptance_is_high():
    from specdec.runtime.draft_len import AdaptiveDraftLen

    flat = [0.010] * 9  # verification costs the same for any width: long drafts are free to check
    p = AdaptiveDraftLen(verify_s=flat, draft_s=0.001, acceptance=0.9)
    assert p.next_k(8) == 8
    p = AdaptiveDraftLen(verify_s=flat, draft_s=0.001, acceptance=0.05)
    assert p.next_k(8) <= 1
    steep = [0.010 * t for t in range(1, 10)]  # each verified token costs a full step: speculation can't pay
    p = AdaptiveDraftLen(verify_s=steep, draft_s=0.004, acceptance=0.5)
    assert p.next_k(8) == 0
    p = AdaptiveDraftLen(verify_s=flat, draft_s=0.001, acceptance=0.9)
    for _ in range(50):
        p.update(4, 0)  # every first draft rejected
    assert p.estimate().acceptance < 0.05 and p.next_k(8) <= 1
    assert p.next_k(2) <= 2


def test_hybrid_uses_lookup_where_the_text_repeats(engines):
    e = engines["hybrid"]
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"
    plain = engines["none"].generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=0, chat=False))
    g = e.generate(prompt, GenerationConfig(max_new_tokens=30, draft_len=4, chat=False))
    assert g.token_ids == plain.token_ids
    # Sampling through both drafters stays seeded and valid.
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0), seed=3, draft_len=3)
    assert e.generate(prompt, cfg).token_ids == e.generate(prompt, cfg).token_ids


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_text_equals_decoded_tokens(engines, drafter):
    e = engines[drafter]
    eos = set(e.manifest.tokenizer.eos_token_ids)
    for prompt in PROMPTS:
        g = e.generate(prompt, GenerationConfig(max_new_tokens=33, draft_len=3))
        assert g.text == e.codec.decode([t for t in g.token_ids if t not in eos])


def test_adaptive_policy_probes_when_it_stops_drafting():
    from specdec.runtime.draft_len import PROBE_EVERY, AdaptiveDraftLen

    steep = [0.010 * t for t in range(1, 10)]
    p = AdaptiveDraftLen(verify_s=steep, draft_s=0.004, acceptance=0.5)
    ks = [p.next_k(8) for _ in range(PROBE_EVERY)]
    assert ks[:-1] == [0] * (PROBE_EVERY - 1) and ks[-1] == 1
    for _ in range(30):  # probes that succeed raise the estimate the next choice is made from
        p.update(1, 1)
    assert p.estimate().acceptance > 0.9


def test_draft_model_stops_at_low_confidence_without_changing_output(engines, monkeypatch):
    e, drafter = engines["model"], engines["model"].drafter
    plain = engines["none"].generate(PROMPTS[0], GenerationConfig(max_new_tokens=24)).token_ids
    monkeypatch.setattr(drafter, "confidence_stop", 0.999)  # a tiny random model is always below it: 1-token drafts
    short = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, draft_len=4))
    # one draft token per round, in every round the budget leaves room for one
    assert len(short.stats.drafted_at) == 1 and short.stats.drafted >= short.stats.target_forwards - 1
    drafter.confidence_stop = 0.0  # monkeypatch still restores the module's value
    full = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, draft_len=4))
    assert full.stats.drafted > full.stats.target_forwards
    assert short.token_ids == full.token_ids == plain


def test_adaptive_policy_keeps_draft_sources_apart():
    """A hybrid's dear, disappointing model drafts must not talk the policy out of free lookup drafts."""
    from specdec.runtime.draft_len import AdaptiveDraftLen

    verify = [0.020, 0.022, 0.023, 0.024, 0.025, 0.027, 0.029, 0.031, 0.034]  # fp32-like: width is cheap
    p = AdaptiveDraftLen(verify_s=list(verify), draft_s=0.010, source_draft_s={"lookup": 0.0, "model": 0.010})
    for _ in range(20):
        p.update(4, 0, draft_s=0.040, verify_s=0.025, source="model")  # model drafts all rejected
        p.update(4, 4, draft_s=0.0001, verify_s=0.025, source="lookup")  # lookups all accepted
    assert p.next_k(8, "model") == 0
    assert p.next_k(8, "lookup") == 8
    assert p.next_k(8, "") >= 1  # the default source kept its optimistic prior: untouched by the others


def test_hybrid_reports_its_next_source(engines):
    from specdec.runtime.sampling import SamplingConfig

    h = engines["hybrid"].drafter
    h.begin([5, 6, 7, 8, 5, 6], SamplingConfig(), np.random.default_rng(0))
    assert h.source([5, 6, 7, 8, 5, 6]) == "lookup"  # "5 6" occurred before: lookup has a continuation
    assert h.source([5, 6, 7, 8, 5, 6, 9, 10, 11]) == "model"  # "10 11" never occurred


def test_pad_step_widens_a_step_without_changing_what_its_real_tokens_see():
    """A 1-token step padded to 2 (graphs with min_step_tokens 2): the pad repeats the last token at the next
    position; in a tree step's bias the real row keeps its mask and is masked off the pad's column."""
    from specdec.runtime.decoder import _pad_step

    tokens = np.array([[7], [9]])  # [B=2, T=1]
    positions = np.array([[4], [6]])
    q = np.array([1, 0])  # row 1 idle
    bias = np.array([[[[0.0, -1e9, 0.0, 0.0, 0.0]]], [[[0.0, 0.0, 0.0, 0.0, 0.0]]]], dtype=np.float32)  # [2,1,1,5]
    features = np.arange(2 * 1 * 3, dtype=np.float32).reshape(2, 1, 3)
    t, p, q2, f, b = _pad_step(2, tokens, positions, q, features, bias)
    np.testing.assert_array_equal(t, [[7, 7], [9, 9]])
    np.testing.assert_array_equal(p, [[4, 5], [6, 7]])
    np.testing.assert_array_equal(q2, [2, 0])  # the idle row stays idle
    np.testing.assert_array_equal(f[:, 1], f[:, 0])
    assert b.shape == (2, 1, 2, 6)
    np.testing.assert_array_equal(b[:, :, :1, :5], bias)
    assert (b[:, :, :1, 5] == np.finfo(np.float32).min).all()  # the real row never sees the pad
    assert (b[:, :, 1, :] == 0).all()
