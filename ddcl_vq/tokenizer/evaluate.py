"""Evaluate a run directory written by `ddcl-vq train` on a dataset split and write
RUN_DIR/eval.json (reconstruction on hard codes, and soft codes for DDCL; SSIM, LPIPS;
dataset-level codebook usage and geometry). Dotted overrides change the run's config for
the evaluation only (e.g. data.root=/path, train.device=cpu). Overrides that change which
images are evaluated (data.name, natural_patches' photographs) measure the model on data it
was not trained on and write RUN_DIR/eval_<dataset>.json (e.g. eval_digits.json), leaving the
run's own eval.json as it is.

  ddcl-vq evaluate runs/fashion_ddcl --max-images 2000
  ddcl-vq evaluate runs/fashion_ddcl data.name=digits     # -> runs/fashion_ddcl/eval_digits.json
  torchrun --nproc_per_node 2 -m ddcl_vq evaluate runs/fashion_ddcl
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ddcl_vq import uniform_ceiling
from ddcl_vq.common.data import SPLITS
from ddcl_vq.common.errors import UserError, entry_point
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE
from ddcl_vq.common.threads import set_threads, threads_option

from ddcl_vq.tokenizer.metrics import ImageMetricSums, build_lpips, codebook_geometry, definitions, rfid_availability

HELP = __doc__  # the module docstring is the --help text


class EvaluateError(UserError, RuntimeError):
    """The run directory cannot be evaluated (missing dir, config or checkpoint)."""


def load_run(run_dir: str | Path, overrides: Sequence[str] = (), device: torch.device | str = "cpu"):
    """-> (cfg, model in eval mode on ``device``, checkpoint step, checkpoint path).

    The quantizer's state comes from the checkpoint, its temperature schedule included (DDCL:
    τ where training left it, i.e. the final temperature for a finished run). A config.yaml
    written before the schedule keys moved to ``quantizer.*`` is read with them moved.
    """
    from ddcl_vq.tokenizer.builders import build_model
    from ddcl_vq.common.checkpoint import latest_checkpoint, load_into
    from ddcl_vq.tokenizer.config import load_config
    from ddcl_vq.common.data import image_channels
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EvaluateError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / "config.yaml").is_file():
        raise EvaluateError(f"run directory {str(run_dir)!r} has no config.yaml (was it written by ddcl-vq train?)")
    cfg = load_config(run_dir / "config.yaml", overrides, migrate=True)
    if overrides:
        check_overrides(run_dir, load_config(run_dir / "config.yaml", migrate=True), cfg)
    found = latest_checkpoint(run_dir / "checkpoints", map_location="cpu")
    if found is None:
        raise EvaluateError(f"run directory {str(run_dir)!r} has no checkpoint (expected "
                            f"{str(run_dir / 'checkpoints' / 'last.pt')!r}); train it first")
    state, path = found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ρ ≤ 1 training warnings are irrelevant here
        model = build_model(cfg, image_channels(cfg.data))
    load_into(model, state["model"], path)
    step = int(state["step"])
    model.training_usage = (state.get("log_state") or {}).get("recent_stats")  # read by evaluate_run
    return cfg, model.to(device).eval(), step, path


#: the training's last usage figures (RecentUsage, saved with the checkpoint) that eval.json's codebook block repeats
TRAINING_USAGE_KEYS = ("queue_utilization", "queue_indices", "queue_ceiling", "batch_utilization", "batch_ceiling")


def check_overrides(run_dir: Path, trained, asked) -> None:
    """EvaluateError when an override changes a setting of the trained model (model.*, quantizer.*):
    the checkpoint decides those (the temperature included: the run's schedule is saved in it), so
    such an override would be ignored or fail to load."""
    from ddcl_vq.tokenizer.config import differences
    # overrides may change the data, where it runs and the (same-result) implementation, not the model
    fixed = [(k, a, b) for k, a, b in differences(trained, asked)
             if k.startswith(("model.", "quantizer.")) and k != "quantizer.implementation"]
    if fixed:
        changes = ", ".join(f"{k}={b!r} (trained with {a!r})" for k, a, b in fixed)
        why = (" — the temperature comes from the schedule saved in the checkpoint"
               if any(k.startswith("quantizer.temperature") for k, _, _ in fixed) else "")
        raise EvaluateError(f"{str(run_dir)!r}: evaluate measures the model as trained; overrides cannot change its "
                            f"settings: {changes}{why}. Overrides may change data.*, train.* (e.g. train.device) and "
                            "quantizer.implementation; to measure other settings, train a run with them")


def heldout_tag(run_dir: str | Path, overrides: Sequence[str] = (), split: str = "test") -> Optional[str]:
    """None when ``overrides`` evaluate the run's own data; else a name for the other data (``digits``;
    ``natural_patches_camera_moon`` for other photographs): the evaluation then goes to RUN_DIR/eval_<name>.json, not
    eval.json. None too when the run has no readable config (load_run says why)."""
    from ddcl_vq.tokenizer.config import ConfigError, load_config
    config = Path(run_dir) / "config.yaml"
    if not overrides or not config.is_file():
        return None
    try:
        trained, asked = load_config(config, migrate=True), load_config(config, overrides, migrate=True)
    except ConfigError:
        return None
    key = "train_photos" if split == "train" else "test_photos"
    photos = getattr(asked.data, key) if asked.data.name == "natural_patches" else None
    if asked.data.name == trained.data.name and (photos is None or photos == getattr(trained.data, key)):
        return None
    return "_".join([asked.data.name] + list(photos or []))


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (what an evaluation records of its checkpoint: freshness by content,
    not by file times, which ``cp -p`` or a restored backup keep or fake)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def evaluate_run(run_dir: str | Path, split: str = "test", max_images: int = 0, batch_size: int = EVAL_BATCH_SIZE,
                 overrides: Sequence[str] = (), progress: bool = False, command: Optional[str] = None,
                 write: bool = True, made_by: str = "evaluate") -> Dict:
    """Evaluate ``run_dir`` and (on rank 0, when ``write``) write RUN_DIR/eval.json; returns the dict.

    ``made_by`` (``evaluate``, ``compare``, ``study``) is recorded with the command, so a later
    ``compare`` knows whose result an eval.json is (it does not overwrite an ``evaluate`` one). Under torchrun every
    process takes a disjoint share of the images and every metric is a float64 sum all-reduced before dividing, so the
    numbers equal a single-process pass up to float summation order."""
    from ddcl_vq.common.data import build_dataset, resolve_workers
    from ddcl_vq.tokenizer.train import setup_distributed
    from ddcl_vq.tokenizer.testset import reconstruction_pass
    from ddcl_vq.distributed import rank
    from ddcl_vq.common.rundir import writable_dir
    run_dir = Path(run_dir)
    # config first (clear errors before any process group starts)
    cfg, model, step, ckpt = load_run(run_dir, overrides, "cpu")
    digest = file_digest(ckpt)
    if step < cfg.train.steps and os.environ.get("RANK", "0") == "0":
        print(f"note: {str(run_dir)!r} is at step {step} of {cfg.train.steps} (still training, or stopped early): "
              f"evaluating its checkpoint of step {step}", file=sys.stderr)
    if write and rank() == 0:
        writable_dir(run_dir, "run directory")  # before the expensive pass
    device = setup_distributed(cfg.train.device)["device"]
    model = model.to(device)
    dataset = build_dataset(cfg.data, split, cfg.run.seed)
    lpips_model, lpips_note = build_lpips(device)
    rfid_ok, rfid_note = rfid_availability()
    sums = ImageMetricSums(lpips_model, device=device, rfid=rfid_ok)
    result = reconstruction_pass(model, dataset, batch_size=batch_size, device=device, max_images=max_images,
                                 on_batch=sums.update, progress=progress,
                                 num_workers=resolve_workers(cfg.data, dataset))
    extra = sums.compute()
    usage = result["usage"]
    hard, soft = ({"mse": result[kind]["mse"], "psnr": result[kind]["psnr"], "ssim": extra[f"{kind}_ssim"],
                   "lpips": extra[f"{kind}_lpips"]} if result[kind] is not None else None for kind in ("hard", "soft"))
    q = model.quantizer
    latent_positions = usage.num_vectors // max(result["num_images"], 1)
    training = getattr(model, "training_usage", None) or {}  # runs saved before 2026-12-04 have none
    out = {
        "run": str(run_dir), "name": cfg.run.name, "step": step, "train_steps": cfg.train.steps,
        "checkpoint": str(ckpt), "checkpoint_sha256": digest,  # freshness is judged by it (with step, split, ...)
        "made_by": made_by, "dataset": cfg.data.name,
        **({"photos": list(cfg.data.train_photos if split == "train" else cfg.data.test_photos)}
           if cfg.data.name == "natural_patches" else {}),
        "trained_on": load_run_dataset(run_dir),  # differs from dataset for a held-out evaluation
        "split": split, "num_images": result["num_images"], "max_images": max_images,
        "overrides": list(overrides),  # with step, checkpoint, split, max_images: what compare reuses it for
        "latent_positions_per_image": latent_positions,
        "quantizer": {"type": cfg.quantizer.type, "num_codes": q.num_codes, "dim": q.dim, **q.describe()},
        "recon": {"hard": hard, "soft": soft, "soft_minus_hard": None if soft is None else {
            k: (soft[k] - hard[k]) if soft.get(k) is not None and hard.get(k) is not None else None for k in hard}},
        "codebook": {**{key: getattr(usage, key) for key in ("utilization", "active_codes", "dead_codes", "perplexity",
                                                             "soft_perplexity", "entropy_bits", "num_vectors")},
                     "utilization_ceiling": uniform_ceiling(q.num_codes, usage.num_vectors),
                     **{key: training.get(key) for key in TRAINING_USAGE_KEYS},
                     **codebook_geometry(q.codebook, usage.counts)},
        "usage_counts": usage.counts, "lpips_note": lpips_note, "rfid": extra["rfid"], "rfid_note": rfid_note,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command or f"ddcl-vq evaluate {shlex.quote(str(run_dir))} --split {split} "
                              f"--max-images {max_images} --batch-size {batch_size}"
                              + "".join(" " + shlex.quote(o) for o in overrides),
        "definitions": definitions(),
    }
    if write and rank() == 0:
        tag = heldout_tag(run_dir, overrides, split)
        write_eval(run_dir, out, None if tag is None else eval_path(run_dir, tag=tag))
    return out


def load_run_dataset(run_dir: str | Path) -> str:
    """The data.name the run was trained on (its config.yaml without overrides)."""
    from ddcl_vq.tokenizer.config import load_config
    return load_config(Path(run_dir) / "config.yaml", migrate=True).data.name


def eval_path(run_dir: str | Path, out: Optional[str | Path] = None, tag: Optional[str] = None) -> Path:
    """Where an evaluation goes: RUN_DIR/eval.json (RUN_DIR/eval_<tag>.json for other data than the
    run's own, see :func:`heldout_tag`), or ``out`` (a .json file, or a folder to write eval.json
    into) for a run directory that cannot or should not be written (an archived run)."""
    if out is None:
        return Path(run_dir) / ("eval.json" if tag is None else f"eval_{tag}.json")
    out = Path(out)
    return out / "eval.json" if out.is_dir() or out.suffix.lower() != ".json" else out


def write_eval(run_dir: Path, ev: Dict, path: Optional[Path] = None) -> Path:
    """RUN_DIR/eval.json (or ``path``), atomically (temporary file, rename)."""
    path = Path(path) if path is not None else Path(run_dir) / "eval.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(ev, indent=2) + "\n")
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise EvaluateError(f"could not write {str(path)!r} ({type(err).__name__}: {err.strerror or err})") from None
    return path


def fmt(v, spec: str) -> str:
    """``format(v, spec)``; '—' for None, and inf or nan as they are."""
    if v is None:
        return "—"
    return str(v) if isinstance(v, float) and not math.isfinite(v) else format(v, spec)


def format_report(ev: Dict) -> str:
    """The evaluate table and the definitions, as printed by the command."""
    q = ev["quantizer"]
    desc = f"{q['type']} K={q['num_codes']} D={q['dim']}"
    if "mode" in q:
        desc += f" mode={q['mode']} τ={q['temperature']:g}"
    lines = [f"{ev['run']}  step {ev['step']}  {desc}",
             f"{ev['dataset']} {ev['split']} split, {ev['num_images']} images "
             f"({ev['latent_positions_per_image']} latent positions each)", "",
             "| codes | MSE | PSNR (dB) | SSIM | LPIPS |", "|---|---|---|---|---|"]
    rec = ev["recon"]
    for name in ("hard", "soft", "soft_minus_hard"):
        r = rec.get(name)
        if r is None:
            continue
        sign = "+" if name == "soft_minus_hard" else ""
        lines.append(f"| {name.replace('_', ' ')} | {fmt(r['mse'], sign + '.5f')} | {fmt(r['psnr'], sign + '.2f')} "
                     f"| {fmt(r['ssim'], sign + '.4f')} | {fmt(r['lpips'], sign + '.4f')} |")
    c = ev["codebook"]
    lines += ["", "| utilization | active | dead | perplexity | soft perplexity | entropy (bits) |",
              "|---|---|---|---|---|---|",
              f"| {c['utilization']:.1%} | {c['active_codes']} | {c['dead_codes']} | {c['perplexity']:.1f} "
              f"| {fmt(c['soft_perplexity'], '.1f')} | {c['entropy_bits']:.2f} |", "",
              f"utilization ceiling for {c.get('num_vectors', 0):,} vectors: {fmt(c.get('utilization_ceiling'), '.1%')}; "
              f"training's last indices: queue {fmt(c.get('queue_utilization'), '.1%')} of "
              f"{fmt(c.get('queue_indices'), ',')} (ceiling {fmt(c.get('queue_ceiling'), '.1%')}), per batch "
              f"{fmt(c.get('batch_utilization'), '.1%')} (ceiling {fmt(c.get('batch_ceiling'), '.1%')})",
              f"code distances: min {fmt(c['min_code_distance'], '.4g')}, mean {fmt(c['mean_code_distance'], '.4g')} "
              f"(all codes); min {fmt(c['min_active_code_distance'], '.4g')}, mean "
              f"{fmt(c['mean_active_code_distance'], '.4g')} (active codes)", f"lpips: {ev['lpips_note']}",
              f"rfid: {fmt(ev['rfid'], '.3f')} ({ev['rfid_note']})",
              f"command: {ev['command']}", "", "definitions:", ev["definitions"]]
    return "\n".join(lines)


@dataclass(kw_only=True)
class EvaluateOptions:
    run_dir: str = option(help="a run directory written by ddcl-vq train", positional=True)
    split: str = option("test", "dataset split")
    max_images: int = option(0, "first N images of the split (0 = all)")
    batch_size: int = option(EVAL_BATCH_SIZE, "images per batch")
    quiet: bool = option(False, "no progress bar or table")
    threads: Optional[int] = threads_option()
    out: Optional[str] = option(None, "write the evaluation here instead of RUN_DIR/eval.json: a .json file, or a "
                                      "folder to write eval.json into (e.g. for a read-only, archived run)",
                                metavar="PATH")
    overrides: List[str] = option(default_factory=list, help="dotted config overrides", positional=True, nargs="*",
                                  metavar="key=value")


OPTIONS = Options(EvaluateOptions, prog="ddcl-vq evaluate", description=HELP, intermixed=True,
                  rules=Rules(choices={"split": SPLITS}, positive={"batch_size", "threads"},
                              non_negative={"max_images"}))


@entry_point("ddcl-vq evaluate")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    set_threads(opts.threads)

    from ddcl_vq.distributed import rank
    from ddcl_vq.common.rundir import RunDirError, writable_dir
    cmd = shlex.join(["ddcl-vq", "evaluate"] + list(sys.argv[1:] if argv is None else argv))
    path = eval_path(opts.run_dir, opts.out, heldout_tag(opts.run_dir, opts.overrides, opts.split))
    if rank() == 0 and Path(opts.run_dir).is_dir():
        try:  # before the expensive pass
            writable_dir(path.parent, "run directory" if opts.out is None else "--out folder")
        except RunDirError as err:
            hint = "; pass --out PATH to write the evaluation elsewhere" if opts.out is None else ""
            raise EvaluateError(f"{err}{hint}") from None
    ev = evaluate_run(opts.run_dir, opts.split, opts.max_images, opts.batch_size, opts.overrides,
                      progress=not opts.quiet, command=cmd, write=False)
    if rank() != 0:
        return 0
    try:
        path = write_eval(Path(opts.run_dir), ev, path)
    except EvaluateError:
        print(format_report(ev))  # the results, even when they cannot be saved
        raise
    if not opts.quiet:
        print(format_report(ev))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    from ddcl_vq.common.skeleton import teardown_distributed
    code = main()
    if code == 0:
        teardown_distributed()
    sys.exit(code)
