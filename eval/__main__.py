"""``python -m ddcl_vq.eval COMMAND ...`` = ``ddcl-vq COMMAND ...`` (``torchrun ... -m ddcl_vq.eval evaluate RUN_DIR``)."""
import sys

from .cli import main

sys.exit(main())
