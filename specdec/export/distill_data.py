"""`specdec distill-data`: the target's own answers and hidden states, streamed to disk, for training drafters.

The target answers prompts (specdec's built-in instructions, export/prompts.py, plus any file the user gives),
greedily and in batches; each batch becomes one shard `shard-NNNNN.npz`. A conversation of the user's file
that ends in an assistant turn is already answered: that answer is recorded as given, in one teacher-forced pass
(~210 tokens/s on 2 AVX2 cores for SmolLM2-135M, against 60-100 answer tokens/s when generating). That is how
answers the target wrote before (a corpus, an app's logs) become training data again; answers written by another
model are not the target's own, and heads trained on them learn the target's features on someone else's text.

    tokens     [n]        int32  every sequence (prompt + answer) back to back
    starts     [s + 1]    int64  sequence i is tokens[starts[i]:starts[i+1]]
    prompt_len [s]        int64  how many of its tokens are prompt
    hidden     [n, D]     fp16   the residual stream before the final norm at every position (what EAGLE-style
                                 heads read), i.e. the input of the LM head up to the final norm

Shards are written to a temporary name and renamed, and prompts are drawn in a fixed order from the seed, so
shard k always holds the same prompts: a killed run restarted with the same command skips the shards it has and
never duplicates or loses one. `distill.json` pins the settings; another target or settings are refused.
Prompts that are Spec-Bench questions are dropped: drafters are measured on those, never trained on them.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from specdec.errors import SpecdecError

META_NAME = "distill.json"
META_FORMAT = "specdec-distill-data"
META_VERSION = 1
PROMPT_SETS = ("broad", "basic")
# Reading-task documents: the target's own earlier answers, long enough to summarize; at most this many are kept
# (a prompt takes 1-4 of them), which bounds the prompt plan's memory
DOCUMENT_MIN_TOKENS = 60
MAX_DOCUMENTS = 20000
LENGTH_WINDOW = 8  # batches whose prompts are sorted by length together (see _by_length)


@dataclass(frozen=True)
class DistillDataConfig:
    n_prompts: int = 8000  # built-in instruction prompts; x ~130 answer tokens ~ 1M tokens for the default model
    # (0: only the user's file)
    new_tokens: int = 192  # answer length cap: long enough for multi-paragraph answers, short enough to batch
    batch: int = 32  # prompts per generation batch = per shard (bounded memory: one batch's states at a time)
    seed: int = 0
    # "broad": export/prompt_families.py (many task families, reading tasks over --documents); "basic": the first
    # set (28 templates x 53 topics, few distinct prompts), kept so that data made with it can still be resumed
    prompt_set: str = "broad"

    def __post_init__(self) -> None:
        for name, least in (("n_prompts", 0), ("new_tokens", 1), ("batch", 1)):
            if getattr(self, name) < least:
                raise SpecdecError(f"distill-data {name} must be >= {least}, got {getattr(self, name)}")
        if self.prompt_set not in PROMPT_SETS:
            raise SpecdecError(f"unknown prompt set {self.prompt_set!r}", f"choose one of {', '.join(PROMPT_SETS)}")


def _text_of(conversation: list[dict]) -> str:
    return "\n".join(m.get("content", "") for m in conversation if m.get("role") == "user").strip()


def load_prompt_file(path: Path) -> list[list[dict]]:
    """JSONL lines with "prompt" (text) or "messages" (chat); a bad line is an error naming its line number."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SpecdecError(f"cannot read prompts file {path}: {e.strerror or e}", "check the path") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise SpecdecError(f"{path} line {i} is not valid JSON", "one JSON object per line") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            out.append([{"role": "user", "content": rec["prompt"]}])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and _well_formed(rec["messages"]):
            out.append(rec["messages"])
        else:
            raise SpecdecError(f"{path} line {i} has neither a 'prompt' string nor a 'messages' list of "
                               "{'role', 'content'} turns with a user turn")
    return out


def _well_formed(messages: list) -> bool:
    return (bool(messages) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                   and m.get("role") in ("system", "user", "assistant") for m in messages)
            and any(m["role"] == "user" for m in messages))


def is_answered(conversation: list[dict]) -> bool:
    """Ends in an assistant turn: its last answer is recorded as given, not generated."""
    return conversation[-1].get("role") == "assistant"


