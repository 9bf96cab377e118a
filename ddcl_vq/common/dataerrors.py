"""What the data modules raise when a dataset or an image cannot be had, and the grey-to-colour step both the
image-folder reader (:mod:`~ddcl_vq.common.data`) and the seeded crop (:mod:`~ddcl_vq.common.augment`) share."""
from __future__ import annotations

from torch import Tensor

from ddcl_vq.common.errors import UserError


class DataUnavailable(UserError, RuntimeError):
    """A dataset could not be found or downloaded; the message names the ways to get it."""


class UnreadableImage(DataUnavailable):
    """An image file of an image folder cannot be read or decoded; the message names the file."""


CHECK_HINT = "`ddcl-vq train --config CONFIG --check-data` lists every unreadable image"


def three_channels(x: Tensor) -> Tensor:
    """A (1, H, W) grey image (a high-bit-depth file, loaded as one float channel) as (3, H, W)."""
    return x.expand(3, -1, -1).contiguous() if x.shape[0] == 1 else x
