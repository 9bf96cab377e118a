"""A VQ-VAE in the style of van den Oord et al. (2017): strided convs + residual blocks.

Encoder: (B, C, H, W) -> (B, D, H/f, W/f), f = 2**num_downsamples.
Decoder: (B, D, H/f, W/f) -> (B, C, H, W).
VQVAE:   encoder -> any ddcl_vq quantizer -> decoder.

Sharing a model: a VQVAE built with ``VQVAE.from_config`` (every model ``ddcl-vq train`` builds)
saves itself the way the ecosystem shares models, ``save_pretrained(DIR)`` -> ``config.json``
(constructor arguments) + ``model.safetensors`` (weights and quantizer state, no pickle), and
``VQVAE.from_pretrained(DIR or hub id)`` rebuilds it (huggingface_hub's PyTorchModelHubMixin:
``push_to_hub`` works too where there is network).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import Tensor, nn

from ddcl_vq import (EMAVQ, DDCLQuantizer, FSQQuantizer, FVQQuantizer, HardVQ, IBQQuantizer, LFQQuantizer, Quantizer,
                     QuantizerOutput, SimVQQuantizer, VQPQuantizer)

from ddcl_vq.models.loading import (check_config, check_size, index_maps, latent_grid, load_weights, read_config_file,
                      safetensors_header)

# config.json "quantizer_type" -> class; its "quantizer_kwargs" are the class's constructor arguments
QUANTIZER_TYPES = {"ddcl": DDCLQuantizer, "hard": HardVQ, "ema": EMAVQ, "vqp": VQPQuantizer, "fsq": FSQQuantizer,
                   "simvq": SimVQQuantizer, "lfq": LFQQuantizer, "ibq": IBQQuantizer,
                   "fvq": FVQQuantizer}
CONFIG_FORMAT = "ddcl-vq/vqvae"
WEIGHTS_NAME = "model.safetensors"


class ResidualBlock(nn.Module):
    """x + conv1x1(relu(conv3x3(relu(x)))), as in the VQ-VAE paper."""

    def __init__(self, channels: int, hidden: int):
        super().__init__()
        self.block = nn.Sequential(nn.ReLU(), nn.Conv2d(channels, hidden, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(hidden, channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x)


class Encoder(nn.Module):
    def __init__(self, in_channels: int = 1, channels: int = 64, num_res_blocks: int = 2,
                 num_downsamples: int = 2, latent_dim: int = 64, res_hidden: int = 32):
        super().__init__()
        if num_downsamples < 1:
            raise ValueError(f"expected num_downsamples >= 1, got {num_downsamples}")
        layers = [nn.Conv2d(in_channels, channels // 2 if num_downsamples > 1 else channels, 4, 2, 1)]
        for i in range(1, num_downsamples):
            c_in = channels // 2 if i == 1 else channels
            layers += [nn.ReLU(), nn.Conv2d(c_in, channels, 4, 2, 1)]
        layers += [nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1)]
        layers += [ResidualBlock(channels, res_hidden) for _ in range(num_res_blocks)]
        layers += [nn.ReLU(), nn.Conv2d(channels, latent_dim, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, out_channels: int = 1, channels: int = 64, num_res_blocks: int = 2,
                 num_downsamples: int = 2, latent_dim: int = 64, res_hidden: int = 32):
        super().__init__()
        layers = [nn.Conv2d(latent_dim, channels, 3, padding=1)]
        layers += [ResidualBlock(channels, res_hidden) for _ in range(num_res_blocks)]
        for i in range(num_downsamples - 1):
            c_out = channels // 2 if i == num_downsamples - 2 else channels
            layers += [nn.ReLU(), nn.ConvTranspose2d(channels, c_out, 4, 2, 1)]
            channels = c_out
        layers += [nn.ReLU(), nn.ConvTranspose2d(channels, out_channels, 4, 2, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


@dataclass
class VQVAEOutput:
    """reconstruction: (B, C, H, W) decoded from what the quantizer passes on;
    quantizer: the quantizer's output (indices (B, h, w), loss, terms, ...)."""

    reconstruction: Tensor
    quantizer: QuantizerOutput


