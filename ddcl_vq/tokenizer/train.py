"""``ddcl-vq train`` and its loop, top to bottom: set-up, resume, steps, logging, checkpoints, summary.

What every training loop does around its step — run directory and lock, resume, atomic checkpoints, RNG state,
metrics.jsonl, TensorBoard, progress, torchrun, SIGTERM/SIGINT — is :class:`~ddcl_vq.common.skeleton.TrainingRun`; this
loop's own pieces are :class:`LogState` and :class:`RunLog` (the usage window, the metrics line, image grids),
:func:`training_step` (``ddcl-vq bench`` times it too) and the end-of-run evaluation. The quantizer is driven only
through the ``ddcl_vq.Quantizer`` interface (``step()``, ``log_stats()``, ``has_soft_codes``). Under torchrun
data.batch_size is the *global* batch, split evenly over processes, and train.lr applies to it (DDP averages
gradients): a config means the same optimisation on 1 or N processes. Only rank 0 writes files.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ddcl_vq import CodebookUsage, UsageStats
from ddcl_vq.usage import RecentUsage
from ddcl_vq.distributed import all_reduce_sum_
from ddcl_vq.models import VQVAE, VQVAEOutput

from ddcl_vq.common.checkpoint import write_json
from ddcl_vq.common.config import ConfigError, Options, Rules, option
from ddcl_vq.common.data import (EpochBatches, UnreadableImage, build_dataset, check_data, image_channels, make_loader,
                                 resolve_workers)
from ddcl_vq.common.errors import Diverged, UserError, entry_point, one_line, tensorboard_hint, tool, where
from ddcl_vq.common.rundir import note
from ddcl_vq.common.skeleton import TrainingRun, is_due, teardown_distributed, wrap_ddp
from ddcl_vq.common import threads
from ddcl_vq.tokenizer.config import build_model, build_optimizer, lr_lambda
from ddcl_vq.tokenizer.config import (Config, TrainConfig, check_resume, dump_config, finished_summary, follow_run_dir,
                                      load_config, run_dir_of_config, saved_config, validate_training)
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE, reconstruction_pass
from ddcl_vq.tokenizer.losses import GANStep
from ddcl_vq.tokenizer.memory import NotEnoughMemory, check_fits
from ddcl_vq.tokenizer.metrics import DEFINITIONS_HINT, definitions
from ddcl_vq.tokenizer.tokens import init_from_export


class LogState:
    """What the log carries from step to step, saved in checkpoints (``log_state``) so that a resumed run logs what the
    straight run logs: the usage window (``train.usage_window``) and its last figures, the recent training indices
    (:class:`~ddcl_vq.RecentUsage`) and their last figures, the cumulative ``revived`` count at the last metrics
    line."""

    def __init__(self, model: VQVAE, device: torch.device, world: int = 1, is_main: bool = True):
        self.is_main = is_main
        k, self.codebooks = model.quantizer.num_codes, getattr(model.quantizer, "num_codebooks", 1)
        self.usage = CodebookUsage(k, device=device, codebooks=self.codebooks)
        self.stats: Optional[UsageStats] = None
        # several codebooks (residual levels, groups): one queue over their K·C (codebook, code) pairs, whose
        # figures are the means over codebooks of each codebook's
        self.recent = RecentUsage(k * self.codebooks, device=device, world=world)
        self.recent_stats: Optional[Dict] = None  # the last window's queue and per-batch figures
        self.revived_logged = float(getattr(model.quantizer, "revived", 0))  # for revived_new

    def state_dict(self) -> Dict:
        """Every process calls this (the window's counts are summed over processes: rank 0 saves them all)."""
        counts, mass = all_reduce_sum_(self.usage.counts.clone()), all_reduce_sum_(self.usage.soft_mass.clone())
        return {"counts": counts.cpu(), "soft_mass": mass.cpu(), "has_soft": self.usage.has_soft,
                "stats": None if self.stats is None else {**self.stats.to_dict(),
                                                          "counts": torch.tensor(self.stats.counts)},
                "revived_logged": self.revived_logged, "recent": self.recent.state_dict(),
                "recent_stats": self.recent_stats}

    def load_state_dict(self, state: Dict) -> None:
        if self.is_main:  # the others start from zero: the next all-reduce sums to the saved window plus the new steps
            self.usage.counts.copy_(state["counts"])
            self.usage.soft_mass.copy_(state["soft_mass"])
        self.usage.has_soft = bool(state["has_soft"])
        stats = state["stats"]
        self.stats = None if stats is None else UsageStats(**{**stats, "counts": stats["counts"].tolist()})
        self.revived_logged = float(state["revived_logged"])
        self.recent.load_state_dict(state["recent"])
        self.recent_stats = state["recent_stats"]


def pair_indices(indices: torch.Tensor, num_codes: int) -> torch.Tensor:
    """(..., C) indices of C codebooks -> the (codebook, code) pairs c·K + k, flattened; −1 (a level left out) dropped."""
    pairs = indices + num_codes * torch.arange(indices.shape[-1], device=indices.device)
    return pairs[indices >= 0]


#: TensorBoard names of metrics.jsonl keys whose name alone would mislead
TB_NAMES = {"revived": "revived_total"}


class RunLog:
    """What this loop reports beside the skeleton's: the codebook usage every ``train.usage_window`` steps
    (all-reduced: every process takes part), the metrics line every ``train.log_every`` steps (:meth:`record`), image
    grids every ``train.image_every`` steps; files on rank 0 only, through ``run``."""

    def __init__(self, cfg: Config, run: TrainingRun, model: VQVAE, preview: torch.Tensor, state: LogState):
        self.cfg, self.t, self.run, self.model, self.preview, self.state = cfg, cfg.train, run, model, preview, state
        self.extra_stats: Callable[[], Dict] = dict
        self.t_start = time.time()
        run.postfix = self.postfix

    def after_step(self, step: int, loss: torch.Tensor, recon_loss: torch.Tensor, out: VQVAEOutput,
                   optimizer: torch.optim.Optimizer) -> None:
        q, run = out.quantizer, self.run
        window = self.state.usage
        window.update(q.indices, q.soft_counts)
        self.state.recent.update(q.indices if self.state.codebooks == 1 else
                                 pair_indices(q.indices, self.model.quantizer.num_codes))
        if run.due(self.t.usage_window, step):
            self.state.stats = window.compute()  # all-reduced across processes
            window.reset()
            self.state.recent_stats = self.state.recent.compute()  # likewise; a new per-batch average begins
            if run.writer is not None:
                run.writer.add_histogram("usage/code_counts",
                                         torch.tensor(self.state.stats.counts, dtype=torch.float32), step)
        if run.writer is not None and run.due(self.t.log_every, step):
            record = self.record(loss, recon_loss, out, optimizer)
            run.log(step, record, {k: TB_NAMES.get(k, k).replace("term_", "terms/") for k in record})
        if run.writer is not None and run.due(self.t.image_every, step):
            self.images(step)

    def record(self, loss, recon_loss, out: VQVAEOutput, optimizer) -> Dict:
        """One metrics.jsonl line: losses, the quantizer's terms and statistics, lr (``codebook_lr`` when the optimizer
        trains a codebook), usage. ``revived`` (DDCL) counts the codes re-seeded since the run began (TensorBoard:
        ``revived_total``), ``revived_new`` those since the previous line."""
        q = out.quantizer
        record = {"time": round(time.time() - self.t_start, 3), "wall": round(time.time(), 3),
                  "loss": loss.item(), "recon_mse": recon_loss.item(), "quantizer_loss": q.loss.item(),
                  "perplexity_batch": float(q.perplexity), "lr": optimizer.param_groups[0]["lr"]}
        record.update({"codebook_lr": g["lr"] for g in optimizer.param_groups if g.get("name") == "codebook"})
        record.update({f"term_{k}": float(v) for k, v in q.terms.items()})
        record.update(self.model.quantizer.log_stats())
        if "revived" in record:
            record["revived_new"] = record["revived"] - self.state.revived_logged
            self.state.revived_logged = record["revived"]
        record.update(self.extra_stats())  # the VQGAN loss: its parts, lambda, logits on real and fake
        w, r = self.state.stats, self.state.recent_stats
        if w is not None:
            record.update(utilization_window=w.utilization, dead_codes_window=w.dead_codes,
                          perplexity_window=w.perplexity)
        if r is not None:
            record.update(utilization_queue=r["queue_utilization"], utilization_batch=r["batch_utilization"])
        return record

    def postfix(self, record: Dict) -> Dict:
        w = self.state.stats
        return dict(loss=f"{record['loss']:.4f}", ppl=f"{record['perplexity_batch']:.0f}",
                    util=f"{w.utilization:.0%}" if w else "-")

    def images(self, step: int) -> None:
        """original | hard-code | soft-code (when the quantizer has soft codes) reconstructions."""
        from torchvision.utils import make_grid
        self.model.eval()
        rows = [self.preview] + [self.model.reconstruct(self.preview, codes)
                                 for codes in ("hard", "soft")[:2 if self.model.quantizer.has_soft_codes else 1]]
        self.model.train()
        grid = make_grid(torch.cat(rows).clamp(0, 1), nrow=self.preview.shape[0], padding=1)
        self.run.writer.add_image("reconstructions/original_hard_soft", grid, step)


def mixed_precision(amp: str, device: torch.device) -> tuple[Callable, torch.amp.GradScaler]:
    """``train.amp`` -> (a context-manager factory for the forward, the GradScaler: enabled for fp16 only)."""
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    if amp_dtype is torch.float16 and device.type != "cuda":
        raise ConfigError("config key 'train.amp': fp16 needs a CUDA device, this run is on the CPU; use "
                          "train.amp=bf16 or none")
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    return autocast, torch.amp.GradScaler("cuda", enabled=amp_dtype is torch.float16)


def training_step(model: VQVAE, x: torch.Tensor, step: int, optimizer: torch.optim.Optimizer, scheduler,
                  t: TrainConfig, *, forward: Optional[torch.nn.Module] = None, autocast: Callable = nullcontext,
                  scaler: Optional[torch.amp.GradScaler] = None,
                  gan: Optional[GANStep] = None) -> Tuple[torch.Tensor, torch.Tensor, VQVAEOutput]:
    """One training step on the (B, C, H, W) batch ``x``: forward, the loss (the plain MSE, or ``gan``'s: pixel,
    perceptual, adversarial), backward, clipping, the optimizer and lr-schedule steps, the discriminator's step, the
    quantizer's per-step state. -> (loss, recon_loss, out). ``step``: optimizer steps done before this one;
    ``forward``: the module to call (the DDP wrapper of ``model``); ``autocast``, ``scaler``: see mixed_precision."""
    forward = model if forward is None else forward
    scaler = torch.amp.GradScaler("cuda", enabled=False) if scaler is None else scaler
    # the terms only the metrics line reads (DDCL's distortion and its split) on the steps it is written (RunLog)
    model.quantizer.report_terms = is_due(t.log_every, step + 1, t.steps)
    with autocast():
        try:
            out = forward(x)
        except ValueError as err:  # the quantizer refuses NaN/Inf features: the encoder diverged
            if "expected finite" not in str(err):
                raise
            raise Diverged(f"step {step}: the encoder's features are not finite ({one_line(err)}): the training "
                           f"diverged; lower train.lr (now {t.lr:g}) or keep train.grad_clip on") from None
    if gan is None:
        recon_loss = F.mse_loss(out.reconstruction.float(), x)
        loss = recon_loss + t.quantizer_loss_weight * out.quantizer.loss
    else:  # the loss section: pixel, perceptual, adversarial (recon_loss: the pixel MSE, logged)
        loss, recon_loss = gan.generator_loss(x, out.reconstruction, t.quantizer_loss_weight * out.quantizer.loss, step)
    if not torch.isfinite(loss):
        raise Diverged(f"step {step}: loss is {loss.item()}; lower train.lr (now {t.lr:g}) or check the data")
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if t.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    if gan is not None:
        gan.discriminator_step(x, out.reconstruction, step)
    model.quantizer.step()  # per-step quantizer state (DDCL: the temperature schedule)
    return loss, recon_loss, out


class EndOfRunEvaluationFailed(UserError, RuntimeError):
    """Training finished and was saved, but the end-of-run evaluation failed."""


def train(cfg: Config, quiet: bool = False, stop_after: Optional[int] = None, verbose: bool = False) -> Dict:
    """Train (or resume) the run described by ``cfg``; returns the end-of-run summary. ``stop_after``: leave after this
    many steps of this session, with a checkpoint (pre-emptible jobs; SIGTERM and SIGINT do the same and raise
    :class:`~ddcl_vq.common.errors.Stopped`). A run resumes only with the config it was trained with (RESUMABLE keys
    aside); a finished run is left as it is; when the end-of-run evaluation fails, the training is kept and the same
    command again only evaluates. ``verbose``: the printed summary ends with the usage definitions."""
    t = cfg.train
    if t.threads is not None:  # set: in every entry (the commands choose the automatic count before calling this)
        threads.set_threads(t.threads)
    run = TrainingRun(cfg.run.dir, t.steps, checkpoint_every=t.checkpoint_every, log_every=t.log_every,
                      name=cfg.run.name, device=t.device, quiet=quiet, stop_after=stop_after, config=cfg.to_dict(),
                      threads=t.threads)
    try:
        with run:
            return _train(cfg, run, verbose)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err):
            raise NotEnoughMemory(f"out of memory on {run.device} ({one_line(err)}); lower quantizer.num_codes "
                                  "(or model.latent_dim, data.batch_size, model.channels)") from err
        raise


