"""``train.init_from``: start a new run from an exported model (fine-tuning).

The folder written by ``ddcl-vq export`` (or ``VQVAE.save_pretrained``, or its Hub id) gives the new run's starting
weights and quantizer state (codebook, its running statistics, first-batch set-up and warm-up done); nothing else: the
run is new (step 0, fresh optimizer and learning-rate schedule, its own temperature schedule and revival count from its
config). The exported model must have the shape this config builds (quantizer type, K, D, channels, ...); otherwise the
run is refused with one line naming the settings that differ. A run that already has a checkpoint resumes from it and
ignores ``init_from``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from ddcl_vq.common.config import ConfigError

#: quantizer state that belongs to the run, not to the weights: a new run starts its own
NEW_RUN_STATE = ("quantizer.schedule", "quantizer.schedule_step", "quantizer.revived")

#: config.json entry -> the training config key that sets it
CONFIG_KEYS = {"quantizer_type": "quantizer.type", "quantizer_kwargs.num_codes": "quantizer.num_codes",
               "quantizer_kwargs.dim": "model.latent_dim", "encoder_kwargs.in_channels": "data.name (channels)",
               "arch": "model.arch"}


#: what a Hugging Face Hub model id looks like (``user/name``), as opposed to a local path
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _check_source(source: str, where: str) -> str:
    """Say plainly what ``source`` is not, before asking the Hub (whose errors are about repo-id syntax);
    -> how the error of a failed load should describe it."""
    path = Path(source)
    if path.is_dir():
        if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
            raise ConfigError(f"{where} is a run directory, not an exported model: export it first (ddcl-vq export "
                              f"{source} OUT_DIR) and give train.init_from=OUT_DIR")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{where} is a folder without config.json: not an exported model (ddcl-vq export "
                              "writes config.json + model.safetensors)")
        return ""
    if path.exists():
        raise ConfigError(f"{where} is a file; expected a folder written by ddcl-vq export (or its Hub id)")
    if not HUB_ID.match(source):
        raise ConfigError(f"{where}: no such folder here, and not a Hugging Face Hub id (user/name) either; give "
                          "the folder ddcl-vq export wrote, or its Hub id")
    return " (not a folder here, so read as a Hugging Face Hub id)"


def _flat(config: Dict[str, Any]) -> Dict[str, Any]:
    out = {"quantizer_type": config.get("quantizer_type"), "arch": config.get("arch", "vqvae")}
    for part in ("encoder_kwargs", "decoder_kwargs"):
        out.update({f"{part}.{k}": v for k, v in (config.get(part) or {}).items()})
    q = config.get("quantizer_kwargs") or {}
    out.update({f"quantizer_kwargs.{k}": q.get(k) for k in ("num_codes", "dim")})
    return out


def shape_differences(exported: Dict[str, Any], built: Dict[str, Any]) -> List[str]:
    """'config key: export X, this config Y' for every constructor size that differs."""
    a, b = _flat(exported), _flat(built)
    diffs: Dict[str, str] = {}
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            name = CONFIG_KEYS.get(key.replace("decoder_kwargs.out_channels", "encoder_kwargs.in_channels")) \
                or "model." + key.split(".", 1)[-1]
            diffs.setdefault(name, f"{name}: export {a.get(key)!r}, this config {b.get(key)!r}")
    return list(diffs.values())


def init_from_export(model: nn.Module, source: str) -> None:
    """Load the exported model ``source`` into ``model`` (built from the new run's config) as
    described in the module docstring; ConfigError (one line) when it cannot be."""
    from ddcl_vq.models import VQVAE
    where = f"train.init_from {source!r}"
    read_as = _check_source(str(source), where)
    try:
        with torch.random.fork_rng(devices=[]):  # building it draws initial weights: not from the run's RNG stream
            exported = VQVAE.from_pretrained(source)
    except Exception as err:  # noqa: BLE001 - files, JSON, Hub: every failure is the user's to fix
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise ConfigError(f"{where}{read_as}: cannot load it as an exported model ({type(err).__name__}: "
                          f"{first})") from None
    state, own = exported.state_dict(), model.state_dict()
    misfit = sorted(k for k in set(state) | set(own)
                    if k not in state or k not in own or state[k].shape != own[k].shape)
    if misfit:
        diffs = shape_differences(exported.config or {}, getattr(model, "config", None) or {})
        detail = "; ".join(diffs[:6]) if diffs else f"tensors {', '.join(misfit[:3])} differ"
        raise ConfigError(f"{where}: the exported model has another shape than this config's model ({detail}); "
                          "give the config the exported model's sizes")
    state.update({key: own[key] for key in NEW_RUN_STATE if key in own})
    model.load_state_dict(state)
