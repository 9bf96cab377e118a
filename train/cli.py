"""``ddcl-vq train`` / ``python -m ddcl_vq.train`` / ``torchrun ... -m ddcl_vq.train``."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

HELP = """\
Train a VQ-VAE from a YAML config. Dotted key=value overrides follow the options, e.g.

  ddcl-vq train --config configs/fashion_ddcl.yaml train.steps=200 quantizer.temperature=0.02

A run resumes from RUN_DIR/checkpoints when they exist (kill it and start the same
command again). Multi-process: torchrun --nproc_per_node 2 -m ddcl_vq.train --config ...
"""


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ddcl-vq train", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    parser.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                        help="leave after STEPS steps in this session with a checkpoint (pre-emptible "
                             "jobs); the same command resumes")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)

    from .checkpoint import CheckpointError
    from .config import ConfigError, dump_config, load_config
    from .data import DataUnavailable

    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        from .loop import teardown_distributed, train
        train(cfg, quiet=args.quiet, stop_after=args.stop_after)
        teardown_distributed()  # after success only: a barrier after a failure could hang
    except (ConfigError, DataUnavailable, CheckpointError) as err:
        print(f"ddcl-vq train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