def _train(cfg: Config, run: TrainingRun, verbose: bool = False) -> Dict:
    world, device, is_main, t = run.world, run.device, run.is_main, cfg.train
    t_setup = time.time()
    torch.manual_seed(cfg.run.seed)

    found = run.latest()
    found_step = int(found[0]["step"]) if found else 0
    saved = saved_config(found[0], run.dir) if found else None  # before anything is built: resumed only as itself
    notes = [] if saved is None else check_resume(saved, cfg, found_step, run.dir)
    if found is not None and found_step >= t.steps and (done := finished_summary(run.dir, found_step, cfg)) is not None:
        if is_main and not run.quiet:
            print(f"{run.dir} is finished ({found_step} of train.steps={t.steps} steps, summary.json written); nothing "
                  "to do. To train longer, raise train.steps; for a new run, give another run.dir", file=sys.stderr)
        return done

    check_fits(cfg, image_channels(cfg.data), device, world)  # a model the machine cannot hold: refused with the figure
    train_set, test_set = (build_dataset(cfg.data, split, cfg.run.seed) for split in ("train", "test"))
    model = build_model(cfg, image_channels(cfg.data)).to(device)
    if t.init_from and found is None:  # a new run from an exported model (a resumed one has its own)
        init_from_export(model, t.init_from)
    optimizer = build_optimizer(model, t, cfg.quantizer['type'])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    # the loss section beyond the plain MSE (perceptual, discriminator): None for the defaults
    gan = GANStep.from_config(cfg, model, image_channels(cfg.data), device, world)
    # The batches' iterator is made BEFORE the RNG state is restored: it draws its base seed from the global RNG, which
    # training draws from too (DDCL's revival). A resumed run draws it here as the straight run did, then restores the
    # RNG state its checkpoint saved: it continues the straight run's random stream exactly.
    batches = None
    if found_step < t.steps:
        batches = iter(make_loader(train_set, EpochBatches(len(train_set), cfg.data.batch_size, cfg.run.seed,
                                                           run.rank, world, start_step=found_step),
                                   resolve_workers(cfg.data, train_set), device))
    log_state = LogState(model, device, world, is_main)
    # the quantizer's state (its temperature schedule included) comes with the model
    run.keep(model=model, optimizer=optimizer, scheduler=scheduler, log_state=log_state,
             **({"gan": gan} if gan is not None else {}))
    step = run.resume(found)
    found = None  # let the loaded copy go
    if is_main:
        for text in notes:
            note(text)
        (run.dir / "config.yaml").write_text(dump_config(cfg))

    t_start = time.time()
    if step < t.steps:
        step = _steps(cfg, run, model, optimizer, scheduler, batches, test_set, step, log_state, gan)
    batches = None  # the training loader's worker processes (if any) end here, before the evaluation
    train_seconds = time.time() - t_start

    summary = {"run": str(run.dir), "step": step, "train_seconds": round(train_seconds, 1),
               "eval_images": t.eval_images, "training_usage": log_state.recent_stats,
               "seconds": {"setup": round(t_start - t_setup, 1), "train": round(train_seconds, 1)}}
    if t.eval_images > 0 and step >= t.steps:  # hard (and soft) reconstruction, usage on the first test images
        try:
            t_eval = time.time()
            result = reconstruction_pass(model, test_set, EVAL_BATCH_SIZE, device, t.eval_images,
                                         num_workers=resolve_workers(cfg.data, test_set))
            summary.update(split="test", num_images=result["num_images"], hard=result["hard"], soft=result["soft"],
                           codebook={k: v for k, v in result["usage"].to_dict().items() if k != "counts"})
            summary["seconds"]["evaluate"] = round(time.time() - t_eval, 1)
        except Exception as err:
            if is_main:
                failed = f"{type(err).__name__}: {one_line(err)}"
                write_json(run.dir / "summary.json", {**summary, "evaluation_error": failed})
            kept = (f"training finished and was saved ({step} steps, {run.dir / 'checkpoints' / 'last.pt'}); the "
                    f"end-of-run evaluation failed")
            again = "Fix that and run the same command again: it evaluates without training again"
            if isinstance(err, UserError):
                raise EndOfRunEvaluationFailed(f"{kept}: {err}. {again}") from err
            print(f"{kept}. {again}", file=sys.stderr)
            raise
    if is_main:
        write_json(run.dir / "summary.json", summary)
        if not run.quiet:
            print(format_summary(summary, run.dir, verbose))
    return summary


