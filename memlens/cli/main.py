"""`memlens` entry point: dispatches to one module per verb.

Each verb module in this package defines ``add_parser(subparsers)`` and ``run(args) -> int`` and
can be run alone (``python -m memlens.cli.estimate ...``). Bad input raises MemlensError, which
is printed as one line with a hint and exits 2.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import signal
import sys
import threading
import traceback

from ..core.errors import MemlensError
from ..core.usercode import user_code_error
from ..core.version import __version__

# verb -> module name under memlens.cli
VERBS = {
    "estimate": "estimate",
    "profile": "profile",
    "compare": "compare",
    "sweep": "sweep",
    "fit": "fit",
    "doctor": "doctor",
    "watch": "watch",
    "calibrate": "calibrate",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as MemlensError (one line, exit 2). A value that looks like a
    negative number with a unit (``--budget -1GiB``) is read as the option's value, so its type check
    refuses it in words (argparse alone takes it for an option and says "expected one argument")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.?\d+(?:[eE][+-]?\d+)?[A-Za-z]*$")

    def error(self, message: str):  # noqa: D401 - argparse API
        raise MemlensError(message, hint=f"see `{self.prog} --help`")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser of every verb, or with ``verb`` of that verb alone (imports only its module:
    `memlens estimate` loads no doctor, `memlens doctor` no torch)."""
    parser = _Parser(prog="memlens", description="Predict, measure and explain the GPU memory of PyTorch training.")

    parser.add_argument("--version", action="version", version=f"memlens {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for internal errors")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for verb, modname in VERBS.items() if verb not in VERBS else [(verb, VERBS[verb])]:
        try:
            mod = importlib.import_module(f"memlens.cli.{modname}")
        except ModuleNotFoundError as e:
            if e.name == f"memlens.cli.{modname}":
                continue  # verb not built yet
            raise
        _add_debug(mod.add_parser(sub))
    return parser


def _add_debug(parser) -> None:
    """`memlens estimate ... --debug` works as well as `memlens --debug estimate ...` (and under doctor's verbs)."""
    if parser is None:
        return
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for internal errors")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _add_debug(child)


def run_verb(module_run, args) -> int:
    """Run a verb's ``run(args)``, turning MemlensError into one line and exit 2."""
    try:
        return int(module_run(args) or 0)
    except MemlensError as e:
        cause = e.__cause__ or e.__context__
        if cause is not None and _debug(args):   # what the one line summarizes
            traceback.print_exception(cause, file=sys.stderr)
        print(e.render(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:   # main() run in a process of its own handlers (the `memlens` command exits in _exit_now)
        _end_workers()
        print("ERROR: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # the user's own code (a factory, a loss function), or an internal bug: one line unless --debug
        if _debug(args):
            traceback.print_exception(e, file=sys.stderr)
        mine = user_code_error(e)
        if mine is not None:
            print(mine.render(), file=sys.stderr)
            return mine.exit_code
        if _debug(args):
            return 1
        print(f"ERROR: internal error: {type(e).__name__}: {e}  HINT: rerun with --debug and report it", file=sys.stderr)
        return 1


def _end_workers() -> None:
    """The estimator's worker processes (fit, sweep, compare simulate in forks), if it was loaded."""
    scaling = sys.modules.get("memlens.estimator.scaling")
    if scaling is not None:
        scaling.end_workers()


def _debug(args) -> bool:
    return bool(getattr(args, "debug", False) or os.environ.get("MEMLENS_DEBUG"))


def _verb_of(argv: list[str]) -> str | None:
    """The verb an argument list names (the first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(_verb_of(argv))
        args, extra = parser.parse_known_args(argv)
        if extra:
            verb = " ".join(w for w in (getattr(args, "verb", None), getattr(args, "doctor_what", None)) if w)
            raise MemlensError(f"unrecognized arguments: {' '.join(extra)}",
                               hint=f"see `memlens {verb} --help`" if verb else "see `memlens --help`")
    except MemlensError as e:
        print(e.render(), file=sys.stderr)
        return e.exit_code
    if not args.verb:
        parser.print_help()
        return 0
    return run_verb(args.func, args)


def _exit_now(signum, frame) -> None:
    """Ctrl-C or ``kill`` of the ``memlens`` command: the workers ended, one line, exit now (130 / 143).
    Raising KeyboardInterrupt in the main thread instead can land inside a finalizer or a callback that torch's C++
    code runs during a simulation: swallowed there ("Exception ignored in ...") or fatal ("terminate called after
    throwing an instance of 'python_error'"), with more lines than the one. A forked worker that inherited this
    handler ends silently: its parent speaks."""
    code = 143 if signum == signal.SIGTERM else 130
    if os.getpid() != _CLI_PID[0]:
        os._exit(code)
    _end_workers()
    try:
        print("ERROR: terminated (SIGTERM)" if signum == signal.SIGTERM else "ERROR: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(code)


_CLI_PID = [0]   # the `memlens` command's process (cli())


def cli() -> None:
    """The ``memlens`` command: :func:`main`, then an exit that skips the interpreter's last garbage
    collections. With torch and transformers imported they walk millions of objects: about 0.8 s
    of a 6 s estimate on a 2-core machine, for memory the process gives back anyway. Everything is
    still flushed, closed and joined as usual (``atexit`` handlers, finalizers, worker processes);
    objects in reference cycles are just not collected first. Ctrl-C and SIGTERM end it at once (:func:`_exit_now`)."""
    previous = {}
    _CLI_PID[0] = os.getpid()
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _exit_now) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main()
    finally:
        for sig, handler in previous.items():   # a caller's own handlers (cli() run in a test process) come back
            signal.signal(sig, handler)
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    cli()
