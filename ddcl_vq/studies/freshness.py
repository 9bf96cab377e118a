"""Which evaluation of a run ``ddcl-vq compare`` (and ``study``) may reuse, and where its own go.

An evaluation is reused only when it was made exactly as asked: from the run's newest checkpoint (same step, name and
bytes), on the same split and number of images, without config overrides. It is looked for and written in
RUN_DIR/eval.json, unless that holds an ``evaluate`` result or cannot be written; else in
``STORE/<run name>-<path hash>.json`` (compare's STORE is ``OUT/evals``).
"""
from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE, evaluate_run, file_digest, write_eval


def current_checkpoint(run_dir: Path) -> Optional[Tuple[int, Path]]:
    """(step, path) of the checkpoint an evaluation of ``run_dir`` would read now, or None."""
    from ddcl_vq.common.checkpoint import CheckpointError, latest_checkpoint
    try:
        found = latest_checkpoint(run_dir / "checkpoints")  # None when there is none (no folder either)
    except CheckpointError:
        return None
    return None if found is None else (int(found[0]["step"]), found[1])


def read_eval(path: Path) -> Optional[Dict]:
    """The evaluation in ``path``, or None when there is none (missing, unreadable, not a dict)."""
    try:
        ev = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return ev if isinstance(ev, dict) else None


def is_fresh(ev: Optional[Dict], checkpoint: Optional[Tuple[int, Path]], split: str, max_images: int,
             overrides: Sequence[str] = ()) -> bool:
    """True when ``ev`` was made from ``checkpoint`` (step, name and content) as asked."""
    if ev is None or checkpoint is None or "overrides" not in ev or "checkpoint_sha256" not in ev:
        return False  # nothing, or written before evaluations recorded what they were made with
    asked = {"split": split, "max_images": max_images, "overrides": list(overrides)}
    if any(ev.get(key) != value for key, value in asked.items()):
        return False
    step, path = checkpoint
    if ev.get("step") != step or Path(str(ev.get("checkpoint"))).name != path.name:
        return False
    try:
        return ev["checkpoint_sha256"] == file_digest(path)
    except OSError:
        return False


def needs_eval(run_dir: Path, split: str, max_images: int, overrides: Sequence[str] = ()) -> bool:
    """True unless RUN_DIR/eval.json was computed exactly as asked (see the module docstring)."""
    run_dir = Path(run_dir)
    return not is_fresh(read_eval(run_dir / "eval.json"), current_checkpoint(run_dir), split, max_images, overrides)


def can_write(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (tried, not judged by permission bits)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            return True
    except OSError:
        return False


def stored_path(store: Path, run_dir: Path) -> Path:
    """``STORE/<run folder name>-<8 hex of its absolute path>.json``: one file per run."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(run_dir).resolve().name) or "run"
    return Path(store) / f"{name}-{key}.json"


def ensure_eval(run_dir: Path, split: str = "test", max_images: int = 0, batch_size: int = EVAL_BATCH_SIZE,
                progress: bool = False, *, store: Optional[Path] = None, command: Optional[str] = None,
                made_by: str = "compare", overrides: Sequence[str] = (), path: Optional[Path] = None) -> Dict:
    """A fresh evaluation of ``run_dir``, reused or made now and written where the module docstring says. With
    ``path`` (a held-out evaluation under data ``overrides``) only that file is looked for and written."""
    run_dir = Path(run_dir)
    checkpoint = current_checkpoint(run_dir)
    for found in [path] if path else [run_dir / "eval.json"] + ([stored_path(store, run_dir)] if store else []):
        ev = read_eval(found)
        if is_fresh(ev, checkpoint, split, max_images, overrides):
            return ev
    ev = evaluate_run(run_dir, split, max_images, batch_size, overrides=list(overrides), progress=progress,
                      write=False, made_by=made_by,
                      command=command or f"ddcl-vq {made_by} (evaluation of {run_dir}: --split {split} --max-images "
                                         f"{max_images} --batch-size {batch_size}{''.join(' ' + o for o in overrides)}"
                                         ")")
    if path is not None:
        write_eval(run_dir, ev, path)
    elif (read_eval(run_dir / "eval.json") or {}).get("made_by") != "evaluate" and can_write(run_dir):
        write_eval(run_dir, ev)
    elif store is not None:
        write_eval(run_dir, ev, stored_path(store, run_dir))
    return ev