def _steps(cfg: Config, run: TrainingRun, model: VQVAE, optimizer, scheduler, batches, test_set, step: int,
           log_state: LogState, gan: Optional[GANStep] = None) -> int:
    """The training steps of this session, from ``step``, over ``batches`` (an iterator of (images,
    labels) that starts at ``step``); -> the step reached."""
    t, device = cfg.train, run.device
    ddp_model = wrap_ddp(model, device) if run.world > 1 else model
    autocast, scaler = mixed_precision(t.amp, device)
    preview = torch.stack([test_set[i][0] for i in range(min(8, len(test_set)))]).to(device)
    log = RunLog(cfg, run, model, preview, log_state)
    if gan is not None:
        gan.autocast, log.extra_stats = autocast, gan.log_stats

    if run.is_main and not run.quiet and device.type == "cpu":
        print(f"threads: {torch.get_num_threads()} ({threads.chosen or 'set'}; train.threads sets it)", file=sys.stderr)
    warmup = getattr(model.quantizer, "warmup_steps", 0)
    if run.is_main and not run.quiet and t.steps < warmup:
        print(f"warning: train.steps={t.steps} ends inside the quantizer's warm-up (quantizer.warmup_steps={warmup}): "
              "the decoder has not yet been trained on codes alone, so code use and hard-code quality are not yet "
              f"meaningful (DDCL can look collapsed); train at least {warmup} steps to compare", file=sys.stderr)
    for module in model.modules():  # this loop says it above, once a run: not again at every checkpoint and image
        if hasattr(module, "warn_inside_warmup"):
            module.warn_inside_warmup = False
    ddp_model.train()
    for step, (images, _) in run.steps(batches, step):
        x = images.to(device, non_blocking=True)
        loss, recon_loss, out = training_step(model, x, step, optimizer, scheduler, t, forward=ddp_model,
                                              autocast=autocast, scaler=scaler, gan=gan)
        log.after_step(step + 1, loss, recon_loss, out, optimizer)
    return run.step


