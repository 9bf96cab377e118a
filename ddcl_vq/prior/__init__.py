"""``ddcl-vq prior train|sample|evaluate|study``: a transformer prior over a tokenizer's codes (docs/guide/prior.md)."""
