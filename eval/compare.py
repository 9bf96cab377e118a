"""``ddcl-vq compare RUN_DIR ... --out DIR``: one table and a few plots over several runs.

Every run is evaluated first unless RUN_DIR/eval.json was made exactly as asked: from the run's
newest checkpoint (same step and file, not older than it), on the same split and number of
images, without config overrides. Writes into DIR:

  table.md  table.csv  table.json       one row per run (columns defined in COLUMN_DEFINITIONS)
  usage_histograms.png                  sorted per-code usage counts, log scale, one panel per run
  usage_over_training.png               windowed utilization and perplexity from metrics.jsonl
  psnr_vs_utilization.png               hard-code PSNR against utilization
  reconstructions.png                   the same test images decoded from each run's hard codes
"""
from __future__ import annotations

import csv
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ddcl_vq.train.errors import entry_point
from ddcl_vq.train.rundir import writable_dir
from ddcl_vq.train.settings import Options, Rules, option

from .evaluate import EvaluateError, evaluate_run, load_run
from .metrics import definitions

COLUMNS = [  # (key, header, format)
    ("name", "run", "s"), ("type", "quantizer", "s"), ("num_codes", "K", "d"), ("settings", "settings", "s"),
    ("hard_psnr", "PSNR hard (dB)", ".2f"), ("hard_mse", "MSE hard", ".5f"), ("hard_ssim", "SSIM hard", ".4f"),
    ("hard_lpips", "LPIPS hard", ".4f"), ("soft_psnr", "PSNR soft (dB)", ".2f"),
    ("soft_minus_hard_psnr", "soft−hard PSNR", "+.2f"), ("utilization", "utilization", ".1%"),
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


# --------------------------------------------------------------------------- evaluation freshness

def needs_eval(run_dir: Path, split: str, max_images: int, overrides: Sequence[str] = ()) -> bool:
    """True unless RUN_DIR/eval.json was computed exactly as asked: the newest checkpoint (same step,
    same file, eval.json not older than it), ``split``, ``max_images`` and ``overrides``."""
    from ddcl_vq.train.checkpoint import CheckpointError, latest_checkpoint

    ev_path = run_dir / "eval.json"
    if not ev_path.is_file():
        return True
    try:
        ev = json.loads(ev_path.read_text())
    except (OSError, json.JSONDecodeError):
        return True
    if not isinstance(ev, dict) or "overrides" not in ev:  # written before evaluations recorded them
        return True
    asked = {"split": split, "max_images": max_images, "overrides": list(overrides)}
    if any(ev.get(key) != value for key, value in asked.items()):
        return True
    try:
        found = latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    except CheckpointError:
        return True  # evaluate_run reports it
    if found is None:
        return True
    state, ckpt = found
    return (ev.get("step") != int(state["step"]) or Path(str(ev.get("checkpoint"))).name != ckpt.name
            or ev_path.stat().st_mtime < ckpt.stat().st_mtime)


def ensure_eval(run_dir: Path, split: str = "test", max_images: int = 0, batch_size: int = 256,
                progress: bool = False) -> Dict:
    run_dir = Path(run_dir)
    if needs_eval(run_dir, split, max_images):
        return evaluate_run(run_dir, split, max_images, batch_size, progress=progress)
    return json.loads((run_dir / "eval.json").read_text())


# --------------------------------------------------------------------------- run facts

def read_metrics(run_dir: Path) -> List[Dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    # a resumed run appends again from the checkpoint's step: keep the last record per step
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def train_seconds(run_dir: Path) -> Optional[float]:
    """Sum over training sessions of the last logged 'time' (it restarts at 0 each session)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    total, last = 0.0, None
    for line in path.read_text().splitlines():
        try:
            t = float(json.loads(line)["time"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if last is not None and t < last:
            total += last
        last = t
    return total + (last or 0.0) if last is not None else None


def ms_per_step(run_dir: Path) -> Optional[float]:
    """Milliseconds per training step from metrics.jsonl (see COLUMN_DEFINITIONS): sum of 'time'
    differences over sum of 'step' differences between consecutive records of one session (a
    session ends where 'time' goes back or 'step' does not advance: a resumed run). A run whose
    sessions each logged one record falls back to the first record's time / step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    points = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            points.append((float(record["time"]), int(record["step"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    seconds = steps = 0.0
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t1 >= t0 and s1 > s0:
            seconds += t1 - t0
            steps += s1 - s0
    if steps > 0:
        return 1000.0 * seconds / steps
    if points and points[0][1] > 0:
        return 1000.0 * points[0][0] / points[0][1]
    return None


def settings_text(cfg) -> str:
    q, t = cfg.quantizer, cfg.train
    if q.type == "ddcl":
        tau = f"τ={q.temperature:g}"
        if q.temperature_schedule != "constant":
            tau = f"τ={q.temperature:g}→{q.temperature_final:g} ({q.temperature_schedule})"
        tau += " (data)" if q.temperature_reference == "data" else ""
        if q.codebook_update == "mstep":
            codebook = "M-step" + (f" decay={q.decay:g}" if q.decay is not None else "")
        else:
            codebook = f"ρ={t.codebook_lr_ratio:g}"
        extra = ([f"{q.codebook_init} init"] if q.codebook_init != "uniform" else []) \
            + ([f"revival {q.revive_threshold:g}" + (" (mass)" if q.revive_criterion == "mass" else "")]
               if q.revive_threshold > 0 else []) \
            + ([f"warm-up {q.warmup_steps}"] if q.warmup_steps > 0 else []) \
            + (["rotation trick"] if q.encoder_gradient == "rotation" else [])
        return ", ".join([q.mode, tau, codebook] + extra)
    if q.type == "hard":
        extra = [f"β={q.beta:g}"] + (["cosine"] if q.distance == "cosine" else []) + (["k-means init"] if q.kmeans_init else [])
        return ", ".join(extra) + (f", ρ={t.codebook_lr_ratio:g}" if t.codebook_lr_ratio != 1 else "")
    if q.type == "ema":
        return f"decay={q.decay:g}, dead-code restart<{q.dead_code_threshold:g}" if q.dead_code_threshold > 0 \
            else f"decay={q.decay:g}, no restart"
    if q.type == "vqp":
        return "defaults" if not q.vqp else ", ".join(f"{k}={v}" for k, v in q.vqp.items())
    return ""


def make_row(run_dir: Path, ev: Dict, name: str) -> Dict:
    from ddcl_vq.train.config import load_config
    cfg = load_config(Path(run_dir) / "config.yaml", migrate=True)
    hard, soft, gap = ev["recon"]["hard"], ev["recon"]["soft"], ev["recon"]["soft_minus_hard"]
    c = ev["codebook"]
    return {
        "name": name, "run": str(run_dir), "type": ev["quantizer"]["type"], "num_codes": ev["quantizer"]["num_codes"],
        "mode": cfg.quantizer.mode if cfg.quantizer.type == "ddcl" else None,
        "temperature": cfg.quantizer.temperature if cfg.quantizer.type == "ddcl" else None,
        "temperature_schedule": cfg.quantizer.temperature_schedule if cfg.quantizer.type == "ddcl" else None,
        "temperature_final": cfg.quantizer.temperature_final if cfg.quantizer.type == "ddcl" else None,
        "codebook_lr_ratio": cfg.train.codebook_lr_ratio,
        "settings": settings_text(cfg),
        "hard_psnr": hard["psnr"], "hard_mse": hard["mse"], "hard_ssim": hard["ssim"], "hard_lpips": hard["lpips"],
        "soft_psnr": soft["psnr"] if soft else None, "soft_minus_hard_psnr": gap["psnr"] if gap else None,
        "utilization": c["utilization"], "active_codes": c["active_codes"], "dead_codes": c["dead_codes"],
        "perplexity": c["perplexity"], "soft_perplexity": c["soft_perplexity"], "steps": ev["step"],
        "train_seconds": train_seconds(run_dir), "ms_per_step": ms_per_step(run_dir),
        "split": ev["split"], "num_images": ev["num_images"],
    }


def _cell(value, spec: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def markdown_table(rows: Sequence[Dict], columns: Sequence[tuple] = COLUMNS) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k), f) for k, _, f in columns) + " |")
    return "\n".join(lines)


