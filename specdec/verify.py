"""`specdec verify`: prove on this device that a bundle's speculation is lossless, or show where it is not.

Losslessness is a property of the kernels actually run: int8-activation kernels, a GPU provider, fp16 or another
onnxruntime can round a T-token step differently from T single steps, and then a drafter's greedy output can
drift from plain decoding. Three checks, each on the bundle as loaded here (provider, threads, onnxruntime):

- greedy identity: every drafter's greedy output against plain decoding of the same bundle, token for token
  (the first differing position and tokens where it fails);
- T-invariance of the target: the logits of one T-token step against T single steps, for the widths a round
  uses (2 .. AUTO_K_MAX + 1): max |dlogit| and whether any argmax changes (a changed argmax is a failure);
- sampled losslessness: many seeded answers to fixed short prompts under each drafter, the tokens after the first
  compared with the target's exact law (specdec.verify_stats: chi-square over pooled cells, p-value and total
  variation). The suite shows the check's power: the same check at the same size rejects acceptance rules broken
  on purpose (tests/test_sampled_lossless.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from specdec.errors import SpecdecError
from specdec.runtime.decoder import Decoder
from specdec.runtime.engine import AUTO_K_MAX, Engine, GenerationConfig
from specdec.runtime.sampling import SamplingConfig
from specdec.verify_stats import TargetLaw, answers_from_engine, continuation_check

PASS_P = 1e-3  # a sampled check fails below this p-value
SAMPLED = SamplingConfig(temperature=0.6)  # cool enough that drafts of the top token fail often
SAMPLED_PROMPTS = ["Write one sentence about the sea.", "List three colours.", "What is 2 + 2?"]
DEPTH = 2  # tokens checked after the first of each answer
# Drafts of a fixed length: "auto" may rightly decide not to draft on a busy machine, and a check where nothing was
# drafted proves nothing. The widths "auto" would pick are covered by the T-invariance check.
VERIFY_DRAFT_LEN = 4
WEAK_CELLS = 8


@dataclass
class Check:
    kind: str  # "greedy" | "t-invariance" | "sampled"
    subject: str  # a drafter, or a step width
    passed: bool
    detail: str
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "passed": self.passed, "detail": self.detail, **self.data}


def runnable_drafters(engine: Engine) -> list[str]:
    """Every drafter kind the bundle can run (not "none")."""
    from specdec.tune import candidate_configs

    return list(dict.fromkeys(c.drafter for c in candidate_configs(engine.manifest) if c.drafter != "none"))


def greedy_identity(engine: Engine, drafters: Sequence[str], prompts: Sequence[list[dict]], max_new_tokens: int,
                    on_step: Callable[[], None] = lambda: None) -> list[Check]:
    plain_cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=0)
    engine.use_drafter("none")
    ids = [engine.encode(p) for p in prompts]
    reference = []
    for prompt_ids in ids:
        engine.reset()
        reference.append([t for chunk in engine.stream_ids(prompt_ids, plain_cfg) for t in chunk])
        on_step()
    checks = []
    for kind in drafters:
        engine.use_drafter(kind)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=VERIFY_DRAFT_LEN)
        failure, drafted, accepted = None, 0, 0
        for i, prompt_ids in enumerate(ids):
            engine.reset()
            got = [t for chunk in engine.stream_ids(prompt_ids, cfg) for t in chunk]
            drafted, accepted = drafted + engine.last_stats.drafted, accepted + engine.last_stats.accepted
            on_step()
            if got != reference[i] and failure is None:
                at = next((j for j, (a, b) in enumerate(zip(got, reference[i])) if a != b), min(len(got), len(reference[i])))
                failure = (f"prompt {i + 1}: first difference at token {at}: "
                           f"{got[at] if at < len(got) else 'end'} instead of "
                           f"{reference[i][at] if at < len(reference[i]) else 'end'}")
        checks.append(Check("greedy", kind, failure is None,
                            failure or f"{len(ids)} prompts identical ({accepted}/{drafted} drafts accepted)",
                            {"prompts": len(ids), "drafted": drafted, "accepted": accepted}))
    return checks


def t_invariance(engine: Engine, context: Sequence[int], widths: Sequence[int]) -> list[Check]:
    """One T-token step against T single steps over the same KV prefix, for each T in `widths`."""
    target = engine.target
    if not isinstance(target, Decoder):
        return [Check("t-invariance", "target", True, "not measured: a LayerSkip bundle's target runs as two slices")]
    w_max = max(widths)
    if len(context) < w_max + 1:
        raise SpecdecError("the T-invariance context is too short", "use a longer prompt")
    prefix, tail = list(context[:-w_max]), list(context[-w_max:])
    kv = target.kv
    engine.reset()
    target.prefill(np.asarray([prefix], dtype=np.int64))
    start = int(kv.lengths[0])
    single = []
    for token in tail:
        single.append(target.forward(np.asarray([[token]], dtype=np.int64))[0, 0].copy())  # [vocab]
        kv.advance(1)
    single_logits = np.stack(single)  # [w_max, vocab]
    checks = []
    for width in widths:
        kv.truncate(start)
        multi = target.forward(np.asarray([tail[:width]], dtype=np.int64))[0, :width].copy()  # [width, vocab]
        diff = float(np.abs(multi - single_logits[:width]).max())
        flips = int((multi.argmax(-1) != single_logits[:width].argmax(-1)).sum())
        checks.append(Check("t-invariance", f"T={width}", flips == 0,
                            f"max |dlogit| {diff:.2e}, {flips} argmax change{'s' if flips != 1 else ''}",
                            {"max_abs_dlogit": diff, "argmax_changes": flips}))
    engine.reset()
    return checks


def sampled_lossless(engine: Engine, drafters: Sequence[str], samples: int, sampling: SamplingConfig = SAMPLED,
                     on_drafter: Callable[[], None] = lambda: None) -> list[Check]:
    """`samples` seeded answers per drafter, spread over SAMPLED_PROMPTS, against the target's exact law."""
    law = TargetLaw(engine.target, sampling)
    prompts = [engine.encode(p) for p in SAMPLED_PROMPTS]
    eos = engine.manifest.tokenizer.eos_token_ids
    checks = []
    for kind in drafters:
        engine.use_drafter(kind)
        cfg = GenerationConfig(max_new_tokens=1 + DEPTH, sampling=sampling, draft_len=VERIFY_DRAFT_LEN)
        by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
        drafted = accepted = 0
        for i, prompt_ids in enumerate(prompts):
            engine.reset()  # the law's prefills share the target's KV
            share = samples // len(prompts) + (i < samples % len(prompts))
            answers = answers_from_engine(engine, prompt_ids, cfg, range(i * samples, i * samples + share))
            by_prompt.update(answers.by_prompt)
            drafted, accepted = drafted + answers.drafted, accepted + answers.accepted
        check = continuation_check(by_prompt, law, DEPTH, stop=eos)
        engine.reset()
        note = f"{check}; {accepted}/{drafted} drafts accepted"
        if drafted == 0 or accepted == drafted:
            note += " (acceptance and rejection did not both occur: the check is weak here)"
        if check.cells < WEAK_CELLS:  # a flat law spreads the answers over cells too small to stand alone
            note += " (few cells: little power here; raise --samples or lower --temperature)"
        checks.append(Check("sampled", kind, check.pvalue > PASS_P, note,
                            {"pvalue": check.pvalue, "tv": check.tv, "answers": check.n, "cells": check.cells,
                             "drafted": drafted, "accepted": accepted}))
        on_drafter()
    return checks


def default_widths() -> list[int]:
    return list(range(2, AUTO_K_MAX + 2))
