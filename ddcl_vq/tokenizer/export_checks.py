"""What both export formats share (:mod:`.export`, the ddcl-vq folder; :mod:`.export_diffusers`, a
plain diffusers ``VQModel`` folder): the error they raise and the fixed batch the written folder is
checked on before the command returns."""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ddcl_vq.common.errors import UserError


class ExportError(UserError, RuntimeError):
    """The run cannot be exported as asked (output folder in the way, upload failed, ...)."""


#: the files each export format writes into OUT_DIR; an export that replaces an earlier one
#: (``--overwrite``) removes the files of the other format, so one folder never holds two models
EXPORT_FILES = {"ddcl-vq": ("config.json", "model.safetensors", "README.md"),
                "diffusers": ("config.json", "diffusion_pytorch_model.safetensors", "README.md")}


def umask() -> int:
    """The process's file-creation mask (read without changing it for good)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_parents(out_dir: Path) -> None:
    """Before any work: an ExportError when a file stands where a folder above ``out_dir`` must be."""
    blocking = next((p for p in out_dir.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ExportError(f"OUT_DIR {str(out_dir)!r} cannot be written: {str(blocking)!r} is a file, not a folder")


def check_out_dir(run_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """Before any work: ``out_dir`` is a folder that may be written (empty, or ``overwrite``), not the run's."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{str(out_dir)!r} exists and is not a folder")
    check_parents(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{str(out_dir)!r} is not empty; pass --overwrite to replace an earlier export there")
    if out_dir.resolve() == run_dir.resolve():
        raise ExportError("OUT_DIR must not be the run directory")


def staging_folder(out_dir: Path) -> Path:
    """A new hidden folder beside ``out_dir`` to write and check an export in before it is moved into place
    (a full disk or a failed check then leaves OUT_DIR as it was)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))


def move_into_place(staging: Path, out_dir: Path, files: Sequence[str]) -> None:
    """Move the checked export ``files`` from ``staging`` into ``out_dir``, readable like any file the user writes
    (mkdtemp and some writers use 0700 / 0600); over an earlier export, the other format's files are removed."""
    mask = umask()
    os.chmod(staging, 0o777 & ~mask)  # an export is for sharing
    for name in files:
        os.chmod(staging / name, 0o666 & ~mask)
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    for name in files:
        os.replace(staging / name, out_dir / name)
    stale = {name for names in EXPORT_FILES.values() for name in names} - set(files)
    for name in sorted(stale):
        (out_dir / name).unlink(missing_ok=True)


def check_inputs(model, cfg) -> torch.Tensor:
    """A fixed batch to check the export on: the first test images, or seeded noise offline."""
    from ddcl_vq.common.data import build_dataset, image_channels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            test = build_dataset(cfg.data, "test", cfg.run.seed)
        return torch.stack([test[i][0] for i in range(min(16, len(test)))])
    except UserError:
        g = torch.Generator().manual_seed(0)
        size = cfg.data.image_size
        return torch.rand(16, image_channels(cfg.data), size, size, generator=g)
