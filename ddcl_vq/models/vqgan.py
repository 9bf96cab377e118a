"""The VQGAN encoder and decoder (taming-transformers / diffusers ``VQModel``), around any ddcl_vq quantizer: built on
diffusers' own ``Encoder`` and ``Decoder`` (GroupNorm + SiLU ResNet blocks, attention in the middle block and in the
blocks at taming's ``attn_resolutions``)::

    VQGANEncoder: (B, C, H, W) -> diffusers Encoder -> (B, z_channels, h, w) -> quant_conv 1x1 -> (B, D, h, w)
    VQGANDecoder: (B, D, h, w) -> post_quant_conv 1x1 -> (B, z_channels, h, w) -> diffusers Decoder -> (B, C, H, W)

h = H / 2**(len(ch_mult) - 1). The parameter names match ``VQModel``'s, so :func:`diffusers_state_dict` +
:func:`diffusers_config` give a folder plain ``VQModel.from_pretrained`` loads (``ddcl-vq export --format diffusers``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

def block_types(ch_mult: Sequence[int], attn_resolutions: Sequence[int], resolution: int
                ) -> Tuple[List[str], List[str]]:
    """diffusers' (down_block_types, up_block_types) for taming's ch_mult / attn_resolutions."""
    n = len(ch_mult)
    attn = set(int(r) for r in attn_resolutions)
    down = ["AttnDownEncoderBlock2D" if resolution // 2 ** i in attn else "DownEncoderBlock2D" for i in range(n)]
    up = ["AttnUpDecoderBlock2D" if resolution // 2 ** (n - 1 - i) in attn else "UpDecoderBlock2D" for i in range(n)]
    return down, up


def _diffusers_vae():
    try:
        from diffusers.models.autoencoders import vae
    except ImportError as err:  # pragma: no cover - diffusers is a dependency of the dev extra
        raise ImportError("model.arch vqgan is built on diffusers' VQModel encoder/decoder: pip install diffusers "
                          f"({err})") from None
    return vae


class VQGANEncoder(nn.Module):
    """diffusers' Encoder (taming's layout) + VQModel's quant_conv to the codebook dimension ``latent_dim``."""

    def __init__(self, in_channels: int = 3, ch: int = 128, ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, attn_resolutions: Sequence[int] = (16,), resolution: int = 256,
                 z_channels: int = 256, latent_dim: int = 256, norm_groups: int = 32):
        super().__init__()
        down, _ = block_types(ch_mult, attn_resolutions, resolution)
        self.encoder = _diffusers_vae().Encoder(
            in_channels=in_channels, out_channels=z_channels, down_block_types=tuple(down),
            block_out_channels=tuple(ch * m for m in ch_mult), layers_per_block=num_res_blocks,
            norm_num_groups=norm_groups, act_fn="silu", double_z=False, mid_block_add_attention=True)
        self.quant_conv = nn.Conv2d(z_channels, latent_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.quant_conv(self.encoder(x))


class VQGANDecoder(nn.Module):
    """VQModel's post_quant_conv + diffusers' Decoder; ``last_layer`` is its output conv's weight."""

    def __init__(self, out_channels: int = 3, ch: int = 128, ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
                 num_res_blocks: int = 2, attn_resolutions: Sequence[int] = (16,), resolution: int = 256,
                 z_channels: int = 256, latent_dim: int = 256, norm_groups: int = 32):
        super().__init__()
        _, up = block_types(ch_mult, attn_resolutions, resolution)
        self.post_quant_conv = nn.Conv2d(latent_dim, z_channels, 1)
        self.decoder = _diffusers_vae().Decoder(
            in_channels=z_channels, out_channels=out_channels, up_block_types=tuple(up),
            block_out_channels=tuple(ch * m for m in ch_mult), layers_per_block=num_res_blocks,
            norm_num_groups=norm_groups, act_fn="silu", norm_type="group", mid_block_add_attention=True)

    @property
    def last_layer(self) -> nn.Parameter:
        return self.decoder.conv_out.weight

    def forward(self, z: Tensor) -> Tensor:
        return self.decoder(self.post_quant_conv(z))


def diffusers_config(model: Dict[str, Any], num_codes: int) -> Dict[str, Any]:
    """``diffusers.VQModel``'s constructor arguments for a VQGAN of ``model`` (its arguments), ``num_codes`` codes."""
    e = dict(model)
    ch, ch_mult = e.get("ch", 128), list(e.get("ch_mult", (1, 1, 2, 2, 4)))
    down, up = block_types(ch_mult, e.get("attn_resolutions", (16,)), e.get("resolution", 256))
    return {"in_channels": e.get("in_channels", 3), "out_channels": e.get("in_channels", 3),
            "down_block_types": down, "up_block_types": up, "block_out_channels": [ch * m for m in ch_mult],
            "layers_per_block": e.get("num_res_blocks", 2), "act_fn": "silu",
            "latent_channels": e.get("z_channels", 256), "sample_size": e.get("resolution", 256),
            "num_vq_embeddings": int(num_codes), "norm_num_groups": e.get("norm_groups", 32),
            "vq_embed_dim": e.get("latent_dim", 256), "norm_type": "group", "mid_block_add_attention": True,
            "lookup_from_codebook": False, "force_upcast": False}


def diffusers_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """``VQModel``'s state dict from a VQGAN VQVAE, the hard codebook (K, D) as ``quantize.embedding.weight``."""
    if not isinstance(model.encoder, VQGANEncoder) or not isinstance(model.decoder, VQGANDecoder):
        raise ValueError(f"expected a VQGAN (VQGANEncoder / VQGANDecoder), got {type(model.encoder).__name__} / "
                         f"{type(model.decoder).__name__}")
    # encoder.*, quant_conv.*, post_quant_conv.*, decoder.*: as VQModel names them
    out = {**model.encoder.state_dict(), **model.decoder.state_dict(),
           "quantize.embedding.weight": model.quantizer.codebook.detach().to(torch.float32)}
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