def format_summary(summary: Dict, run_dir: Path, verbose: bool = False) -> str:
    """The end-of-run summary (at most 12 lines; ``verbose``: with the usage definitions)."""
    done = "hard" in summary
    lines = [f"done: {summary['step']} steps ({summary['train_seconds']:.0f} s this session) -> {run_dir}" if done else
             f"stopped at step {summary['step']} ({summary['train_seconds']:.0f} s this session); checkpoint in "
             f"{run_dir / 'checkpoints'}; run the same command again to resume"]
    if done:
        c = summary["codebook"]
        lines.append(f"test set, {summary['num_images']} images, hard codes: MSE {summary['hard']['mse']:.5f}  "
                     f"PSNR {summary['hard']['psnr']:.2f} dB"
                     + (f"   (soft codes: PSNR {summary['soft']['psnr']:.2f} dB)" if summary.get("soft") else ""))
        books = c.get("codebooks") or 1  # several codebooks: active and dead are summed over them
        per_book = (f" over {books} codebooks of {c['num_codes']}; per codebook "
                    + ", ".join(f"{u:.0%}" for u in c["utilization_per_codebook"])) if books > 1 else ""
        lines.append(f"codebook: utilization {c['utilization']:.1%} ({c['active_codes']}/{c['num_codes'] * books} "
                     f"active, {c['dead_codes']} dead{per_book}), perplexity {c['perplexity']:.1f}")
        r = summary.get("training_usage")
        if r and r.get("queue_utilization") is not None:
            lines.append(f"training's last indices: queue utilization {r['queue_utilization']:.1%} of the last "
                         f"{r['queue_indices']:,} (uniform ceiling {r['queue_ceiling']:.1%}), per-batch "
                         f"{r['batch_utilization']:.1%} (ceiling {r['batch_ceiling']:.1%})")
        lines.append("definitions:\n" + definitions() if verbose else DEFINITIONS_HINT)
    seconds = summary.get("seconds") or {}
    names = {"setup": "set-up (data, model)", "train": "training", "evaluate": "test-set evaluation"}
    if seconds:
        lines.append(f"time: {', '.join(f'{what} {seconds[k]:.0f} s' for k, what in names.items() if k in seconds)}; "
                     f"{sum(seconds.values()):.0f} s in all")
    return "\n".join(lines + [f"TensorBoard: {tensorboard_hint(run_dir / 'tb')}",
                              f"full evaluation (SSIM, LPIPS): {tool('ddcl-vq')} evaluate {where(run_dir)}"])


