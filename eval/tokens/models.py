"""Load what the token commands work on: a run directory (config.yaml + checkpoints) or a folder
written by ``ddcl-vq export`` / ``VQVAE.save_pretrained`` (config.json + model.safetensors)."""
from __future__ import annotations

from pathlib import Path

from ddcl_vq.train.errors import UserError


class ModelSourceError(UserError, ValueError):
    """Neither a run directory nor an exported model folder."""


def load_model(source: str | Path, device="cpu"):
    """-> model in eval mode on ``device``, from a run directory or an exported folder."""
    from ddcl_vq.eval.evaluate import load_run
    from ddcl_vq.models import VQVAE

    source = Path(source)
    if (source / "config.json").is_file() and not (source / "config.yaml").is_file():
        try:
            return VQVAE.from_pretrained(str(source)).to(device).eval()
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ModelSourceError(f"cannot load the exported model in {str(source)!r}: {err}") from None
    if source.is_dir() and not (source / "config.yaml").is_file():
        raise ModelSourceError(f"{str(source)!r} is neither a run directory (config.yaml) nor an exported model "
                               "(config.json + model.safetensors)")
    return load_run(source, (), device)[1]
