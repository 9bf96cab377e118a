"""Config schema, datasets, training loop, checkpoints and the ``train`` command."""
