"""The run directory: usable (a writable folder), one training at a time, resumed only as the same run.

- :func:`writable_dir` checks a folder can be created and written before any expensive work (training, ``evaluate``,
  ``compare``), so a bad path fails at once with one line.
- :class:`RunLock` holds ``RUN_DIR/train.lock`` (an advisory ``flock`` on a file that names the holder's PID and host)
  while a training runs: a second training in the same folder is refused, naming that PID; the kernel drops the lock
  when its process ends, however it ends (kill -9 included), so a lock left by a process that is gone is taken over.
- :func:`check_resume` compares the config a checkpoint was trained with (resolved, old keys migrated) with the config
  asked for now: only :data:`RESUMABLE` keys may change; anything that changes the model, the optimisation, the data or
  a schedule is refused with the list of differing keys.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .config import Config, differences, load_config, migrate_renamed
from .errors import UserError, one_line
from .settings import ConfigError

LOCK_NAME = "train.lock"

#: settings that may change when a run resumes: how long it trains, what it logs and keeps, where it runs (train.steps:
#: not below the steps already trained; data.root: not for image_folder, where it is the data itself)
RESUMABLE = ("train.steps", "train.log_every", "train.image_every", "train.checkpoint_every", "train.eval_images",
             "train.usage_window", "train.device", "train.threads", "data.num_workers", "data.download", "data.root", "run.dir",
             "run.name", "quantizer.implementation")


class RunDirError(UserError, RuntimeError):
    """A run directory cannot be used as asked: not a writable folder, in use by another training,
    or holding a run trained with another config."""


def writable_dir(path: Path, what: str = "run.dir") -> Path:
    """Create ``path`` (and parents) if needed and check a file can be written in it; RunDirError if not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{what} {str(path)!r} is a file, expected a directory (or a path that does not exist yet)")
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
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        return text or "a process that did not write its PID yet"

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


# ----------------------------------------------------------------------------- resume
def saved_config(state: Dict[str, Any], run_dir: Path) -> Optional[Config]:
    """The resolved config a checkpoint was trained with (old keys migrated as for its config.yaml);
    from RUN_DIR/config.yaml for a checkpoint that does not store it; None when neither exists."""
    raw = state.get("config")
    try:
        if isinstance(raw, dict):
            return Config.from_dict(migrate_renamed(raw), saved=True)
        if (run_dir / "config.yaml").is_file():
            return load_config(run_dir / "config.yaml", migrate=True)
    except ConfigError as err:
        raise RunDirError(f"run directory {str(run_dir)!r}: the config its checkpoint was trained with cannot be "
                          f"read by this version ({err}); start a new run with another run.dir") from None
    return None


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_resume(saved: Config, cfg: Config, trained_steps: int, run_dir: Path) -> List[str]:
    """Refuse (RunDirError) to resume a run trained with ``saved`` under ``cfg`` when they differ in
    anything but :data:`RESUMABLE` keys; -> notes about allowed changes worth knowing."""
    refused, notes, fewer = [], [], None  # changes refused (key, old, new); notes; a train.steps below the steps done
    for key, old, new in differences(saved, cfg):
        if key not in RESUMABLE or (key == "data.root" and cfg.data.name == "image_folder"):
            refused.append((key, old, new))
        elif key == "train.steps" and new < trained_steps:
            fewer = (key, old, new)
        elif key == "train.steps":
            stretched = [what for what, on in (("the cosine learning-rate schedule", cfg.train.lr_schedule == "cosine"),
                                               ("the temperature schedule", cfg.quantizer.type == "ddcl"
                                                and cfg.quantizer.temperature_schedule != "constant")) if on]
            if stretched:
                notes.append(f"train.steps {old} -> {new}: {' and '.join(stretched)} "
                             f"{'was' if len(stretched) == 1 else 'were'} laid out for {old} steps; the learning rate "
                             f"follows {new} steps from here (a temperature schedule stays where it ended)")
    if fewer and not refused:
        raise RunDirError(f"run directory {str(run_dir)!r} holds a run that has trained {trained_steps} steps; "
                          f"train.steps={fewer[2]} is fewer. Give train.steps >= {trained_steps}, or another run.dir "
                          "for a new run")
    if refused:
        refused += [fewer] if fewer else []
        changes = ", ".join(f"{key} {_fmt(old)} -> {_fmt(new)}" for key, old, new in refused)
        allowed = ", ".join(k if k != "train.steps" else f"train.steps (at least {trained_steps})" for k in RESUMABLE)
        raise RunDirError(
            f"run directory {str(run_dir)!r} holds a run trained {trained_steps} steps with another config; resuming "
            f"it would mix the two ({changes}). Only these may change on resume: {allowed}. To train with the new "
            f"settings, start a new run (another run.dir, or delete {str(run_dir)!r}); to continue this run as it "
            f"was: ddcl-vq train --config {str(run_dir / 'config.yaml')}")
    return notes


