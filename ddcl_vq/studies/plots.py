"""``ddcl-vq compare``'s four plots (PNG): sorted code usage per run, usage over training,
hard-code PSNR against utilization, and the same test images decoded from each run's hard codes."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ddcl_vq.tokenizer.evaluate import load_run
from ddcl_vq.common.runlog import read_metrics


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path, dpi: int = 110, **layout) -> None:
    """``fig`` laid out (``tight_layout(**layout)``), written to ``path`` and closed."""
    fig.tight_layout(**layout)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def label(ax, xlabel: str, ylabel: str, title: str = "", legend: Optional[dict] = None, **grid) -> None:
    """Axis labels, a title, a grid (``grid``: its keywords) and, unless ``legend`` is None, a legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, **grid)
    if legend is not None:
        ax.legend(**legend)


def plot_usage_histograms(evals: Sequence[Dict], names: Sequence[str], path: Path) -> None:
    plt = pyplot()
    cols = min(len(evals), 6)
    rows = -(-len(evals) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 2.4 * rows), squeeze=False)
    for ax in axes.flat[len(evals):]:
        ax.axis("off")
    for ax, ev, name in zip(axes.flat, evals, names):
        counts = sorted(ev["usage_counts"], reverse=True)
        k = len(counts)
        ax.stairs([max(c, 0.8) for c in counts], range(k + 1), fill=True, baseline=0.8, color="tab:blue")
        ax.set_yscale("log")
        ax.set_ylim(0.8, max(counts + [1]) * 1.5)
        ax.set_xlim(0, k)
        c = ev["codebook"]
        ax.set_title(f"{name}\n{c['active_codes']}/{k} used, ppl {c['perplexity']:.0f}", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("code rank", fontsize=6)
    fig.suptitle("Sorted code usage on the evaluated split (hard indices; dead codes have no bar)", fontsize=9)
    save(fig, path)


def plot_usage_over_training(metrics: Sequence[List[Dict]], names: Sequence[str], path: Path) -> None:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("tab20")
    for i, (records, name) in enumerate(zip(metrics, names)):
        pts = [(r["step"], r["utilization_window"], r["perplexity_window"]) for r in records
               if r.get("utilization_window") is not None]
        if not pts:
            continue
        steps, util, ppl = zip(*pts)
        style = dict(color=cmap(i % 20), lw=1.2, ls=["-", "--", ":"][(i // 20) % 3], label=name)
        a1.plot(steps, util, **style)
        a2.plot(steps, ppl, **style)
    a1.set_ylim(0, 1.02)
    a2.set_yscale("log")
    for ax, ylabel in ((a1, "utilization (window)"), (a2, "perplexity (window)")):
        label(ax, "training step", ylabel)
    a2.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Codebook usage during training (train.usage_window steps of hard indices per point)", fontsize=9)
    save(fig, path)


def plot_psnr_vs_utilization(rows: Sequence[Dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    markers = {"ddcl": "o", "hard": "s", "ema": "^", "vqp": "D"}
    for r in rows:
        if r.get("hard_psnr_sd") is not None or r.get("utilization_sd") is not None:
            ax.errorbar(r["utilization"], r["hard_psnr"], xerr=r.get("utilization_sd"), yerr=r.get("hard_psnr_sd"),
                        fmt="none", ecolor="gray", elinewidth=0.8, capsize=2)
        ax.scatter(r["utilization"], r["hard_psnr"], marker=markers.get(r["type"], "x"), s=36)
        ax.annotate(r["name"], (r["utilization"], r["hard_psnr"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    label(ax, "utilization (dataset level)", "PSNR, hard codes (dB)")
    ax.set_xlim(-0.02, 1.05)
    handles = [plt.Line2D([], [], marker=m, ls="", color="gray", label=t) for t, m in markers.items()
               if any(r["type"] == t for r in rows)]
    ax.legend(handles=handles, fontsize=7)
    spread = any(r.get("hard_psnr_sd") is not None for r in rows)
    ax.set_title("Reconstruction (hard codes) vs codebook utilization"
                 + (": means, bars ± sample sd over seeds" if spread else ""), fontsize=9)
    save(fig, path)


@torch.no_grad()
def plot_reconstructions(run_dirs: Sequence[Path], names: Sequence[str], path: Path, split: str = "test",
                         num_images: int = 8, overrides: Sequence[str] = ()) -> None:
    """``overrides``: evaluate's dotted data overrides (images of another dataset, e.g. data.name=digits)."""
    from ddcl_vq.common.data import build_dataset
    plt = pyplot()
    recons, originals = [], None
    for d in run_dirs:
        cfg, model, _, _ = load_run(d, overrides, device="cpu")
        if originals is None:
            ds = build_dataset(cfg.data, split, cfg.run.seed)
            originals = torch.stack([ds[i][0] for i in range(min(num_images, len(ds)))])
        recons.append(model.reconstruct(originals, "hard").clamp(0, 1))
    rows = [("original", originals)] + list(zip(names, recons))
    n = originals.shape[0]
    fig, axes = plt.subplots(len(rows), n, figsize=(0.9 * n + 1.6, 0.9 * len(rows)), squeeze=False)
    for i, (name, images) in enumerate(rows):
        for j in range(n):
            ax = axes[i, j]
            img = images[j].permute(1, 2, 0).numpy()
            ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None,
                      vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[i, 0].set_ylabel(name, rotation=0, ha="right", va="center", fontsize=6)
    fig.suptitle(f"First {n} {split} images, decoded from hard codes", fontsize=9)
    save(fig, path, rect=(0, 0, 1, 1 - 0.3 / (0.9 * len(rows))))


def write_plots(out: Path, run_dirs: Sequence[Path], names: Sequence[str], evals: Sequence[Dict],
                rows: Sequence[Dict], split: str = "test", grid_images: int = 8, overrides: Sequence[str] = ()) -> None:
    """The four plots; ``rows`` feed psnr_vs_utilization.png (one point per row, error bars
    where a row has ``hard_psnr_sd`` / ``utilization_sd``), the runs feed the other three."""
    plot_usage_histograms(evals, names, out / "usage_histograms.png")
    plot_usage_over_training([read_metrics(d) for d in run_dirs], names, out / "usage_over_training.png")
    plot_psnr_vs_utilization(rows, out / "psnr_vs_utilization.png")
    plot_reconstructions(run_dirs, names, out / "reconstructions.png", split, grid_images, overrides)


