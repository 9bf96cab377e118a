"""A VQ-VAE in the style of van den Oord et al. (2017): strided convs + residual blocks.

Encoder: (B, C, H, W) -> (B, D, H/f, W/f), f = 2**num_downsamples; Decoder: back; VQVAE: encoder -> any ddcl_vq
quantizer -> decoder, shared as config.json + model.safetensors (``save_pretrained`` / ``from_pretrained``).
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from torch import Tensor, nn

from ddcl_vq import (EMAVQ, DDCLQuantizer, FSQQuantizer, FVQQuantizer, GroupedDDCL, HardVQ, IBQQuantizer,
                     LFQQuantizer, Quantizer, QuantizerOutput, ResidualDDCL, SimVQQuantizer, VQPQuantizer)

#: the one registry of quantizer types: a config's ``quantizer.type`` -> the class; the rest of the ``quantizer``
#: section is that class's keyword arguments (``dim`` is ``model.latent_dim``)
QUANTIZER_TYPES = {"ddcl": DDCLQuantizer, "hard": HardVQ, "ema": EMAVQ, "vqp": VQPQuantizer, "fsq": FSQQuantizer,
                   "simvq": SimVQQuantizer, "lfq": LFQQuantizer, "ibq": IBQQuantizer, "fvq": FVQQuantizer,
                   "residual_ddcl": ResidualDDCL, "grouped_ddcl": GroupedDDCL}
CONFIG_FORMAT = "ddcl-vq/vqvae"
#: the keys every config.json holds (the encoder's and the quantizer's keyword arguments), and 0.2.0's (migrated)
REQUIRED = ("model", "quantizer")
OLD_KEYS = ("encoder_kwargs", "decoder_kwargs", "quantizer_type", "quantizer_kwargs")
WEIGHTS_NAME = "model.safetensors"


# ----------------------------------------------------------------------------- what from_pretrained reads
# config.json and model.safetensors must belong together; anything else is a ValueError raised before anything large
# is allocated. No code runs from either file.
#: quantizers whose weights hold a learned (K, D) codebook: the weights file is at least K·D·2 bytes
LEARNED_CODEBOOK = ("ddcl", "hard", "ema", "vqp")
#: the encoder/decoder sizes config.json may give, and their bound (a tampered 1e12 is refused, not allocated)
SIZES = ("in_channels", "channels", "latent_dim", "res_hidden", "num_downsamples", "num_res_blocks", "ch", "z_channels",
         "norm_groups")
MAX_SIZE = 65536
INTEGER_DTYPES = (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
                  torch.int64)


def byte_size(n: float) -> str:
    """``n`` bytes in decimal units: '512 bytes', '1.5 MB'."""
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000


def _integer(value: Any, low: int = 1, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def migrate_config(config: Any) -> Any:
    """A ddcl-vq 0.2.0 config.json (``encoder_kwargs``, ``decoder_kwargs``, ``quantizer_type``, ``quantizer_kwargs``)
    in this version's form (``model``, ``quantizer``); any other config as it is."""
    if not isinstance(config, dict) or "model" in config or not all(isinstance(config.get(k), dict) for k in OLD_KEYS
                                                                      if k.endswith("kwargs")):
        return config
    model = {"arch": config.get("arch", "vqvae"), **config["encoder_kwargs"]}
    q = {k: v for k, v in config["quantizer_kwargs"].items() if not (k == "dim" and v == model.get("latent_dim"))}
    return {**{k: v for k, v in config.items() if k not in OLD_KEYS + ("arch",)}, "model": model,
            "quantizer": {"type": config["quantizer_type"], **q}}


def check_model_arguments(model: Dict[str, Any], prefix: str = "model.", where: str = "") -> None:
    """ValueError for a size of the encoder/decoder (``SIZES``, ``ch_mult``) out of [1, MAX_SIZE] (blocks: from 0)."""
    for key, value in model.items():
        low = 0 if key in ("num_res_blocks", "attn_resolutions") else 1
        if key in SIZES + ("ch_mult", "attn_resolutions") and not all(
                _integer(v, low, MAX_SIZE) for v in (value if isinstance(value, (list, tuple)) else [value])):
            what = "integers" if isinstance(value, (list, tuple)) else "an integer"
            raise ValueError(f"expected {prefix}{key}{where} to be {what} in [{low}, {MAX_SIZE}], got {value!r}"[:300])


