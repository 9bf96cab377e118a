"""The run directory: a writable folder, one training at a time (:class:`RunLock`, a ``flock`` on
``RUN_DIR/train.lock`` naming the holder), the metrics a resumed run keeps, a failed start undone."""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Optional

from ddcl_vq.common.checkpoint import atomic_write
from ddcl_vq.common.errors import UserError, one_line

LOCK_NAME = "train.lock"


class RunDirError(UserError, RuntimeError):
    """A run directory cannot be used as asked: not a writable folder, in use, or holding another run."""


def writable_dir(path: Path, what: str = "run.dir") -> Path:
    """Create ``path`` if needed and check a file can be written in it; RunDirError if not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{what} {str(path)!r} is a file, expected a directory (or a path that does not exist yet)")
    if path.is_symlink() and not path.exists():
        raise RunDirError(f"{what} {str(path)!r} is a symbolic link to {os.readlink(path)!r}, which leads to no folder "
                          "(a dangling link or a loop); create its target, remove the link or give another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise RunDirError(f"{what} {str(path)!r} cannot be written ({one_line(err)})") from None
    return path


# ----------------------------------------------------------------------------- lock
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunLock:
    """``RUN_DIR/train.lock`` held while one training runs; ``with RunLock(run_dir): ...``."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: Optional[int] = None

    def _holder(self) -> str:
        """What the lock file says of its holder (OutLock's refusal names it too)."""
        try:
            holder = self.path.read_text().strip()
        except OSError:
            holder = ""
        return holder or "a process that did not write its PID yet"

    def _refuse(self) -> RunDirError:
        return RunDirError(f"run directory {str(self.run_dir)!r} is in use by another training ({self._holder()}); "
                           f"wait for it to end or stop it, or give this one another run.dir (lock file: "
                           f"{str(self.path)!r})")

    def acquire(self) -> "RunLock":
        writable_dir(self.run_dir)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            fcntl = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is None:
                    raise OSError(errno.ENOLCK, "no fcntl")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise self._refuse() from None
                self._pid_check(fd)  # a file system without flock: fall back on the recorded PID
            # the previous holder may have removed the file between our open and our lock: retry
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            since = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode())
            os.fsync(fd)
            self.fd = fd
            return self

    def _pid_check(self, fd: int) -> None:
        text = os.read(fd, 200).decode(errors="replace").split()
        if len(text) >= 4 and text[0] == "pid" and text[1].isdigit():
            pid, host = int(text[1]), text[3].rstrip(",")
            if pid != os.getpid() and (host != socket.gethostname() or _alive(pid)):
                os.close(fd)
                raise self._refuse()
        os.lseek(fd, 0, os.SEEK_SET)

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: who opens the path afterwards gets a new file
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def check_run_dir_setting(run_dir: str) -> Path:
    """``run.dir`` as a Path; RunDirError for an empty one (an unset shell variable in ``run.dir=$DIR``)."""
    if not str(run_dir).strip():
        raise RunDirError("run.dir is empty (an unset variable in run.dir=$DIR?); a run would write config.yaml, "
                          "checkpoints/, tb/ and metrics.jsonl into the current folder. Give the run's folder, e.g. "
                          "run.dir=runs/NAME (run.dir=. to mean the current folder)")
    return Path(run_dir)


def first_missing(path: Path) -> Optional[Path]:
    """The outermost folder of ``path`` (itself or a parent) that does not exist yet, or None."""
    path = Path(path).absolute()
    if path.exists():
        return None
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top


#: what a training writes into a run directory before its first step
_SETUP_FILES = {"config.yaml", "metrics.jsonl", "tb", "checkpoints", LOCK_NAME}


def remove_failed_start(run_dir: Path, created: Optional[Path]) -> None:
    """After a failed training: remove the run directory (and the parents it created) when this command created it
    (``created``: :func:`first_missing`) and it holds nothing but set-up files."""
    import shutil
    run_dir = Path(run_dir).absolute()
    if created is None or not run_dir.is_dir():
        return
    names = {p.name for p in run_dir.iterdir()}
    metrics, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    if (not names <= _SETUP_FILES or (metrics.is_file() and metrics.stat().st_size > 0)
            or (checkpoints.is_dir() and any(checkpoints.iterdir()))):
        return  # a run that got going: keep everything
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = run_dir.parent
    while folder != created.parent and folder.is_dir():
        try:
            folder.rmdir()  # only when empty
        except OSError:
            break
        folder = folder.parent


def keep_logged_steps(metrics: Path, step: int) -> None:
    """Before a run resumes at ``step``: drop the lines of ``metrics`` for later steps, and torn lines (atomically)."""
    metrics = Path(metrics)
    if not metrics.is_file():
        return
    lines = metrics.read_text(errors="replace").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
            if int(record["step"]) > step:
                continue
        except (ValueError, KeyError, TypeError):
            continue  # a torn line (the kill cut it) or not a record
        kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        atomic_write(metrics, lambda tmp: tmp.write_text("".join(kept)))