def finished_summary(run_dir: Path, step: int, cfg: Config) -> Optional[Dict[str, Any]]:
    """RUN_DIR/summary.json when it describes the run finished at ``step`` completely (with its
    end-of-run evaluation when train.eval_images > 0); None when something is left to do."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("step") != step or "evaluation_error" in summary:
        return None
    if summary.get("eval_images", cfg.train.eval_images) != cfg.train.eval_images:
        return None  # asked for another evaluation
    return None if cfg.train.eval_images > 0 and summary.get("hard") is None else summary


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


# ----------------------------------------------------------------------------- which folder
def run_dir_of_config(config_path: str | Path) -> Optional[Path]:
    """The run directory a config file belongs to: ``RUN_DIR`` when ``config_path`` is
    ``RUN_DIR/config.yaml`` next to the run's ``checkpoints/`` or ``metrics.jsonl``; else None."""
    path = Path(config_path)
    folder = path.parent
    if path.name != "config.yaml" or not path.is_file():
        return None
    return folder if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file() else None


def follow_run_dir(cfg: Config, config_path: str | Path, overrides: Sequence[str] = ()) -> Optional[str]:
    """The rule for ``--config RUN_DIR/config.yaml``: continue THAT run directory.

    A run's config.yaml names the folder it was trained in (``run.dir``); after ``cp -a`` or ``mv``
    that name is stale (it points to the original, or to nothing), so when the config file lives in
    a run directory (:func:`run_dir_of_config`) and no ``run.dir=...`` override is given, ``cfg.run.dir``
    becomes that directory. An explicit ``run.dir=`` override always wins. -> a note to print when
    the saved run.dir was not that folder (None when it was, or when the rule does not apply)."""
    folder = run_dir_of_config(config_path)
    if folder is None or any(text.split("=", 1)[0].strip() == "run.dir" for text in overrides):
        return None
    saved = cfg.run.dir
    if saved.strip() and Path(saved).resolve() == folder.resolve():
        return None
    cfg.run.dir = str(folder)
    return (f"{str(Path(config_path))!r} says run.dir {saved!r}, but it lives in the run directory {str(folder)!r} "
            f"(a copied or moved run): training {str(folder)!r}, the run this config belongs to (give run.dir=... "
            "to train another folder)")


def check_run_dir_setting(run_dir: str) -> Path:
    """``run.dir`` as a Path; RunDirError for an empty one (an unset shell variable in ``run.dir=$DIR``):
    it would mean the current folder, and a run writes config.yaml, checkpoints/, tb/ there."""
    if not str(run_dir).strip():
        raise RunDirError("run.dir is empty (an unset variable in run.dir=$DIR?); a run would write config.yaml, "
                          "checkpoints/, tb/ and metrics.jsonl into the current folder. Give the run's folder, e.g. "
                          "run.dir=runs/NAME (run.dir=. to mean the current folder)")
    return Path(run_dir)


def first_missing(path: Path) -> Optional[Path]:
    """The outermost folder of ``path`` (itself or a parent) that does not exist yet: what creating
    ``path`` creates (None when ``path`` exists)."""
    path = Path(path).absolute()
    if path.exists():
        return None
    top = path
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    return top


#: what a training writes into a run directory before its first step
_SETUP_FILES = {"config.yaml", "metrics.jsonl", "tb", "checkpoints", LOCK_NAME}


def remove_failed_start(run_dir: Path, created: Optional[Path]) -> bool:
    """After a training failed: remove the run directory when this command created it (``created``,
    from :func:`first_missing` before) and the run never got going — no checkpoint and no metrics
    line, nothing but what set-up writes — with the parent folders it created; -> whether it did.
    A run that trained (a checkpoint, or a metrics line that shows why it failed) is kept."""
    import shutil
    run_dir = Path(run_dir).absolute()
    if created is None or not run_dir.is_dir():
        return False
    names = {p.name for p in run_dir.iterdir()}
    metrics = run_dir / "metrics.jsonl"
    if not names <= _SETUP_FILES or (metrics.is_file() and metrics.stat().st_size > 0):
        return False
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = run_dir.parent
    while folder != created.parent and folder.is_dir():
        try:
            folder.rmdir()  # only when empty
        except OSError:
            break
        folder = folder.parent
    return not run_dir.exists()


def keep_logged_steps(metrics: Path, step: int) -> None:
    """Before a run resumes from its checkpoint at ``step``: drop the lines of ``metrics``
    (metrics.jsonl) for later steps — the killed session logged them, the resumed one logs them
    again — and a line cut short by the kill. Rewritten atomically; nothing to do when every line is kept."""
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
    if kept == lines:
        return
    tmp = metrics.with_name(f".{metrics.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text("".join(kept))
        os.replace(tmp, metrics)
    finally:
        tmp.unlink(missing_ok=True)
