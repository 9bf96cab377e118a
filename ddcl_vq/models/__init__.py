"""Models built on ddcl_vq: ``VQVAE`` (any ddcl_vq quantizer), VQGAN parts, the prior, the readout study's model."""
from ddcl_vq.models.patch_transformer import PatchTransformer
from ddcl_vq.models.vqvae import VQVAE, Decoder, Encoder, ResidualBlock, VQVAEOutput

__all__ = ["VQVAE", "VQVAEOutput", "Encoder", "Decoder", "ResidualBlock", "PatchTransformer"]
