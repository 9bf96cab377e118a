"""Commands the tools print as hints ("TensorBoard: ...", "full evaluation: ..."), written so that they work when pasted
in any folder: the script from the folder of the running Python (``sys.executable``'s: the virtual environment's
``bin``), else its bare name (found on PATH), and paths made absolute."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def tool(name: str) -> str:
    """The console script ``name`` (``ddcl-vq``, ``tensorboard``) as an absolute path when it sits
    next to the running Python, else ``name``; quoted for a shell."""
    path = Path(sys.executable).parent / name
    return shlex.quote(str(path.absolute())) if path.is_file() and os.access(path, os.X_OK) else name


def where(path: str | os.PathLike) -> str:
    """``path`` made absolute and quoted for a shell."""
    return shlex.quote(str(Path(path).absolute()))


def tensorboard_hint(logdir: str | os.PathLike) -> str:
    return f"{tool('tensorboard')} --logdir {where(logdir)} --host 127.0.0.1"
