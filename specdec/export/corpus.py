"""`specdec corpus`: add a corpus of the target's own answers to a bundle, for the "corpus" drafter.

The answers come from `specdec distill-data` folders (their prompts are specdec's own, never benchmark questions;
the user turns are left out: the corpus holds what the target writes, not what users ask), or from the output
lines of `specdec batch` run on the bundle itself (its answers as text, tokenized again here: no torch, and the
bundle's own fast kernels write them). Only token ids are stored (uint16 for vocabularies under 65,536: 2 bytes a
token); the runtime indexes them on load.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.errors import SpecdecError
from specdec.export.writer import bundle_files
from specdec.runtime.drafters.corpus import Corpus
from specdec.runtime.manifest import MANIFEST_NAME, read_manifest

CORPUS_FILE = "corpus.npz"
SHIPPED_SUFFIX = ".corpus.npz"  # beside the shipped heads (export/heads/): a corpus for the default model


def shipped_corpus(fingerprint: str) -> Path | None:
    """The corpus shipped with specdec for the target with this weights fingerprint, if any."""
    from specdec.export.eagle import SHIPPED_HEADS

    for path in sorted(SHIPPED_HEADS.glob("*" + SHIPPED_SUFFIX)):
        try:
            with np.load(path) as d:
                if str(d["target"]) == fingerprint:
                    return path
        except (OSError, KeyError, ValueError):
            continue
    return None


def answers_of(folders: Sequence[Path], vocab_size: int) -> list[np.ndarray]:
    """Every answer recorded in the distill-data folders, in folder then shard order."""
    texts = []
    for folder in folders:
        shards = sorted(Path(folder).glob("shard-*.npz"))
        if not shards:
            raise SpecdecError(f"{folder} holds no distillation shards", "make them with `specdec distill-data -o DIR`")
        for path in shards:
            try:
                with np.load(path) as d:
                    tokens, starts, prompt_len = d["tokens"], d["starts"], d["prompt_len"]
            except (OSError, KeyError, ValueError) as e:
                raise SpecdecError(f"distillation shard {path} is unreadable ({e})",
                                   "delete it and rerun the same `specdec distill-data` command to remake it") from None
            if len(tokens) and int(tokens.max()) >= vocab_size:
                raise SpecdecError(f"{path} holds token ids beyond this bundle's vocabulary ({vocab_size})",
                                   "use data made with this bundle's target")
            texts += [tokens[int(starts[i]) + int(prompt_len[i]):int(starts[i + 1])] for i in range(len(prompt_len))]
    return texts


def _answer_text(record) -> str | None:
    """The answer in one output line: `specdec batch`'s {"text": ...}, or an OpenAI Batch API output line's
    response body (a chat completion's message content or a completion's text)."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("text"), str):
        return record["text"]
    body = ((record.get("response") or {}).get("body") or {}) if isinstance(record.get("response"), dict) else {}
    choices = body.get("choices") if isinstance(body, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        c = choices[0]
        text = (c.get("message") or {}).get("content") if isinstance(c.get("message"), dict) else c.get("text")
        return text if isinstance(text, str) else None
    return None


def answers_from_jsonl(files: Sequence[Path], tokenizer_file: Path, vocab_size: int) -> list[np.ndarray]:
    """The answers in `specdec batch` output files (lines with "text", or OpenAI Batch API output lines), as token
    ids of the bundle's tokenizer. A line without an answer (a failed request: "text": null) is skipped."""
    import json

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    texts = []
    for path in files:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecdecError(f"cannot read answers file {path} ({e})",
                               "give the output file of `specdec batch`") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{path}:{n} is not JSON ({e.msg})",
                                   "give the output file of `specdec batch` (one JSON object per line)") from None
            text = _answer_text(record)
            if text is None and not (isinstance(record, dict) and ("text" in record or "error" in record)):
                raise SpecdecError(f'{path}:{n} holds no answer ("text", or an OpenAI batch output\'s response)',
                                   "give the output file of `specdec batch`")
            if text:
                ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
                if len(ids) and int(ids.max()) >= vocab_size:
                    raise SpecdecError(f"{path}:{n} tokenizes beyond this bundle's vocabulary ({vocab_size})")
                texts.append(ids)
    return texts


