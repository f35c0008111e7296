"""The user's own code (a ``pkg.module:factory``, the loss function or step it returns, its model's
forward): when it fails, the failure is the user's, reported in one line with its last frame in
the user's code (exit 2), not as an internal error of memlens.

Factories are registered here as they are resolved and built (models/source.py, models/build.py);
`user_code_error(exc)` reads a traceback against them.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, TracebackType

from .errors import MemlensError, sentences

_ROLES: dict[CodeType, tuple[str, str]] = {}   # code object -> (role, factory name)
_FILES: dict[str, str] = {}                     # the factory module's file -> factory name


def register_file(path: str | None, name: str) -> None:
    """A factory's module: every function in it is the user's code."""
    if path:
        _FILES[os.path.realpath(path)] = name


def register(fn, role: str, name: str) -> None:
    """One of the user's callables: ``role`` is factory, loss function or step function."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if isinstance(code, CodeType):
        _ROLES[code] = (role, name)
        register_file(code.co_filename, name)


def _library_dirs() -> tuple[str, ...]:
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))   # the memlens package
    dirs = {here}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(os.path.realpath(p))
    dirs.update(os.path.realpath(p) for p in sys.path if p and "site-packages" in p)
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _frames(tb: TracebackType | None):
    while tb is not None:
        yield tb.tb_frame.f_code, tb.tb_lineno
        tb = tb.tb_next


def user_frames(exc: BaseException) -> tuple[tuple[str, str] | None, list[tuple[CodeType, int]]]:
    """(the outermost registered role in the traceback, the frames in the user's code), or (None, [])
    when the traceback passes through no registered factory code."""
    frames = list(_frames(exc.__traceback__))
    registered = [_ROLES[c] for c, _ in frames if c in _ROLES]
    files = [_FILES[os.path.realpath(c.co_filename)] for c, _ in frames if os.path.realpath(c.co_filename) in _FILES]
    if not registered and not files:
        return None, []
    lib = _library_dirs()

    def is_user(code: CodeType) -> bool:
        f = code.co_filename
        if f.startswith("<"):
            return False
        real = os.path.realpath(f)
        return code in _ROLES or real in _FILES or not real.startswith(lib)

    role = registered[0] if registered else ("code", files[0])
    return role, [(c, n) for c, n in frames if is_user(c)]


def last_user_frame(exc: BaseException) -> str | None:
    """'file.py:LINE in fn' of the innermost frame outside memlens, Python and installed packages."""
    lib = _library_dirs()
    frames = [(c, n) for c, n in _frames(exc.__traceback__)
              if not c.co_filename.startswith("<") and not os.path.realpath(c.co_filename).startswith(lib)]
    if not frames:
        return None
    code, line = frames[-1]
    return f"{os.path.basename(code.co_filename)}:{line} in {code.co_name}"


_PHRASES = {"factory": "your factory {name}", "loss function": "the loss function of your factory {name}",
            "step function": "the step function of your factory {name}", "code": "your code (factory {name})"}


def describe(exc: BaseException) -> tuple[str, str] | None:
    """(who, where) for an exception raised in the user's code: e.g. ("your factory fac:boom",
    "fac.py:3 in boom"); None when the user's code is not in the traceback."""
    role, frames = user_frames(exc)
    if role is None or not frames:
        return None
    code, line = frames[-1]
    who = _PHRASES.get(role[0], "your code (factory {name})").format(name=role[1])
    return who, f"{os.path.basename(code.co_filename)}:{line} in {code.co_name}"


def first_line(exc: BaseException, limit: int = 200) -> str:
    return sentences(exc, limit) or type(exc).__name__


def user_code_error(exc: BaseException) -> MemlensError | None:
    """A one-line error that blames the user's own code, or None when the traceback has none of it."""
    d = describe(exc)
    if d is None:
        return None
    who, where = d
    return MemlensError(f"{who} raised {type(exc).__name__}: {first_line(exc)} ({where})",
                        hint="fix it in your code: memlens runs it as written (--debug shows the whole traceback)")
