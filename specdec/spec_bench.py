"""Benchmark prompts: Spec-Bench questions as chat messages.

Spec-Bench (``question.jsonl``) holds one JSON object per line with ``question_id`` (int),
``category`` (str), ``turns`` (list of user messages; 1 or 2) and sometimes ``reference``.
Only the first turn is used: multi-turn questions would need the model's own first answer
as context, which differs between runtimes and would make the prompts differ.

Standard library only (json + dataclasses + random) and specdec.errors: `specdec bench` and the scripts under
bench/ share it.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from specdec.errors import SpecdecError

# Spec-Bench's questions ship with specdec (data/README.md): `specdec bench` works wherever specdec is installed.
DEFAULT_QUESTIONS = Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt. ``messages`` is a chat: a list of ``{"role", "content"}`` dicts."""

    id: str
    category: str
    messages: list[dict[str, str]] = field(hash=False)


def load_spec_bench(path: str | Path, limit_per_category: int | None = None,
                    seed: int | None = 0) -> list[Prompt]:
    """Read Spec-Bench questions as single-turn user prompts.

    ``limit_per_category``: keep at most this many questions per category (None: all).
    ``seed``: which questions are kept when limiting: a seeded random choice per category
    (stable across runs and Python versions), or the first ones in file order when None.
    Categories appear in the order of their first question in the file; questions within a
    category keep file order.
    """
    if limit_per_category is not None and limit_per_category < 0:
        raise ValueError(f"limit_per_category must be >= 0 or None, got {limit_per_category}")
    by_category: dict[str, list[Prompt]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                qid, category, turns = row["question_id"], row["category"], row["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Spec-Bench question ({e})") from None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
            prompt = Prompt(id=str(qid), category=str(category),
                            messages=[{"role": "user", "content": turns[0]}])
            by_category.setdefault(prompt.category, []).append(prompt)

    out: list[Prompt] = []
    for category, prompts in by_category.items():
        if limit_per_category is None or limit_per_category >= len(prompts):
            chosen = prompts
        elif seed is None:
            chosen = prompts[:limit_per_category]
        else:
            # A str seed is hashed with SHA-512 by random.Random: stable across processes.
            rng = random.Random(f"{seed}/{category}")
            keep = sorted(rng.sample(range(len(prompts)), limit_per_category))
            chosen = [prompts[i] for i in keep]
        out.extend(chosen)
    return out


def categories(prompts: list[Prompt]) -> list[str]:
    """Distinct categories in first-appearance order."""
    return list(dict.fromkeys(p.category for p in prompts))


def questions_as_prompts(questions: Path | None, limit: int) -> list[Prompt]:
    """The questions of a Spec-Bench JSONL (default: the copy shipped with specdec), `limit` per category (0: all);
    a missing, malformed or empty file is the user's input error."""
    questions = Path(questions) if questions else DEFAULT_QUESTIONS
    if not questions.is_file():
        raise SpecdecError(f"questions file {questions} not found", "pass --questions PATH")
    try:
        prompts = load_spec_bench(questions, limit_per_category=limit or None)
    except ValueError as e:
        raise SpecdecError(str(e), "pass a Spec-Bench question.jsonl") from None
    if not prompts:
        raise SpecdecError(f"{questions} holds no questions", "pass a Spec-Bench question.jsonl")
    return prompts
