"""Errors that reach the user as one line and a hint (exit code 2), never a traceback."""
from __future__ import annotations


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
