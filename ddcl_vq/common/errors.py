"""What every command prints: one-line errors and warnings, stops, and hints that work pasted in any folder.

:func:`entry_point` wraps every command's ``main``: a :class:`UserError`, an OSError or a refused allocation becomes
one line, ``ddcl-vq CMD: error: <message>``, exit status 2 (``--debug``: the traceback); anything else keeps its
traceback. SIGTERM and Ctrl-C end a command with one line and exit status 128 + the signal.
"""
from __future__ import annotations

import functools
import os
import shlex
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

#: the option every command accepts: errors are raised with their traceback instead of one line
DEBUG_FLAG = "--debug"


class UserError(Exception):
    """Something the user asked for cannot be done as asked; the message says what and why."""

    def __init__(self, *args) -> None:
        if len(args) == 1 and isinstance(args[0], str) and "\nOriginal Traceback" in args[0]:
            # re-raised from a DataLoader worker: keep it one line, the original message (its traceback's last line)
            last = [line for line in args[0].strip().splitlines() if line.strip()][-1]
            head, sep, tail = last.partition(": ")
            args = (tail if sep and " " not in head else last,)
        super().__init__(*args)


class Stopped(Exception):
    """A command stopped by SIGTERM or SIGINT; the message says what was kept; ``code`` = 128 + the signal."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class SignalScope:
    """Inside ``with``, SIGTERM and SIGINT go to ``self._handler`` (main thread only); the previous handlers after."""

    previous: Dict[int, Any]

    def __enter__(self):
        self.previous = {}
        try:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handler)
        except ValueError:  # not the main thread: signals stay as they are
            pass
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)


class Diverged(UserError, FloatingPointError):
    """Training produced a loss or features that are not finite (NaN/Inf): the optimisation diverged."""


class DataUnavailable(UserError, RuntimeError):
    """A dataset could not be found or downloaded; the message names the ways to get it."""


class UnreadableImage(DataUnavailable):
    """An image file of an image folder cannot be read or decoded; the message names the file."""


CHECK_HINT = "`ddcl-vq train --config CONFIG --check-data` lists every unreadable image"


def one_line(err: BaseException) -> str:
    """An exception as one line: its message (first line), or its type when it has none."""
    text = str(err).strip()
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.strerror}: {str(err.filename)!r}"
        if err.filename2 is not None:
            text += f" -> {str(err.filename2)!r}"
    return (text.splitlines() or [type(err).__name__])[0]


def out_of_memory(err: BaseException) -> bool:
    """An allocation the machine refused: MemoryError, torch.OutOfMemoryError, the CPU allocator's RuntimeError."""
    return (isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
            or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err)))


def _format_warning(prog: str, formatwarning: Callable, message, category, filename, lineno, line=None) -> str:
    """``warnings.formatwarning`` (``prog`` and the previous one bound): the toolkit's own warnings as one line,
    ``PROG: warning: ...``, any other as before."""
    if "/ddcl_vq/" in str(filename).replace(chr(92), "/"):
        return f"{prog}: warning: {message}\n"
    return formatwarning(message, category, filename, lineno, line)


def _stop_on_sigterm(signum, frame) -> None:
    raise Stopped("stopped by SIGTERM", 128 + signum)


def _failure(prog: str, err: BaseException, debug: bool) -> int:
    """The one line for an error every command turns into exit status 2 (re-raised with ``debug`` or for a bug)."""
    if debug:
        raise err
    if isinstance(err, UserError):
        print(f"{prog}: error: {err}", file=sys.stderr)
    elif isinstance(err, OSError):  # the machine said no: a full disk, a path that cannot be written, ...
        print(f"{prog}: error: {one_line(err)} ({type(err).__name__}; {DEBUG_FLAG} shows the traceback)",
              file=sys.stderr)
    elif out_of_memory(err):  # the machine had no memory left for what was asked
        print(f"{prog}: error: out of memory ({one_line(err)}); ask for less (a smaller model, codebook or batch) "
              f"or free memory ({DEBUG_FLAG} shows the traceback)", file=sys.stderr)
    else:
        raise err
    return 2


def entry_point(prog: str) -> Callable:
    """Decorator for a command's ``main(argv) -> int``, as the module docstring says."""

    def wrap(main: Callable[[Optional[List[str]]], int]) -> Callable[[Optional[List[str]]], int]:
        @functools.wraps(main)
        def run(argv: Optional[List[str]] = None) -> int:
            args = list(sys.argv[1:] if argv is None else argv)
            debug = DEBUG_FLAG in args
            args = [a for a in args if a != DEBUG_FLAG]
            formatwarning = warnings.formatwarning
            warnings.formatwarning = functools.partial(_format_warning, prog, formatwarning)
            main_thread = threading.current_thread() is threading.main_thread()
            sigterm = signal.signal(signal.SIGTERM, _stop_on_sigterm) if main_thread else None
            try:
                return main(args if (debug or argv is not None) else None)
            except KeyboardInterrupt:
                print(f"{prog}: stopped by SIGINT (Ctrl-C)", file=sys.stderr)
                return 128 + signal.SIGINT
            except Stopped as stop:  # not an error: what was kept is said, the same command goes on
                print(f"{prog}: {stop}", file=sys.stderr)
                return stop.code
            except (UserError, OSError, MemoryError, RuntimeError) as err:
                return _failure(prog, err, debug)
            finally:
                warnings.formatwarning = formatwarning
                if main_thread:
                    signal.signal(signal.SIGTERM, sigterm if sigterm is not None else signal.SIG_DFL)
        return run

    return wrap


def tool(name: str) -> str:
    """The console script ``name`` as a quoted absolute path when it sits next to the running Python, else ``name``."""
    path = Path(sys.executable).parent / name
    return shlex.quote(str(path.absolute())) if path.is_file() and os.access(path, os.X_OK) else name


def where(path: str | os.PathLike) -> str:
    """``path`` made absolute and quoted for a shell."""
    return shlex.quote(str(Path(path).absolute()))


def tensorboard_hint(logdir: str | os.PathLike) -> str:
    return f"{tool('tensorboard')} --logdir {where(logdir)} --host 127.0.0.1"