def extended(base: Corpus | None, texts: Sequence[np.ndarray], vocab_size: int) -> Corpus:
    """A corpus of `base`'s texts (if any) followed by `texts`."""
    added = Corpus.from_texts(texts, vocab_size)
    if base is None:
        return added
    if base.vocab_size != vocab_size:
        raise SpecdecError(f"the corpus to extend has a vocabulary of {base.vocab_size}, the data {vocab_size}")
    return Corpus(np.concatenate([base.tokens, added.tokens]), vocab_size)


def add_corpus(bundle: Path, folders: Sequence[Path], keep: bool = False, answers: Sequence[Path] = ()) -> dict:
    """Write bundle/corpus.npz from the folders' answers and the answers files' (after the bundle's current corpus,
    with `keep`) and record it in the manifest (checksummed)."""
    bundle = Path(bundle)
    m = read_manifest(bundle)
    base = None
    if keep:
        if m.drafter.corpus is None:
            raise SpecdecError(f"bundle {bundle} has no corpus to keep", "leave out --keep to make one")
        base = Corpus.load(bundle / m.drafter.corpus, m.model.vocab_size, m.tokenizer.vocab_digest)
    texts = answers_of(folders, m.model.vocab_size) if folders else []
    if answers:
        texts += answers_from_jsonl(answers, bundle / m.tokenizer.file, m.model.vocab_size)
    corpus = extended(base, texts, m.model.vocab_size)
    if not len(corpus):
        raise SpecdecError("the data holds no answers to build a corpus from")
    tmp = bundle / (CORPUS_FILE + ".tmp")
    corpus.save(tmp, m.tokenizer.vocab_digest)
    tmp.replace(bundle / CORPUS_FILE)
    m = replace(m, drafter=replace(m.drafter, corpus=CORPUS_FILE))
    m = replace(m, files=bundle_files(bundle))
    staged = bundle / (MANIFEST_NAME + ".tmp")
    staged.write_text(m.to_json())
    staged.replace(bundle / MANIFEST_NAME)  # the manifest last: a killed run leaves the old bundle valid
    return {"tokens": len(corpus), "texts": int((corpus.tokens == corpus.sep).sum()),
            "bytes": (bundle / CORPUS_FILE).stat().st_size, "max_ngram": corpus.max_ngram,
            "folders": [str(f) for f in folders], "answers": [str(f) for f in answers]}


def write_shipped_corpus(model_path, folders: Sequence[Path], out: Path, base: Path | None = None) -> dict:
    """A corpus for specdec/export/heads/ (`NAME.corpus.npz`): tagged with the target's weights fingerprint, so
    that `specdec export` of that target copies it into every bundle. `base`: a corpus file of the same target
    whose texts come first (the shipped one, to grow it with new data)."""
    from specdec.export.eagle import target_fingerprint
    from specdec.export.graph import model_config_from_hf, weights_from_torch
    from specdec.runtime.tokenizer import vocab_digest
    from specdec.export.source import load_source

    source = load_source(model_path)
    cfg = model_config_from_hf(source.hf_config)
    digest = vocab_digest(source.tokenizer.backend_tokenizer)
    fingerprint = target_fingerprint(weights_from_torch(source.model))
    first = None
    if base is not None:
        with np.load(base) as d:
            if str(d["target"]) != fingerprint:
                raise SpecdecError(f"{base} holds another target's answers", "extend a corpus made for this model")
        first = Corpus.load(base, cfg.vocab_size, digest)
    corpus = extended(first, answers_of(folders, cfg.vocab_size), cfg.vocab_size)
    staged = Path(str(out) + ".tmp")  # `out` may be `base` itself
    corpus.save(staged, digest, fingerprint)
    staged.replace(out)
    return {"tokens": len(corpus), "bytes": Path(out).stat().st_size}
