"""Training: ``config`` (the typed experiment config), ``settings`` (the typed-settings machinery every command's
settings go through), ``errors`` (``UserError``, the one error base class, and ``entry_point``, which prints it as one
line), ``data``, ``builders``, ``loop``, ``checkpoint``, ``testset`` and the ``train`` command (``cli``; ``python -m
ddcl_vq.train``, ``torchrun ... -m ddcl_vq.train``). Installed as ``ddcl_vq.train``."""
