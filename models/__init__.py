"""Encoder, decoder and the VQVAE that plugs any ddcl_vq quantizer in between."""
from .vqvae import VQVAE, Decoder, Encoder, ResidualBlock, VQVAEOutput

__all__ = ["VQVAE", "VQVAEOutput", "Encoder", "Decoder", "ResidualBlock"]
