"""Encode every image of a dataset split with a trained model and write the hard code indices,
N x h x w in the smallest unsigned integer type that holds K (uint8 for K <= 256, uint16 for
K <= 65,536), with the labels when the dataset has them:

  FILE.npy          indices; labels in FILE.labels.npy      numpy.load(FILE)
  FILE.safetensors  tensors 'indices' and 'labels' + metadata  safetensors.numpy.load_file(FILE)

MODEL is a run directory, a folder written by `ddcl-vq export`, or its Hub id (user/name): an
export names its dataset (name, image size), and data.* overrides say where it lives here.
Dotted overrides change the run's config for this command only (e.g. data.root=/path).

  ddcl-vq tokenize runs/fashion_ddcl --split train --out tokens/fashion_train.npy
  ddcl-vq tokenize exported/fashion_ddcl --split test --out tokens/fashion_test.safetensors
  ddcl-vq decode runs/fashion_ddcl tokens/fashion_train.npy --out first64.png
"""
# Also: the token files, and the models the token commands and train.init_from read.
from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ddcl_vq.models import VQVAE

from ddcl_vq.common.checkpoint import write_file
from ddcl_vq.common.config import ConfigError, Options, Rules, option
from ddcl_vq.common.data import (SPLITS, DataUnavailable, SequentialBatches, build_dataset, image_channels, make_loader,
                                 resolve_workers)
from ddcl_vq.common.errors import Stopped, UserError, entry_point, one_line
from ddcl_vq.common.progress import Progress
from ddcl_vq.common.threads import set_threads, threads_option
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE, load_run

SUFFIXES = (".npy", ".safetensors")
NPY_MAGIC = b"\x93NUMPY"


class TokenFileError(UserError, ValueError):
    """A token file cannot be written or read as asked."""


class ModelSourceError(UserError, ValueError):
    """Neither a run directory nor an exported model folder nor a loadable Hub id."""


