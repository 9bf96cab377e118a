"""The image tokenizer (a VQ-VAE or VQGAN around any ddcl_vq quantizer): ``ddcl-vq train``, ``evaluate``, ``gap``,
``export``, ``tokenize``, ``decode``."""
