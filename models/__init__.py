"""Encoder, decoder and the VQVAE that plugs any ddcl_vq quantizer in between."""
