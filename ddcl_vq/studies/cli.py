"""``ddcl-vq study`` / ``python -m ddcl_vq study``: the command and its options."""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import List, Optional

from ddcl_vq.common.errors import entry_point, where
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.common.threads import set_threads, threads_option

from ddcl_vq.studies import study as study_module
from ddcl_vq.studies.study import arm_status, load_study, run_study


@dataclass(kw_only=True)
class StudyOptions:
    config: str = option(help="study YAML (configs/study_*.yaml)")
    quick: bool = option(False, "tiny model, a few steps, few eval images (smoke test)")
    out: Optional[str] = option(None, "report directory", default_text="the study's 'out', or reports/<name>; "
                                                                        "'_quick' appended with --quick")
    report_only: bool = option(False, "train nothing: evaluate and report the arms whose training has finished")
    threads: Optional[int] = threads_option("torch intra-op threads: of this process (training with --jobs 1, "
                                            "evaluation), and of each training process with --jobs > 1 (there "
                                            "default 1); an arm's train.threads wins")
    jobs: int = option(1, "arms trained at once, each in its own process; 1: in this process")
    verbose: bool = option(False, "show each arm's training progress (--jobs 1)")
    list_arms: bool = option(False, "print the arms and their status, then exit", flag="--list")
    seeds: Optional[List[int]] = option(None, "run every arm x sweep point once per seed, replacing the study's "
                                        "'seeds' (table: mean ± sd)", sep=",", metavar="SEED,...",
                                        default_text="the study's 'seeds', else one run with the base's run.seed")
    arms: List[str] = option(default_factory=list, help="only the arms whose run name, or name without the "
                             "_s<seed> suffix, matches one of these shell patterns (e.g. '*_k256,hard*')",
                             sep=",", metavar="PATTERN,...", default_text="every arm")
    overrides: List[str] = option(default_factory=list, help="dotted overrides for every arm", positional=True,
                                  nargs="*", metavar="key=value")


OPTIONS = Options(StudyOptions, prog="ddcl-vq study", description=study_module.__doc__, intermixed=True,
                  rules=Rules(positive={"jobs"}, non_negative={"threads"}))


@entry_point("ddcl-vq study")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    command = shlex.join(["ddcl-vq", "study"] + list(sys.argv[1:] if argv is None else argv))
    study = load_study(opts.config, quick=opts.quick, out=opts.out, overrides=opts.overrides, seeds=opts.seeds,
                       only=opts.arms)
    if opts.list_arms:
        for arm in study.arms:
            print(f"{arm.name:40s} {arm_status(arm):28s} {' '.join(arm.overrides)}")
        return 0
    set_threads(opts.threads)
    from ddcl_vq.studies.parts import run_parts  # a study with parts (held-out data): one comparison per part
    result = (run_parts if study.parts else run_study)(study, train_arms=not opts.report_only, progress=True,
                                                       verbose=opts.verbose, command=command, jobs=opts.jobs,
                                                       threads=opts.threads)
    from ddcl_vq.studies.tables import markdown_table, mean_sd_table
    if study.parts:
        print(result["summary"])
    else:
        print(markdown_table(result["rows"]) if result["groups"] is None else mean_sd_table(result["groups"]))
    print(f"\nreport: {where(study.out / 'report.md')}")
    if result["failed"] or result["unfinished"]:
        print(f"not in the table: {', '.join(list(result['failed']) + result['unfinished'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
