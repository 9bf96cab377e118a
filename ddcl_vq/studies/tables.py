"""``ddcl-vq compare``'s tables: one row per run (columns in COLUMNS, defined in
COLUMN_DEFINITIONS), as markdown, CSV and JSON, with the footer saying what was evaluated how."""
from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ddcl_vq import EMAVQ

from ddcl_vq.tokenizer.evaluate import fmt
from ddcl_vq.tokenizer.metrics import definitions
from ddcl_vq.common.runlog import ms_per_step, train_seconds

COLUMNS = [  # (key, header, format)
    ("name", "run", "s"), ("type", "quantizer", "s"), ("num_codes", "K", "d"), ("settings", "settings", "s"),
    ("hard_psnr", "PSNR hard (dB)", ".2f"), ("hard_mse", "MSE hard", ".5f"), ("hard_ssim", "SSIM hard", ".4f"),
    ("hard_lpips", "LPIPS hard", ".4f"), ("soft_psnr", "PSNR soft (dB)", ".2f"),
    ("soft_minus_hard_psnr", "soft−hard PSNR", "+.2f"), ("utilization", "utilization", ".1%"),
    ("queue_utilization", "util. (queue)", ".1%"), ("batch_utilization", "util. (batch)", ".1%"),
    ("dead_codes", "dead codes", "d"), ("perplexity", "perplexity", ".1f"), ("steps", "steps", "d"),
    ("train_seconds", "train time (s)", ".0f"), ("ms_per_step", "ms/step", ".1f"),
]

