"""A study's report.md: the table, what it says, the plots, the arms, the definitions."""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ddcl_vq.common.progress import fmt


def _psnr(r: Dict) -> str:
    """'23.31 dB', or with seeds '23.31 ± 0.12 dB (n = 3)'."""
    if "n" not in r:
        return f"{r['hard_psnr']:.2f} dB"
    return f"{fmt(r['hard_psnr'], '.2f', sd=r.get('hard_psnr_sd'))} dB (n = {r['n']})"


def _separation(d: Dict, b: Dict) -> str:
    """Whether the DDCL mean exceeds the best baseline mean by more than the larger of their sds."""
    sds = [r.get("hard_psnr_sd") for r in (d, b)]
    if any(sd is None for sd in sds):
        return "spread not measured (one seed in an arm)"
    larger, diff = max(sds), d["hard_psnr"] - b["hard_psnr"]
    if diff > larger:
        return f"the DDCL mean exceeds the best baseline mean by more than the larger sd ({larger:.2f} dB)"
    if -diff > larger:
        return f"the DDCL mean is below the best baseline mean by more than the larger sd ({larger:.2f} dB)"
    return f"the difference is within the larger sd ({larger:.2f} dB): not separated"


def headline(rows: Sequence[Dict]) -> List[str]:
    """Per K: the best hard-code PSNR among baselines and among DDCL arms, and which DDCL arms use every code
    (mean ± sd rows are compared by their means, and by the larger sd)."""
    lines = []
    for k in sorted({r["num_codes"] for r in rows}):
        at_k = [r for r in rows if r["num_codes"] == k and r.get("hard_psnr") is not None]
        base = [r for r in at_k if r["type"] != "ddcl"]
        ddcl = [r for r in at_k if r["type"] == "ddcl"]
        parts = []
        b = max(base, key=lambda r: r["hard_psnr"]) if base else None
        if b:
            parts.append(f"best baseline {b['name']} {_psnr(b)} at {b['utilization']:.1%} utilization")
        if ddcl:
            d = max(ddcl, key=lambda r: r["hard_psnr"])
            dead = d["dead_codes"] if "n" not in d else format(d["dead_codes"], ".1f")
            text = f"best DDCL {d['name']} {_psnr(d)} at {d['utilization']:.1%} utilization ({dead} dead)"
            if b:
                text += f", {d['hard_psnr'] - b['hard_psnr']:+.2f} dB vs the best baseline"
                if "n" in d:
                    text += f" (means; {_separation(d, b)})"
            parts.append(text)
            u = max(ddcl, key=lambda r: (r["utilization"], r["hard_psnr"]))
            parts.append(f"highest DDCL utilization {u['name']} {u['utilization']:.1%} ({u['hard_psnr']:.2f} dB)")
            full = [r["name"] for r in ddcl if r["dead_codes"] == 0]
            parts.append(f"DDCL arms with 0 dead codes{' in every seed' if 'n' in d else ''}: "
                         f"{', '.join(full) if full else 'none'}")
        if parts:
            lines.append(f"- K = {k}: " + "; ".join(parts) + ".")
    return lines


def _delta(a: Dict, b: Dict, key: str, spec: str, unit: str = "", scale: float = 1.0) -> Optional[str]:
    if a.get(key) is None or b.get(key) is None:
        return None
    diff = (a[key] - b[key]) * scale
    text = f"{format(diff, '+' + spec)}{unit} ({format(b[key] * scale, spec)} → {format(a[key] * scale, spec)})"
    sds = [r.get(f"{key}_sd") for r in (a, b)]
    if "n" in a and all(sd is not None for sd in sds):
        larger = max(sds) * scale
        text += f", {'more' if abs(diff) > larger else 'not more'} than the larger sd {format(larger, spec)}"
    return text


def changes(study, rows: Sequence[Dict]) -> List[str]:
    """For every arm declared with ``vs``: its differences from that arm at each sweep point."""
    by_name = {r["name"]: r for r in rows}
    pairs = list(dict.fromkeys((a.group, a.vs) for a in study.arms if a.vs))
    lines = []
    for group, vs in pairs:
        a, b = by_name.get(group), by_name.get(vs)
        if a is None or b is None:
            lines.append(f"- `{group}` vs `{vs}`: {'both' if a is None and b is None else 'one'} not in the table")
            continue
        parts = [p for p in (
            _delta(a, b, "hard_psnr", ".2f", " dB PSNR"),
            _delta(a, b, "utilization", ".1f", " points utilization", 100.0),
            _delta(a, b, "dead_codes", ".1f", " dead codes"),
            _delta(a, b, "perplexity", ".1f", " perplexity"),
            _delta(a, b, "ms_per_step", ".1f", " ms/step")) if p]
        lines.append(f"- `{group}` vs `{vs}`: " + "; ".join(parts) + ".")
    return lines


