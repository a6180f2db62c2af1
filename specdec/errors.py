"""The one exception type users see: a message saying what is wrong and a hint saying what to do."""
from __future__ import annotations


class SpecdecError(Exception):
    """An error caused by input (files, flags, prompts), reported as one line by the CLI."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message
