"""The toolkit's one error base class, and what every command does with it.

Errors a user can fix by changing what they asked for (a config key, an option, a missing dataset, an unreadable
checkpoint, a run directory that cannot be evaluated, ...) derive from :class:`UserError`. Every command's ``main`` is
wrapped in :func:`entry_point`, which turns a UserError — or an OSError or refused allocation from the machine (a full
disk, a path that cannot be written, out of memory) — into one line, ``ddcl-vq CMD: error: <message>``, and exit status
2; ``--debug`` (any command) shows the traceback instead. Anything else is a bug and keeps its traceback. The toolkit's
own warnings are printed as one line, ``ddcl-vq CMD: warning: <message>``.
"""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Callable, List, Optional

#: the option every command accepts: errors are raised with their traceback instead of one line
DEBUG_FLAG = "--debug"


def _worker_message(text: str) -> str:
    """The original message of an exception that a DataLoader worker re-raised in the main
    process ('Caught X in DataLoader worker process 0.\\nOriginal Traceback ...\\nmodule.X: msg')."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else text
    head, sep, tail = last.partition(": ")
    return tail if sep and " " not in head else last


class UserError(Exception):
    """Something the user asked for cannot be done as asked; the message says what and why."""

    def __init__(self, *args) -> None:
        if len(args) == 1 and isinstance(args[0], str) and "\nOriginal Traceback" in args[0]:
            args = (_worker_message(args[0]),)  # re-raised from a DataLoader worker: keep it one line
        super().__init__(*args)


class Stopped(Exception):
    """A training stopped by SIGTERM or SIGINT after saving a checkpoint (:mod:`ddcl_vq.common.skeleton`);
    the message says where and how to resume; ``code`` = 128 + the signal, the exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Diverged(UserError, FloatingPointError):
    """Training produced a loss or features that are not finite (NaN/Inf): the optimisation diverged."""


def one_line(err: BaseException) -> str:
    """An exception as one line: its message (first line), or its type when it has none."""
    text = str(err).strip()
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.strerror}: {str(err.filename)!r}"
        if err.filename2 is not None:
            text += f" -> {str(err.filename2)!r}"
    return (text.splitlines() or [type(err).__name__])[0]


def out_of_memory(err: BaseException) -> bool:
    """An allocation the machine refused: MemoryError, torch.OutOfMemoryError (a GPU), or the CPU
    allocator's RuntimeError ("can't allocate memory")."""
    return (isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
            or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err)))


def _one_line_warnings(prog: str, formatwarning: Callable) -> Callable:
    """A ``warnings.formatwarning`` that writes the toolkit's own warnings as one line, ``PROG: warning: ...``
    (Python's form is two: the file and line, then the source line); other warnings as ``formatwarning`` does."""

    def format_warning(message, category, filename, lineno, line=None):
        if "/ddcl_vq/" in str(filename).replace(chr(92), "/"):
            return f"{prog}: warning: {message}\n"
        return formatwarning(message, category, filename, lineno, line)
    return format_warning


def entry_point(prog: str) -> Callable:
    """Decorator for a command's ``main(argv) -> int``: UserError or OSError -> ``PROG: error: ...``
    on stderr, exit status 2; ``--debug`` anywhere in argv: the traceback instead."""

    def wrap(main: Callable[[Optional[List[str]]], int]) -> Callable[[Optional[List[str]]], int]:
        @functools.wraps(main)
        def run(argv: Optional[List[str]] = None) -> int:
            args = list(sys.argv[1:] if argv is None else argv)
            debug = DEBUG_FLAG in args
            args = [a for a in args if a != DEBUG_FLAG]
            formatwarning = warnings.formatwarning
            warnings.formatwarning = _one_line_warnings(prog, formatwarning)
            try:
                return main(args if (debug or argv is not None) else None)
            except Stopped as stop:  # not an error: the checkpoint is saved, the same command resumes
                print(f"{prog}: {stop}", file=sys.stderr)
                return stop.code
            except UserError as err:
                if debug:
                    raise
                print(f"{prog}: error: {err}", file=sys.stderr)
                return 2
            except OSError as err:  # the machine said no: a full disk, a path that cannot be written, ...
                if debug:
                    raise
                print(f"{prog}: error: {one_line(err)} ({type(err).__name__}; {DEBUG_FLAG} shows the traceback)",
                      file=sys.stderr)
                return 2
            except (MemoryError, RuntimeError) as err:  # the machine had no memory left for what was asked
                if debug or not out_of_memory(err):
                    raise
                print(f"{prog}: error: out of memory ({one_line(err)}); ask for less (a smaller model, codebook or "
                      f"batch) or free memory ({DEBUG_FLAG} shows the traceback)", file=sys.stderr)
                return 2
            finally:
                warnings.formatwarning = formatwarning
        return run

    return wrap