# ----------------------------------------------------------------------------- the command
HELP = """\
Train a VQ-VAE from a YAML config. Dotted key=value overrides follow the options, e.g.

  ddcl-vq train --config configs/fashion_ddcl.yaml train.steps=200 quantizer.temperature=0.02

A run resumes from RUN_DIR/checkpoints when they exist (kill it and start the same
command again), with the config it was trained with: a change to the model, optimizer, data or
a schedule is refused (more train.steps, logging and checkpoint intervals may change);
--config RUN_DIR/config.yaml continues a run as it was. One training at a time per run
directory (RUN_DIR/train.lock). Multi-process: torchrun --nproc_per_node 2 -m ddcl_vq train --config ...

train.threads: torch CPU threads per process (default null = auto: OMP_NUM_THREADS if set, one per process
under torchrun, else the cores that are idle when the run starts, at most 4; the first line says which and
why, and a resumed run keeps the count it was trained with).
"""


@dataclass(kw_only=True)
class TrainOptions:
    config: str = option(help="YAML config (see configs/)")
    overrides: List[str] = option(default_factory=list, help="dotted config overrides", positional=True, nargs="*",
                                  metavar="key=value")
    quiet: bool = option(False, "no progress bar or summary")
    verbose: bool = option(False, "end the summary with the definitions of its figures")
    stop_after: Optional[int] = option(None, "leave after STEPS steps in this session with a checkpoint "
                                             "(pre-emptible jobs); the same command resumes", metavar="STEPS")
    print_config: bool = option(False, "print the resolved config and exit")
    check_data: bool = option(False, "read every image of both splits (an image folder: decode each file), list "
                                     "those that cannot be read, and exit (status 2 if any)")


