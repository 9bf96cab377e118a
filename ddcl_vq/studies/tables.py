"""The tables of ``ddcl-vq compare`` and the studies: one row per run or, with seeds, mean ± sd per arm x sweep
point (:func:`aggregate`); markdown (:func:`markdown_table`), CSV and JSON."""
from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ddcl_vq.common.progress import fmt
from ddcl_vq.tokenizer.metrics import definitions
from ddcl_vq.common.runlog import ms_per_step, train_seconds


def count_cell(key: str) -> Callable[[Dict], str]:
    """A column format for a count that is a mean over levels for a quantizer with several codebooks: ``d`` for
    an int, ``.1f`` for a fractional mean, ``—`` for None."""
    return lambda row: fmt(row.get(key), ".1f" if isinstance(row.get(key), float) else "d")


COLUMNS = [  # (key, header, format)
    ("name", "run", "s"), ("type", "quantizer", "s"), ("num_codes", "K", "d"), ("settings", "settings", "s"),
    ("hard_psnr", "PSNR hard (dB)", ".2f"), ("hard_mse", "MSE hard", ".5f"), ("hard_ssim", "SSIM hard", ".4f"),
    ("hard_lpips", "LPIPS hard", ".4f"), ("soft_psnr", "PSNR soft (dB)", ".2f"),
    ("soft_minus_hard_psnr", "soft−hard PSNR", "+.2f"), ("utilization", "utilization", ".1%"),
    ("queue_utilization", "util. (queue)", ".1%"), ("batch_utilization", "util. (batch)", ".1%"),
    ("dead_codes", "dead codes", count_cell("dead_codes")), ("perplexity", "perplexity", ".1f"),
    ("steps", "steps", "d"),
    ("train_seconds", "train time (s)", ".0f"), ("ms_per_step", "ms/step", ".1f"),
]
#: the columns of table.md and of what compare prints: those of the results tables in docs/results.md (PSNR, LPIPS,
#: SSIM on hard codes, codes used, dead codes, perplexity) after what names the run; every other column of COLUMNS,
#: and more, is in table.csv and table.json
TABLE_KEYS = ("name", "type", "num_codes", "settings", "hard_psnr", "hard_lpips", "hard_ssim", "utilization",
              "dead_codes", "perplexity")
TABLE_COLUMNS = [next(c for c in COLUMNS if c[0] == key) for key in TABLE_KEYS]

COLUMN_DEFINITIONS = """\
table.md shows run, quantizer, K, settings, PSNR/LPIPS/SSIM hard, utilization, dead codes and perplexity (the
                  columns of docs/results.md); table.csv and table.json add the others defined here and more
settings        = what distinguishes the arm: DDCL mode, temperature tau (relative to the data's
                  nearest-code distance; a -> b when annealed, with the schedule), the M-step codebook
                  (with its statistics' decay when set), init other than k-means, revival threshold,
                  warm-up, beta schedule; EMA decay and dead-code threshold;
                  vector-quantize-pytorch keyword arguments ({} = its defaults)
PSNR/MSE/SSIM/LPIPS hard = decoded from hard codes on the evaluated split (see definitions below)
PSNR soft, soft−hard    = DDCL only: decoded from soft codes, and soft minus hard
utilization, dead codes, perplexity = dataset level, hard indices, on the evaluated split
util. (queue), util. (batch) = the field's two other definitions, from the end of training (see
                  queue_utilization and batch_utilization below); — for runs saved before they existed
steps           = training steps of the evaluated checkpoint
train time (s)  = wall-clock seconds of training logged in metrics.jsonl, summed over sessions
                  (shared machines: depends on the load, not only on the quantizer)
ms/step         = milliseconds of wall-clock time per training step, from metrics.jsonl 'time':
                  the sum of time differences over the sum of step differences between consecutive
                  logged steps of the same session. The steps before each session's first logged
                  step are left out, so one-off start-up costs (data loading, k-means
                  initialisation, first-step warm-up) are not in it (they are in train time);
                  logging and checkpoint writes are. Same caveat as train time: arms trained at
                  once (--jobs > 1) or on a loaded machine share the cores"""

#: table.csv / table.json columns of a run whose quantizer has several codebooks (eval.json's per-level fields)
PER_LEVEL_COLUMNS = ("levels", "utilization_per_level", "active_codes_per_level", "dead_codes_per_level",
                     "perplexity_per_level", "soft_perplexity_per_level", "hard_psnr_by_levels", "hard_mse_by_levels")
