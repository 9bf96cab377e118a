"""``python -m ddcl_vq COMMAND ...`` = ``ddcl-vq COMMAND ...`` (``torchrun --nproc_per_node 2 -m ddcl_vq train``)."""
from .cli import main

raise SystemExit(main())
