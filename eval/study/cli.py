"""``ddcl-vq study`` / ``python -m ddcl_vq.eval.study``: the command and its options."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import List, Optional

from . import config
from .config import load_study
from .run import StudyError, arm_status, run_study


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ddcl-vq study", description=config.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="study YAML (configs/study_*.yaml)")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few steps, few eval images (smoke test)")
    parser.add_argument("--out", default=None, help="report directory (default: the study's 'out', "
                                                     "or reports/<name>; '_quick' appended with --quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: evaluate and report the arms whose training has finished")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0 = torch's default; 1 is fastest on a loaded machine)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="arms trained at once, each in its own process (default 1: in this process)")
    parser.add_argument("--verbose", action="store_true", help="show each arm's training progress (--jobs 1)")
    parser.add_argument("--list", action="store_true", help="print the arms and their status, then exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides for every arm")
    args = parser.parse_intermixed_args(argv)

    from ddcl_vq.train.checkpoint import CheckpointError
    from ddcl_vq.train.config import ConfigError
    from ddcl_vq.train.data import DataUnavailable

    from ddcl_vq.eval.evaluation.evaluate import EvaluateError

    command = shlex.join(["ddcl-vq", "study"] + list(sys.argv[1:] if argv is None else argv))
    if args.threads < 0 or args.jobs < 1:
        print(f"ddcl-vq study: error: expected --threads >= 0 and --jobs >= 1, got {args.threads} and {args.jobs}",
              file=sys.stderr)
        return 2
    try:
        study = load_study(args.config, quick=args.quick, out=args.out, overrides=args.overrides)
        if args.list:
            for arm in study.arms:
                print(f"{arm.name:40s} {arm_status(arm):28s} {' '.join(arm.overrides)}")
            return 0
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        result = run_study(study, train_arms=not args.report_only, progress=True, verbose=args.verbose,
                           command=command, jobs=args.jobs, threads=args.threads)
    except (ConfigError, StudyError, EvaluateError, CheckpointError, DataUnavailable) as err:
        print(f"ddcl-vq study: error: {err}", file=sys.stderr)
        return 2
    from ddcl_vq.eval.evaluation.compare import markdown_table
    print(markdown_table(result["rows"]))
    print(f"\nreport: {study.out / 'report.md'}")
    if result["failed"] or result["unfinished"]:
        print(f"not in the table: {', '.join(list(result['failed']) + result['unfinished'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
