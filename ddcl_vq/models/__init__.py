"""Models built on ddcl_vq: the encoder, decoder and ``VQVAE`` that plugs any ddcl_vq quantizer in
between (``vqvae``), and the patch transformer of the readout study (``patch_transformer``)."""
from ddcl_vq.models.patch_transformer import PatchTransformer
from ddcl_vq.models.vqvae import VQVAE, Decoder, Encoder, ResidualBlock, VQVAEOutput

__all__ = ["VQVAE", "VQVAEOutput", "Encoder", "Decoder", "ResidualBlock", "PatchTransformer"]