PER_LEVEL_COLUMN_DEFINITIONS = """\
several codebooks (residual levels, groups): table.csv and table.json add, for such runs (empty
                  for the others):
levels          = the number of codebooks L; utilization, dead codes and perplexity above are
                  then the means over them
*_per_level     = each codebook's utilization, active and dead codes, perplexity, soft perplexity
                  (lists in index order; CSV: space-separated)
hard_psnr_by_levels, hard_mse_by_levels = residual quantizers: PSNR / MSE decoded from the hard codes
                  of the first l levels, l = 1..L (the last: PSNR hard)"""


def per_level_row(ev: Dict) -> Dict:
    """The per-level columns of a run's row: {} for a quantizer with one codebook (its row keeps its columns)."""
    c, by_levels = ev["codebook"], ev["recon"].get("hard_by_levels")
    if c.get("utilization_per_level") is None:
        return {}
    row = {key: c.get(key) for key in PER_LEVEL_COLUMNS[:6]}
    row["hard_psnr_by_levels"] = [r["psnr"] for r in by_levels] if by_levels else None
    row["hard_mse_by_levels"] = [r["mse"] for r in by_levels] if by_levels else None
    return row


def column_definitions(rows: Sequence[Dict]) -> str:
    """COLUMN_DEFINITIONS, with PER_LEVEL_COLUMN_DEFINITIONS when a row has per-level columns."""
    per_level = any("utilization_per_level" in r for r in rows)
    return COLUMN_DEFINITIONS + ("\n" + PER_LEVEL_COLUMN_DEFINITIONS if per_level else "")


def settings_text(cfg) -> str:
    from ddcl_vq.tokenizer.config import resolve_quantizer
    q, t, own = SimpleNamespace(**cfg.quantizer), cfg.train, resolve_quantizer({"type": cfg.quantizer["type"]})
    if q.type == "ddcl":
        tau = (f"τ={q.temperature:g}" if q.temperature_schedule == "constant" else
               f"τ={q.temperature:g}→{q.temperature_final:g} ({q.temperature_schedule})")
        extra = ([f"{q.codebook_init} init"] if q.codebook_init != "kmeans" else []) \
            + ([f"revival {q.revive_threshold:g}"] if q.revive_threshold > 0 else []) \
            + ([f"warm-up {q.warmup_steps}"] if q.warmup_steps > 0 else []) \
            + ([f"β {q.beta:g}→{q.beta_final:g}"] if q.beta_final is not None and q.mode == "straight_through" else [])
        return ", ".join([q.mode, tau, "M-step" + (f" decay={q.decay:g}" if q.decay != own["decay"] else "")] + extra)
    if q.type == "hard":
        extra = [f"β={q.beta:g}"] + (["cosine"] if q.distance == "cosine" else []) \
            + (["k-means init"] if q.kmeans_init else [])
        return ", ".join(extra) + (f", ρ={t.codebook_lr_ratio:g}" if t.codebook_lr_ratio != 1 else "")
    if q.type == "ema":
        return f"decay={q.decay:g}, dead-code restart<{q.dead_code_threshold:g}" if q.dead_code_threshold > 0 \
            else f"decay={q.decay:g}, no restart"
    if q.type in ("vqp", "simvq", "lfq"):
        changed = [f"{k}={v}" for k, v in cfg.quantizer.items() if k != "num_codes" and (k not in own or own[k] != v)]
        text = ", ".join(changed) or "defaults"
        return text + (f", ρ={t.codebook_lr_ratio:g}" if q.type == "simvq" else "")
    if q.type == "ibq":
        extra = [f"β={q.beta:g}", f"{q.logits} logits"] + (
            [f"entropy {q.entropy_weight:g} (T {q.entropy_temperature:g})"] if q.entropy_weight > 0 else ["no entropy"])
        return ", ".join(extra) + f", ρ={t.codebook_lr_ratio:g}"
    if q.type == "fsq":
        from ddcl_vq.fsq import fsq_levels
        levels = q.levels if q.levels is not None else list(fsq_levels(q.num_codes)[0])
        return "levels [" + ", ".join(str(v) for v in levels) + "]"
    return ""