def benchmark_texts(path: Path | None) -> set[str]:
    """The user turns of every Spec-Bench question in `path` (None: none to keep out)."""
    if path is None:
        return set()
    if not Path(path).is_file():
        raise SpecdecError(f"questions file {path} not found", "pass --questions PATH (Spec-Bench's question.jsonl)")
    from specdec.spec_bench import load_spec_bench

    return {_text_of(p.messages) for p in load_spec_bench(path)}


def plan_prompts(cfg: DistillDataConfig, extra: list[list[dict]], exclude: set[str],
                 documents: list[str] | tuple = ()) -> list[list[dict]]:
    """The run's prompts in their fixed order: the user's first, then the built-in ones; benchmark ones dropped.
    `documents` feed the broad set's reading tasks (summaries, extraction, answers from passages)."""
    from specdec.export.prompt_families import broad_prompts
    from specdec.export.prompts import instruction_prompts

    if cfg.prompt_set == "broad":
        built_in = _by_length(broad_prompts(cfg.n_prompts, seed=cfg.seed, documents=documents), cfg.batch)
    else:
        built_in = instruction_prompts(cfg.n_prompts, seed=cfg.seed)
    plan = [p for p in list(extra) + built_in if _text_of(p) not in exclude]
    if not plan:
        raise SpecdecError("no prompts to answer", "give --n above 0 or a --prompts-file with prompts")
    return plan


def _by_length(prompts: list[list[dict]], batch: int) -> list[list[dict]]:
    """Within each window of LENGTH_WINDOW batches, prompts sorted by length: a batch is padded to its longest
    prompt, and reading tasks are ten times longer than the rest. Deterministic, so resuming stays exact."""
    width = LENGTH_WINDOW * batch
    out: list[list[dict]] = []
    for start in range(0, len(prompts), width):
        window = prompts[start:start + width]
        out += sorted(window, key=lambda p: sum(len(m.get("content", "")) for m in p))
    return out


def answers_as_documents(folder: Path, tokenizer) -> list[str]:
    """The answers recorded in a distill-data folder, as text, in shard order: documents for reading tasks."""
    shards = sorted(Path(folder).glob("shard-*.npz"))
    if not shards:
        raise SpecdecError(f"{folder} holds no distillation shards to take documents from",
                           "give a folder written by `specdec distill-data`")
    docs: list[str] = []
    for path in shards:
        try:
            with np.load(path) as d:
                tokens, starts, prompt_len = d["tokens"], d["starts"], d["prompt_len"]
        except (OSError, KeyError, ValueError) as e:
            raise SpecdecError(f"distillation shard {path} is unreadable ({e})") from None
        for i in range(len(prompt_len)):
            answer = tokens[int(starts[i]) + int(prompt_len[i]):int(starts[i + 1])]
            if len(answer) >= DOCUMENT_MIN_TOKENS:
                docs.append(tokenizer.decode(answer.tolist(), skip_special_tokens=True).strip())
            if len(docs) >= MAX_DOCUMENTS:
                return docs
    return docs


def _digest(prompts: list[list[dict]]) -> str:
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()


def _shards(prompts: list, batch: int) -> Iterator[tuple[int, list]]:
    for k, start in enumerate(range(0, len(prompts), batch)):
        yield k, prompts[start:start + batch]


def pre_norm_states(model, ids: np.ndarray) -> np.ndarray:
    """The residual stream entering the final norm at every position of ids [T]: [T, D] float32. (transformers'
    last `hidden_states` entry is after the norm, so the norm's input is taken with a hook.)"""
    return batched_pre_norm_states(model, [ids])[0]


def batched_pre_norm_states(model, seqs: list[np.ndarray], batch_tokens: int = 4096) -> list[np.ndarray]:
    """`pre_norm_states` of several sequences, run in right-padded batches of similar lengths (padding sits after
    every real token, so causal attention never lets it change one); the LM head is skipped (its [T, vocab]
    product is ~20% of a small model's work and no state depends on it)."""
    import torch

    captured = []
    hook = model.model.norm.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    out: list[np.ndarray | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    try:
        start = 0
        while start < len(order):
            end = start + 1  # a batch grows while its padded size (longest x count) fits batch_tokens
            while end < len(order) and len(seqs[order[end]]) * (end + 1 - start) <= batch_tokens:
                end += 1
            idx = order[start:end]
            width = len(seqs[idx[-1]])
            ids = torch.zeros((len(idx), width), dtype=torch.long)  # [b, width]
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(seqs[i])] = torch.from_numpy(np.asarray(seqs[i], dtype=np.int64))
                mask[row, :len(seqs[i])] = 1
            captured.clear()
            with torch.no_grad():
                model.model(input_ids=ids, attention_mask=mask)
            states = captured[0].float().numpy()  # [b, width, D]
            for row, i in enumerate(idx):
                out[i] = states[row, :len(seqs[i])]
            start = end
    finally:
        hook.remove()
    return out


