"""What both export formats share (:mod:`.export`, the ddcl-vq folder; :mod:`.export_diffusers`, a
plain diffusers ``VQModel`` folder): the error they raise and the fixed batch the written folder is
checked on before the command returns."""
from __future__ import annotations

import warnings

import torch

from ddcl_vq.train.errors import UserError


class ExportError(UserError, RuntimeError):
    """The run cannot be exported as asked (output folder in the way, upload failed, ...)."""


def check_inputs(model, cfg) -> torch.Tensor:
    """A fixed batch to check the export on: the first test images, or seeded noise offline."""
    from ddcl_vq.train.data import build_dataset, image_channels

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            test = build_dataset(cfg.data, "test", cfg.run.seed)
        return torch.stack([test[i][0] for i in range(min(16, len(test)))])
    except UserError:
        g = torch.Generator().manual_seed(0)
        size = cfg.data.image_size
        return torch.rand(16, image_channels(cfg.data), size, size, generator=g)
