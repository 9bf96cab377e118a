"""The toolkit's jobs beyond training, and the ``ddcl-vq`` command (``cli``; also ``python -m ddcl_vq.eval
COMMAND``): measuring a trained model (``evaluate``, ``metrics``, ``compare``, ``gap``, and a subpackage per job:
``study``, ``bench``, ``readout``, ``prior``) and using it (``use``); docs/design.md's Layout says what each holds.

Installed as ``ddcl_vq.eval``; it may import ddcl_vq, ddcl_vq.models and ddcl_vq.train.
"""
