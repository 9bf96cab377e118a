"""Atomic files (checkpoints and every file a command writes: a hidden file, fsync, rename) and checkpoints loaded
with weights_only=True."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ddcl_vq.common.errors import UserError

KEEP_PERIODIC = 3


class CheckpointError(UserError, RuntimeError):
    """A checkpoint file is missing, truncated or corrupted; the message names the file."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written (a full disk, a file-size limit, ...); the previous one is intact."""


def _os_cause(err: Optional[BaseException]) -> Optional[OSError]:
    """The OSError ``err`` is or was raised from / while handling (torch.save wraps a failed write)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def umask() -> int:
    """The process's file-creation mask (read without changing it for good)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[Path], Any], *, exclusive: bool = False, shared: bool = False) -> None:
    """``write(tmp)`` into a hidden file beside ``path``, synced, then renamed to ``path``: a crash leaves ``path`` as
    it was. ``exclusive``: FileExistsError when ``path`` exists by then; ``shared``: mode 0666 & ~umask."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if shared:
            os.chmod(tmp, 0o666 & ~umask())
        if not exclusive:
            os.replace(tmp, path)
        elif os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        else:
            try:
                os.link(tmp, path)  # fails when another process created path since: no silent overwrite
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                os.replace(tmp, path)  # a file system without hard links: the check above is all there is
    except OSError as err:
        if err.filename in (str(tmp), None):
            raise type(err)(err.errno, err.strerror or str(err), str(path)) from None
        raise
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_file(path: Path, write: Callable[[Path], Any], error: type = UserError, *, exclusive: bool = False,
               shared: bool = False) -> Path:
    """:func:`atomic_write` into ``path``, its folder made first; a failure is one ``error`` that names ``path``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write, exclusive=exclusive, shared=shared)
    except OSError as err:
        if exclusive and isinstance(err, FileExistsError) and err.filename == str(path):
            raise error(f"{str(path)!r} was written by another command meanwhile; pass --overwrite to replace "
                        "it") from None
        kept = "the earlier file is unchanged" if path.exists() else "nothing was written there"
        raise error(f"could not write {str(path)!r} ({err.strerror or err}); {kept}") from None
    return path