def render_report(study, rows: Sequence[Dict], info: Dict, groups: Optional[Sequence[Dict]] = None) -> str:
    """report.md; ``groups``: with seeds, the mean ± sd rows (one per arm x sweep point)."""
    from ddcl_vq.studies.tables import COLUMN_DEFINITIONS, SEED_DEFINITIONS, markdown_table, mean_sd_table
    from ddcl_vq.tokenizer.metrics import definitions
    b = study.arms[0].config
    seed_text = ", ".join(map(str, sorted({a.seed for a in study.arms if a.seed is not None})))  # arms may add seeds
    m = b.model  # the sizes of its arch
    sizes = (f"{m['channels']} channels, {m['num_res_blocks']} residual blocks, {m['num_downsamples']} downsamplings"
             if m["arch"] == "vqvae" else f"VQGAN ch {m['ch']} × {m['ch_mult']}, {m['num_res_blocks']} residual blocks")
    budget = (f"{b.data.name}, {b.data.image_size}×{b.data.image_size}, batch {b.data.batch_size}; encoder/decoder "
              f"{sizes}, D = {m['latent_dim']}; {b.train.steps} steps, lr {b.train.lr:g} "
              f"({b.train.lr_schedule}), "
              + (f"seed {b.run.seed}" if study.seeds is None else f"seeds {seed_text}"))
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
              f"- Machine at start: {info['machine_start']}", f"- Machine at end: {info['machine_end']}",
              f"- Shared budget (every arm): {budget}",
              f"- Evaluation: {ev.split} split, {'all' if not ev.max_images else 'first ' + str(ev.max_images)} "
              "images, hard codes (soft codes too for DDCL)",
              (f"- Arms: {len(study.arms)} declared, {len(rows)} in the table" if study.seeds is None else
               f"- Runs: {len(study.arms)} (arms × sweep points × seeds), {len(rows)} in the per-seed table; "
               f"{len(dict.fromkeys(a.group for a in study.arms))} arms × sweep points")
              + (f" (selected with --arms from {study.declared})" if study.declared > len(study.arms) else "")
              + (f", {len(info['failed'])} failed" if info["failed"] else "")
              + (f", {len(info['unfinished'])} not finished" if info["unfinished"] else ""), ""]
    if info["failed"] or info["unfinished"]:
        lines += ["**Not in the table:**", ""]
        lines += [f"- {name}: failed — {why} (traceback in its run directory, study_error.txt)"
                  for name, why in info["failed"].items()]
        lines += [f"- {name}: training not finished" for name in info["unfinished"]]
        lines.append("")
    table = rows if groups is None else groups
    if groups is None:
        lines += ["## Results", "", markdown_table(rows)]
    else:
        lines += ["## Results", "", f"Mean ± sample sd over seeds {seed_text} "
                  "(n = the seeds that finished; per-seed table below):", "", mean_sd_table(groups)]
    lines += ["", "Computed from the table:", ""] + headline(table)
    if any(a.vs for a in study.arms):
        lines += ["", "## What each change buys", "",
                  "Each arm declared with `vs` against that arm" + (" (means; sd as in the table)" if groups else "")
                  + ":", ""] + changes(study, table)
    if groups is not None:
        lines += ["", "### Per seed", "", markdown_table(rows)]
    seed_note = ("" if groups is None else
                 "Usage histograms, usage during training and reconstructions show each arm's first seed; "
                 "PSNR vs utilization shows means with ± sd bars.")
    lines += ["", "## Plots", ""] + ([seed_note, ""] if seed_note else []) + [
              "![sorted code usage](usage_histograms.png)", "", "![usage during training](usage_over_training.png)", "",
              "![PSNR vs utilization](psnr_vs_utilization.png)", "", "![reconstructions](reconstructions.png)", "",
              "## Arms", ""]
    if study.seeds is None:
        for arm in study.arms:
            lines.append(f"- `{arm.name}`: " + " ".join(f"`{o}`" for o in arm.overrides))
        run_dirs = "<arm>"
    else:
        for group in dict.fromkeys(a.group for a in study.arms):
            members = [a for a in study.arms if a.group == group]
            seeds = ", ".join(str(a.seed) for a in members)
            lines.append(f"- `{group}` (seeds {seeds}; runs `{group}_s<seed>`): "
                         + " ".join(f"`{o}`" for o in members[0].overrides if not o.startswith("run.seed=")))
        run_dirs = "<arm>_s<seed>"
    lines += ["", f"Run directories: `{study.out / 'runs'}/{run_dirs}` (config.yaml, checkpoints, metrics.jsonl, "
              "eval.json, TensorBoard events).", "", "## Definitions", "", "```", COLUMN_DEFINITIONS, ""]
    if groups is not None:
        lines += [SEED_DEFINITIONS, ""]
    lines += [definitions(), "```", ""]
    return "\n".join(lines)
