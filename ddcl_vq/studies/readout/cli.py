"""``ddcl-vq readout-study`` / ``python -m ddcl_vq readout-study``: the command, its options, report.md and plots."""
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
from typing import Dict, List, Optional

import torch

from ddcl_vq.common.machine import describe_machine
from ddcl_vq.readout import DEFAULT_PROTOTYPE_LR_RATIO, DEFAULT_TEMPERATURE
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, Rules, option

from ddcl_vq import USAGE_DEFINITIONS
from ddcl_vq.studies.readout.train import ARMS, load_patches, run_compressor, train_arm

HELP = """\
Train a small transformer encoder over 4x4 image patches of real Fashion-MNIST (49 tokens, dim 64,
2 layers, 4 heads) once per readout arm, at the same budget (steps, batch, lr, seed, data order,
encoder initialisation): mean (mean pooling of the final tokens), cls (a class token), ddcl (the
DDCL readout, ddcl_vq.DDCLReadout with the library defaults: pooled = mean of the tokens' soft summaries,
loss = cross-entropy + readout.loss on stop-gradient tokens, prototypes at --prototype-lr-ratio x lr).
Ablation arms: ddcl_soft, ddcl_joint, ddcl_rho1, ddcl_ponly, ddcl_joint_rho1, ddcl_tau0.03, ddcl_tau0.3
(docs/guide/readout.md). Reports test accuracy, wall time, and for DDCL the prototype usage and the identity
max |distortion - ols - variance| / distortion. Then ddcl_vq.HierarchicalCompressor on the DDCL arm's
frozen tokens (--windows): reconstruction error vs compression ratio, beside window-mean pooling.

Writes OUT/results.json, OUT/report.md and PNG plots; each arm trains in OUT/runs/<arm>: the same
command resumes a killed study and reuses the arms that finished.
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
    prototype_lr_ratio: float = option(DEFAULT_PROTOTYPE_LR_RATIO, "prototype lr / encoder lr (timescale: > 1)")
    windows: List[int] = option(default_factory=lambda: [2, 2, 2, 2, 2, 2], sep=",",
                                metavar="W,...", help="compressor window per stage")
    compressor_prototypes: int = option(64, "K per compressor stage")
    compressor_steps: int = option(300, "compressor training steps")
    compressor_lr: float = option(1e-2, "compressor Adam lr")
    compressor_train: int = option(8192, "training images whose tokens train the compressor")
    compressor_test: int = option(2000, "test images whose tokens measure it")
    no_compressor: bool = option(False, "skip the compressor part")
    threads: int = option(1, "torch CPU threads")
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


parse_args = OPTIONS.parse  # an empty --arms or --windows is refused there ("expected at least one value")


ARM_TEXT = {"mean": "masked mean of the final tokens", "cls": "a learned class token prepended, its final state"}


def plots(results: Dict, out: Path) -> List[str]:
    """accuracy.png, ddcl_terms.png (with a DDCL arm) and compressor.png (with the compressor) -> their names."""
    from ddcl_vq.studies.plots import label, pyplot, save
    ddcl = [a for a in results["arms"].values() if a["readout"] == "ddcl"]
    comp = results.get("compressor")
    files = ["accuracy.png"] + (["ddcl_terms.png"] if ddcl else []) + (["compressor.png"] if comp else [])
    for name in files:
        fig, ax = pyplot().subplots(figsize=(6, 4))
        if name == "accuracy.png":
            for arm in results["arms"].values():
                steps = [c["step"] for c in arm["curve"]]
                ax.plot(steps, [100 * c["test_accuracy"] for c in arm["curve"]], marker="o", label=arm["arm"])
            label(ax, "training step", f"test accuracy (%), {results['config']['test_size']} images",
                  "Fashion-MNIST, patch transformer: readout arms", {})
        elif name == "ddcl_terms.png":
            for arm in ddcl:
                steps = [r["step"] for r in arm["train_log"]]
                for key, style in (("distortion", "-"), ("ols", "--"), ("variance", ":")):
                    ax.plot(steps, [r[key] for r in arm["train_log"]], style,
                            label=f"{arm['arm']} {key}" if len(ddcl) > 1 else key)
            ax.set_yscale("log")
            label(ax, "training step", "sum over D, mean over tokens",
                  "DDCL readout: distortion = OLS + variance (train batches)", {"fontsize": 7})
        else:
            st = comp["stages"]
            ratios = [s["cumulative_ratio"] for s in st]
            ax.plot(ratios, [s["cumulative_error"] for s in st], "o-", label="HierarchicalCompressor (DDCL)")
            ax.plot(ratios, [s["window_mean_cumulative_error"] for s in st], "s--", label="window mean pooling")
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(ratios)
            ax.set_xticklabels([f"{r:.3g}" for r in ratios])
            label(ax, "compression ratio (tokens in / summaries out)", "relative reconstruction error",
                  "compressor: error vs ratio (test tokens)", {}, which="both")
        save(fig, out / name, dpi=120)
    return files


def _readout(a: Dict) -> str:
    if a["readout"] != "ddcl":
        return ARM_TEXT.get(a["arm"], "")
    return (f"DDCL pooled; τ={a['temperature']:g}, ρ={a['prototype_lr_ratio']:g}, "
            f"distortion→tokens {'yes' if a['distortion_to_tokens'] else 'no (sg)'}, "
            f"task loss→prototypes {'yes' if a['task_grad_to_prototypes'] else 'no'}, "
            f"{a.get('mode', 'straight_through').replace('_', '-')} token gradient")


#: markdown_table columns of the arms (a row: an arm's result with its usage figures) and the compressor's stages
ARM_COLUMNS = [("arm", "arm", "s"), ("readout", "readout", _readout), ("test_accuracy", "test acc", ".2%"),
               ("utilization", "utilization", ".0%"), ("perplexity", "perplexity", ".1f"),
               ("soft_perplexity", "soft perplexity", ".1f"), ("identity_max", "max \\|L−OLS−V\\|/L", ".1e"),
               ("train_wall_s", "train wall s", ".0f"), ("params", "params", ",")]
STAGE_COLUMNS = [("stage", "stage", "d"), ("window", "window", "d"), ("num_prototypes", "K", "d"),
                 ("ratio", "ratio", ".2f"), ("cumulative_ratio", "cumulative ratio", ".2f"),
                 ("stage_error", "stage error", ".3f"), ("cumulative_error", "cumulative error", ".3f"),
                 ("window_mean_cumulative_error", "window-mean cumulative error", ".3f"),
                 ("utilization", "utilization", ".0%"), ("perplexity", "perplexity", ".1f")]


def report(results: Dict) -> str:
    from ddcl_vq.studies.tables import markdown_table
    cfg, meta = results["config"], results["meta"]
    arms = [{**(a.get("usage") or {}), **a} for a in results["arms"].values()]
    lines = ["# Readout study: DDCL readout vs mean pooling vs class token", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ", f"Machine: {meta['machine']}", "",
             f"Fashion-MNIST, {cfg['patch']}x{cfg['patch']} patches ({results['num_tokens']} tokens), transformer "
             f"dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads; every arm: {cfg['steps']} steps, "
             f"batch {cfg['batch_size']}, Adam lr {cfg['lr']:g} (warmup + cosine), seed {cfg['seed']}, "
             f"{cfg['train_size']} training images, test accuracy on {cfg['test_size']} test images "
             f"({'the full test set' if cfg['test_size'] >= 10000 else 'a fixed random subset'}). "
             f"DDCL: K = {cfg['num_prototypes']} prototypes, τ relative to D, loss = CE + "
             f"{cfg['loss_weight']:g}·distortion/D, prototype lr = ratio × lr.", "", markdown_table(arms, ARM_COLUMNS),
             "", "Utilization and perplexity: dataset-level over every test token's hard argmin prototype "
             "(ddcl_vq.CodebookUsage); the identity column is the maximum over every training step.", ""]
    comp = results.get("compressor")
    if comp:
        lines += ["## Hierarchical compressor", "",
                  f"On the `{comp['source_arm']}` arm's frozen final tokens ({comp['tokens_per_sequence']} per image, "
                  f"raster order), windows {comp['windows']}, trained {comp['steps']} steps on "
                  f"{comp['train_sequences']} training images with the stages' DDCL distortions "
                  f"(k-means init, distortion on stop-gradient inputs), measured on {comp['test_sequences']} test "
                  f"images. Error = Σ‖x − x̂‖² / Σ‖x − mean‖², x̂ = the ancestor summary (cumulative) or the "
                  f"window's summary (stage); window mean pooling is the L2-best summary for the same windows.", "",
                  markdown_table(comp["stages"], STAGE_COLUMNS), ""]
    lines += ["Codebook usage definitions:", "", "```", USAGE_DEFINITIONS, "```", ""]
    lines += [f"Plots: {', '.join(results['plots'])}", f"Total wall time: {meta['total_wall_s']:.0f} s", ""]
    return "\n".join(lines)


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
    date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    results["meta"] = {"command": shlex.join(["ddcl-vq", "readout-study", *argv]), "date": date,
                       "machine": describe_machine(), "python": platform.python_version()}
    results["plots"] = plots(results, out)
    results["meta"]["total_wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report(results))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plots "
          f"({results['meta']['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
