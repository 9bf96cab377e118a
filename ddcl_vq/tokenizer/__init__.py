"""The image tokenizer (a VQ-VAE or VQGAN around any ddcl_vq quantizer): its config, training loop and
losses (``ddcl-vq train``), evaluation and metrics (``evaluate``, ``gap``), and what uses a trained one
(``export``, ``tokenize``, ``decode`` and the token file format)."""
