"""Load what the token commands work on: a run directory (config.yaml + checkpoints), a folder
written by ``ddcl-vq export`` / ``VQVAE.save_pretrained`` (config.json + model.safetensors), or
the Hub id of such a folder (``user/name``; downloaded once, then read from the local cache).

Every model comes back with ``model.config["data"]`` saying what it encodes (dataset name, image
size, channels, seed, latent grid), as an export records it, so ``tokenize`` knows which images
to read and ``decode`` which grid a flat sequence of codes lies on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch

from ddcl_vq.common.errors import UserError
from ddcl_vq.tokenizer.init_from import HUB_ID  # what a Hugging Face Hub model id looks like (``user/name``)


class ModelSourceError(UserError, ValueError):
    """Neither a run directory nor an exported model folder nor a loadable Hub id."""


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _from_pretrained(source: str, where: str):
    from ddcl_vq.models import VQVAE
    try:
        return VQVAE.from_pretrained(source)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ModelSourceError(f"cannot load the exported model {where}: {_first_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - huggingface_hub's errors (offline, not found, auth) have no common base
        if type(err).__module__.startswith("huggingface_hub"):
            raise ModelSourceError(f"cannot load the exported model {where} ({type(err).__name__}: "
                                   f"{_first_line(err)})") from None
        raise


def run_data(cfg, model) -> dict:
    """``config["data"]`` of an export, for a model loaded from a run directory."""
    from ddcl_vq.common.data import image_channels
    channels = image_channels(cfg.data)
    with torch.no_grad():
        grid = model.encoder(torch.zeros(1, channels, cfg.data.image_size, cfg.data.image_size)).shape[-2:]
    return {"name": cfg.data.name, "image_size": cfg.data.image_size, "channels": channels, "seed": cfg.run.seed,
            "latent_size": int(grid[0]) if grid[0] == grid[1] else [int(grid[0]), int(grid[1])], "range": [0.0, 1.0]}


def load_source(source: str | Path, overrides=(), device="cpu") -> Tuple[object, Optional[object], dict]:
    """-> (model in eval mode on ``device``, the run's config or None for an export, a summary of the
    source: ``kind`` run/export/hub, ``step`` and ``checkpoint`` when known)."""
    from ddcl_vq.tokenizer.evaluate import load_run
    path = Path(source)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        model = _from_pretrained(str(path), f"in {str(path)!r}")
        return model.to(device).eval(), None, {"kind": "export", "step": (model.config.get("source") or {}).get("step")}
    if path.is_dir() and not (path / "config.yaml").is_file():
        raise ModelSourceError(f"{str(path)!r} is neither a run directory (config.yaml) nor an exported model "
                               "(config.json + model.safetensors)")
    if not path.exists() and HUB_ID.match(str(source)):
        model = _from_pretrained(str(source), f"{str(source)!r} (not a folder here, so read as a Hugging Face Hub id)")
        return model.to(device).eval(), None, {"kind": "hub", "step": (model.config.get("source") or {}).get("step")}
    cfg, model, step, ckpt = load_run(path, overrides, "cpu")
    model.config = dict(model.config or {}, data=run_data(cfg, model))
    return model.to(device).eval(), cfg, {"kind": "run", "step": step, "checkpoint": ckpt}


def load_model(source: str | Path, device="cpu"):
    """-> model in eval mode on ``device``, from a run directory, an exported folder or a Hub id."""
    return load_source(source, (), device)[0]