def check_config(config: Any, where: str) -> Dict[str, Any]:
    """``config`` if it has the shape ``VQVAE.from_config`` needs, else a ValueError saying what is wrong."""
    if not isinstance(config, dict):
        raise ValueError(f"expected {where} to hold a JSON object (written by VQVAE.save_pretrained or ddcl-vq "
                         f"export), got a JSON {type(config).__name__}")
    config = migrate_config(config)
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ValueError(f"expected {where} to have {', '.join(missing)} (a VQVAE config); got keys {sorted(config)}")
    for key in REQUIRED:
        if not isinstance(config[key], dict):
            raise ValueError(f"expected {key} in {where} to be a JSON object, got {config[key]!r}"[:300])
    q = config["quantizer"]
    if q.get("type") not in QUANTIZER_TYPES:
        raise ValueError(f"expected quantizer.type in {where} to be one of {', '.join(QUANTIZER_TYPES)}, "
                         f"got {q.get('type')!r}"[:300])
    for key, value in (("quantizer.num_codes", q.get("num_codes")),
                       ("model.latent_dim (D)", q.get("dim", config["model"].get("latent_dim")))):
        if not _integer(value):
            raise ValueError(f"expected {key} in {where} to be a positive integer, got {value!r}")
    check_model_arguments(config["model"], where=f" in {where}")
    return config


def safetensors_header(path: str | os.PathLike) -> Dict[str, Any]:
    """The header of a safetensors file ({name: {dtype, shape, data_offsets}}), checked against the
    file's size; a ValueError when the file is truncated or not safetensors."""
    path = str(path)
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError("header cut off")
            header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"expected {path!r} to be a safetensors weights file (written by VQVAE.save_pretrained "
                         f"or ddcl-vq export); it is truncated or not safetensors ({byte_size(size)})") from None
    if 8 + n + end > size:
        raise ValueError(f"{path!r} is truncated: its header lists {byte_size(end)} of tensors, the file holds "
                         f"{byte_size(size - 8 - n)} after the header")
    return header


def check_size(config: Dict[str, Any], header: Dict[str, Any], weights: str) -> None:
    """Refuse a config whose codebook alone (K·D float32) is larger than the weights file's tensors or this machine."""
    q = config["quantizer"]
    dim = q.get("dim", config["model"].get("latent_dim"))
    if q["type"] not in LEARNED_CODEBOOK:
        return
    codebook = 4 * q["num_codes"] * dim
    stored = sum(math.prod(v.get("shape", [])) * 2 for v in header.values())  # >= 2 bytes per stored element
    if codebook > 2 * max(stored, 1):
        raise ValueError(f"config.json asks for K = {q['num_codes']:,} codes of D = {dim} (a "
                         f"{byte_size(codebook)} codebook) but {weights!r} holds about {byte_size(stored)} of weights: "
                         "config.json and model.safetensors do not belong together")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's physical memory
    if codebook > memory:
        raise ValueError(f"config.json asks for K = {q['num_codes']:,} codes of D = {dim}: the codebook alone "
                         f"needs {byte_size(codebook)}, this machine has {byte_size(memory)} of memory")


