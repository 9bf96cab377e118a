"""``ddcl-vq readout-study``: DDCL readout vs mean pooling vs a class token, plus the compressor (docs/guide/readout.md)."""
