"""Progress as a tqdm bar in a terminal or plain lines in a log file (``DDCL_VQ_PROGRESS=bar`` or ``=lines`` forces
one), and numbers as every report writes them (:func:`fmt`)."""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

_NO_SD = object()


def fmt(value: Any, spec: str = "", sd: Any = _NO_SD) -> str:
    """``format(value, spec)``; '—' for None, inf and nan as they are; with ``sd``: 'value ± sd' ('—' for an sd of
    None), e.g. ``fmt(23.312, ".2f", sd=0.1)`` -> '23.31 ± 0.10'."""
    if value is None:
        return "—"
    text = str(value) if isinstance(value, float) and not math.isfinite(value) else format(value, spec)
    return text if sd is _NO_SD else f"{text} ± {fmt(sd, spec)}"


def interactive() -> bool:
    """True when progress should be a redrawn bar: ``DDCL_VQ_PROGRESS`` if set, else stderr is a TTY."""
    forced = os.environ.get("DDCL_VQ_PROGRESS", "").strip().lower()
    if forced in ("bar", "tty"):
        return True
    if forced in ("lines", "log"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``update(n)``, ``set_postfix(**values)``, ``close()``: a tqdm bar on a terminal, else a line
    every ``every`` updates (and one at ``total``) on stderr; ``off``: neither."""

    def __init__(self, total: int, desc: str, unit: str = "it", initial: int = 0, every: int = 1,
                 leave: bool = True, off: bool = False):
        self.total, self.desc, self.unit, self.n = int(total), desc, unit, int(initial)
        self.every, self.bar, self.off = max(int(every), 1), None, off
        self.postfix: dict = {}
        self.start_n, self.last_line, self.t_start = self.n, self.n, time.time()
        if not off and interactive():
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=self.n, desc=desc, unit=unit, dynamic_ncols=True, leave=leave)

    def set_postfix(self, **values) -> None:
        self.postfix = dict(values)
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            return
        due = self.n // self.every > self.last_line // self.every or self.n >= self.total > self.last_line
        if due and not self.off:
            self.last_line = self.n
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = time.time() - self.t_start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {self.unit} {self.n}/{self.total}"]
        if self.total:
            parts[0] += f" ({self.n / self.total:.0%})"
        parts.append(f"{rate:.3g} {self.unit}/s" if rate else f"- {self.unit}/s")
        parts.append(f"elapsed {_clock(elapsed)}")
        if rate and self.total > self.n:
            parts.append(f"eta {_clock((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(" ".join(f"{k}={v}" for k, v in self.postfix.items()))
        return "  ".join(parts)

    def write(self, text: str) -> None:
        """A line of output on stdout that leaves the bar whole (tqdm.write on a terminal)."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
