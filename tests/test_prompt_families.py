"""The broad built-in prompt set: reproducible, varied, reading tasks only over given documents."""
from __future__ import annotations

import json

from specdec.export.distill_data import DistillDataConfig, plan_prompts
from specdec.export.prompt_families import FAMILY_WEIGHTS, broad_prompts
from specdec.export.prompts import instruction_prompts

DOCS = [f"Document {i} tells how the river town of Ostfeld {i} built its mill." * 3 for i in range(40)]


def _last_user(conversation):
    return conversation[-1]["content"]


def test_same_seed_same_prompts_other_seed_others():
    assert broad_prompts(200, seed=3, documents=DOCS) == broad_prompts(200, seed=3, documents=DOCS)
    assert broad_prompts(200, seed=3) != broad_prompts(200, seed=4)


def test_far_more_distinct_prompts_than_the_basic_set():
    # The basic set repeats its ~1,500 prompts; the broad one repeats a fifth of its prompts even without documents.
    n = 5000
    basic = {json.dumps(p) for p in instruction_prompts(n, seed=0)}
    broad = {json.dumps(p) for p in broad_prompts(n, seed=0)}
    assert len(basic) < 0.5 * n
    assert len(broad) > 0.75 * n


def test_every_family_appears_and_reading_needs_documents():
    without = [_last_user(p) for p in broad_prompts(3000, seed=1)]
    assert not any("Document" in t for t in without)
    with_docs = [_last_user(p) for p in broad_prompts(3000, seed=1, documents=DOCS)]
    reading = [t for t in with_docs if "Ostfeld" in t]
    assert 0.05 * len(with_docs) < len(reading) < 0.4 * len(with_docs)
    assert any(t.startswith("Translate German to English: ") for t in with_docs)
    assert any("def " in t or "function" in t for t in with_docs)
    assert any(c.isdigit() for t in with_docs for c in t)
    assert set(FAMILY_WEIGHTS) >= {"open", "code", "translation", "reading", "word_problem"}


def test_plan_drops_benchmark_prompts_and_keeps_a_fixed_order():
    cfg = DistillDataConfig(n_prompts=300, new_tokens=8, batch=16, seed=2)
    plan = plan_prompts(cfg, [], set(), DOCS)
    assert plan == plan_prompts(cfg, [], set(), DOCS)
    banned = "\n".join(m["content"] for m in plan[5] if m["role"] == "user")
    assert all("\n".join(m["content"] for m in p if m["role"] == "user") != banned
               for p in plan_prompts(cfg, [], {banned}, DOCS))
    # Sorted by length within windows of batches, so a batch pads little.
    window = plan[:8 * cfg.batch]
    lengths = [sum(len(m["content"]) for m in p) for p in window]
    assert lengths == sorted(lengths)


def test_basic_set_is_still_there_for_old_folders():
    cfg = DistillDataConfig(n_prompts=50, new_tokens=8, batch=16, prompt_set="basic")
    assert plan_prompts(cfg, [], set()) == instruction_prompts(50, seed=0)