def load_weights(model: torch.nn.Module, weights: str, strict: bool = True, device: str = "cpu") -> None:
    """The tensors of ``weights`` into ``model``, their dtypes and finiteness checked first (ValueErrors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights, device=device)
    except SafetensorError as err:
        raise ValueError(f"cannot read the weights {weights!r} ({str(err).strip()[:200]})") from None
    own = model.state_dict()
    other = [(k, t.dtype, own[k].dtype) for k, t in tensors.items() if k in own and t.dtype != own[k].dtype]
    if other:
        name, got, expected = (str(x).replace("torch.", "") for x in other[0])
        raise ValueError(f"the weights {weights!r} hold {name} as {got} (and {len(other) - 1} more tensors in another "
                         f"dtype), the model has {expected}: a file re-saved in another precision encodes other codes; "
                         "use the file the export wrote")
    bad = [(name, int((~torch.isfinite(t)).sum()), t.numel()) for name, t in tensors.items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:  # a damaged file, or a training that diverged: such a model would load and decode without a word
        name, count, total = bad[0]
        more = f", and {len(bad) - 1} other tensor{'s' if len(bad) > 2 else ''}" if len(bad) > 1 else ""
        raise ValueError(f"the weights {weights!r} hold values that are not finite (NaN or Inf): {count} of {total} "
                         f"in {name}{more}; the file is damaged or its training diverged: export a healthy "
                         "checkpoint")
    try:
        model.load_state_dict(tensors, strict=strict)
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        detail = "; ".join(lines[1:3] if len(lines) > 1 else lines)[:300]
        raise ValueError(f"the weights {weights!r} do not fit the model config.json describes (another number of "
                         f"codes, channels or quantizer? the two files must come from one export): {detail}") from None


def index_maps(indices: Tensor, grid: Optional[Tuple[int, int]] = None) -> Tensor:
    """(B, h, w) long index maps from (B, h, w) maps or flat (B, L) / (L,) integer sequences, laid out on ``grid``
    (h, w), else on a square."""
    if not isinstance(indices, Tensor):
        raise ValueError(f"expected a tensor of code indices, got {type(indices).__name__}")
    if indices.dtype not in INTEGER_DTYPES:
        raise ValueError(f"expected integer code indices, got dtype {indices.dtype}")
    if indices.ndim == 3:
        return indices.long()
    if indices.ndim not in (1, 2):
        raise ValueError(f"expected code indices of shape (B, h, w) or flat (B, h*w), got shape {tuple(indices.shape)}")
    flat = indices.reshape(1, -1) if indices.ndim == 1 else indices
    length = flat.shape[1]
    if grid is None:
        side = math.isqrt(length)
        if side * side != length:
            raise ValueError(f"expected flat sequences whose length is h*w of a known grid; got length {length}, "
                             "which is not square, and no grid: pass shape=(h, w)")
        grid = (side, side)
    h, w = grid
    if h * w != length:
        raise ValueError(f"expected flat sequences of h*w = {h}*{w} = {h * w} indices (the latent grid), "
                         f"got {length} per sequence")
    return flat.reshape(flat.shape[0], h, w).long()


# ----------------------------------------------------------------------------- the model
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


def architecture(arch: str = "vqvae") -> tuple:
    """(encoder class, decoder class) for a config's ``"arch"``: ``vqvae`` or ``vqgan`` (:mod:`.vqgan`)."""
    if arch == "vqvae":
        return Encoder, Decoder
    if arch == "vqgan":
        from ddcl_vq.models.vqgan import VQGANDecoder, VQGANEncoder
        return VQGANEncoder, VQGANDecoder
    raise ValueError(f"expected arch 'vqvae' or 'vqgan', got {arch!r}")


