"""Seeds: one table row per arm × sweep point, mean ± sample sd over its seeds.

``aggregate(rows)`` is a pure function of the per-run rows that :func:`ddcl_vq.studies.compare.make_row` makes (each with
``group``, the arm × sweep point it belongs to, and ``seed``); ``write_seed_tables`` writes table.md/csv/json from it.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

#: the metrics averaged over seeds: (row key, header, format)
METRICS = [("hard_psnr", "PSNR hard (dB)", ".2f"), ("hard_ssim", "SSIM hard", ".4f"),
           ("hard_lpips", "LPIPS hard", ".4f"), ("utilization", "utilization", ".1%"),
           ("queue_utilization", "util. (queue)", ".1%"), ("batch_utilization", "util. (batch)", ".1%"),
           ("dead_codes", "dead codes", ".1f"), ("perplexity", "perplexity", ".1f"), ("ms_per_step", "ms/step", ".1f")]
#: carried from the group's first run (the same for every seed of an arm × sweep point)
SHARED = ("type", "num_codes", "settings", "utilization_ceiling", "queue_ceiling", "mode", "temperature", "temperature_schedule", "temperature_final",
          "codebook_lr_ratio", "split", "num_images")

SEED_DEFINITIONS = """\
seeds           = the runs of one arm at one sweep point differ only in run.seed (model
                  initialisation, data order, k-means start); n = how many of them finished
mean ± sd       = mean over those runs and the sample standard deviation (n - 1 in the
                  denominator); '—' for the sd when n = 1. A cell with fewer values than n
                  (a metric missing in some run) says so: (n=2)
dead codes      = the mean of the per-run dead-code counts (so it may be fractional)"""


def mean_sd(values: Sequence[Optional[float]]) -> Tuple[Optional[float], Optional[float], int]:
    """(mean, sample sd, n) of the values that are not None; sd is None for n < 2, both None for n = 0."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return (vals[0], None, 1) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals), len(vals))


def aggregate(rows: Sequence[Dict]) -> List[Dict]:
    """One row per ``group`` (default: the row's ``name``), in order of first appearance:
    ``name`` = the group, ``n``, ``seeds``, ``runs``, the :data:`SHARED` keys of its first run, and for
    every metric of :data:`METRICS` its mean (same key), ``<key>_sd`` and ``<key>_n``."""
    groups: Dict[str, List[Dict]] = {}
    for r in rows:
        groups.setdefault(r.get("group") or r["name"], []).append(r)
    out = []
    for name, members in groups.items():
        row: Dict = {"name": name, "n": len(members), "seeds": [m.get("seed") for m in members],
                     "runs": [m["name"] for m in members]}
        row.update({k: members[0].get(k) for k in SHARED})
        for key, _, _ in METRICS:
            mean, sd, n = mean_sd([m.get(key) for m in members])
            row[key], row[f"{key}_sd"], row[f"{key}_n"] = mean, sd, n
        out.append(row)
    return out


def _pm(row: Dict, key: str, spec: str) -> str:
    mean, sd, n = row.get(key), row.get(f"{key}_sd"), row.get(f"{key}_n", row.get("n"))
    if mean is None or (isinstance(mean, float) and not math.isfinite(mean)):
        return "—" if mean is None else str(mean)
    text = format(mean, spec) + " ± " + ("—" if sd is None else format(sd, spec))
    if n is not None and n != row.get("n"):
        text += f" (n={n})"
    return text


def mean_sd_table(groups: Sequence[Dict]) -> str:
    """Markdown: one row per arm × sweep point, mean ± sd over its seeds."""
    head = ["run", "quantizer", "K", "settings", "seeds (n)"] + [h for _, h, _ in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        seeds = ",".join(str(s) for s in g["seeds"])
        cells = [g["name"], g["type"] or "—", str(g["num_codes"]), g["settings"] or "", f"{seeds} ({g['n']})"]
        cells += [_pm(g, key, spec) for key, _, spec in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _flat(row: Dict) -> Dict:
    return {k: (" ".join(str(x) for x in v) if isinstance(v, list) else v) for k, v in row.items()}


def write_seed_tables(out: Path, groups: Sequence[Dict], rows: Sequence[Dict], evals: Sequence[Dict], split: str,
                      max_images: int, command: Optional[str] = None) -> None:
    """table.md (mean ± sd, then the per-seed table), table.csv (one row per arm × sweep point),
    table_runs.csv (one row per run), table.json (both)."""
    from ddcl_vq.studies.compare import COLUMN_DEFINITIONS, markdown_table, table_footer, write_csv
    from ddcl_vq.tokenizer.metrics import definitions
    out = Path(out)
    text = [mean_sd_table(groups), "", "Per seed:", "", markdown_table(rows), "", table_footer(evals, command), "",
            "Seeds:", "```", SEED_DEFINITIONS, "```", ""]
    (out / "table.md").write_text("\n".join(text))
    write_csv(out / "table.csv", [_flat(g) for g in groups])
    write_csv(out / "table_runs.csv", list(rows))
    (out / "table.json").write_text(json.dumps({"rows": list(groups), "runs": list(rows), "command": command,
                                                "split": split, "max_images": max_images,
                                                "definitions": definitions(), "column_definitions": COLUMN_DEFINITIONS,
                                                "seed_definitions": SEED_DEFINITIONS}, indent=2) + "\n")
