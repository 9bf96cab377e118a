"""The toolkit's one error base class, and what every command does with it.

Errors a user can fix by changing what they asked for (a config key, an option, a missing
dataset, an unreadable checkpoint, a run directory that cannot be evaluated, ...) derive from
:class:`UserError`. Every command's ``main`` is wrapped in :func:`entry_point`, which turns a
UserError into one line, ``ddcl-vq CMD: error: <message>``, and exit status 2; anything
else is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, List, Optional


class UserError(Exception):
    """Something the user asked for cannot be done as asked; the message says what and why."""


def entry_point(prog: str) -> Callable:
    """Decorator for a command's ``main(argv) -> int``: UserError -> ``PROG: error: ...`` on stderr, 2."""

    def wrap(main: Callable[[Optional[List[str]]], int]) -> Callable[[Optional[List[str]]], int]:
        @functools.wraps(main)
        def run(argv: Optional[List[str]] = None) -> int:
            try:
                return main(argv)
            except UserError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return 2
        return run

    return wrap