class VQVAE(nn.Module, PyTorchModelHubMixin, library_name="ddcl-vq", tags=["vq-vae", "image-tokenizer", "ddcl"]):
    """encoder -> quantizer -> decoder; any ``ddcl_vq.Quantizer`` (channel-first) plugs in.

    ``VQVAE.from_config(config)`` builds one from plain constructor arguments and remembers them (``model.config``), so
    it can ``save_pretrained`` / ``push_to_hub`` and be loaded with ``VQVAE.from_pretrained``. The config::

        {"format": "ddcl-vq/vqvae", "model": {"arch": "vqvae", "in_channels": C, "latent_dim": D, ...the Encoder's},
         "quantizer": {"type": one of QUANTIZER_TYPES, "num_codes": K, ...that class's arguments}}

    (a training config's sections, with the data's channels; a 0.2.0 config.json is read too: :func:`migrate_config`).

    ``save_pretrained`` adds ``quantizer_state`` (e.g. DDCL's τ, for reading: the state itself is in the weights) and
    keeps any other keys of ``model.config`` (``ddcl-vq export`` records the run, step and data there)."""

    def __init__(self, encoder: nn.Module, quantizer: Quantizer, decoder: nn.Module):
        super().__init__()
        if getattr(quantizer, "channel_dim", 1) != 1:
            raise ValueError(f"expected a channel-first quantizer (channel_dim=1), got "
                             f"channel_dim={quantizer.channel_dim}")
        self.encoder, self.quantizer, self.decoder = encoder, quantizer, decoder
        self.config: Optional[Dict[str, Any]] = None

    # -- sharing -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "VQVAE":
        """Build (untrained) from a config: encoder, quantizer, decoder in that order, as in training."""
        config = migrate_config(config)
        missing = [k for k in REQUIRED if k not in config]
        if missing:
            raise ValueError(f"expected a VQVAE config with {', '.join(missing)}; got keys {sorted(config)}")
        model, q = dict(config["model"]), dict(config["quantizer"])
        encoder_cls, decoder_cls = architecture(model.pop("arch", "vqvae"))
        io = {"in_channels": model.pop("in_channels")} if "in_channels" in model else {}  # the decoder's out_channels
        qtype, dim = q.pop("type", None), q.pop("dim", model.get("latent_dim"))  # D: the encoder's output
        if qtype not in QUANTIZER_TYPES:
            raise ValueError(f"expected quantizer type in {', '.join(QUANTIZER_TYPES)}, got {qtype!r}")
        encoder, quantizer = encoder_cls(**model, **io), QUANTIZER_TYPES[qtype](dim=dim, **q)
        decoder = decoder_cls(**model, **{"out_channels": c for c in io.values()})
        model = cls(encoder, quantizer, decoder)
        model.config = copy.deepcopy(dict(config))
        model.config.setdefault("format", CONFIG_FORMAT)
        return model

    def _save_pretrained(self, save_directory: Path) -> None:
        """config.json + model.safetensors (tensors only, the quantizer's buffers included)."""
        from safetensors.torch import save_model

        import ddcl_vq

        if self.config is None:
            raise ValueError("expected a VQVAE built with VQVAE.from_config (or loaded by from_pretrained or "
                             "ddcl-vq); one built from modules has no constructor arguments to save")
        config = copy.deepcopy(self.config)
        config["quantizer_state"] = {k: v for k, v in self.quantizer.describe().items()
                                     if isinstance(v, (int, float, str, bool)) or v is None}
        if hasattr(self.quantizer, "schedule_step"):
            config["quantizer_state"]["schedule_step"] = int(self.quantizer.schedule_step)
        config["ddcl_vq_version"] = ddcl_vq.__version__
        save_model(self, str(Path(save_directory) / WEIGHTS_NAME))
        umask = os.umask(0)  # safetensors writes 0600: the weights get the permissions of any new file
        os.umask(umask)
        os.chmod(Path(save_directory) / WEIGHTS_NAME, 0o666 & ~umask)
        (Path(save_directory) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "VQVAE":
        """Load a folder written by ``save_pretrained`` / ``ddcl-vq export``, or a Hub id; files that are not what
        ``save_pretrained`` writes are a ValueError raised before anything large is allocated."""
        source = str(pretrained_model_name_or_path)
        if os.path.isdir(source):
            config_file = os.path.join(source, "config.json")
        else:  # the Hub: the download options the mixin takes (their defaults are hf_hub_download's)
            hub = {k: kwargs[k] for k in ("revision", "cache_dir", "force_download", "token", "local_files_only")
                   if k in kwargs}
            config_file = hf_hub_download(repo_id=source, filename="config.json", **hub)
        if os.path.isfile(config_file):
            try:
                with open(config_file, encoding="utf-8") as f:
                    config = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"expected {config_file!r} to hold JSON (written by VQVAE.save_pretrained or "
                                 f"ddcl-vq export), got unreadable text ({err})") from None
            check_config(config, repr(config_file))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: Optional[str], cache_dir, force_download: bool,
                         local_files_only: bool, token, config: Optional[Dict[str, Any]] = None,
                         map_location: str = "cpu", strict: bool = True, **model_kwargs) -> "VQVAE":
        """Rebuild from config.json, load model.safetensors (strict), eval mode."""
        if config is None:
            raise ValueError(f"expected a config.json in {model_id!r} (written by VQVAE.save_pretrained or "
                             "ddcl-vq export)")
        # the mixin hands config.json's keys that share a name with __init__'s arguments ("quantizer") on: not ours
        model_kwargs = {k: v for k, v in model_kwargs.items() if k not in config or config[k] is not v}
        if model_kwargs:
            raise TypeError(f"unexpected arguments for VQVAE.from_pretrained: {', '.join(sorted(model_kwargs))}")
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, WEIGHTS_NAME)
            if not os.path.isfile(weights):
                raise FileNotFoundError(f"expected {weights!r} (written by VQVAE.save_pretrained or ddcl-vq export)")
        else:
            weights = hf_hub_download(repo_id=model_id, filename=WEIGHTS_NAME, revision=revision,
                                      cache_dir=cache_dir, force_download=force_download, token=token,
                                      local_files_only=local_files_only)
        config = {k: v for k, v in config.items() if k not in ("quantizer_state", "ddcl_vq_version")}
        config = check_config(config, f"the config.json of {model_id!r}")
        check_size(config, safetensors_header(weights), weights)  # before anything is allocated
        try:
            model = cls.from_config(config)
        except TypeError as err:  # an argument the constructors do not take
            raise ValueError(f"the config.json of {model_id!r} does not describe a VQVAE: {err}") from None
        load_weights(model, weights, strict=strict, device=str(map_location))
        return model.eval()

    def latent_shape(self) -> Optional[Tuple[int, int]]:
        """(h, w) of the code grid of the images the model was trained on, when its config records it
        (``config["data"]["latent_size"]``), else None."""
        size = ((self.config or {}).get("data") or {}).get("latent_size")
        size = [size, size] if isinstance(size, int) else size
        if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
            return int(size[0]), int(size[1])
        return None

    def forward(self, x: Tensor) -> VQVAEOutput:
        q = self.quantizer(self.encoder(x))
        return VQVAEOutput(reconstruction=self.decoder(q.quantized), quantizer=q)

    @torch.no_grad()
    def encode_indices(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, h, w) long code indices."""
        return self.quantizer(self.encoder(x)).indices

    def decode_indices(self, indices: Tensor, shape: Optional[Tuple[int, int]] = None) -> Tensor:
        """(B, h, w) indices, or flat (B, h·w) sequences, of any integer dtype -> (B, C, H, W) reconstruction from the
        hard codes; flat sequences are laid out on ``shape``, else :meth:`latent_shape`, else a square."""
        indices = index_maps(indices, shape or self.latent_shape())
        return self.decoder(self.quantizer.lookup(indices).to(next(self.decoder.parameters()).dtype))

    @torch.no_grad()
    def reconstruct(self, x: Tensor, codes: str = "hard") -> Tensor:
        """Reconstruction from ``"hard"`` codes or, with ``quantizer.has_soft_codes`` (DDCL), ``"soft"`` codes ẑ."""
        z = self.encoder(x)
        if codes == "hard":
            return self.decoder(self.quantizer.lookup(self.quantizer(z).indices))
        if codes == "soft":
            if not self.quantizer.has_soft_codes:
                raise ValueError(f"expected a quantizer with soft codes (DDCL) for codes='soft', "
                                 f"got {type(self.quantizer).__name__}")
            return self.decoder(self.quantizer.soft_codes(z))
        raise ValueError(f"expected codes 'hard' or 'soft', got {codes!r}")
