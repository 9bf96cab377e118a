"""Token files: the hard code indices of a dataset split, readable without ddcl-vq.

``.npy``: FILE holds the indices (N, h, w); the labels, when the dataset has them, go to ``<FILE without
.npy>.labels.npy`` (N,) int64. Read with ``numpy.load``.

``.safetensors``: tensors ``indices`` (N, h, w) (required: a file without it is refused, whatever else it holds) and
``labels`` (N,) int64 (when present), and string metadata (``num_codes``, ``run``, ``split``, ``step``, ...). Read with
``safetensors.numpy.load_file`` (or ``safetensors.torch.load_file``).

The indices' dtype is the smallest unsigned integer type that holds K codes: uint8 for K ≤ 256, uint16 for K ≤ 65,536,
else uint32.
"""
from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from ddcl_vq.common.errors import UserError

SUFFIXES = (".npy", ".safetensors")


class TokenFileError(UserError, ValueError):
    """A token file cannot be written or read as asked."""


def index_dtype(num_codes: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds indices 0 … K−1."""
    if num_codes <= 0:
        raise ValueError(f"expected num_codes > 0, got {num_codes}")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if num_codes - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def check_suffix(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise TokenFileError(f"expected a token file ending in {' or '.join(SUFFIXES)}, got {str(path)!r}")
    return path


def check_out(path: str | Path, what: str, overwrite: bool = True) -> Path:
    """``path`` checked before any work as a file a command may write: not a folder, no file in the way of its
    folder (a bare "File exists" after the work otherwise), and, unless ``overwrite``, not there yet (with
    the labels file of a .npy token file)."""
    path = Path(path)
    if path.is_dir():
        raise TokenFileError(f"{what} {str(path)!r} is a folder; expected a file name")
    blocking = next((p for p in path.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise TokenFileError(f"{what} {str(path)!r} cannot be written: {str(blocking)!r} is a file, not a folder")
    if not overwrite and path.exists():
        labels = labels_path(path) if path.suffix == ".npy" else None
        extra = f" (and its labels {labels.name})" if labels is not None and labels.exists() else ""
        raise TokenFileError(f"{what} {str(path)!r} exists; pass --overwrite to replace it{extra}")
    return path


def labels_path(path: str | Path) -> Path:
    """Where a .npy token file's labels live: train.npy -> train.labels.npy."""
    path = Path(path)
    return path.with_name(path.name[:-len(".npy")] + ".labels.npy")


def _atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename tmp -> path: a failure (a full disk) leaves ``path`` as it was."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600; a token file is for sharing
        os.replace(tmp, path)
    except OSError as err:
        raise TokenFileError(f"could not write {str(path)!r} ({err.strerror or err}); nothing was written "
                             "there") from None
    finally:
        tmp.unlink(missing_ok=True)


def write_tokens(path: str | Path, indices: np.ndarray, labels: Optional[np.ndarray] = None,
                 metadata: Optional[Dict] = None) -> list[Path]:
    """Write ``indices`` (and ``labels``) to ``path`` (.npy or .safetensors), each file atomically;
    returns the paths written. ``metadata`` goes into the safetensors header (values as strings)."""
    path = check_suffix(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        def save(array):
            def write(tmp):
                # numpy's own writer can cut a file short on a full disk without an error: write the
                # bytes through Python (which raises), sync, and check the size
                buffer = io.BytesIO()
                np.save(buffer, array)
                data = buffer.getbuffer()
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if os.path.getsize(tmp) != len(data):  # pragma: no cover - the write above raises first
                    raise OSError(errno.ENOSPC, f"wrote {os.path.getsize(tmp)} of {len(data)} bytes", str(tmp))
            return write
        _atomic(path, save(indices))
        if labels is not None:
            _atomic(labels_path(path), save(labels))
        else:
            labels_path(path).unlink(missing_ok=True)  # not a stale one from an earlier run
        return [path] + ([labels_path(path)] if labels is not None else [])
    from safetensors import SafetensorError
    from safetensors.numpy import save_file
    tensors = {"indices": np.ascontiguousarray(indices)}
    if labels is not None:
        tensors["labels"] = np.ascontiguousarray(labels)
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    try:
        _atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    except SafetensorError as err:  # an I/O error inside safetensors (a full disk, a file size limit)
        raise TokenFileError(f"could not write {str(path)!r} ({str(err).strip()[:200]})") from None
    return [path]


def read_tokens(path: str | Path) -> Tuple[np.ndarray, Optional[np.ndarray], Dict[str, str]]:
    """-> (indices, labels or None, metadata) from a .npy or .safetensors token file. A .npy file
    may hold any integer array (e.g. what a prior sampled); its labels are read when present."""
    path = check_suffix(path)
    if not path.is_file():
        raise TokenFileError(f"token file {str(path)!r} does not exist")
    from safetensors import SafetensorError
    try:
        if path.suffix == ".npy":
            indices = np.load(path, allow_pickle=False)
            lp = labels_path(path)
            labels = np.load(lp, allow_pickle=False) if lp.is_file() else None
            return indices, labels, {}
        from safetensors import safe_open
        from safetensors.numpy import load_file
        with safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (OSError, ValueError, EOFError, SafetensorError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise TokenFileError(f"cannot read token file {str(path)!r}: not a {path.suffix} token file or cut off "
                             f"({first})") from None
    if "indices" not in tensors:  # never another tensor in its place: labels would be read as codes
        raise TokenFileError(f"token file {str(path)!r} has no 'indices' tensor (it holds "
                             f"{', '.join(repr(name) for name in sorted(tensors)) or 'no tensors'}); a .safetensors "
                             "token file holds the code maps as 'indices' (N, h, w) and, optionally, 'labels' (N,), "
                             "as ddcl-vq tokenize writes them")
    return tensors["indices"], tensors.get("labels"), metadata