COLUMN_DEFINITIONS = """\
settings        = what distinguishes the arm: DDCL mode, temperature tau (relative to D, or to the
                  data's nearest-code distance where marked (data); a -> b when annealed, with the
                  schedule), the codebook's update (M-step, with its statistics' decay when set, or by
                  gradient at codebook/encoder learning-rate ratio rho), init other than uniform,
                  revival threshold, rotation trick; EMA decay and dead-code threshold;
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


EMAVQ_DEFAULT_DECAY = inspect.signature(EMAVQ.__init__).parameters["decay"].default


def settings_text(cfg) -> str:
    q, t = cfg.quantizer, cfg.train
    if q.type == "ddcl":
        tau = (f"τ={q.temperature:g}" if q.temperature_schedule == "constant" else
               f"τ={q.temperature:g}→{q.temperature_final:g} ({q.temperature_schedule})")
        tau += " (data)" if q.temperature_reference == "data" else ""
        codebook = ("M-step" + (f" decay={q.decay:g}" if q.decay is not None else "") if q.codebook_update == "mstep"
                    else f"ρ={t.codebook_lr_ratio:g}")
        extra = ([f"{q.codebook_init} init"] if q.codebook_init != "uniform" else []) \
            + ([f"revival {q.revive_threshold:g}" + (" (mass)" if q.revive_criterion == "mass" else "")
                + (" + twins" if getattr(q, "revive_twins", False) else "")]
               if q.revive_threshold > 0 else []) \
            + ([f"warm-up {q.warmup_steps}"] if q.warmup_steps > 0 else []) \
            + ([f"β {q.beta:g}→{q.beta_final:g}"] if q.beta_final is not None and q.mode == "straight_through" else []) \
            + (["rotation trick"] if q.encoder_gradient == "rotation" else [])
        return ", ".join([q.mode, tau, codebook] + extra)
    if q.type == "hard":
        extra = [f"β={q.beta:g}"] + (["cosine"] if q.distance == "cosine" else []) + (["k-means init"] if q.kmeans_init else [])
        return ", ".join(extra) + (f", ρ={t.codebook_lr_ratio:g}" if t.codebook_lr_ratio != 1 else "")
    if q.type == "ema":
        decay = q.decay if q.decay is not None else EMAVQ_DEFAULT_DECAY  # null: EMAVQ's own default
        return f"decay={decay:g}, dead-code restart<{q.dead_code_threshold:g}" if q.dead_code_threshold > 0 \
            else f"decay={decay:g}, no restart"
    if q.type in ("vqp", "simvq", "lfq"):
        options = getattr(q, q.type)
        text = "defaults" if not options else ", ".join(f"{k}={v}" for k, v in options.items())
        return text + (f", ρ={t.codebook_lr_ratio:g}" if q.type == "simvq" else "")
    if q.type == "ibq":
        extra = [f"β={q.beta:g}", f"{q.logits} logits"] + (
            [f"entropy {q.entropy_weight:g} (T {q.entropy_temperature:g})"] if q.entropy_weight > 0 else ["no entropy"])
        return ", ".join(extra) + f", ρ={t.codebook_lr_ratio:g}"
    if q.type == "fsq":
        from ddcl_vq.fsq import fsq_levels
        levels = q.fsq_levels if q.fsq_levels is not None else list(fsq_levels(q.num_codes)[0])
        return "levels [" + ", ".join(str(v) for v in levels) + "]"
    return ""


def make_row(run_dir: Path, ev: Dict, name: str) -> Dict:
    from ddcl_vq.tokenizer.config import load_config
    cfg = load_config(Path(run_dir) / "config.yaml", migrate=True)
    hard, soft, gap = ev["recon"]["hard"], ev["recon"]["soft"], ev["recon"]["soft_minus_hard"]
    c = ev["codebook"]
    return {
        "name": name, "run": str(run_dir), "type": ev["quantizer"]["type"], "num_codes": ev["quantizer"]["num_codes"],
        **{k: getattr(cfg.quantizer, k) if cfg.quantizer.type == "ddcl" else None
           for k in ("mode", "temperature", "temperature_schedule", "temperature_final")},
        "codebook_lr_ratio": cfg.train.codebook_lr_ratio, "settings": settings_text(cfg),
        **{f"hard_{k}": hard[k] for k in ("psnr", "mse", "ssim", "lpips")},
        "soft_psnr": soft["psnr"] if soft else None, "soft_minus_hard_psnr": gap["psnr"] if gap else None,
        **{k: c[k] for k in ("utilization", "active_codes", "dead_codes")},
        **{k: c.get(k) for k in ("utilization_ceiling", "queue_utilization", "queue_ceiling", "batch_utilization")},
        **{k: c[k] for k in ("perplexity", "soft_perplexity")}, "steps": ev["step"],
        "train_seconds": train_seconds(run_dir), "ms_per_step": ms_per_step(run_dir), "split": ev["split"],
        "num_images": ev["num_images"]}


def markdown_table(rows: Sequence[Dict], columns: Sequence[tuple] = COLUMNS) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k), f) for k, _, f in columns) + " |")
    return "\n".join(lines)


def unique_names(run_dirs: Sequence[Path]) -> List[str]:
    from ddcl_vq.tokenizer.config import load_config
    names = []
    for d in run_dirs:
        try:
            names.append(load_config(Path(d) / "config.yaml", migrate=True).run.name)
        except Exception:  # noqa: BLE001 - fall back to the folder name
            names.append(Path(d).name)
    if len(set(names)) < len(names):
        names = [Path(d).name for d in run_dirs]
    if len(set(names)) < len(names):
        names = [str(d) for d in run_dirs]
    return names


def table_footer(evals: Sequence[Dict], command: Optional[str]) -> str:
    images = sorted({ev["num_images"] for ev in evals})
    lines = [f"Evaluated on the {evals[0]['dataset']} {evals[0]['split']} split, "
             f"{'/'.join(map(str, images))} images per run."]
    if command:
        lines.append(f"Command: `{command}`")
    lines += [f"LPIPS: {n}" for n in sorted({ev["lpips_note"] for ev in evals})]
    lines += [f"rFID: {n}" for n in sorted({ev["rfid_note"] for ev in evals})]
    lines += ["", "Columns:", "```", COLUMN_DEFINITIONS, "```", "", "Definitions:", "```", definitions(), "```"]
    return "\n".join(lines)


def write_tables(out: Path, rows: Sequence[Dict], evals: Sequence[Dict], split: str, max_images: int,
                 command: Optional[str] = None) -> None:
    """table.md, table.csv and table.json: one row per run."""
    (out / "table.md").write_text(markdown_table(rows) + "\n\n" + table_footer(evals, command) + "\n")
    write_csv(out / "table.csv", rows)
    (out / "table.json").write_text(json.dumps({"rows": list(rows), "command": command, "split": split,
                                                "max_images": max_images, "definitions": definitions(),
                                                "column_definitions": COLUMN_DEFINITIONS}, indent=2) + "\n")


def write_csv(path: Path, rows: Sequence[Dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


