"""A VQ-VAE in the style of van den Oord et al. (2017): strided convs + residual blocks.

Encoder: (B, C, H, W) -> (B, D, H/f, W/f), f = 2**num_downsamples.
Decoder: (B, D, H/f, W/f) -> (B, C, H, W).
VQVAE:   encoder -> any ddcl_vq quantizer -> decoder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ddcl_vq import Quantizer, QuantizerOutput


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


class VQVAE(nn.Module):
    """encoder -> quantizer -> decoder; any ``ddcl_vq.Quantizer`` (channel-first) plugs in."""

    def __init__(self, encoder: nn.Module, quantizer: Quantizer, decoder: nn.Module):
        super().__init__()
        if getattr(quantizer, "channel_dim", 1) != 1:
            raise ValueError(f"expected a channel-first quantizer (channel_dim=1), got channel_dim={quantizer.channel_dim}")
        self.encoder, self.quantizer, self.decoder = encoder, quantizer, decoder

    def forward(self, x: Tensor) -> VQVAEOutput:
        q = self.quantizer(self.encoder(x))
        return VQVAEOutput(reconstruction=self.decoder(q.quantized), quantizer=q)

    @torch.no_grad()
    def encode_indices(self, x: Tensor) -> Tensor:
        """(B, C, H, W) images -> (B, h, w) long code indices."""
        return self.quantizer(self.encoder(x)).indices

    def decode_indices(self, indices: Tensor) -> Tensor:
        """(B, h, w) long indices -> (B, C, H, W) reconstruction from the hard codes."""
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
