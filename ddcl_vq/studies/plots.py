"""``ddcl-vq compare``'s four plots (PNG): sorted code usage per run, usage over training,
hard-code PSNR against utilization, and the same test images decoded from each run's hard codes."""
from __future__ import annotations

import textwrap
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


def run_color(i: int):
    """The colour of the i-th run: tab20's ten dark hues first, then its ten light ones (neighbours differ)."""
    return pyplot().get_cmap("tab20")((2 * i) % 20 + (i // 10) % 2)


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
        used = [x for x in counts if x > 0]
        if used and len(used) <= max(1, k // 50):  # bars too thin to see at this width: mark their tops
            ax.plot([i + 0.5 for i in range(len(used))], used, "v", color="tab:red", markersize=4)
            ax.text(0.97, 0.9, f"{len(used)} code{'s' if len(used) > 1 else ''} used (▼ marks the top"
                    f"{'s' if len(used) > 1 else ''}):\n{used[0]:,} of {sum(used):,} indices on the first",
                    transform=ax.transAxes, ha="right", va="top", fontsize=6, color="dimgray")
        ax.set_title(f"{name}\n{c['active_codes']}/{k} used, ppl {c['perplexity']:.0f}", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("code rank", fontsize=6)
    fig.suptitle("Sorted code usage on the evaluated split (hard indices; dead codes have no bar)", fontsize=9)
    save(fig, path)


def plot_usage_over_training(metrics: Sequence[List[Dict]], names: Sequence[str], path: Path,
                             windows: Optional[Sequence[Optional[int]]] = None) -> Optional[str]:
    """Windowed utilization and perplexity per run (``windows``: each run's ``train.usage_window``, for the note on
    a run that logged too few points). A run with one point shows it as a marker; a run with none is named under
    the panels with why; with no points at all, the panels say so instead of staying empty frames. -> that note
    (None when every run has a curve)."""
    from matplotlib.ticker import MaxNLocator
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    windows = list(windows) if windows is not None else [None] * len(names)
    missing, single = [], []
    for i, (records, name, window) in enumerate(zip(metrics, names, windows)):
        pts = [(r["step"], r["utilization_window"], r["perplexity_window"]) for r in records
               if r.get("utilization_window") is not None]
        steps_done = max((r.get("step", 0) for r in records), default=0)
        why = f"{name} ({steps_done} steps logged" + (f", usage_window {window}" if window else "") + ")"
        if len(pts) < 2:
            (single if pts else missing).append(why)
        if not pts:
            continue
        steps, util, ppl = zip(*pts)
        style = dict(color=run_color(i), lw=1.2, ls=["-", "--", ":"][(i // 20) % 3], label=name,
                     marker="o", markersize=2.5 if len(pts) > 1 else 5)
        a1.plot(steps, util, **style)
        a2.plot(steps, ppl, **style)
    a1.set_ylim(0, 1.02)
    for ax, ylabel in ((a1, "utilization (window)"), (a2, "perplexity (window)")):
        label(ax, "training step", ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    note = None
    if a2.lines:
        a2.set_yscale("log")
        a2.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        note = "no curve: no run logged a usage window (one point per train.usage_window steps and at the end, " \
               "on a logged step)"
        for ax in (a1, a2):
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, "\n".join(textwrap.wrap(note, 45)), ha="center", va="center", fontsize=9,
                    color="dimgray", transform=ax.transAxes)
    wrapped: List[str] = []
    if missing or single:
        text = "; ".join((["no usage window logged, no curve: " + ", ".join(missing)] if missing else [])
                         + (["one usage window only, a marker and no curve: " + ", ".join(single)] if single else []))
        note = text if note is None else f"{note}; {text}"
        wrapped = textwrap.wrap(text, 190)
        fig.text(0.01, 0.01, "\n".join(wrapped), fontsize=6, color="dimgray", va="bottom")
    fig.suptitle("Codebook usage during training (train.usage_window steps of hard indices per point)", fontsize=9)
    save(fig, path, rect=(0, 0.03 * len(wrapped), 1, 1))
    return note


#: the marker of each quantizer type in psnr_vs_utilization.png (types not listed take the spare ones in turn)
MARKERS = {"ddcl": "o", "hard": "s", "ema": "^", "vqp": "D", "fsq": "v", "simvq": "P", "lfq": "X", "ibq": "<",
           "fvq": ">"}
SPARE_MARKERS = ("h", "*", "p", "d", "8")


def plot_psnr_vs_utilization(rows: Sequence[Dict], path: Path) -> None:
    """One point per row: colour = the run, marker = its quantizer type; a legend names every point (no labels on
    the axes to overlap), error bars ± sd where a row has them."""
    plt = pyplot()
    types = list(dict.fromkeys(r["type"] for r in rows))
    spare = iter(SPARE_MARKERS * (1 + len(types)))
    marker = {t: MARKERS.get(t) or next(spare) for t in types}
    ncol = 1 if len(rows) <= 18 else 2
    fig, ax = plt.subplots(figsize=(7 + 2.6 * ncol, 5))
    for i, r in enumerate(rows):
        color = run_color(i)
        if r.get("hard_psnr_sd") is not None or r.get("utilization_sd") is not None:
            ax.errorbar(r["utilization"], r["hard_psnr"], xerr=r.get("utilization_sd"), yerr=r.get("hard_psnr_sd"),
                        fmt="none", ecolor=color, alpha=0.6, elinewidth=0.8, capsize=2)
        ax.scatter(r["utilization"], r["hard_psnr"], marker=marker[r["type"]], s=40, color=color,
                   edgecolors="black", linewidths=0.4, label=f"{r['name']} ({r['type']})",
                   zorder=3)
    label(ax, "utilization (dataset level)", "PSNR, hard codes (dB)")
    ax.set_xlim(-0.02, 1.05)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=ncol,
              title="run (quantizer: marker)", title_fontsize=7)
    spread = any(r.get("hard_psnr_sd") is not None for r in rows)
    ax.set_title("Reconstruction (hard codes) vs codebook utilization; marker = quantizer type"
                 + (";\nmeans, bars ± sample sd over seeds" if spread else ""), fontsize=9)
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


def usage_window(run_dir: Path) -> Optional[int]:
    """A run's ``train.usage_window`` (None when its config cannot be read)."""
    from ddcl_vq.tokenizer.config import load_config
    try:
        return int(load_config(Path(run_dir) / "config.yaml").train.usage_window)
    except Exception:  # noqa: BLE001 - only a note on a plot
        return None


def write_plots(out: Path, run_dirs: Sequence[Path], names: Sequence[str], evals: Sequence[Dict],
                rows: Sequence[Dict], split: str = "test", grid_images: int = 8, overrides: Sequence[str] = ()) -> None:
    """The four plots; ``rows`` feed psnr_vs_utilization.png (one point per row, error bars
    where a row has ``hard_psnr_sd`` / ``utilization_sd``), the runs feed the other three."""
    plot_usage_histograms(evals, names, out / "usage_histograms.png")
    plot_usage_over_training([read_metrics(d) for d in run_dirs], names, out / "usage_over_training.png",
                             [usage_window(d) for d in run_dirs])
    plot_psnr_vs_utilization(rows, out / "psnr_vs_utilization.png")
    plot_reconstructions(run_dirs, names, out / "reconstructions.png", split, grid_images, overrides)


