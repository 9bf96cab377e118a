"""``ddcl-vq readout-study`` / ``python -m ddcl_vq readout-study``: the command and its options."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from ddcl_vq.common.machine import describe_machine
from ddcl_vq.readout import DEFAULT_PROTOTYPE_LR_RATIO, DEFAULT_TEMPERATURE
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import ConfigError, Options, Rules, option

from ddcl_vq.studies.readout.train import ARMS, load_patches, train_arm

from ddcl_vq.studies.readout.compressor import run_compressor
from ddcl_vq.studies.readout.report import plots, report

HELP = """\
Train a small transformer encoder over 4x4 image patches of real Fashion-MNIST (49 tokens,
dim 64, 2 layers, 4 heads) once per readout arm, at the same budget (steps, batch, lr, seed,
data order, encoder initialisation):

  mean  - mean pooling of the final tokens
  cls   - a class token
  ddcl  - the DDCL readout (ddcl_vq.DDCLReadout, library defaults): pooled = mean of the
          tokens' soft summaries (straight-through token gradient), loss = cross-entropy +
          readout.loss, the distortion computed on stop-gradient tokens (it trains the
          prototypes only); prototypes at --prototype-lr-ratio x lr

and reports test accuracy, wall time, and for DDCL the prototype utilization and perplexity
(dataset-level over the test tokens, ddcl_vq.CodebookUsage) and the decomposition identity
max |distortion - ols - variance| / distortion along training. Ablation arms (not default):
ddcl_soft (task gradient to the tokens only through q, the paper's readout), ddcl_joint
(ddcl_soft + the distortion also trains the encoder: the paper's joint form), ddcl_rho1 (prototype lr ratio 1), ddcl_ponly (the task
loss does not move the prototypes), ddcl_joint_rho1, ddcl_tau0.03, ddcl_tau0.3.

Then trains ddcl_vq.HierarchicalCompressor on the DDCL arm's frozen tokens (windows
--windows) and reports reconstruction error vs compression ratio, next to plain
window-mean pooling over the same windows.