# ----------------------------------------------------------------------------- token files
def index_dtype(num_codes: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds indices 0 … K−1."""
    if num_codes <= 0:
        raise ValueError(f"expected num_codes > 0, got {num_codes}")
    return next(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64) if num_codes - 1 <= np.iinfo(t).max)


def check_suffix(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise TokenFileError(f"expected a token file ending in {' or '.join(SUFFIXES)}, got {str(path)!r}")
    return path


def check_out(path: str | Path, what: str, overwrite: bool = True, suffix: Optional[str] = None) -> Path:
    """``path`` checked before any work as a file a command may write (ending in ``suffix``; unless ``overwrite``,
    not there yet)."""
    path = Path(path)
    if suffix is not None and path.suffix.lower() != suffix:
        raise TokenFileError(f"expected {what} to end in {suffix}, got {str(path)!r}")
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


def write_tokens(path: str | Path, indices: np.ndarray, labels: Optional[np.ndarray] = None,
                 metadata: Optional[Dict] = None, exclusive: bool = False) -> list[Path]:
    """Write ``indices`` (N, h, w) (and ``labels`` (N,)) to ``path`` (.npy or .safetensors) atomically; -> the paths
    written. ``metadata``: the safetensors header; ``exclusive``: refuse to replace a file written since."""
    path = check_suffix(path)
    if path.suffix == ".npy":
        def save(array):  # the bytes through Python (whose write raises on a full disk; numpy's may not)
            buffer = io.BytesIO()
            np.save(buffer, array)
            return lambda tmp: tmp.write_bytes(buffer.getbuffer())
        write_file(path, save(indices), TokenFileError, exclusive=exclusive, shared=True)
        if labels is not None:
            write_file(labels_path(path), save(labels), TokenFileError, shared=True)
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
        write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), TokenFileError, exclusive=exclusive,
                   shared=True)
    except SafetensorError as err:  # an I/O error inside safetensors (a full disk, a file size limit)
        raise TokenFileError(f"could not write {str(path)!r} ({str(err).strip()[:200]})") from None
    return [path]


def _load_npy(path: Path) -> np.ndarray:
    with open(path, "rb") as f:
        if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
            raise TokenFileError(f"cannot read token file {str(path)!r}: it is not a .npy file (it does not begin "
                                 f"with numpy's header, {NPY_MAGIC!r}; {path.stat().st_size:,} bytes)")
    return np.load(path, allow_pickle=False)


def read_tokens(path: str | Path) -> Tuple[np.ndarray, Optional[np.ndarray], Dict[str, str]]:
    """-> (indices, labels or None, metadata) from a .npy or .safetensors token file."""
    path = check_suffix(path)
    if not path.is_file():
        raise TokenFileError(f"token file {str(path)!r} does not exist")
    from safetensors import SafetensorError, safe_open
    try:
        if path.suffix == ".npy":
            lp = labels_path(path)
            return _load_npy(path), (_load_npy(lp) if lp.is_file() else None), {}
        with safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, EOFError, SafetensorError) as err:
        if isinstance(err, TokenFileError):
            raise
        raise TokenFileError(f"cannot read token file {str(path)!r}: not a {path.suffix} token file or cut off "
                             f"({one_line(err)[:200]})") from None
    if "indices" not in tensors:  # never another tensor in its place: labels would be read as codes
        raise TokenFileError(f"token file {str(path)!r} has no 'indices' tensor (it holds "
                             f"{', '.join(repr(name) for name in sorted(tensors)) or 'no tensors'}); a .safetensors "
                             "token file holds the code maps as 'indices' (N, h, w) and, optionally, 'labels' (N,), "
                             "as ddcl-vq tokenize writes them")
    return tensors["indices"], tensors.get("labels"), metadata


# ----------------------------------------------------------------------------- models
#: what a Hugging Face Hub model id looks like (``user/name``), as opposed to a local path
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _kind(source: str, where: str) -> str:
    """'run' (config.yaml, or a missing path that is no Hub id), 'export' (config.json) or 'hub' (user/name)."""
    path = Path(source)
    if path.is_dir():
        if (path / "diffusion_pytorch_model.safetensors").is_file():
            raise ModelSourceError(f"{where} is a diffusers folder (ddcl-vq export --format diffusers, for "
                                   "diffusers.VQModel.from_pretrained); give the run directory, or its ddcl-vq export "
                                   "(ddcl-vq export RUN_DIR OUT_DIR, the default format)")
        if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
            return "export"
        if not (path / "config.yaml").is_file():
            raise ModelSourceError(f"{where} is a folder without config.json: neither a run directory (config.yaml) "
                                   "nor an exported model (ddcl-vq export writes config.json + model.safetensors)")
        return "run"
    if path.exists():
        raise ModelSourceError(f"{where} is a file; expected a folder written by ddcl-vq export or ddcl-vq train, or "
                               "a Hub id")
    return "hub" if HUB_ID.match(source) else "run"


def _from_pretrained(source: str, where: str) -> VQVAE:
    try:
        return VQVAE.from_pretrained(source)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ModelSourceError(f"cannot load the exported model {where}: {one_line(err)[:300]}") from None
    except Exception as err:  # noqa: BLE001 - huggingface_hub's errors (offline, not found, auth) have no common base
        if type(err).__module__.startswith("huggingface_hub"):
            raise ModelSourceError(f"cannot load the exported model {where} ({type(err).__name__}: "
                                   f"{one_line(err)[:300]})") from None
        raise


def run_data(cfg, model) -> dict:
    """``config["data"]`` of an export (``ddcl-vq export`` writes it; a model loaded from a run directory gets it)."""
    channels = image_channels(cfg.data)
    with torch.no_grad():
        grid = model.encoder(torch.zeros(1, channels, cfg.data.image_size, cfg.data.image_size)).shape[-2:]
    return {"name": cfg.data.name, "image_size": cfg.data.image_size, "channels": channels, "seed": cfg.run.seed,
            "latent_size": int(grid[0]) if grid[0] == grid[1] else [int(grid[0]), int(grid[1])], "range": [0.0, 1.0]}


def load_source(source: str | Path, overrides=(), device="cpu") -> Tuple[VQVAE, Optional[object], dict]:
    """-> (model in eval mode, the run's config or None for an export, {"kind": run/export/hub, "step", ...})."""
    kind = _kind(str(source), repr(str(source)))
    if kind != "run":
        where = f"in {str(source)!r}" if kind == "export" else \
            f"{str(source)!r} (not a folder here, so read as a Hugging Face Hub id)"
        model = _from_pretrained(str(source), where)
        return model.to(device).eval(), None, {"kind": kind, "step": (model.config.get("source") or {}).get("step")}
    cfg, model, step, ckpt = load_run(source, overrides, "cpu")
    model.config = dict(model.config or {}, data=run_data(cfg, model))
    return model.to(device).eval(), cfg, {"kind": "run", "step": step, "checkpoint": ckpt}


def load_model(source: str | Path, device="cpu") -> VQVAE:
    """-> model in eval mode on ``device``, from a run directory, an exported folder or a Hub id."""
    return load_source(source, (), device)[0]


#: quantizer state that belongs to the run, not to the weights: a run started from an export starts its own
NEW_RUN_STATE = ("quantizer.schedule", "quantizer.schedule_step", "quantizer.revived")
#: config.json keys that are no training config key -> the one that sets them
CONFIG_KEYS = {"model.in_channels": "data.name (channels)", "model.resolution": "data.image_size"}


def _shape_differences(exported: Dict, built: Dict) -> List[str]:
    """'config key: export X, this config Y' for every model size, the quantizer type and K that differ."""
    def flat(config: Dict) -> Dict:
        q = config.get("quantizer") or {}
        return {**{f"model.{k}": v for k, v in (config.get("model") or {}).items()},
                **{f"quantizer.{k}": q.get(k) for k in ("type", "num_codes")}}
    a, b = flat(exported), flat(built)
    return [f"{CONFIG_KEYS.get(k, k)}: export {a.get(k)!r}, this config {b.get(k)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def init_from_export(model: nn.Module, source: str) -> None:
    """``train.init_from``: load the exported model ``source`` (folder or Hub id) into ``model``: its weights and
    quantizer state but :data:`NEW_RUN_STATE`. An export of another shape is a ConfigError naming what differs."""
    where = f"train.init_from {source!r}"
    kind = _kind(str(source), where)
    if kind == "run" and Path(source).exists():
        raise ModelSourceError(f"{where} is a run directory, not an exported model: export it first (ddcl-vq export "
                               f"{source} OUT_DIR) and give train.init_from=OUT_DIR")
    if kind == "run":
        raise ModelSourceError(f"{where}: no such folder here, and not a Hugging Face Hub id (user/name) either; give "
                               "the folder ddcl-vq export wrote, or its Hub id")
    read_as = " (not a folder here, so read as a Hugging Face Hub id)" if kind == "hub" else ""
    with torch.random.fork_rng(devices=[]):  # building it draws initial weights: not from the run's RNG stream
        exported = _from_pretrained(source, where + read_as)
    state, own = exported.state_dict(), model.state_dict()
    misfit = sorted(k for k in set(state) | set(own)
                    if k not in state or k not in own or state[k].shape != own[k].shape)
    if misfit:
        diffs = _shape_differences(exported.config or {}, getattr(model, "config", None) or {})
        detail = "; ".join(diffs[:6]) if diffs else f"tensors {', '.join(misfit[:3])} differ"
        raise ConfigError(f"{where}: the exported model has another shape than this config's model ({detail}); "
                          "give the config the exported model's sizes")
    state.update({key: own[key] for key in NEW_RUN_STATE if key in own})
    model.load_state_dict(state)


# ----------------------------------------------------------------------------- tokenize
@torch.no_grad()
def encode_dataset(model, dataset, batch_size: int = EVAL_BATCH_SIZE, max_images: int = 0, device="cpu",
                   progress: bool = False, num_workers: int = 0):
    """-> (indices (N, h, w) numpy in ``index_dtype(K)``, labels (N,) int64, or None for a dataset without any)."""
    n = len(dataset) if not max_images else min(max_images, len(dataset))
    loader = make_loader(dataset, SequentialBatches(n, batch_size), num_workers, device)
    indices: Optional[np.ndarray] = None
    labels = np.empty(n, dtype=np.int64)
    bar = Progress(len(loader), "tokenize", unit="batch", every=max(len(loader) // 20, 1), off=not progress)
    start = 0
    for x, y in loader:
        codes = model.encode_indices(x.to(device)).cpu().numpy()
        if indices is None:
            indices = np.empty((n,) + codes.shape[1:], dtype=index_dtype(model.quantizer.num_codes))
        indices[start:start + len(codes)] = codes
        labels[start:start + len(codes)] = torch.as_tensor(y).numpy()
        start += len(codes)
        bar.update(1)
    bar.close()
    return indices, (labels if (labels >= 0).any() else None)


#: what overrides may change when tokenizing with an exported model (its data and where it runs)
EXPORT_OVERRIDES = ("data.", "train.device=")


def export_data_config(model, source, overrides=()):
    """The config an exported model's dataset is read with: its config.json ``data`` + ``overrides``."""
    data = (model.config or {}).get("data") or {}
    bad = [o for o in overrides if not str(o).startswith(EXPORT_OVERRIDES)]
    if bad:
        raise TokenFileError(f"with an exported model, overrides may change data.* and train.device only, got "
                             f"{', '.join(map(repr, bad))}")
    if "name" not in data and not any(str(o).startswith("data.name=") for o in overrides):
        raise TokenFileError(f"the exported model {str(source)!r} does not say which dataset it encodes (no 'data' in "
                             "its config.json): pass data.name=... and data.image_size=...")
    given = [f"data.{k}={data[k]}" for k in ("name", "image_size") if k in data]
    given += [f"run.seed={data['seed']}"] if isinstance(data.get("seed"), int) else []
    cfg = load_config(None, given + list(overrides))
    channels = (model.config.get("encoder_kwargs") or {}).get("in_channels")
    if channels is not None and channels != image_channels(cfg.data):
        raise TokenFileError(f"the exported model {str(source)!r} encodes {channels}-channel images, "
                             f"{cfg.data.name} has {image_channels(cfg.data)}")
    return cfg


def tokenize_run(run_dir: str | Path, split: str, out: str | Path, batch_size: int = EVAL_BATCH_SIZE,
                 max_images: int = 0, overrides=(), device: str = "auto", progress: bool = False,
                 overwrite: bool = False) -> Dict:
    """Tokenize ``split`` of the dataset of ``run_dir`` (a run directory, an exported model or its Hub id) into ``out``
    in dataset order, written atomically at the end; -> a summary."""
    out = check_out(check_suffix(out), "--out", overwrite)  # before any work
    model, cfg, source = load_source(run_dir, overrides, "cpu")
    exported = cfg is None
    cfg = export_data_config(model, run_dir, overrides) if exported else cfg
    name = "cuda" if device == "auto" and torch.cuda.is_available() and cfg.train.device != "cpu" else device
    dev = torch.device("cpu" if name == "auto" else name)
    model = model.to(dev)
    try:
        dataset = build_dataset(cfg.data, split, cfg.run.seed)
    except DataUnavailable as err:
        if exported and cfg.data.name == "image_folder" and not any(str(o).startswith("data.root=") for o in overrides):
            raise TokenFileError(f"{err}; an export records its dataset's name and image size, not where an image "
                                 "folder is: pass data.root=/path/to/the/folder") from None
        raise
    t0 = time.time()
    try:
        indices, labels = encode_dataset(model, dataset, batch_size, max_images, dev, progress,
                                         resolve_workers(cfg.data, dataset))
    except Stopped as stop:
        raise Stopped(f"{stop} while encoding; nothing was written to {str(out)!r}", stop.code) from None
    seconds = time.time() - t0
    k, step, ckpt = model.quantizer.num_codes, source.get("step"), source.get("checkpoint")
    metadata = {"format": "ddcl-vq/tokens", "num_codes": k, "run": str(run_dir), "step": step,
                "checkpoint": Path(ckpt).name if ckpt else source["kind"], "dataset": cfg.data.name, "split": split,
                "image_size": cfg.data.image_size, "shape": list(indices.shape)}
    written = write_tokens(out, indices, labels, metadata, exclusive=not overwrite)
    return {"files": [str(p) for p in written], "shape": list(indices.shape), "dtype": str(indices.dtype),
            "num_codes": k, "codes_used": int(np.unique(indices).size), "labels": labels is not None,
            "seconds": seconds, "step": step}


@dataclass(kw_only=True)
class TokenizeOptions:
    run_dir: str = option(help="a run directory written by ddcl-vq train, an exported model folder or its Hub id",
                          positional=True, metavar="MODEL")
    split: str = option("train", "dataset split")
    out: str = option(help="the token file to write (.npy or .safetensors)", metavar="FILE")
    overwrite: bool = option(False, "replace FILE (and its labels) when it exists")
    batch_size: int = option(EVAL_BATCH_SIZE, "images per batch")
    max_images: int = option(0, "first N images of the split (0 = all)")
    device: str = option("auto", "cpu, cuda, ... (auto: the run's train.device, CUDA when available)")
    quiet: bool = option(False, "no progress or summary")
    threads: Optional[int] = threads_option()
    overrides: List[str] = option(default_factory=list, help="dotted config overrides", positional=True, nargs="*",
                                  metavar="key=value")


OPTIONS = Options(TokenizeOptions, prog="ddcl-vq tokenize", description=__doc__, intermixed=True,
                  rules=Rules(choices={"split": SPLITS}, positive={"batch_size", "threads"},
                              non_negative={"max_images"}))


@entry_point("ddcl-vq tokenize")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    set_threads(opts.threads)
    done = tokenize_run(opts.run_dir, opts.split, opts.out, opts.batch_size, opts.max_images, opts.overrides,
                        opts.device, progress=not opts.quiet, overwrite=opts.overwrite)
    if not opts.quiet:
        n = done["shape"][0]
        print(f"{opts.split}: {n} images -> indices {'x'.join(map(str, done['shape']))} {done['dtype']} "
              f"(K = {done['num_codes']}, {done['codes_used']} codes used)"
              f"{', with labels' if done['labels'] else ', no labels'} in {done['seconds']:.1f} s "
              f"({n / max(done['seconds'], 1e-9):.0f} images/s)")
        for f in done["files"]:
            print(f"wrote {f}")
    return 0
