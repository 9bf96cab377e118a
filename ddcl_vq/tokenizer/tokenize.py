"""Encode every image of a dataset split with a trained run's model and write the hard code
indices, N x h x w in the smallest unsigned integer type that holds K (uint8 for K <= 256, uint16
for K <= 65,536), with the labels when the dataset has them:

  FILE.npy          indices; labels in FILE.labels.npy      numpy.load(FILE)
  FILE.safetensors  tensors 'indices' and 'labels' + metadata  safetensors.numpy.load_file(FILE)

MODEL is a run directory, a folder written by `ddcl-vq export`, or its Hub id (user/name): an
export names its dataset (name, image size), and data.* overrides say where it lives here.
Dotted overrides change the run's config for this command only (e.g. data.root=/path).

  ddcl-vq tokenize runs/fashion_ddcl --split train --out tokens/fashion_train.npy
  ddcl-vq tokenize exported/fashion_ddcl --split test --out tokens/fashion_test.safetensors
  ddcl-vq decode runs/fashion_ddcl tokens/fashion_train.npy --out first64.png
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from ddcl_vq.common.data import SPLITS
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE
from ddcl_vq.common.threads import set_threads, threads_option

from ddcl_vq.tokenizer.tokens import TokenFileError, check_out, check_suffix, index_dtype, write_tokens

HELP = __doc__  # the module docstring is the --help text


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


OPTIONS = Options(TokenizeOptions, prog="ddcl-vq tokenize", description=HELP, intermixed=True,
                  rules=Rules(choices={"split": SPLITS}, positive={"batch_size", "threads"},
                              non_negative={"max_images"}))


def _device(name: str, cfg) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu"
    return torch.device(name)


@torch.no_grad()
def encode_dataset(model, dataset, batch_size: int = EVAL_BATCH_SIZE, max_images: int = 0, device="cpu",
                   progress: bool = False, num_workers: int = 0):
    """-> (indices (N, h, w) numpy in ``index_dtype(K)``, labels (N,) int64 or None).

    Labels are None when the dataset has none (every label negative, e.g. natural_patches)."""
    from torch.utils.data import DataLoader, Subset
    from ddcl_vq.common.progress import Progress
    n = len(dataset) if not max_images else min(max_images, len(dataset))
    if n < len(dataset):
        dataset = Subset(dataset, range(n))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    dtype = index_dtype(model.quantizer.num_codes)
    indices: Optional[np.ndarray] = None
    labels = np.empty(n, dtype=np.int64)
    bar = Progress(len(loader), "tokenize", unit="batch", every=max(len(loader) // 20, 1), off=not progress)
    start = 0
    for batch in loader:
        x, y = (batch[0], batch[1]) if isinstance(batch, (list, tuple)) else (batch, None)
        codes = model.encode_indices(x.to(device)).cpu().numpy()
        if indices is None:
            indices = np.empty((n,) + codes.shape[1:], dtype=dtype)
        indices[start:start + len(codes)] = codes
        labels[start:start + len(codes)] = -1 if y is None else torch.as_tensor(y).numpy()
        start += len(codes)
        bar.update(1)
    bar.close()
    if indices is None:
        raise ValueError("expected a non-empty dataset")
    return indices, (labels if (labels >= 0).any() else None)


#: what overrides may change when tokenizing with an exported model (its data and where it runs)
EXPORT_OVERRIDES = ("data.", "train.device=")


def export_data_config(model, source, overrides=()):
    """The config an exported model's dataset is read with: its ``config.json`` ``data`` (name,
    image size, seed) + ``data.*`` / ``train.device`` overrides; a TokenFileError when it cannot be."""
    from ddcl_vq.tokenizer.config import load_config
    from ddcl_vq.common.data import image_channels
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
    """Tokenize ``split`` of the dataset of ``run_dir`` (a run directory, an exported model folder or
    its Hub id) into ``out``; returns a summary. An existing ``out`` is replaced only with ``overwrite``.
    Every image of the split, in dataset order, is encoded in eval mode (``VQVAE.encode_indices``); the file is written
    once, at the end, atomically: encoding is fast (Fashion-MNIST's 60,000 training images take about 90 s on one
    shared CPU core with the default model), so there is nothing to resume."""
    from ddcl_vq.common.data import build_dataset, resolve_workers
    from ddcl_vq.common.dataerrors import DataUnavailable
    from ddcl_vq.tokenizer.loaded import load_source
    out = check_out(check_suffix(out), "--out", overwrite)  # before any work
    model, cfg, source = load_source(run_dir, overrides, "cpu")
    exported = cfg is None
    if exported:
        cfg = export_data_config(model, run_dir, overrides)
    step, ckpt = source.get("step"), source.get("checkpoint")
    dev = _device(device, cfg)
    model = model.to(dev)
    try:
        dataset = build_dataset(cfg.data, split, cfg.run.seed)
    except DataUnavailable as err:
        if exported and cfg.data.name == "image_folder" and not any(str(o).startswith("data.root=") for o in overrides):
            raise TokenFileError(f"{err}; an export records its dataset's name and image size, not where an image "
                                 "folder is: pass data.root=/path/to/the/folder") from None
        raise
    t0 = time.time()
    indices, labels = encode_dataset(model, dataset, batch_size, max_images, dev, progress,
                                     resolve_workers(cfg.data, dataset))
    seconds = time.time() - t0
    k = model.quantizer.num_codes
    metadata = {"format": "ddcl-vq/tokens", "num_codes": k, "run": str(run_dir), "step": step,
                "checkpoint": Path(ckpt).name if ckpt else source["kind"], "dataset": cfg.data.name, "split": split,
                "image_size": cfg.data.image_size, "shape": list(indices.shape)}
    written = write_tokens(out, indices, labels, metadata)
    return {"files": [str(p) for p in written], "shape": list(indices.shape), "dtype": str(indices.dtype),
            "num_codes": k, "codes_used": int(np.unique(indices).size), "labels": labels is not None,
            "seconds": seconds, "step": step}


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


if __name__ == "__main__":
    raise SystemExit(main())