def given_answers(tokenizer, conversations: list) -> list[tuple[np.ndarray, int]]:
    """Per answered conversation: (prompt + answer ids, prompt length), laid out as a generation would have
    written them: the prompt is the turns before the last with the generation prompt, the answer its text's ids
    followed by the end-of-turn token the target emits."""
    eos = int(tokenizer.eos_token_id)
    out = []
    for c in conversations:
        prompt = tokenizer.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(c[-1]["content"], add_special_tokens=False)["input_ids"]
        out.append((np.asarray(p + a + [eos], dtype=np.int64), len(p)))
    return out


def _sequences(model, tokenizer, conversations: list, new_tokens: int) -> list[tuple[np.ndarray, int]]:
    """(prompt + answer ids, prompt length) per conversation, in order: given answers kept, the rest generated."""
    from specdec.export.prompts import target_answers

    answered = [is_answered(c) for c in conversations]
    given = iter(given_answers(tokenizer, [c for c, a in zip(conversations, answered) if a]))
    asked = [c for c, a in zip(conversations, answered) if not a]
    made = iter(target_answers(model, tokenizer, asked, new_tokens, batch=len(asked)) if asked else [])
    return [next(given) if a else next(made) for a in answered]


def shard_path(out: Path, k: int) -> Path:
    return out / f"shard-{k:05d}.npz"


def write_distill_data(model, tokenizer, out: Path, cfg: DistillDataConfig, prompts: list[list[dict]],
                       source: str, force: bool = False,
                       progress: Callable[[int, int, int], object] | None = None) -> dict:
    """Generate the shards that `out` lacks. `progress(done_prompts, total_prompts, tokens_this_run)` after each."""
    out = Path(out)
    meta = {"format": META_FORMAT, "version": META_VERSION, "source": source, "config": asdict(cfg),
            "prompts": len(prompts), "prompts_sha256": _digest(prompts)}
    meta_file = out / META_NAME
    if meta_file.is_file():
        old = json.loads(meta_file.read_text())
        old.get("config", {}).setdefault("prompt_set", "basic")  # folders made before there was a choice
        if old != meta and not force:
            raise SpecdecError(f"{out} holds distillation data made with another target, prompts or settings",
                               "use another folder, the same command as before, or --force to start over")
        if old != meta:
            for f in out.glob("shard-*.npz"):
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    meta_file.write_text(json.dumps(meta, indent=1) + "\n")
    for stale in out.glob("*.tmp.npz"):  # a run killed mid-write
        stale.unlink()
    done = tokens = 0
    t0 = time.perf_counter()
    for k, batch in _shards(prompts, cfg.batch):
        path = shard_path(out, k)
        if not path.is_file():
            seqs = _sequences(model, tokenizer, batch, cfg.new_tokens)
            starts = np.cumsum([0] + [len(s) for s, _ in seqs]).astype(np.int64)  # [s+1]
            hidden = np.empty((int(starts[-1]), model.config.hidden_size), dtype=np.float16)  # [n, D]
            for states, a in zip(batched_pre_norm_states(model, [ids for ids, _ in seqs]), starts[:-1]):
                hidden[a:a + len(states)] = states.astype(np.float16)
            tmp = path.with_name(path.stem + ".tmp.npz")
            np.savez(tmp, tokens=np.concatenate([s for s, _ in seqs]).astype(np.int32), starts=starts,
                     prompt_len=np.asarray([p for _, p in seqs], dtype=np.int64), hidden=hidden)
            os.replace(tmp, path)  # whole shards only
            tokens += int(starts[-1]) - sum(p for _, p in seqs)
        done += len(batch)
        if progress is not None:
            progress(done, len(prompts), tokens)
    return {"prompts": len(prompts), "shards": len(list(out.glob("shard-*.npz"))), "answer_tokens_this_run": tokens,
            "seconds": round(time.perf_counter() - t0, 1)}