def make_row(run_dir: Path, ev: Dict, name: str) -> Dict:
    from ddcl_vq.tokenizer.config import load_config
    cfg = load_config(Path(run_dir) / "config.yaml")
    hard, soft, gap = ev["recon"]["hard"], ev["recon"]["soft"], ev["recon"]["soft_minus_hard"]
    c = ev["codebook"]
    return {
        "name": name, "run": str(run_dir), "type": ev["quantizer"]["type"], "num_codes": ev["quantizer"]["num_codes"],
        **{k: cfg.quantizer.get(k)
           for k in ("mode", "temperature", "temperature_schedule", "temperature_final")},
        "codebook_lr_ratio": cfg.train.codebook_lr_ratio, "settings": settings_text(cfg),
        **{f"hard_{k}": hard[k] for k in ("psnr", "mse", "ssim", "lpips")},
        "soft_psnr": soft["psnr"] if soft else None, "soft_minus_hard_psnr": gap["psnr"] if gap else None,
        **{k: c[k] for k in ("utilization", "active_codes", "dead_codes")},
        **{k: c.get(k) for k in ("utilization_ceiling", "queue_utilization", "queue_ceiling", "batch_utilization")},
        **{k: c[k] for k in ("perplexity", "soft_perplexity")}, "steps": ev["step"],
        "train_seconds": train_seconds(run_dir), "ms_per_step": ms_per_step(run_dir), "split": ev["split"],
        "num_images": ev["num_images"], **per_level_row(ev)}


def markdown_table(rows: Sequence[Dict], columns: Sequence[Tuple[str, str, Any]] = TABLE_COLUMNS) -> str:
    """The one markdown table writer: a header of the columns' headers, one line per row. A column is (key, header,
    format): a format spec for :func:`fmt` (``—`` for None) of ``row[key]``, or a callable row -> cell."""
    def cell(row: Dict, key: str, spec: Any) -> str:
        return str(spec(row)) if callable(spec) else fmt(row.get(key), spec)
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, k, f) for k, _, f in columns) + " |" for r in rows])


def unique_names(run_dirs: Sequence[Path]) -> List[str]:
    from ddcl_vq.tokenizer.config import load_config
    names = []
    for d in run_dirs:
        try:
            names.append(load_config(Path(d) / "config.yaml").run.name)
        except Exception:  # noqa: BLE001 - fall back to the folder name
            names.append(Path(d).name)
    if len(set(names)) < len(names):
        names = [Path(d).name for d in run_dirs]
    if len(set(names)) < len(names):
        names = [str(d) for d in run_dirs]
    return names


# ----------------------------------------------------------------------------- seeds: mean ± sd
#: the metrics averaged over seeds: (row key, header, format)
METRICS = [("hard_psnr", "PSNR hard (dB)", ".2f"), ("hard_ssim", "SSIM hard", ".4f"),
           ("hard_lpips", "LPIPS hard", ".4f"), ("utilization", "utilization", ".1%"),
           ("queue_utilization", "util. (queue)", ".1%"), ("batch_utilization", "util. (batch)", ".1%"),
           ("dead_codes", "dead codes", ".1f"), ("perplexity", "perplexity", ".1f"), ("ms_per_step", "ms/step", ".1f")]
#: carried from the group's first run (the same for every seed of an arm × sweep point)
SHARED = ("type", "num_codes", "settings", "utilization_ceiling", "queue_ceiling", "mode", "temperature",
          "temperature_schedule", "temperature_final", "codebook_lr_ratio", "split", "num_images")

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


def aggregate(rows: Sequence[Dict], metrics: Sequence[Tuple] = METRICS, by: str = "group",
              shared: Sequence[str] = SHARED, seed: str = "seed", least: int = 1) -> List[Dict]:
    """The one aggregate: a row per value of ``by`` (a row without one: its ``name``) that at least ``least`` rows
    hold, in order of first appearance: ``name`` = that value, ``n``, ``seeds`` (the rows' ``seed``), ``runs`` (their
    names), the ``shared`` keys of its first row, and for every metric its mean (same key), ``<key>_sd``,
    ``<key>_n``."""
    groups: Dict[str, List[Dict]] = {}
    for r in rows:
        groups.setdefault(r.get(by) or r["name"], []).append(r)
    out = []
    for name, members in groups.items():
        if len(members) < least:
            continue
        row: Dict = {"name": name, "n": len(members), "seeds": [m.get(seed) for m in members],
                     "runs": [m.get("name") for m in members], **{k: members[0].get(k) for k in shared}}
        for key, _, _ in metrics:
            row[key], row[f"{key}_sd"], row[f"{key}_n"] = mean_sd([m.get(key) for m in members])
        out.append(row)
    return out


