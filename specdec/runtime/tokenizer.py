"""Text in and out: a `tokenizers` tokenizer, the bundle's chat template (jinja2), streaming detokenization."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from specdec.errors import SpecdecError


def vocab_digest(tok: Tokenizer) -> str:
    """SHA-256 of the vocabulary and the special tokens: equal digests mean drafts can be shared by id."""
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _raise(msg: str) -> None:
    raise SpecdecError(f"chat template error: {msg}")


class TextCodec:
    def __init__(self, tokenizer_file: Path, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: Sequence[int]) -> None:
        try:
            self.tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise SpecdecError(f"cannot read tokenizer {tokenizer_file}: {str(e)[:200]}", "re-export the bundle") from None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def token_text(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8, as Python decodes argv and stdin (surrogates)
            raise SpecdecError("the prompt is not UTF-8 text", "convert it to UTF-8, e.g. with iconv -t UTF-8") from None
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if self._template is None:
            raise SpecdecError("this bundle has no chat template", "use `specdec generate --raw` with a plain prompt")
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0])
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos)
        # The template already wrote the special tokens as text; they must map to their ids, not be split.
        return self.encode(text)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, never emitting half a UTF-8 character.

    Decodes only a short window (from `prefix` on) each time, so streaming n tokens costs O(n).
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are already fully emitted
        self.read = 0  # tokens whose text has been emitted

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        done = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (e.g. a byte-fallback token pair cut short)."""
        done = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
