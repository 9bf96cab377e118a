"""Config -> model, quantizer, optimizer, learning-rate schedule (the temperature schedule is the quantizer's own)."""
from __future__ import annotations

import copy
import inspect
from typing import Any, Dict, Optional

import torch

from ddcl_vq import Quantizer
from ddcl_vq.models import VQVAE
from ddcl_vq.models.vqvae import CONFIG_FORMAT, QUANTIZER_TYPES, architecture, build_quantizer_from_config

from ddcl_vq.common.config import ConfigError, did_you_mean
from ddcl_vq.common.errors import one_line
from ddcl_vq.common.skeleton import lr_schedule
from ddcl_vq.tokenizer.config import PER_QUANTIZER_DEFAULT, Config, QuantizerConfig, TrainConfig, quantizer_keys


def build_quantizer(q: QuantizerConfig, dim: int, steps: Optional[int] = None) -> Quantizer:
    """The configured quantizer (``steps``: a DDCL temperature schedule's length); a refused setting is a
    ConfigError naming it."""
    if q.type in PEER_SECTIONS:
        check_peer_kwargs(q.type, getattr(q, q.type))
    # the peer checks its keyword arguments with TypeError/assert; ours say ValueError
    refused = (ValueError, TypeError, AssertionError) if q.type in PEER_TYPES else (ValueError,)
    try:
        return build_quantizer_from_config(q.type, quantizer_kwargs(q, dim, steps))
    except refused as err:
        what = (f"quantizer.{q.type} (passed to vector_quantize_pytorch.{PEER_SECTIONS[q.type][0]})"
                if q.type in PEER_SECTIONS else "quantizer.*")
        raise ConfigError(f"config keys {what}: the {q.type} quantizer refuses these settings: "
                          f"{one_line(err) or type(err).__name__}") from None


#: quantizer types that wrap vector-quantize-pytorch (its checks raise TypeError/AssertionError too)
PEER_TYPES = ("vqp", "fsq", "simvq", "lfq")
#: quantizer.<type> sections passed to a vector-quantize-pytorch class: type -> (the class, keywords our wrapper adds)
PEER_SECTIONS = {"vqp": ("VectorQuantize", ()), "simvq": ("SimVQ", ("codebook_bias", "data_init")), "lfq": ("LFQ", ())}


def check_peer_kwargs(qtype: str, kwargs: Dict[str, Any]) -> None:
    """Every key of ``quantizer.<qtype>`` is a keyword argument of the vector-quantize-pytorch class it goes to."""
    name, ours = PEER_SECTIONS[qtype]
    try:
        import vector_quantize_pytorch
    except ImportError:
        return  # the quantizer says how to install it
    params = inspect.signature(getattr(vector_quantize_pytorch, name).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [p for p in params if p not in ("self", "dim", "codebook_size", "channel_first")] + list(ours)
    for key in kwargs:
        if key not in valid:
            full = f"quantizer.{qtype}.{key}"
            raise ConfigError(f"unknown config key {full!r} (not a keyword argument of vector_quantize_pytorch."
                              f"{name}); {did_you_mean(full, [f'quantizer.{qtype}.{v}' for v in valid])}")


def quantizer_kwargs(q: QuantizerConfig, dim: int, steps: Optional[int] = None) -> Dict[str, Any]:
    """The configured quantizer's constructor arguments as plain values (written to config.json); ``decay`` only
    when set; the peers' sections as they are. ``steps``: a DDCL temperature schedule's length."""
    kwargs: Dict[str, Any] = dict(num_codes=q.num_codes, dim=dim)
    kwargs.update({name: getattr(q, name) for name in quantizer_keys(q.type)
                   if not (name in PER_QUANTIZER_DEFAULT and getattr(q, name) is None)})
    if "schedule_steps" in inspect.signature(QUANTIZER_TYPES[q.type].__init__).parameters:
        kwargs["schedule_steps"] = steps
    if q.type in ("vqp", "simvq", "lfq"):  # their sections' keyword arguments, as they are
        kwargs.update(copy.deepcopy(getattr(q, q.type)))
    if q.type == "fsq" and q.fsq_levels is not None:
        kwargs["levels"] = list(q.fsq_levels)
    return kwargs


def model_config(cfg: Config, in_channels: int) -> Dict[str, Any]:
    """``VQVAE.from_config``'s config for this training config (what config.json of an export holds)."""
    m = cfg.model
    if m.arch == "vqgan":  # diffusers' VQModel encoder/decoder (ddcl_vq.models.vqgan)
        common = dict(ch=m.ch, ch_mult=list(m.ch_mult), num_res_blocks=m.num_res_blocks,
                      attn_resolutions=list(m.attn_resolutions), resolution=cfg.data.image_size,
                      z_channels=m.z_channels, latent_dim=m.latent_dim, norm_groups=m.norm_groups)
    else:
        common = dict(channels=m.channels, num_res_blocks=m.num_res_blocks, num_downsamples=m.num_downsamples,
                      latent_dim=m.latent_dim, res_hidden=m.res_hidden)
    return {"format": CONFIG_FORMAT, **({"arch": "vqgan"} if m.arch == "vqgan" else {}),
            "encoder_kwargs": dict(in_channels=in_channels, **common),
            "decoder_kwargs": dict(out_channels=in_channels, **common), "quantizer_type": cfg.quantizer.type,
            "quantizer_kwargs": quantizer_kwargs(cfg.quantizer, m.latent_dim, cfg.train.steps)}


def build_model(cfg: Config, in_channels: int) -> VQVAE:
    """``VQVAE.from_config(model_config(cfg, in_channels))``, a refused quantizer setting a ConfigError."""
    config = model_config(cfg, in_channels)
    # built in this order (encoder, quantizer, decoder), as from_config does: initialisation follows the seed
    encoder_cls, decoder_cls = architecture(config.get("arch", "vqvae"))
    encoder = encoder_cls(**config["encoder_kwargs"])
    model = VQVAE(encoder, build_quantizer(cfg.quantizer, cfg.model.latent_dim, cfg.train.steps),
                  decoder_cls(**config["decoder_kwargs"]))
    model.config = config
    return model


def build_optimizer(model: VQVAE, t: TrainConfig, quantizer_type: str = "") -> torch.optim.Optimizer:
    """AdamW: encoder/decoder at ``lr``, a codebook trained by gradient at ``codebook_lr_ratio``·lr."""
    codebook = [p for p in model.quantizer.parameters() if p.requires_grad]
    ids = {id(p) for p in codebook}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": rest, "lr": t.lr, "weight_decay": t.weight_decay, "name": "encoder_decoder"}]
    if codebook:
        groups.append({"params": codebook, "lr": t.lr * t.codebook_lr_ratio, "weight_decay": 0.0, "name": "codebook"})
    return torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.99))


def lr_lambda(t: TrainConfig):
    """The tokenizer's learning-rate factor: ``train.lr_schedule`` over ``train.steps`` (cosine to 10%, no warm-up)."""
    return lr_schedule(t.steps, t.lr_schedule, warmup=0, floor=0.1)