def unique_names(run_dirs: Sequence[Path]) -> List[str]:
    from ddcl_vq.train.config import load_config
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


# --------------------------------------------------------------------------- plots

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _grid(n: int, max_cols: int = 6):
    cols = min(n, max_cols)
    return -(-n // cols), cols


def plot_usage_histograms(evals: Sequence[Dict], names: Sequence[str], path: Path) -> None:
    plt = _plt()
    rows, cols = _grid(len(evals))
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_usage_over_training(metrics: Sequence[List[Dict]], names: Sequence[str], path: Path) -> None:
    plt = _plt()
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
    a1.set_ylabel("utilization (window)")
    a1.set_ylim(0, 1.02)
    a2.set_ylabel("perplexity (window)")
    a2.set_yscale("log")
    for ax in (a1, a2):
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    a2.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Codebook usage during training (train.usage_window steps of hard indices per point)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_psnr_vs_utilization(rows: Sequence[Dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    markers = {"ddcl": "o", "hard": "s", "ema": "^", "vqp": "D"}
    for r in rows:
        if r.get("hard_psnr_sd") is not None or r.get("utilization_sd") is not None:
            ax.errorbar(r["utilization"], r["hard_psnr"], xerr=r.get("utilization_sd"), yerr=r.get("hard_psnr_sd"),
                        fmt="none", ecolor="gray", elinewidth=0.8, capsize=2)
        ax.scatter(r["utilization"], r["hard_psnr"], marker=markers.get(r["type"], "x"), s=36)
        ax.annotate(r["name"], (r["utilization"], r["hard_psnr"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ax.set_xlabel("utilization (dataset level)")
    ax.set_ylabel("PSNR, hard codes (dB)")
    ax.set_xlim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker=m, ls="", color="gray", label=t) for t, m in markers.items()
               if any(r["type"] == t for r in rows)]
    ax.legend(handles=handles, fontsize=7)
    spread = any(r.get("hard_psnr_sd") is not None for r in rows)
    ax.set_title("Reconstruction (hard codes) vs codebook utilization"
                 + (": means, bars ± sample sd over seeds" if spread else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@torch.no_grad()
def plot_reconstructions(run_dirs: Sequence[Path], names: Sequence[str], path: Path, split: str = "test",
                         num_images: int = 8) -> None:
    from ddcl_vq.train.data import build_dataset
    plt = _plt()
    recons, originals = [], None
    for d in run_dirs:
        cfg, model, _, _ = load_run(d, device="cpu")
        if originals is None:
            ds = build_dataset(cfg.data, split, cfg.run.seed)
            originals = torch.stack([ds[i][0] for i in range(min(num_images, len(ds)))])
        recons.append(model.reconstruct(originals, "hard").clamp(0, 1))
    rows = [("original", originals)] + list(zip(names, recons))
    n = originals.shape[0]
    fig, axes = plt.subplots(len(rows), n, figsize=(0.9 * n + 1.6, 0.9 * len(rows)), squeeze=False)
    for i, (label, images) in enumerate(rows):
        for j in range(n):
            ax = axes[i, j]
            img = images[j].permute(1, 2, 0).numpy()
            ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None,
                      vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[i, 0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=6)
    fig.suptitle(f"First {n} {split} images, decoded from hard codes", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (0.9 * len(rows))))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- compare

def evaluate_runs(run_dirs: Sequence[str | Path], split: str = "test", max_images: int = 0,
                  batch_size: int = 256, names: Optional[Sequence[str]] = None,
                  progress: bool = False) -> tuple[List[Dict], List[Dict]]:
    """(rows, evals): every run evaluated when needed (:func:`ensure_eval`), one table row each."""
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise EvaluateError("expected at least one run directory to compare")
    for d in run_dirs:
        if not d.is_dir():
            raise EvaluateError(f"run directory {str(d)!r} does not exist")
    names = list(names) if names is not None else unique_names(run_dirs)
    evals = [ensure_eval(d, split, max_images, batch_size, progress) for d in run_dirs]
    return [make_row(d, ev, n) for d, ev, n in zip(run_dirs, evals, names)], evals


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


def write_plots(out: Path, run_dirs: Sequence[Path], names: Sequence[str], evals: Sequence[Dict],
                rows: Sequence[Dict], split: str = "test", grid_images: int = 8) -> None:
    """The four plots; ``rows`` feed psnr_vs_utilization.png (one point per row, error bars
    where a row has ``hard_psnr_sd`` / ``utilization_sd``), the runs feed the other three."""
    plot_usage_histograms(evals, names, out / "usage_histograms.png")
    plot_usage_over_training([read_metrics(d) for d in run_dirs], names, out / "usage_over_training.png")
    plot_psnr_vs_utilization(rows, out / "psnr_vs_utilization.png")
    plot_reconstructions(run_dirs, names, out / "reconstructions.png", split, grid_images)


class CompareWriteError(EvaluateError):
    """The comparison was computed but its files could not be written; ``rows`` holds it."""

    def __init__(self, rows: List[Dict], message: str):
        super().__init__(message)
        self.rows = rows


def compare(run_dirs: Sequence[str | Path], out_dir: str | Path, split: str = "test", max_images: int = 0,
            batch_size: int = 256, names: Optional[Sequence[str]] = None, grid_images: int = 8,
            progress: bool = False, command: Optional[str] = None) -> List[Dict]:
    """Evaluate (when needed) and compare ``run_dirs``; writes tables and plots into ``out_dir``
    (checked writable before any evaluation; CompareWriteError, holding the rows, when writing fails)."""
    run_dirs = [Path(d) for d in run_dirs]
    for d in run_dirs:
        if not d.is_dir():
            raise EvaluateError(f"run directory {str(d)!r} does not exist")
    out = writable_dir(Path(out_dir), "--out")  # before the evaluations
    rows, evals = evaluate_runs(run_dirs, split, max_images, batch_size, names, progress)
    try:
        write_tables(out, rows, evals, split, max_images, command)
        write_plots(out, run_dirs, [r["name"] for r in rows], evals, rows, split, grid_images)
    except OSError as err:
        raise CompareWriteError(rows, f"could not write the comparison into {str(out)!r} "
                                      f"({type(err).__name__}: {err.strerror or err})") from None
    return rows


def table_footer(evals: Sequence[Dict], command: Optional[str]) -> str:
    images = sorted({ev["num_images"] for ev in evals})
    lpips_notes = sorted({ev["lpips_note"] for ev in evals})
    rfid_notes = sorted({ev["rfid_note"] for ev in evals})
    lines = [f"Evaluated on the {evals[0]['dataset']} {evals[0]['split']} split, "
             f"{'/'.join(map(str, images))} images per run."]
    if command:
        lines.append(f"Command: `{command}`")
    lines += [f"LPIPS: {n}" for n in lpips_notes] + [f"rFID: {n}" for n in rfid_notes]
    lines += ["", "Columns:", "```", COLUMN_DEFINITIONS, "```", "", "Definitions:", "```", definitions(), "```"]
    return "\n".join(lines)


@dataclass(kw_only=True)
class CompareOptions:
    run_dirs: List[str] = option(help="run directories written by ddcl-vq train", positional=True, nargs="+",
                                 metavar="RUN_DIR")
    out: str = option(help="output directory for tables and plots")
    split: str = option("test", "dataset split")
    max_images: int = option(0, "images per evaluation (0 = whole split)")
    batch_size: int = option(256, "images per batch")
    grid_images: int = option(8, "test images in reconstructions.png")
    quiet: bool = option(False, "no table on stdout")


OPTIONS = Options(CompareOptions, prog="ddcl-vq compare", description=__doc__,
                  rules=Rules(choices={"split": ("train", "test")}, positive={"batch_size"},
                              non_negative={"max_images", "grid_images"}))


@entry_point("ddcl-vq compare")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    cmd = shlex.join(["ddcl-vq", "compare"] + list(sys.argv[1:] if argv is None else argv))
    try:
        rows = compare(opts.run_dirs, opts.out, opts.split, opts.max_images, opts.batch_size,
                       grid_images=opts.grid_images, progress=not opts.quiet, command=cmd)
    except CompareWriteError as err:
        print(markdown_table(err.rows))  # the results, even when they cannot be saved
        raise
    if not opts.quiet:
        print(markdown_table(rows))
        print(f"\nwrote table.md, table.csv, table.json and 4 plots to {opts.out}")
        print("\ndefinitions:\n" + COLUMN_DEFINITIONS + "\n" + definitions())
    return 0


if __name__ == "__main__":
    sys.exit(main())