OPTIONS = Options(TrainOptions, prog="ddcl-vq train", description=HELP, rules=Rules(positive={"stop_after"}),
                  intermixed=True)


@entry_point("ddcl-vq train")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)

    # a run directory's own config.yaml (next to its checkpoints) is read as evaluate reads it: this version's keys
    saved = run_dir_of_config(opts.config) is not None
    cfg = load_config(opts.config, opts.overrides, saved=saved)
    if saved:
        validate_training(cfg)
    # RUN_DIR/config.yaml trains RUN_DIR, also after cp -a or mv (its saved run.dir is stale then)
    moved = follow_run_dir(cfg, opts.config, opts.overrides)
    if moved and os.environ.get("RANK", "0") == "0":
        note(moved)
    if opts.print_config:
        print(dump_config(cfg), end="")
        return 0
    if opts.check_data:
        report, bad = check_data(cfg.data, cfg.run.seed)
        print("\n".join(report))
        for path, reason in bad:
            print(f"unreadable: {path} ({reason})")
        if bad:
            raise UnreadableImage(f"{len(bad)} image(s) cannot be read (listed above); replace or remove them")
        print("every image can be read")
        return 0
    threads.set_threads(cfg.train.threads)  # per process (under torchrun: each of them); the run's first line says why
    train(cfg, quiet=opts.quiet, stop_after=opts.stop_after, verbose=opts.verbose)
    teardown_distributed()  # after success only: a barrier after a failure could hang
    return 0
