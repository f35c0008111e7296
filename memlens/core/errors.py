"""Errors that reach the user as one line and a hint (exit code 2), never a traceback."""
from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(\[])")
_MONSTROUS = 600   # a "sentence" this long is a dump (a tensor, a traceback), not prose: cut at a word


def sentences(text: object, limit: int = 200) -> str:
    """A library's message for one line: its whitespace folded, and as many whole sentences as fit
    in ``limit`` characters, never fewer than the first (cut at a word only past 600 characters).

    >>> sentences("You are trying to access a gated repo.\\nMake sure to have access to it. Please request the "
    ...           "access on the model page, then log in.", limit=80)
    'You are trying to access a gated repo. Make sure to have access to it.'
    >>> sentences("expected int, got str (value: '768')")
    "expected int, got str (value: '768')"
    """
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    parts = _SENTENCE_END.split(flat)
    out = parts[0]
    for part in parts[1:]:
        if len(out) + 1 + len(part) > limit:
            break
        out += " " + part
    if len(out) > _MONSTROUS:
        out = out[:_MONSTROUS].rsplit(" ", 1)[0] + " ..."
    return out


class MemlensError(Exception):
    """A problem with the user's input or environment, explained in one line.

    >>> e = MemlensError("unknown model 'gtp2'", hint="did you mean 'gpt2'?")
    >>> str(e)
    "unknown model 'gtp2'"
    """

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self) -> str:
        line = f"ERROR: {self.message}"
        if self.hint:
            line += f"  HINT: {self.hint}"
        return line


class SpecError(MemlensError):
    """The training spec is invalid (bad flag value, impossible combination, malformed YAML)."""


class ModelSourceError(MemlensError):
    """The model cannot be found or built from its config."""


class NoDeviceError(MemlensError):
    """A verb needs a GPU / NVML that this machine does not have."""
