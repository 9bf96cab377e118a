"""A study's report.md: the table, what it says, the plots, the arms, the definitions."""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Dict, List, Sequence

from .config import Study


def headline(rows: Sequence[Dict]) -> List[str]:
    """Computed, not written: per K, the best hard-code PSNR among baselines and among DDCL arms,
    and which DDCL arms reach 100% utilization."""
    lines = []
    for k in sorted({r["num_codes"] for r in rows}):
        at_k = [r for r in rows if r["num_codes"] == k]
        base = [r for r in at_k if r["type"] != "ddcl"]
        ddcl = [r for r in at_k if r["type"] == "ddcl"]
        parts = []
        b = max(base, key=lambda r: r["hard_psnr"]) if base else None
        if b:
            parts.append(f"best baseline {b['name']} {b['hard_psnr']:.2f} dB at {b['utilization']:.1%} utilization")
        if ddcl:
            d = max(ddcl, key=lambda r: r["hard_psnr"])
            text = f"best DDCL {d['name']} {d['hard_psnr']:.2f} dB at {d['utilization']:.1%} utilization ({d['dead_codes']} dead)"
            if b:
                text += f", {d['hard_psnr'] - b['hard_psnr']:+.2f} dB vs the best baseline"
            parts.append(text)
            u = max(ddcl, key=lambda r: (r["utilization"], r["hard_psnr"]))
            parts.append(f"highest DDCL utilization {u['name']} {u['utilization']:.1%} ({u['hard_psnr']:.2f} dB)")
            full = [r["name"] for r in ddcl if r["dead_codes"] == 0]
            parts.append(f"DDCL arms with 0 dead codes: {', '.join(full) if full else 'none'}")
        lines.append(f"- K = {k}: " + "; ".join(parts) + ".")
    return lines


def render_report(study: Study, rows: Sequence[Dict], info: Dict) -> str:
    from ddcl_vq.eval.evaluation.compare import COLUMN_DEFINITIONS, markdown_table
    from ddcl_vq.eval.evaluation.metrics import definitions

    b = study.arms[0].config
    budget = (f"{b.data.name}, {b.data.image_size}×{b.data.image_size}, batch {b.data.batch_size}; encoder/decoder "
              f"{b.model.channels} channels, {b.model.num_res_blocks} residual blocks, {b.model.num_downsamples} "
              f"downsamplings, D = {b.model.latent_dim}; {b.train.steps} steps, lr {b.train.lr:g} "
              f"({b.train.lr_schedule}), seed {b.run.seed}")
    ev = study.eval
    stamps = sorted(Path(r["run"], "checkpoints", "last.pt").stat().st_mtime for r in rows
                    if Path(r["run"], "checkpoints", "last.pt").is_file())
    when = (lambda t: _dt.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds"))
    trained = (f"final checkpoints of the arms in the table written between {when(stamps[0])} and {when(stamps[-1])}"
               if stamps else "no checkpoint found")
    lines = [f"# Study: {study.name}", ""]
    if study.description:
        lines += [study.description, ""]
    lines += [f"- Command: `{info['command']}`",
              f"- Config: `{study.path}`" + (" with `--quick` (tiny model and budget: a smoke test, not a result)"
                                             if study.quick else ""),
              f"- Date: this report {info['date_start']} → {info['date_end']} ({info['wall_seconds'] / 60:.1f} min "
              f"for this invocation; finished arms are not retrained); {trained}",
              f"- Machine at start: {info['machine_start']}",
              f"- Machine at end: {info['machine_end']}",
              f"- Shared budget (every arm): {budget}",
              f"- Evaluation: {ev.split} split, "
              f"{'all' if not ev.max_images else 'first ' + str(ev.max_images)} images, hard codes "
              "(soft codes too for DDCL)",
              f"- Arms: {len(study.arms)} declared, {len(rows)} in the table"
              + (f", {len(info['failed'])} failed" if info["failed"] else "")
              + (f", {len(info['unfinished'])} not finished" if info["unfinished"] else ""), ""]
    if info["failed"] or info["unfinished"]:
        lines += ["**Not in the table:**", ""]
        lines += [f"- {name}: failed — {why} (traceback in its run directory, study_error.txt)"
                  for name, why in info["failed"].items()]
        lines += [f"- {name}: training not finished" for name in info["unfinished"]]
        lines.append("")
    lines += ["## Results", "", markdown_table(rows), "", "Computed from the table:", ""] + headline(rows)
    lines += ["", "## Plots", "", "![sorted code usage](usage_histograms.png)", "",
              "![usage during training](usage_over_training.png)", "",
              "![PSNR vs utilization](psnr_vs_utilization.png)", "",
              "![reconstructions](reconstructions.png)", "", "## Arms", ""]
    for arm in study.arms:
        lines.append(f"- `{arm.name}`: " + " ".join(f"`{o}`" for o in arm.overrides))
    lines += ["", f"Run directories: `{study.out / 'runs'}/<arm>` (config.yaml, checkpoints, metrics.jsonl, "
              "eval.json, TensorBoard events).", "", "## Definitions", "", "```", COLUMN_DEFINITIONS, "",
              definitions(), "```", ""]
    return "\n".join(lines)
