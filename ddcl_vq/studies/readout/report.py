"""The readout study's report.md and PNG plots."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from ddcl_vq import USAGE_DEFINITIONS

ARM_TEXT = {"mean": "masked mean of the final tokens", "cls": "a learned class token prepended, its final state"}


def plots(results: Dict, out: Path) -> List[str]:
    from ddcl_vq.studies.plots import pyplot, save
    plt = pyplot()
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in results["arms"].values():
        steps = [c["step"] for c in arm["curve"]]
        ax.plot(steps, [100 * c["test_accuracy"] for c in arm["curve"]], marker="o", label=arm["arm"])
    ax.set_xlabel("training step")
    ax.set_ylabel(f"test accuracy (%), {results['config']['test_size']} images")
    ax.set_title("Fashion-MNIST, patch transformer: readout arms")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, out / "accuracy.png", dpi=120)
    files.append("accuracy.png")

    ddcl = [a for a in results["arms"].values() if a["readout"] == "ddcl"]
    if ddcl:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in ddcl:
            steps = [r["step"] for r in arm["train_log"]]
            for key, style in (("distortion", "-"), ("ols", "--"), ("variance", ":")):
                ax.plot(steps, [r[key] for r in arm["train_log"]], style,
                        label=f"{arm['arm']} {key}" if len(ddcl) > 1 else key)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("sum over D, mean over tokens")
        ax.set_title("DDCL readout: distortion = OLS + variance (train batches)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, out / "ddcl_terms.png", dpi=120)
        files.append("ddcl_terms.png")

    comp = results.get("compressor")
    if comp:
        st = comp["stages"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ratios = [s["cumulative_ratio"] for s in st]
        ax.plot(ratios, [s["cumulative_error"] for s in st], "o-", label="HierarchicalCompressor (DDCL)")
        ax.plot(ratios, [s["window_mean_cumulative_error"] for s in st], "s--", label="window mean pooling")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ratios)
        ax.set_xticklabels([f"{r:.3g}" for r in ratios])
        ax.set_xlabel("compression ratio (tokens in / summaries out)")
        ax.set_ylabel("relative reconstruction error")
        ax.set_title("compressor: error vs ratio (test tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        save(fig, out / "compressor.png", dpi=120)
        files.append("compressor.png")
    return files


def fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


def report(results: Dict) -> str:
    cfg, meta = results["config"], results["meta"]
    lines = ["# Readout study: DDCL readout vs mean pooling vs class token", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ", f"Machine: {meta['machine']}", "",
             f"Fashion-MNIST, {cfg['patch']}x{cfg['patch']} patches ({results['num_tokens']} tokens), transformer "
             f"dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads; every arm: {cfg['steps']} steps, "
             f"batch {cfg['batch_size']}, Adam lr {cfg['lr']:g} (warmup + cosine), seed {cfg['seed']}, "
             f"{cfg['train_size']} training images, test accuracy on {cfg['test_size']} test images "
             f"({'the full test set' if cfg['test_size'] >= 10000 else 'a fixed random subset'}). "
             f"DDCL: K = {cfg['num_prototypes']} prototypes, τ relative to D, loss = CE + "
             f"{cfg['loss_weight']:g}·distortion/D, prototype lr = ratio × lr.", "",
             "| arm | readout | test acc | utilization | perplexity | soft perplexity | max \\|L−OLS−V\\|/L | "
             "train wall s | params |", "|---|---|---|---|---|---|---|---|---|"]
    for a in results["arms"].values():
        u = a.get("usage") or {}
        what = ARM_TEXT.get(a["arm"], "")
        if a["readout"] == "ddcl":
            what = (f"DDCL pooled; τ={a['temperature']:g}, ρ={a['prototype_lr_ratio']:g}, "
                    f"distortion→tokens {'yes' if a['distortion_to_tokens'] else 'no (sg)'}, "
                    f"task loss→prototypes {'yes' if a['task_grad_to_prototypes'] else 'no'}"
                    + f", {a.get('mode', 'straight_through').replace('_', '-')} token gradient")
        lines.append(
            f"| {a['arm']} | {what} | {100 * a['test_accuracy']:.2f}% | "
            f"{fmt(u.get('utilization'), '.0%') if u else '—'} | {fmt(u.get('perplexity'), '.1f') if u else '—'} | "
            f"{fmt(u.get('soft_perplexity'), '.1f') if u else '—'} | "
            f"{fmt(a.get('identity_max'), '.1e') if 'identity_max' in a else '—'} | {a['train_wall_s']:.0f} | "
            f"{a['params']:,} |")
    lines += ["", "Utilization and perplexity: dataset-level over every test token's hard argmin prototype "
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
                  "| stage | window | K | ratio | cumulative ratio | stage error | cumulative error | "
                  "window-mean cumulative error | utilization | perplexity |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in comp["stages"]:
            lines.append(f"| {s['stage']} | {s['window']} | {s['num_prototypes']} | {s['ratio']:.2f} | "
                         f"{s['cumulative_ratio']:.2f} | {s['stage_error']:.3f} | {s['cumulative_error']:.3f} | "
                         f"{s['window_mean_cumulative_error']:.3f} | {s['utilization']:.0%} | {s['perplexity']:.1f} |")
        lines.append("")
    lines += ["Codebook usage definitions:", "", "```", USAGE_DEFINITIONS, "```", ""]
    lines += [f"Plots: {', '.join(results['plots'])}", f"Total wall time: {meta['total_wall_s']:.0f} s", ""]
    return "\n".join(lines)