def pm(row: Dict, key: str, spec: str) -> str:
    """The one mean ± sd cell: ``mean ± sd`` (``—`` for a missing sd), ``(n=2)`` when fewer values than the row's n."""
    mean, n = row.get(key), row.get(f"{key}_n", row.get("n"))
    if mean is None or (isinstance(mean, float) and not math.isfinite(mean)):
        return fmt(mean, spec)
    return fmt(mean, spec, sd=row.get(f"{key}_sd")) + (f" (n={n})" if n is not None and n != row.get("n") else "")


def pm_columns(metrics: Sequence[Tuple]) -> List[Tuple[str, str, Callable]]:
    """markdown_table columns of mean ± sd cells for ``metrics`` (key, header, format)."""
    return [(key, header, lambda r, key=key, spec=spec: pm(r, key, spec)) for key, header, spec in metrics]


def seeds_cell(row: Dict) -> str:
    return f"{','.join(map(str, row['seeds']))} ({row['n']})"


MEAN_SD_COLUMNS = [("name", "run", "s"), ("type", "quantizer", "s"), ("num_codes", "K", "d"),
                   ("settings", "settings", "s"), ("seeds", "seeds (n)", seeds_cell)] + pm_columns(METRICS)


def mean_sd_table(groups: Sequence[Dict]) -> str:
    """Markdown: one row per arm × sweep point, mean ± sd over its seeds."""
    return markdown_table(groups, MEAN_SD_COLUMNS)


# ----------------------------------------------------------------------------- the files
def write_csv(path: Path, rows: Sequence[Dict]) -> None:
    """``rows`` as CSV, lists as space-separated text; the columns of every row, in order of appearance (a
    column a row lacks, e.g. per-level ones, is empty there)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()} for r in rows)


def write_tables(out: Path, rows: Sequence[Dict], evals: Sequence[Dict], split: str, max_images: int,
                 command: Optional[str] = None, groups: Optional[Sequence[Dict]] = None) -> None:
    """table.md, table.csv and table.json: one row per run; with ``groups`` (seeds) one row per arm × sweep point,
    mean ± sd, and the per-run rows below (table.md), in table_runs.csv and in table.json's ``runs``."""
    images = "/".join(map(str, sorted({ev["num_images"] for ev in evals})))
    text = [markdown_table(rows), "", f"Evaluated on the {evals[0]['dataset']} {evals[0]['split']} split, "
            f"{images} images per run."] + ([f"Command: `{command}`"] if command else [])
    text += [f"LPIPS: {n}" for n in sorted({ev["lpips_note"] for ev in evals})]
    text += [f"rFID: {n}" for n in sorted({ev["rfid_note"] for ev in evals})]
    per_level = any("utilization_per_level" in r for r in rows)
    text += ["", "Columns:", "```", column_definitions(rows), "```", "", "Definitions:", "```",
             definitions(per_level), "```"]
    if groups is not None:
        text = [mean_sd_table(groups), "", "Per seed:", ""] + text + ["", "Seeds:", "```", SEED_DEFINITIONS, "```"]
        write_csv(out / "table_runs.csv", rows)
    (out / "table.md").write_text("\n".join(text) + "\n")
    write_csv(out / "table.csv", rows if groups is None else groups)
    extra = {} if groups is None else {"runs": list(rows), "seed_definitions": SEED_DEFINITIONS}
    (out / "table.json").write_text(json.dumps({"rows": list(rows if groups is None else groups), **extra,
                                                "command": command, "split": split, "max_images": max_images,
                                                "definitions": definitions(per_level),
                                                "column_definitions": column_definitions(rows)},
                                               indent=2) + "\n")


def tabulate(out: Path, arms: Sequence, rows: List[Dict], evals: Sequence[Dict], ev, seeds: bool,
             command: Optional[str], overrides: Sequence[str] = ()) -> Optional[List[Dict]]:
    """The tables and plots of a study's finished ``arms`` in ``out`` (``ev``: the study's eval settings); with
    ``seeds`` the tables are mean ± sd and the plots show each arm's first seed. -> the groups or None."""
    from ddcl_vq.studies.plots import write_plots
    groups, first = None, list(range(len(arms)))
    if seeds:
        for row, arm in zip(rows, arms):
            row["group"], row["seed"] = arm.group, arm.seed
        groups = aggregate(rows)
        first = [i for i in first if i == 0 or arms[i - 1].group != arms[i].group]
    write_tables(out, rows, evals, ev.split, ev.max_images, command, groups)
    write_plots(out, [Path(arms[i].config.run.dir) for i in first], [arms[i].name for i in first],
                [evals[i] for i in first], groups or rows, ev.split, ev.grid_images, overrides)
    return groups
