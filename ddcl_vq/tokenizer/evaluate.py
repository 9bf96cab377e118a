"""Evaluate a run directory written by `ddcl-vq train` on a dataset split and write
RUN_DIR/eval.json (reconstruction on hard codes, and soft codes for DDCL; SSIM, LPIPS;
dataset-level codebook usage and geometry). Dotted overrides change the run's config for
the evaluation only (e.g. data.root=/path, train.device=cpu); overrides that change which
images are evaluated write RUN_DIR/eval_<dataset>.json instead.

  ddcl-vq evaluate runs/fashion_ddcl --max-images 2000
  ddcl-vq evaluate runs/fashion_ddcl data.name=digits     # -> runs/fashion_ddcl/eval_digits.json
  torchrun --nproc_per_node 2 -m ddcl_vq evaluate runs/fashion_ddcl
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import math
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch.utils.data import Dataset, Subset

from ddcl_vq import CodebookUsage, Quantizer
from ddcl_vq.usage import uniform_ceiling
from ddcl_vq.distributed import all_reduce_sum_, rank, world_size
from ddcl_vq.models import VQVAE

from ddcl_vq.common.checkpoint import latest_checkpoint, load_into, write_json
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.common.data import (SPLITS, DataUnavailable, SequentialBatches, build_dataset, image_channels, make_loader,
                                 resolve_workers)
from ddcl_vq.common.errors import UserError, entry_point
from ddcl_vq.common.progress import Progress, fmt
from ddcl_vq.common.rundir import RunDirError, writable_dir
from ddcl_vq.common.skeleton import setup_distributed
from ddcl_vq.common.threads import set_threads, threads_option
from ddcl_vq.tokenizer.config import build_model
from ddcl_vq.tokenizer.config import ConfigError, differences, load_config
from ddcl_vq.tokenizer.metrics import (DEFINITIONS_HINT, ImageMetricSums, build_lpips, codebook_geometry,
                                     definitions, rfid_availability)

#: images per batch of every evaluation pass; lower it where memory is short
EVAL_BATCH_SIZE = 256


def shard(dataset: Dataset, max_images: int = 0) -> tuple[Subset, int]:
    """The first ``max_images`` images (all when 0), strided over processes."""
    n = len(dataset) if not max_images else min(max_images, len(dataset))
    return Subset(dataset, list(range(rank(), n, world_size()))), n


def _hard_codes(quantizer: Quantizer, indices: torch.Tensor) -> torch.Tensor:
    """``quantizer.lookup(indices)`` without its range check (a host sync per batch on a GPU)."""
    if type(quantizer).lookup is not Quantizer.lookup:
        return quantizer.lookup(indices)
    codes = quantizer.codebook[indices]
    return codes.movedim(-1, 1) if quantizer.channel_dim == 1 and codes.dim() > 2 else codes


def codebook_count(quantizer: Quantizer) -> Optional[int]:
    """C when ``quantizer``'s indices carry a trailing axis of one entry per codebook (its ``num_codebooks``:
    ResidualDDCL's levels, GroupedDDCL's groups), else None (one index per vector)."""
    count = getattr(quantizer, "num_codebooks", None)
    return int(count) if count else None


def prefix_levels(quantizer: Quantizer) -> int:
    """L when ``quantizer`` decodes the first l of its L codebooks for every l (a residual chain: its
    ``decodes_prefixes``), else 0."""
    count = codebook_count(quantizer)
    return count if count and count > 1 and getattr(quantizer, "decodes_prefixes", False) else 0


def _add_mse_psnr(sums: torch.Tensor, rec: torch.Tensor, x: torch.Tensor) -> None:
    """sums[0] += Σ per-image MSE, sums[1] += Σ per-image PSNR (RECON_DEFINITIONS)."""
    mse_img = (rec - x).pow(2).flatten(1).mean(1).double()
    sums[0] += mse_img.sum()
    sums[1] += (10 * torch.log10(1.0 / mse_img.clamp_min(1e-10))).sum()


@torch.no_grad()
def reconstruction_pass(model: VQVAE, dataset: Dataset, batch_size: int = EVAL_BATCH_SIZE, device="cpu",
                        max_images: int = 0, on_batch=None, progress: bool = False, num_workers: int = 0) -> Dict:
    """One pass over a split (each process a disjoint share) -> {"num_images", "hard": {"mse", "psnr"}, "soft": {...}
    or None, "usage": UsageStats}; PSNR = mean of 10·log10(1 / MSE_image); ``on_batch(x, hard, soft)`` adds metrics.

    A quantizer with several codebooks (:func:`codebook_count`, indices (..., C)): the usage is counted per codebook
    (``CodebookUsage(K, codebooks=C)``); one that decodes prefixes (:func:`prefix_levels`, a residual chain) adds
    "hard_by_levels": [{"levels": l, "mse", "psnr"}, l = 1..L], decoded from the hard codes of its first l levels
    (l = L is "hard")."""
    was_training = model.training
    model.eval()
    part, n = shard(dataset, max_images)
    if n == 0:
        raise DataUnavailable("nothing to evaluate: the split has no images")
    loader = make_loader(part, SequentialBatches(len(part), batch_size), num_workers, device)
    has_soft = model.quantizer.has_soft_codes
    parts, levels = codebook_count(model.quantizer), prefix_levels(model.quantizer)
    usage = CodebookUsage(model.quantizer.num_codes, device=device) if parts is None else \
        CodebookUsage(model.quantizer.num_codes, device=device, codebooks=parts)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # hard mse, hard psnr, soft mse, soft psnr, count
    level_sums = torch.zeros(max(levels - 1, 0), 2, dtype=torch.float64, device=device)  # first l < L levels
    bar = Progress(len(loader), "evaluate", unit="batch", every=max(len(loader) // 10, 1), leave=False,
                   off=not (progress and rank() == 0))
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        z = model.encoder(x)
        q = model.quantizer(z)
        if parts == 1:  # one codebook behind a codebook axis: counted as one codebook
            usage.update(q.indices[..., 0], None if q.soft_counts is None else q.soft_counts.reshape(-1))
        else:
            usage.update(q.indices, q.soft_counts)
        hard = model.decoder(_hard_codes(model.quantizer, q.indices)).float().clamp(0, 1)
        for first in range(1, levels):  # the first `first` levels' hard codes
            rec = model.decoder(model.quantizer.lookup(q.indices[..., :first])).float().clamp(0, 1)
            _add_mse_psnr(level_sums[first - 1], rec, x)
        soft = None
        if has_soft:
            soft_z = q.soft_codes if q.soft_codes is not None else model.quantizer.soft_codes(z)  # DDCL: one pass
            soft = model.decoder(soft_z).float().clamp(0, 1)
        for i, rec in enumerate([hard, soft] if has_soft else [hard]):  # hard: sums 0, 1; soft: 2, 3
            _add_mse_psnr(sums[2 * i:2 * i + 2], rec, x)
        sums[4] += x.shape[0]
        if on_batch is not None:
            on_batch(x, hard, soft)
        bar.update(1)
    bar.close()
    all_reduce_sum_(sums)
    model.train(was_training)
    count = float(sums[4])
    out = {"num_images": int(count), "hard": {"mse": float(sums[0]) / count, "psnr": float(sums[1]) / count},
           "soft": {"mse": float(sums[2]) / count, "psnr": float(sums[3]) / count} if has_soft else None,
           "usage": usage.compute()}
    if levels:
        all_reduce_sum_(level_sums)
        out["hard_by_levels"] = [{"levels": i + 1, "mse": float(m) / count, "psnr": float(p) / count}
                                 for i, (m, p) in enumerate(level_sums.tolist())] + [{"levels": levels, **out["hard"]}]
    return out


def reconstruction_by_levels(model: VQVAE, dataset: Dataset, batch_size: int = EVAL_BATCH_SIZE, device="cpu",
                             max_images: int = 0) -> List[Dict]:
    """Reconstruction against the levels used, for a model whose quantizer decodes prefixes of its levels
    (:func:`prefix_levels`: ResidualDDCL): [{"levels": l, "mse", "psnr"} for l = 1..L], decoded from the hard codes
    of the first l levels (RECON_DEFINITIONS' MSE and PSNR); a ValueError for any other quantizer."""
    if not prefix_levels(model.quantizer):
        raise ValueError(f"expected a quantizer that decodes the first l of its levels (ResidualDDCL, "
                         f"decodes_prefixes), got {type(model.quantizer).__name__}")
    return reconstruction_pass(model, dataset, batch_size, device, max_images)["hard_by_levels"]


#: eval.json's per-level fields (a quantizer with several codebooks), and the UsageStats list each comes from
PER_LEVEL_KEYS = ("utilization", "active_codes", "dead_codes", "perplexity", "soft_perplexity", "entropy_bits",
                  "num_vectors")


def codebook_block(quantizer: Quantizer, usage, training: Optional[Dict] = None) -> Dict:
    """eval.json's "codebook" block from the pass's :class:`~ddcl_vq.usage.UsageStats` and the training's last usage
    figures (``training``: RecentUsage's, or None). Several codebooks (``usage.codebooks``): the scalar fields are the
    mean over the codebooks of the ``*_per_level`` lists (metrics.PER_LEVEL_DEFINITIONS)."""
    training = training or {}
    if usage.codebooks is None:
        return {**{key: getattr(usage, key) for key in ("utilization", "active_codes", "dead_codes", "perplexity",
                                                        "soft_perplexity", "entropy_bits", "num_vectors")},
                "utilization_ceiling": uniform_ceiling(quantizer.num_codes, usage.num_vectors),
                **{key: training.get(key) for key in TRAINING_USAGE_KEYS},
                **codebook_geometry(quantizer.codebook, usage.counts)}
    k, c = usage.num_codes, usage.codebooks
    rows = [usage.counts[i * k:(i + 1) * k] for i in range(c)]
    per = {"utilization": usage.utilization_per_codebook, "active_codes": usage.active_codes_per_codebook,
           "dead_codes": usage.dead_codes_per_codebook, "perplexity": usage.perplexity_per_codebook,
           "soft_perplexity": usage.soft_perplexity_per_codebook,
           "entropy_bits": [math.log2(p) for p in usage.perplexity_per_codebook],
           "num_vectors": [sum(row) for row in rows]}

    def mean(values):
        if any(v is None for v in values):
            return None
        m = sum(values) / len(values)
        return int(m) if all(isinstance(v, int) for v in values) and m == int(m) else m

    scalars = {key: mean(per[key]) for key in PER_LEVEL_KEYS}
    codebook = quantizer.codebook.detach()
    if codebook.dim() == 3:  # one (K, d) codebook per level or group
        shapes = [codebook_geometry(codebook[i], rows[i]) for i in range(c)]
        geometry = {key: mean([g[key] for g in shapes]) for key in shapes[0]}
    else:  # one codebook shared by every level: its own figures, the levels' counts pooled
        geometry = codebook_geometry(codebook, [sum(col) for col in zip(*rows)])
    return {**scalars, "utilization_ceiling": uniform_ceiling(k, scalars["num_vectors"]),
            **{key: training.get(key) for key in TRAINING_USAGE_KEYS}, **geometry,
            "levels": c, **{f"{key}_per_level": per[key] for key in PER_LEVEL_KEYS}}


class EvaluateError(UserError, RuntimeError):
    """The run directory cannot be evaluated (missing dir, config or checkpoint)."""


def load_run(run_dir: str | Path, overrides: Sequence[str] = (), device: torch.device | str = "cpu"):
    """-> (cfg, model in eval mode on ``device``, checkpoint step, checkpoint path); the quantizer's state (DDCL's τ
    included) comes from the checkpoint. EvaluateError when an override changes a setting of the trained model (model.*,
    quantizer.*)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EvaluateError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / "config.yaml").is_file():
        raise EvaluateError(f"run directory {str(run_dir)!r} has no config.yaml (was it written by ddcl-vq train?)")
    cfg = load_config(run_dir / "config.yaml", overrides, saved=True)
    fixed = [(k, a, b) for k, a, b in differences(load_config(run_dir / "config.yaml", saved=True), cfg)
             if k.startswith(("model.", "quantizer.")) and k != "quantizer.implementation"] if overrides else []
    if fixed:
        changes = ", ".join(f"{k}={b!r} (trained with {a!r})" for k, a, b in fixed)
        why = (" — the temperature comes from the schedule saved in the checkpoint"
               if any(k.startswith("quantizer.temperature") for k, _, _ in fixed) else "")
        raise EvaluateError(f"{str(run_dir)!r}: evaluate measures the model as trained; overrides cannot change its "
                            f"settings: {changes}{why}. Overrides may change data.*, train.* (e.g. train.device) and "
                            "quantizer.implementation; to measure other settings, train a run with them")
    found = latest_checkpoint(run_dir / "checkpoints", map_location="cpu")
    if found is None:
        raise EvaluateError(f"run directory {str(run_dir)!r} has no checkpoint (expected "
                            f"{str(run_dir / 'checkpoints' / 'last.pt')!r}); train it first")
    state, path = found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # building the model: construction warnings (e.g. a peer's) are irrelevant here
        model = build_model(cfg, image_channels(cfg.data))
    load_into(model, state["model"], path)
    step = int(state["step"])
    model.training_usage = (state.get("log_state") or {}).get("recent_stats")  # read by evaluate_run
    return cfg, model.to(device).eval(), step, path


#: the training's last usage figures (RecentUsage, saved with the checkpoint) that eval.json's codebook block repeats
TRAINING_USAGE_KEYS = ("queue_utilization", "queue_indices", "queue_ceiling", "batch_utilization", "batch_ceiling")


def heldout_tag(run_dir: str | Path, overrides: Sequence[str] = (), split: str = "test") -> Optional[str]:
    """None when ``overrides`` evaluate the run's own data (or its config cannot be read); else a name for the other
    data (``digits``, ``natural_patches_camera_moon``): its evaluation goes to RUN_DIR/eval_<name>.json."""
    config = Path(run_dir) / "config.yaml"
    if not overrides or not config.is_file():
        return None
    try:
        trained, asked = load_config(config, saved=True), load_config(config, overrides, saved=True)
    except ConfigError:
        return None
    key = "train_photos" if split == "train" else "test_photos"
    photos = getattr(asked.data, key) if asked.data.name == "natural_patches" else None
    if asked.data.name == trained.data.name and (photos is None or photos == getattr(trained.data, key)):
        return None
    return "_".join([asked.data.name] + list(photos or []))


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (an evaluation's freshness is by its checkpoint's content, not by file times)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def evaluate_run(run_dir: str | Path, split: str = "test", max_images: int = 0, batch_size: int = EVAL_BATCH_SIZE,
                 overrides: Sequence[str] = (), progress: bool = False, command: Optional[str] = None,
                 write: bool = True, made_by: str = "evaluate") -> Dict:
    """Evaluate ``run_dir`` and (on rank 0, when ``write``) write RUN_DIR/eval.json; returns the dict. ``made_by``
    (evaluate, compare, study) is recorded: compare never overwrites an evaluate result."""
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
    training = getattr(model, "training_usage", None) or {}  # runs saved before 2026-12-04 have none
    codebook = codebook_block(q, usage, training)
    latent_positions = int(codebook["num_vectors"]) // max(result["num_images"], 1)
    out = {
        "run": str(run_dir), "name": cfg.run.name, "step": step, "train_steps": cfg.train.steps,
        "checkpoint": str(ckpt), "checkpoint_sha256": digest,  # freshness is judged by it (with step, split, ...)
        "made_by": made_by, "dataset": cfg.data.name,
        **({"photos": list(cfg.data.train_photos if split == "train" else cfg.data.test_photos)}
           if cfg.data.name == "natural_patches" else {}),
        # the data.name the run was trained on (its config.yaml without overrides): differs for a held-out evaluation
        "trained_on": load_config(run_dir / "config.yaml", saved=True).data.name,
        "split": split, "num_images": result["num_images"], "max_images": max_images,
        "overrides": list(overrides),  # with step, checkpoint, split, max_images: what compare reuses it for
        "latent_positions_per_image": latent_positions,
        "quantizer": {"type": cfg.quantizer['type'], "num_codes": q.num_codes, "dim": q.dim, **q.describe()},
        "recon": {"hard": hard, "soft": soft, "soft_minus_hard": None if soft is None else {
            k: (soft[k] - hard[k]) if soft.get(k) is not None and hard.get(k) is not None else None for k in hard},
            **({"hard_by_levels": result["hard_by_levels"]} if "hard_by_levels" in result else {})},
        "codebook": codebook,
        "usage_counts": usage.counts, "lpips_note": lpips_note, "rfid": extra["rfid"], "rfid_note": rfid_note,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command or f"ddcl-vq evaluate {shlex.quote(str(run_dir))} --split {split} "
                              f"--max-images {max_images} --batch-size {batch_size}"
                              + "".join(" " + shlex.quote(o) for o in overrides),
        "definitions": definitions(per_level=usage.codebooks is not None),
    }
    if write and rank() == 0:
        write_eval(run_dir, out, eval_path(run_dir, tag=heldout_tag(run_dir, overrides, split)))
    return out


def eval_path(run_dir: str | Path, out: Optional[str | Path] = None, tag: Optional[str] = None) -> Path:
    """RUN_DIR/eval.json (eval_<tag>.json for other data), or ``out`` (a .json file, or a folder for eval.json)."""
    if out is None:
        return Path(run_dir) / ("eval.json" if tag is None else f"eval_{tag}.json")
    out = Path(out)
    return out / "eval.json" if out.is_dir() or out.suffix.lower() != ".json" else out


def write_eval(run_dir: Path, ev: Dict, path: Optional[Path] = None) -> Path:
    """RUN_DIR/eval.json (or ``path``), atomically (temporary file, rename)."""
    return write_json(Path(path) if path is not None else Path(run_dir) / "eval.json", ev, EvaluateError)


def format_report(ev: Dict, verbose: bool = False) -> str:
    """What the command prints: a summary of at most 11 lines (the caller adds 'wrote PATH'); ``verbose``: the
    tables, the command and the definitions."""
    if not verbose:
        return _short_report(ev)
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
              f"| {fmt(c['soft_perplexity'], '.1f')} | {c['entropy_bits']:.2f} |", *_per_level_lines(ev), "",
              f"utilization ceiling for {c.get('num_vectors', 0):,} vectors: "
              f"{fmt(c.get('utilization_ceiling'), '.1%')}; training's last indices: queue "
              f"{fmt(c.get('queue_utilization'), '.1%')} of {fmt(c.get('queue_indices'), ',')} (ceiling "
              f"{fmt(c.get('queue_ceiling'), '.1%')}), per batch {fmt(c.get('batch_utilization'), '.1%')} (ceiling "
              f"{fmt(c.get('batch_ceiling'), '.1%')})",
              f"code distances: min {fmt(c['min_code_distance'], '.4g')}, mean {fmt(c['mean_code_distance'], '.4g')} "
              f"(all codes); min {fmt(c['min_active_code_distance'], '.4g')}, mean "
              f"{fmt(c['mean_active_code_distance'], '.4g')} (active codes)", f"lpips: {ev['lpips_note']}",
              f"rfid: {fmt(ev['rfid'], '.3f')} ({ev['rfid_note']})",
              f"command: {ev['command']}", "", "definitions:", ev["definitions"]]
    return "\n".join(lines)


def _per_level_lines(ev: Dict) -> List[str]:
    """A quantizer with several codebooks: one line of per-level usage (the codebook line's figures are their means)
    and, for a residual chain, one of the hard codes' PSNR against the levels used; none for one codebook."""
    c, lines = ev["codebook"], []
    if c.get("utilization_per_level") is not None:
        lines.append(f"per level (the figures above: their means): utilization "
                     + " ".join(f"{u:.1%}" for u in c["utilization_per_level"]) + ", dead "
                     + " ".join(str(d) for d in c["dead_codes_per_level"]) + ", perplexity "
                     + " ".join(f"{p:.1f}" for p in c["perplexity_per_level"]))
    if ev["recon"].get("hard_by_levels"):
        lines.append("hard codes of the first l levels: " + ", ".join(
            f"l={r['levels']} PSNR {fmt(r['psnr'], '.2f')} dB" for r in ev["recon"]["hard_by_levels"]))
    return lines


def _short_report(ev: Dict) -> str:
    q, c, rec = ev["quantizer"], ev["codebook"], ev["recon"]
    desc = f"{q['type']} K={q['num_codes']} D={q['dim']}" + (
        f" mode={q['mode']} τ={q['temperature']:g}" if "mode" in q else "")
    lines = [f"{ev['run']}  step {ev['step']}  {desc}",
             f"{ev['dataset']} {ev['split']} split, {ev['num_images']} images "
             f"({ev['latent_positions_per_image']} latent positions each)"]
    for name in ("hard", "soft"):
        r = rec.get(name)
        if r is not None:
            gap = rec.get("soft_minus_hard") if name == "soft" else None
            lines.append(f"{name} codes: MSE {fmt(r['mse'], '.5f')}  PSNR {fmt(r['psnr'], '.2f')} dB  "
                         f"SSIM {fmt(r['ssim'], '.4f')}  LPIPS {fmt(r['lpips'], '.4f')}"
                         + (f"   (soft − hard: PSNR {fmt(gap['psnr'], '+.2f')} dB)" if gap else ""))
    soft_ppl = f", soft perplexity {fmt(c['soft_perplexity'], '.1f')}" if c.get("soft_perplexity") is not None else ""
    lines.append(f"codebook: utilization {c['utilization']:.1%} ({c['active_codes']} active, {c['dead_codes']} dead; "
                 f"ceiling {fmt(c.get('utilization_ceiling'), '.1%')} for {c.get('num_vectors', 0):,} vectors), "
                 f"perplexity {c['perplexity']:.1f}{soft_ppl}, entropy {c['entropy_bits']:.2f} bits")
    lines += _per_level_lines(ev)
    if c.get("queue_utilization") is not None:
        lines.append(f"training's last indices: queue {fmt(c.get('queue_utilization'), '.1%')} of "
                     f"{fmt(c.get('queue_indices'), ',')} (ceiling {fmt(c.get('queue_ceiling'), '.1%')}), per batch "
                     f"{fmt(c.get('batch_utilization'), '.1%')} (ceiling {fmt(c.get('batch_ceiling'), '.1%')})")
    lines.append(f"code distances: min {fmt(c['min_code_distance'], '.4g')}, mean {fmt(c['mean_code_distance'], '.4g')}"
                 f" (all codes); min {fmt(c['min_active_code_distance'], '.4g')}, mean "
                 f"{fmt(c['mean_active_code_distance'], '.4g')} (active)")
    lines.append(f"LPIPS: {ev['lpips_note']}; rFID: {fmt(ev['rfid'], '.3f')} ({ev['rfid_note']})")
    lines.append(DEFINITIONS_HINT)
    return "\n".join(lines)


@dataclass(kw_only=True)
class EvaluateOptions:
    run_dir: str = option(help="a run directory written by ddcl-vq train", positional=True)
    split: str = option("test", "dataset split")
    max_images: int = option(0, "first N images of the split (0 = all)")
    batch_size: int = option(EVAL_BATCH_SIZE, "images per batch")
    quiet: bool = option(False, "no progress bar or table")
    verbose: bool = option(False, "print the full tables, the command and the definitions of every figure")
    threads: Optional[int] = threads_option()
    out: Optional[str] = option(None, "write the evaluation here instead of RUN_DIR/eval.json: a .json file, or a "
                                      "folder to write eval.json into (e.g. for a read-only, archived run)",
                                metavar="PATH")
    overrides: List[str] = option(default_factory=list, help="dotted config overrides", positional=True, nargs="*",
                                  metavar="key=value")


OPTIONS = Options(EvaluateOptions, prog="ddcl-vq evaluate", description=__doc__, intermixed=True,
                  rules=Rules(choices={"split": SPLITS}, positive={"batch_size", "threads"},
                              non_negative={"max_images"}))


@entry_point("ddcl-vq evaluate")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    set_threads(opts.threads)

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
        print(format_report(ev, opts.verbose))  # the results, even when they cannot be saved
        raise
    if not opts.quiet:
        print(format_report(ev, opts.verbose))
        print(f"wrote {path}")
    return 0
