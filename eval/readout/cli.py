"""``ddcl-vq readout-study`` / ``python -m ddcl_vq.eval.readout``: the command and its options."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from ddcl_vq.eval.machine import describe_machine
from ddcl_vq.readout import DEFAULT_PROTOTYPE_LR_RATIO, DEFAULT_TEMPERATURE

from .compressor import run_compressor
from .data import load_patches
from .report import plots, report
from .training import ARMS, train_arm

DEFAULTS = dict(steps=1000, batch_size=128, lr=1e-3, eval_every=200, train_size=60000, test_size=10000,
                compressor_steps=300, compressor_train=8192, compressor_test=2000)

QUICK = dict(steps=80, batch_size=64, lr=2e-3, eval_every=40, train_size=4096, test_size=1000,
             compressor_steps=10, compressor_train=256, compressor_test=128)

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

Writes OUT/results.json, OUT/report.md, OUT/accuracy.png, OUT/ddcl_terms.png, OUT/compressor.png.
The default budget (3 arms x 1,000 steps, 1 thread) takes about 6-7 minutes on a 2-core CPU;
--quick takes seconds (for tests).
"""


def parse_args(argv: Optional[List[str]]):
    p = argparse.ArgumentParser(prog="ddcl-vq readout-study", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/readout_study", help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a seconds-long run on data subsets (for tests)")
    p.add_argument("--arms", default="mean,cls,ddcl", help=f"comma list from {', '.join(ARMS)} (default: %(default)s)")
    p.add_argument("--steps", type=int, help=f"training steps per arm (default {DEFAULTS['steps']}, quick {QUICK['steps']})")
    p.add_argument("--batch-size", type=int, help=f"default {DEFAULTS['batch_size']}, quick {QUICK['batch_size']}")
    p.add_argument("--lr", type=float, help=f"Adam lr of every arm (default {DEFAULTS['lr']}, quick {QUICK['lr']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, help=f"training images (default {DEFAULTS['train_size']})")
    p.add_argument("--test-size", type=int, help=f"test images (default {DEFAULTS['test_size']} = all)")
    p.add_argument("--eval-every", type=int, help="steps between test-accuracy points")
    p.add_argument("--log-every", type=int, default=25, help="steps per logged training record")
    p.add_argument("--patch", type=int, default=4, choices=(2, 4, 7, 14), help="patch size (default 4: 49 tokens)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-prototypes", type=int, default=64, help="K of the DDCL readout")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="τ relative to D")
    p.add_argument("--prototype-init", default="kmeans", choices=("kmeans", "normal"),
                   help="DDCL prototypes: k-means on the first batch's tokens, or N(0, 1) (default: %(default)s)")
    p.add_argument("--loss-weight", type=float, default=1.0, help="λ in CE + λ·distortion/D")
    p.add_argument("--prototype-lr-ratio", type=float, default=DEFAULT_PROTOTYPE_LR_RATIO,
                   help="prototype lr / encoder lr (timescale condition: > 1)")
    p.add_argument("--windows", default="2,2,2,2,2,2", help="compressor window per stage (default: %(default)s)")
    p.add_argument("--compressor-prototypes", type=int, default=64, help="K per compressor stage")
    p.add_argument("--compressor-steps", type=int)
    p.add_argument("--compressor-lr", type=float, default=1e-2)
    p.add_argument("--compressor-train", type=int, help="training images whose tokens train the compressor")
    p.add_argument("--compressor-test", type=int, help="test images whose tokens measure it")
    p.add_argument("--no-compressor", action="store_true", help="skip the compressor part")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on cores shared with other jobs, 2 threads ran a step "
                        "15x slower than 1; on an idle machine 2 are about 1.7x faster)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms:
        p.error(f"unknown arm(s) {bad}; expected a comma list from {', '.join(ARMS)}")
    try:
        args.windows = [int(w) for w in args.windows.split(",") if w.strip()]
    except ValueError:
        p.error(f"expected --windows as comma-separated positive ints, got {args.windows!r}")
    if not args.windows or min(args.windows) < 1:
        p.error(f"expected --windows as comma-separated positive ints, got {args.windows!r}")
    for key in ("threads", "steps", "batch_size", "train_size", "test_size", "eval_every", "log_every", "compressor_steps",
                "compressor_train", "compressor_test"):
        if getattr(args, key) <= 0:
            p.error(f"expected --{key.replace('_', '-')} > 0, got {getattr(args, key)}")
    return args


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
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")}
    results = {"config": cfg, "num_tokens": int(train_data[0].shape[1]), "arms": {}}
    models = {}
    for name in args.arms:
        res, model = train_arm(name, args, train_data, test_data, show)
        results["arms"][name] = res
        models[name] = model
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
