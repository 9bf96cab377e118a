"""``ddcl-vq readout-study``: DDCL readout vs mean pooling vs a class token, plus the compressor.

One small patch transformer on real Fashion-MNIST, trained once per readout arm at the same budget (same steps, batch,
learning rate, seed, data order and encoder initialisation); then the hierarchical compressor on the DDCL arm's frozen
token features. Writes ``results.json``, ``report.md`` and PNG plots to ``--out``.

Modules: ``compressor`` (the hierarchical compressor on frozen tokens, measured), ``report`` (report.md and plots),
``cli`` (the command and its options). The arms, their data and their training loop are :mod:`ddcl_vq.studies.readout.train`;
the model is :class:`ddcl_vq.models.PatchTransformer`.
"""