def _readable(path: Path) -> None:
    """Give a written file the permissions of any new file (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def architecture(arch: str = "vqvae") -> tuple:
    """(encoder class, decoder class) for a config's ``"arch"``: ``vqvae`` (this module's) or ``vqgan``
    (diffusers' VQModel encoder/decoder, :mod:`ddcl_vq.models.vqgan`)."""
    if arch == "vqvae":
        return Encoder, Decoder
    if arch == "vqgan":
        from ddcl_vq.models.vqgan import VQGANDecoder, VQGANEncoder
        return VQGANEncoder, VQGANDecoder
    raise ValueError(f"expected arch 'vqvae' or 'vqgan', got {arch!r}")


def build_quantizer_from_config(quantizer_type: str, kwargs: Dict[str, Any]) -> Quantizer:
    """``QUANTIZER_TYPES[quantizer_type](**kwargs)`` (kwargs hold ``num_codes`` and ``dim``)."""
    if quantizer_type not in QUANTIZER_TYPES:
        raise ValueError(f"expected quantizer_type in {', '.join(QUANTIZER_TYPES)}, got {quantizer_type!r}")
    return QUANTIZER_TYPES[quantizer_type](**kwargs)


class VQVAE(nn.Module, PyTorchModelHubMixin, library_name="ddcl-vq", tags=["vq-vae", "image-tokenizer", "ddcl"]):
    """encoder -> quantizer -> decoder; any ``ddcl_vq.Quantizer`` (channel-first) plugs in.

    ``VQVAE.from_config(config)`` builds one from plain constructor arguments and remembers them
    (``model.config``), so it can ``save_pretrained`` / ``push_to_hub`` and be loaded with
    ``VQVAE.from_pretrained``. The config::

        {"format": "ddcl-vq/vqvae",
         "encoder_kwargs": {...Encoder arguments...}, "decoder_kwargs": {...Decoder arguments...},
         "quantizer_type": "ddcl" | "hard" | "ema" | "vqp" | "fsq" | "simvq" | "lfq" | "ibq" | "fvq", "quantizer_kwargs": {"num_codes": K, "dim": D, ...}}

    ``save_pretrained`` adds ``quantizer_state`` (e.g. DDCL's τ and schedule step, for reading:
    the state itself is in the weights file) and keeps any other keys of ``model.config``
    (``ddcl-vq export`` records the run, step and data there).
    """

    def __init__(self, encoder: nn.Module, quantizer: Quantizer, decoder: nn.Module):
        super().__init__()
        if getattr(quantizer, "channel_dim", 1) != 1:
            raise ValueError(f"expected a channel-first quantizer (channel_dim=1), got channel_dim={quantizer.channel_dim}")
        self.encoder, self.quantizer, self.decoder = encoder, quantizer, decoder
        self.config: Optional[Dict[str, Any]] = None

    # -- sharing -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "VQVAE":
        """Build (untrained) from a config (see the class docstring); modules are built in the order
        encoder, quantizer, decoder, so parameter initialisation follows the seed as in training."""
        missing = [k for k in ("encoder_kwargs", "decoder_kwargs", "quantizer_type", "quantizer_kwargs")
                   if k not in config]
        if missing:
            raise ValueError(f"expected a VQVAE config with {', '.join(missing)}; got keys {sorted(config)}")
        encoder_cls, decoder_cls = architecture(config.get("arch", "vqvae"))
        encoder = encoder_cls(**config["encoder_kwargs"])
        quantizer = build_quantizer_from_config(config["quantizer_type"], dict(config["quantizer_kwargs"]))
        model = cls(encoder, quantizer, decoder_cls(**config["decoder_kwargs"]))
        model.config = copy.deepcopy(dict(config))
        model.config.setdefault("format", CONFIG_FORMAT)
        return model

    def _pretrained_config(self) -> Dict[str, Any]:
        if self.config is None:
            raise ValueError("expected a VQVAE built with VQVAE.from_config (or loaded by from_pretrained or "
                             "ddcl-vq); one built from modules has no constructor arguments to save")
        import ddcl_vq

        config = copy.deepcopy(self.config)
        config["quantizer_state"] = {k: v for k, v in self.quantizer.describe().items()
                                     if isinstance(v, (int, float, str, bool)) or v is None}
        if hasattr(self.quantizer, "schedule_step"):
            config["quantizer_state"]["schedule_step"] = int(self.quantizer.schedule_step)
        config["ddcl_vq_version"] = ddcl_vq.__version__
        return config

    def _save_pretrained(self, save_directory: Path) -> None:
        """config.json + model.safetensors (tensors only: the quantizer's buffers and DDCL's float64
        ``schedule`` entry included)."""
        import json

        from safetensors.torch import save_model

        config = self._pretrained_config()
        save_model(self, str(Path(save_directory) / WEIGHTS_NAME))
        _readable(Path(save_directory) / WEIGHTS_NAME)
        (Path(save_directory) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "VQVAE":
        """Load a folder written by ``save_pretrained`` / ``ddcl-vq export``, or a Hub id. Files that
        are not what ``save_pretrained`` writes (a config.json that is not a JSON object or whose
        sizes were edited, weights of another model, a truncated weights file) are a ValueError
        saying so, raised before anything large is allocated (see :mod:`ddcl_vq.models.loading`)."""
        source = str(pretrained_model_name_or_path)
        if os.path.isdir(source):
            config_file = os.path.join(source, "config.json")
        else:
            from huggingface_hub import hf_hub_download
            config_file = hf_hub_download(repo_id=source, filename="config.json", revision=kwargs.get("revision"),
                                          cache_dir=kwargs.get("cache_dir"),
                                          force_download=kwargs.get("force_download", False),
                                          token=kwargs.get("token"),
                                          local_files_only=kwargs.get("local_files_only", False))
        if os.path.isfile(config_file):
            check_config(read_config_file(config_file), repr(config_file), QUANTIZER_TYPES)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: Optional[str], cache_dir, force_download: bool,
                         local_files_only: bool, token, config: Optional[Dict[str, Any]] = None,
                         map_location: str = "cpu", strict: bool = True, **model_kwargs) -> "VQVAE":
        """Rebuild from config.json, load model.safetensors (strict), eval mode."""
        if config is None:
            raise ValueError(f"expected a config.json in {model_id!r} (written by VQVAE.save_pretrained or "
                             "ddcl-vq export)")
        if model_kwargs:
            raise TypeError(f"unexpected arguments for VQVAE.from_pretrained: {', '.join(sorted(model_kwargs))}")
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, WEIGHTS_NAME)
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"expected {weights!r} (written by VQVAE.save_pretrained or ddcl-vq export)")
        else:
            from huggingface_hub import hf_hub_download
            weights = hf_hub_download(repo_id=model_id, filename=WEIGHTS_NAME, revision=revision,
                                      cache_dir=cache_dir, force_download=force_download, token=token,
                                      local_files_only=local_files_only)
        config = {k: v for k, v in config.items() if k not in ("quantizer_state", "ddcl_vq_version")}
        check_config(config, f"the config.json of {model_id!r}", QUANTIZER_TYPES)
        check_size(config, safetensors_header(weights), weights)  # before anything is allocated
        try:
            model = cls.from_config(config)
        except TypeError as err:  # an argument the constructors do not take
            raise ValueError(f"the config.json of {model_id!r} does not describe a VQVAE: {err}") from None
        load_weights(model, weights, strict=strict, device=str(map_location))
        return model.eval()

    def latent_shape(self) -> Optional[Tuple[int, int]]:
        """(h, w) of the code grid of the images the model was trained on, when its config records
        it (an exported model, a run loaded by ddcl-vq); None otherwise."""
        return latent_grid(self.config)

    def forward(self, x: Tensor) -> VQVAEOutput:
        q = self.quantizer(self.encoder(x))
        return VQVAEOutput(reconstruction=self.decoder(q.quantized), quantizer=q)

    @torch.no_grad()
    def encode_indices(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, h, w) long code indices."""
        return self.quantizer(self.encoder(x)).indices

    def decode_indices(self, indices: Tensor, shape: Optional[Tuple[int, int]] = None) -> Tensor:
        """(B, h, w) indices, or flat (B, h·w) sequences (what a prior emits), of any integer dtype
        (uint8/uint16 token files, int32, int64) -> (B, C, H, W) reconstruction from the hard codes.
        A flat sequence is laid out on ``shape`` (h, w), else on the model's :meth:`latent_shape`,
        else on a square grid; a length that does not fit is a ValueError."""
        indices = index_maps(indices, shape or self.latent_shape())
        return self.decoder(self.quantizer.lookup(indices).to(next(self.decoder.parameters()).dtype))

    @torch.no_grad()
    def reconstruct(self, x: Tensor, codes: str = "hard") -> Tensor:
        """Reconstruction from ``"hard"`` codes (what a prior or deployed decoder sees) or, for a
        quantizer that has them (``quantizer.has_soft_codes``: DDCL), from ``"soft"`` codes ẑ."""
        z = self.encoder(x)
        if codes == "hard":
            return self.decoder(self.quantizer.lookup(self.quantizer(z).indices))
        if codes == "soft":
            if not self.quantizer.has_soft_codes:
                raise ValueError(f"expected a quantizer with soft codes (DDCL) for codes='soft', "
                                 f"got {type(self.quantizer).__name__}")
            return self.decoder(self.quantizer.soft_codes(z))
        raise ValueError(f"expected codes 'hard' or 'soft', got {codes!r}")
