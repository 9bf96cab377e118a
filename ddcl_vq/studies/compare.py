"""``ddcl-vq compare RUN_DIR ... --out DIR``: one table and a few plots over several runs.

Every run is evaluated first unless a fresh evaluation exists (:mod:`.freshness`: made from the
run's newest checkpoint, same step, file and content, on the same split and number of images,
without config overrides). The runs must share one dataset (name, image size, channels; the
folder for image_folder): compare refuses runs of different datasets before any work. Writes
into DIR, all at once when everything is computed (nothing partial is left on a failure):

  table.md  table.csv  table.json       one row per run (columns defined in COLUMN_DEFINITIONS; a run
                                        whose quantizer has several codebooks adds per-level columns
                                        to table.csv and table.json, PER_LEVEL_COLUMN_DEFINITIONS)
  usage_histograms.png                  sorted per-code usage counts, log scale, one panel per run
  usage_over_training.png               windowed utilization and perplexity from metrics.jsonl
  psnr_vs_utilization.png               hard-code PSNR against utilization
  reconstructions.png                   the same test images decoded from each run's hard codes
  evals/                                evaluations compare made that it could not keep in a run
                                        directory (read-only, or holding an `evaluate` result)
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ddcl_vq.common.data import SPLITS
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.rundir import writable_dir
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.common.threads import set_threads, threads_option
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE, EvaluateError
from ddcl_vq.studies.freshness import ensure_eval, needs_eval
from ddcl_vq.tokenizer.metrics import DEFINITIONS_HINT, definitions
from ddcl_vq.studies.plots import write_plots
from ddcl_vq.studies.tables import column_definitions, make_row, markdown_table, unique_names, write_tables

__all__ = ["compare", "check_one_dataset", "CompareWriteError", "main", "needs_eval"]


def dataset_of(run_dir: Path) -> str:
    """A run's dataset as compare tells them apart: ``name CxSxS`` (+ image_folder's folder, the test photographs)."""
    from ddcl_vq.tokenizer.config import load_config
    from ddcl_vq.common.data import image_channels
    if not (Path(run_dir) / "config.yaml").is_file():
        raise EvaluateError(f"run directory {str(run_dir)!r} has no config.yaml (was it written by ddcl-vq train?)")
    data = load_config(Path(run_dir) / "config.yaml").data
    text = f"{data.name} {image_channels(data)}x{data.image_size}x{data.image_size}"
    if data.name == "image_folder":
        text += f" from {str(Path(data.root).expanduser().resolve())!r}"
    if data.name == "natural_patches":  # other test photographs are other data
        text += f" (test photographs {', '.join(data.test_photos)})"
    return text


def check_one_dataset(run_dirs: Sequence[Path]) -> str:
    """The dataset every run shares, or an EvaluateError naming which run has which."""
    found = {Path(d): dataset_of(d) for d in run_dirs}
    kinds = sorted(set(found.values()))
    if not kinds:
        raise EvaluateError("expected at least one run directory to compare")
    if len(kinds) > 1:
        groups = "; ".join(f"{kind}: {', '.join(str(d) for d, k in found.items() if k == kind)}" for kind in kinds)
        raise EvaluateError(f"the runs were trained on different datasets ({groups}); compare runs of one dataset "
                            "at a time")
    return kinds[0]


class CompareWriteError(EvaluateError):
    """The comparison was computed but its files could not be written; ``rows`` holds it."""

    def __init__(self, rows: List[Dict], message: str):
        super().__init__(message)
        self.rows = rows


def compare(run_dirs: Sequence[str | Path], out_dir: str | Path, split: str = "test", max_images: int = 0,
            batch_size: int = EVAL_BATCH_SIZE, names: Optional[Sequence[str]] = None, grid_images: int = 8,
            progress: bool = False, command: Optional[str] = None) -> List[Dict]:
    """Evaluate (when needed) and compare ``run_dirs`` into ``out_dir``, all files moved into place at the end
    (CompareWriteError, holding the rows, when writing fails)."""
    run_dirs = [Path(d) for d in run_dirs]
    for d in run_dirs:
        if not d.is_dir():
            raise EvaluateError(f"run directory {str(d)!r} does not exist")
    check_one_dataset(run_dirs)  # before any evaluation or output
    out = writable_dir(Path(out_dir), "--out")  # before the evaluations
    evals = [ensure_eval(d, split, max_images, batch_size, progress, store=out / "evals") for d in run_dirs]
    rows = [make_row(d, ev, n) for d, ev, n in zip(run_dirs, evals, names or unique_names(run_dirs))]
    try:
        with tempfile.TemporaryDirectory(prefix=".compare-", dir=out, ignore_cleanup_errors=True) as staging:
            write_tables(Path(staging), rows, evals, split, max_images, command)
            write_plots(Path(staging), run_dirs, [r["name"] for r in rows], evals, rows, split, grid_images)
            for path in sorted(Path(staging).iterdir()):  # into place, each file by one rename (atomic per file)
                os.replace(path, out / path.name)
    except OSError as err:
        raise CompareWriteError(rows, f"could not write the comparison into {str(out)!r} "
                                      f"({type(err).__name__}: {err.strerror or err})") from None
    return rows


def distinct_runs(run_dirs: Sequence[str]) -> List[str]:
    """``run_dirs`` with a run given twice kept once, with a note on stderr."""
    kept: Dict[Path, str] = {}
    for d in run_dirs:
        key = Path(d).resolve()
        if key in kept:
            print(f"note: {d!r} is the run {kept[key]!r} again; compared once", file=sys.stderr)
        else:
            kept[key] = d
    return list(kept.values())


@dataclass(kw_only=True)
class CompareOptions:
    run_dirs: List[str] = option(help="run directories written by ddcl-vq train", positional=True, nargs="+",
                                 metavar="RUN_DIR")
    out: str = option(help="output directory for tables and plots")
    split: str = option("test", "dataset split")
    max_images: int = option(0, "images per evaluation (0 = whole split)")
    batch_size: int = option(EVAL_BATCH_SIZE, "images per batch")
    grid_images: int = option(8, "test images in reconstructions.png")
    quiet: bool = option(False, "no table on stdout")
    verbose: bool = option(False, "print the definitions of the columns and figures after the table")
    threads: Optional[int] = threads_option()


OPTIONS = Options(CompareOptions, prog="ddcl-vq compare", description=__doc__,
                  rules=Rules(choices={"split": SPLITS}, positive={"batch_size", "threads"},
                              non_negative={"max_images", "grid_images"}))


@entry_point("ddcl-vq compare")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    set_threads(opts.threads)
    cmd = shlex.join(["ddcl-vq", "compare"] + list(sys.argv[1:] if argv is None else argv))
    run_dirs = distinct_runs(opts.run_dirs)
    try:
        rows = compare(run_dirs, opts.out, opts.split, opts.max_images, opts.batch_size,
                       grid_images=opts.grid_images, progress=not opts.quiet, command=cmd)
    except CompareWriteError as err:
        print(markdown_table(err.rows))  # the results, even when they cannot be saved
        raise
    if not opts.quiet:
        print(markdown_table(rows))
        print(f"wrote table.md, table.csv, table.json (every column) and 4 plots to {opts.out}")
        per_level = any("utilization_per_level" in r for r in rows)
        print("\ndefinitions:\n" + column_definitions(rows) + "\n" + definitions(per_level) if opts.verbose else
              DEFINITIONS_HINT.replace("--verbose, or", "--verbose, table.md, or"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