def write_json(path: Path, obj: Any, error: type = UserError) -> Path:
    """``obj`` as indented JSON in ``path``, by :func:`write_file`."""
    return write_file(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"), error)


def save_checkpoint(state: Dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` atomically: a crash mid-write leaves the old file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                torch.save(state, f)
        atomic_write(path, write)
    except (OSError, RuntimeError) as err:  # torch.save wraps a failed write in a RuntimeError
        cause = _os_cause(err)
        if cause is None and "PytorchStreamWriter" not in str(err) and "inline_container" not in str(err):
            raise  # not a failed write (the OS refusing: a full disk, a file-size limit): a bug, keep its traceback
        if cause is not None and cause.errno is not None:  # why, in one line
            why = f"{os.strerror(cause.errno)} ({errno.errorcode.get(cause.errno, cause.errno)})"
        else:
            why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [type(err).__name__])[0][:200]}"
        kept = "the previous checkpoint is intact" if path.exists() else "no checkpoint was written"
        raise CheckpointWriteError(f"could not write checkpoint {str(path)!r}: {why}; {kept}. Free "
                                   "disk space (or raise the file-size limit) and run the same command again: it "
                                   "resumes from the last checkpoint") from err


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> Dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; unreadable files raise CheckpointError."""
    path = Path(path)
    if not path.exists():
        if path.is_symlink():  # a loop, or a link to a file that is gone
            reason = "a loop of links" if _loops(path) else f"its target {os.readlink(path)!r} does not exist"
            raise CheckpointError(f"checkpoint {str(path)!r} is a symbolic link that leads to no file ({reason}); "
                                  "replace it with a checkpoint file")
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types for bad files
        if isinstance(err, pickle.UnpicklingError) and "weights only load failed" in str(err).lower():
            # a pickle that asks for Python objects: refused before anything in it ran (never suggest a full load)
            raise CheckpointError(f"checkpoint {str(path)!r} is not a plain checkpoint of tensors: it asks to load "
                                  f"Python objects ({_refused_object(err)}), which loading only weights refuses; it "
                                  "may be malicious and was not loaded (nothing in it ran). Delete it, or replace it "
                                  "with a checkpoint you trust") from None
        raise CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupted and cannot be loaded "
                              f"({type(err).__name__}: {_reason(err)})") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint {str(path)!r}: expected a ddcl-vq training checkpoint "
                              f"(a dict with 'model' and 'step'), got {type(state).__name__}")
    return state


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def _reason(err: BaseException) -> str:
    """The first line of ``err``, without advice to load with ``weights_only`` off (that runs code)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip() and "weights_only" not in line]
    return (lines or [type(err).__name__])[0][:200]


def _refused_object(err: BaseException) -> str:
    """What a weights-only load refused, from torch's message ('unsupported GLOBAL posix.system ...')."""
    for line in str(err).splitlines():
        line = line.strip()
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line.rstrip(".")[:200]
    return "not tensors"


def load_into(target: Any, state: Dict[str, Any], path: Path, what: str = "model") -> None:
    """``target.load_state_dict(state)``; a checkpoint that does not fit what the config built is a CheckpointError."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as err:
        channels = _image_channels(target, state)
        if channels is not None:
            raise CheckpointError(f"checkpoint {str(path)!r} holds a model of {channels[0]}-channel images, the "
                                  f"{what} built from the config takes {channels[1]}-channel images (data.* names "
                                  f"other images than it was trained on); use {channels[0]}-channel images") from None
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        detail = "; ".join(lines[1:3] if len(lines) > 1 else lines)[:300]
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the {what} built from the config "
                              f"(another number of codes, latent size or quantizer?): {detail}") from None


def _image_channels(target: Any, state: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    """(the checkpoint's, the model's) image channels when only the first convolution's input channels differ."""
    if not isinstance(target, torch.nn.Module):
        return None
    own = target.state_dict()
    first = next((name for name, t in own.items() if t.ndim == 4), None)
    saved = state.get(first) if first is not None else None
    if not isinstance(saved, torch.Tensor) or saved.ndim != 4:
        return None
    a, b = tuple(saved.shape), tuple(own[first].shape)
    return (a[1], b[1]) if a[1] != b[1] and a[:1] + a[2:] == b[:1] + b[2:] else None


def periodic_checkpoints(ckpt_dir: Path) -> List[Path]:
    """step_XXXXXXX.pt files, newest first."""
    files = [p for p in Path(ckpt_dir).glob("step_*.pt") if re.fullmatch(r"step_\d+\.pt", p.name)]
    return sorted(files, key=lambda p: int(p.stem.split("_")[1]), reverse=True)


def prune_periodic(ckpt_dir: Path) -> None:
    for old in periodic_checkpoints(ckpt_dir)[KEEP_PERIODIC:]:
        old.unlink(missing_ok=True)


def latest_checkpoint(ckpt_dir: Path, map_location="cpu") -> Optional[Tuple[Dict[str, Any], Path]]:
    """The newest readable checkpoint in ``ckpt_dir`` (state, path), or None; unreadable files are skipped with a
    warning (CheckpointError when all are)."""
    ckpt_dir = Path(ckpt_dir)
    candidates = [p for p in [ckpt_dir / "last.pt"] if os.path.lexists(p)] + periodic_checkpoints(ckpt_dir)
    if not candidates:
        return None
    loaded, errors = [], []
    for path in candidates:
        if not os.path.lexists(path):  # removed since it was listed: a running training pruned (or replaced) it
            continue
        try:
            loaded.append((load_checkpoint(path, map_location), path))
        except CheckpointError as err:
            if not os.path.lexists(path):  # removed while it was being read: the same, quietly
                continue
            errors.append(str(err))
    if not loaded:
        raise CheckpointError("no readable checkpoint in " + str(ckpt_dir) + ": " + "; ".join(errors))
    for err in errors:
        print(f"warning: {err}; trying an older checkpoint", file=sys.stderr)
    return max(loaded, key=lambda item: item[0]["step"])
