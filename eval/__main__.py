"""``python -m ddcl_vq.eval COMMAND ...`` = ``ddcl-vq COMMAND ...`` (``torchrun ... -m ddcl_vq.eval evaluate RUN_DIR``)."""
from .cli import main

raise SystemExit(main())
