"""``ddcl-vq train`` / ``python -m ddcl_vq train`` / ``torchrun ... -m ddcl_vq train``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, Rules, option

HELP = """\
Train a VQ-VAE from a YAML config. Dotted key=value overrides follow the options, e.g.

  ddcl-vq train --config configs/fashion_ddcl.yaml train.steps=200 quantizer.temperature=0.02

A run resumes from RUN_DIR/checkpoints when they exist (kill it and start the same
command again), with the config it was trained with: a change to the model, optimizer, data or
a schedule is refused (more train.steps, logging and checkpoint intervals may change);
--config RUN_DIR/config.yaml continues a run as it was. One training at a time per run
directory (RUN_DIR/train.lock). Multi-process: torchrun --nproc_per_node 2 -m ddcl_vq train --config ...

train.threads: torch CPU threads per process (default null = auto: OMP_NUM_THREADS if set, one per process
under torchrun, else the cores that are idle when the run starts, at most 4; the first line says which and
why, and a resumed run keeps the count it was trained with).
"""


@dataclass(kw_only=True)
class TrainOptions:
    config: str = option(help="YAML config (see configs/)")
    overrides: List[str] = option(default_factory=list, help="dotted config overrides", positional=True, nargs="*",
                                  metavar="key=value")
    quiet: bool = option(False, "no progress bar or summary")
    stop_after: Optional[int] = option(None, "leave after STEPS steps in this session with a checkpoint "
                                             "(pre-emptible jobs); the same command resumes", metavar="STEPS")
    print_config: bool = option(False, "print the resolved config and exit")
    check_data: bool = option(False, "read every image of both splits (an image folder: decode each file), list "
                                     "those that cannot be read, and exit (status 2 if any)")


OPTIONS = Options(TrainOptions, prog="ddcl-vq train", description=HELP, rules=Rules(positive={"stop_after"}),
                  intermixed=True)


@entry_point("ddcl-vq train")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)

    from ddcl_vq.tokenizer.config import dump_config, load_config
    # a run directory's own config.yaml (next to its checkpoints) is read as evaluate reads it:
    # keys of older versions migrated, so that an old run continues as it was trained
    from ddcl_vq.common.rundir import note
    from ddcl_vq.tokenizer.config import follow_run_dir, run_dir_of_config
    cfg = load_config(opts.config, opts.overrides, migrate=run_dir_of_config(opts.config) is not None)
    # RUN_DIR/config.yaml trains RUN_DIR, also after cp -a or mv (its saved run.dir is stale then)
    moved = follow_run_dir(cfg, opts.config, opts.overrides)
    if moved and os.environ.get("RANK", "0") == "0":
        note(moved)
    if opts.print_config:
        print(dump_config(cfg), end="")
        return 0
    if opts.check_data:
        from ddcl_vq.common.data import UnreadableImage, check_data
        report, bad = check_data(cfg.data, cfg.run.seed)
        print("\n".join(report))
        for path, reason in bad:
            print(f"unreadable: {path} ({reason})")
        if bad:
            raise UnreadableImage(f"{len(bad)} image(s) cannot be read (listed above); replace or remove them")
        print("every image can be read")
        return 0
    from ddcl_vq.tokenizer.train import teardown_distributed, train
    from ddcl_vq.common.threads import set_threads
    set_threads(cfg.train.threads)  # per process (under torchrun: each of them); the run's first line says why
    train(cfg, quiet=opts.quiet, stop_after=opts.stop_after)
    teardown_distributed()  # after success only: a barrier after a failure could hang
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