Writes OUT/results.json, OUT/report.md, OUT/accuracy.png, OUT/ddcl_terms.png, OUT/compressor.png;
each arm trains in OUT/runs/<arm> (checkpoints, metrics.jsonl): the same command resumes a killed
study, and reuses the arms that finished.
The default budget (3 arms x 1,000 steps, 1 thread) takes about 6-7 minutes on a 2-core CPU;
--quick takes seconds (for tests).
"""


@dataclass(kw_only=True)
class ReadoutOptions:
    out: str = option("runs/readout_study", "output folder")
    quick: bool = option(False, "a seconds-long run on data subsets (for tests)")
    arms: List[str] = option(default_factory=lambda: ["mean", "cls", "ddcl"], sep=",", metavar="ARM,...",
                             help=f"comma list from {', '.join(ARMS)}")
    steps: int = option(1000, "training steps per arm")
    batch_size: int = option(128, "images per training batch")
    lr: float = option(1e-3, "Adam lr of every arm")
    seed: int = option(0, "seed of the initialisation and the data order")
    train_size: int = option(60000, "training images")
    test_size: int = option(10000, "test images (10000 = all)")
    eval_every: int = option(200, "steps between test-accuracy points")
    log_every: int = option(25, "steps per logged training record")
    patch: int = option(4, "patch size (4: 49 tokens)")
    dim: int = option(64, "token width")
    layers: int = option(2, "transformer layers")
    heads: int = option(4, "attention heads")
    num_prototypes: int = option(64, "K of the DDCL readout")
    temperature: float = option(DEFAULT_TEMPERATURE, "τ relative to D")
    prototype_init: str = option("kmeans", "DDCL prototypes: k-means on the first batch's tokens, or N(0, 1)")
    loss_weight: float = option(1.0, "λ in CE + λ·distortion/D")
    prototype_lr_ratio: float = option(DEFAULT_PROTOTYPE_LR_RATIO, "prototype lr / encoder lr (timescale condition: > 1)")
    windows: List[int] = option(default_factory=lambda: [2, 2, 2, 2, 2, 2], sep=",",
                                metavar="W,...", help="compressor window per stage")
    compressor_prototypes: int = option(64, "K per compressor stage")
    compressor_steps: int = option(300, "compressor training steps")
    compressor_lr: float = option(1e-2, "compressor Adam lr")
    compressor_train: int = option(8192, "training images whose tokens train the compressor")
    compressor_test: int = option(2000, "test images whose tokens measure it")
    no_compressor: bool = option(False, "skip the compressor part")
    threads: int = option(1, "torch CPU threads (on cores shared with other jobs, 2 threads ran a step 15x slower "
                             "than 1; on an idle machine 2 are about 1.7x faster)")
    no_progress: bool = option(False, "no tqdm progress bars")


QUICK = dict(steps=80, batch_size=64, lr=2e-3, eval_every=40, train_size=4096, test_size=1000,
             compressor_steps=10, compressor_train=256, compressor_test=128)
OPTIONS = Options(
    ReadoutOptions, prog="ddcl-vq readout-study", description=HELP, presets={"quick": QUICK},
    rules=Rules(choices={"arms": tuple(ARMS), "patch": (2, 4, 7, 14), "prototype_init": ("kmeans", "normal")},
                positive={"threads", "steps", "batch_size", "train_size", "test_size", "eval_every", "log_every",
                          "compressor_steps", "compressor_train", "compressor_test", "windows", "dim", "layers",
                          "heads", "num_prototypes", "temperature", "compressor_prototypes", "compressor_lr", "lr"},
                non_negative={"loss_weight", "prototype_lr_ratio"}))


def parse_args(argv: Optional[List[str]]) -> ReadoutOptions:
    opts = OPTIONS.parse(argv)
    for name in ("arms", "windows"):
        if not getattr(opts, name):
            raise ConfigError(f"option --{name}: expected a non-empty comma list, got none")
    return opts


@entry_point("ddcl-vq readout-study")
def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    show = not args.no_progress
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, out, show)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv: List[str], out: Path, show: bool) -> int:
    t_start = time.perf_counter()
    train_data = load_patches("train", args.train_size, args.patch, args.seed)
    test_data = load_patches("test", args.test_size, args.patch, args.seed + 1)
    cfg = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("out", "no_progress")}
    results = {"config": cfg, "num_tokens": int(train_data[0].shape[1]), "arms": {}}
    models = {}
    for name in args.arms:
        res, model = train_arm(name, args, train_data, test_data, out, show)
        results["arms"][name], models[name] = res, model
        u = res.get("usage")
        extra = (f", utilization {u['utilization']:.0%}, perplexity {u['perplexity']:.1f}, identity max "
                 f"{res['identity_max']:.1e}" if u else "")
        print(f"{name}: test accuracy {100 * res['test_accuracy']:.2f}%{extra}, train {res['train_wall_s']:.0f} s",
              flush=True)
    if not args.no_compressor:
        source = next((n for n in args.arms if ARMS[n][0] == "ddcl"), args.arms[0])
        results["compressor"] = run_compressor(args, models[source], train_data[0], test_data[0], show)
        for s in results["compressor"]["stages"]:
            print(f"compressor stage {s['stage']}: ratio x{s['cumulative_ratio']:.2f}, error "
                  f"{s['cumulative_error']:.3f} (window mean {s['window_mean_cumulative_error']:.3f})", flush=True)
    command = "ddcl-vq readout-study " + " ".join(shlex.quote(a) for a in argv)
    results["meta"] = {"command": command.strip(), "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                       "machine": describe_machine(), "python": platform.python_version(),
                       "total_wall_s": time.perf_counter() - t_start}
    results["plots"] = plots(results, out)
    results["meta"]["total_wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report(results))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plots "
          f"({results['meta']['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
