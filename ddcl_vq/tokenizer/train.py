"""The training loop, top to bottom: set-up, resume, steps, logging, checkpoints, summary.

:func:`train` reads on one screen. What every training loop does around its step — run directory and lock, resume,
atomic checkpoints, RNG state, metrics.jsonl, TensorBoard, progress, torchrun, SIGTERM/SIGINT — is
:class:`~ddcl_vq.common.skeleton.TrainingRun`; this loop's own pieces are :class:`LogState` and :class:`RunLog` (the
usage window, the metrics line, image grids), :func:`training_step` (one step: forward, loss, backward, optimizer,
discriminator; ``ddcl-vq bench`` times it too) and :func:`end_of_run_evaluation`. The quantizer is driven only through
the ``ddcl_vq.Quantizer`` interface: ``step()`` once per optimizer step (DDCL advances its temperature schedule),
``log_stats()`` for extra scalars, ``has_soft_codes`` for image grids.

Distributed training is detected from the environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK): the process group
starts with NCCL on GPUs, gloo on CPUs; the model is wrapped in DistributedDataParallel; data.batch_size is the *global*
batch, split evenly over processes, and train.lr applies to that global batch (DDP averages gradients), so a config
means the same optimisation on 1 or N processes. Only rank 0 writes files.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ddcl_vq import USAGE_DEFINITIONS, CodebookUsage, RecentUsage, UsageStats
from ddcl_vq.distributed import all_reduce_sum_
from ddcl_vq.models import VQVAE, VQVAEOutput

from ddcl_vq.tokenizer.builders import build_model, build_optimizer, lr_lambda
from ddcl_vq.tokenizer.config import Config, TrainConfig, dump_config
from ddcl_vq.common.data import EpochBatches, build_dataset, image_channels, make_loader, resolve_workers
from ddcl_vq.common.errors import Diverged, UserError, one_line
from ddcl_vq.tokenizer.losses import GANStep
from ddcl_vq.tokenizer.memory import NotEnoughMemory, check_fits
from ddcl_vq.common.rundir import note
from ddcl_vq.tokenizer.config import check_resume, finished_summary, saved_config
from ddcl_vq.common.config import ConfigError
from ddcl_vq.common.skeleton import TrainingRun, is_due, setup_distributed, teardown_distributed, wrap_ddp  # noqa: F401 - the commands import them here
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE, reconstruction_pass


class LogState:
    """What the log carries from step to step, saved in checkpoints (as ``log_state``) so that a resumed run logs what
    the straight run logs: the usage window being accumulated (``train.usage_window``), the last completed window's
    figures, the queue of recent training indices and the window's per-batch usage (:class:`~ddcl_vq.RecentUsage`) with
    their last figures, the cumulative ``revived`` count at the last metrics line."""

    def __init__(self, model: VQVAE, device: torch.device, world: int = 1, is_main: bool = True):
        self.is_main = is_main
        self.usage = CodebookUsage(model.quantizer.num_codes, device=device)
        self.stats: Optional[UsageStats] = None
        self.recent = RecentUsage(model.quantizer.num_codes, device=device, world=world)
        self.recent_stats: Optional[Dict] = None  # the last window's queue and per-batch figures
        self.revived_logged = float(getattr(model.quantizer, "revived", 0))  # for revived_new

    def state_dict(self) -> Dict:
        """Every process calls this (the window's counts are summed over processes: rank 0 saves them all)."""
        counts, mass = all_reduce_sum_(self.usage.counts.clone()), all_reduce_sum_(self.usage.soft_mass.clone())
        return {"counts": counts.cpu(), "soft_mass": mass.cpu(), "has_soft": self.usage.has_soft,
                "stats": None if self.stats is None else {**self.stats.to_dict(), "counts": torch.tensor(self.stats.counts)},
                "revived_logged": self.revived_logged, "recent": self.recent.state_dict(),
                "recent_stats": self.recent_stats}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        """A checkpoint's log state (none in checkpoints from before it was saved: the window starts empty)."""
        if not state:
            return
        if self.is_main:  # the others start from zero: the next all-reduce sums to the saved window plus the new steps
            self.usage.counts.copy_(state["counts"])
            self.usage.soft_mass.copy_(state["soft_mass"])
        self.usage.has_soft = bool(state["has_soft"])
        stats = state["stats"]
        self.stats = None if stats is None else UsageStats(**{**stats, "counts": stats["counts"].tolist()})
        self.revived_logged = float(state["revived_logged"])
        if "recent" in state:  # checkpoints from before the queue was kept start with an empty one
            self.recent.load_state_dict(state["recent"])
            self.recent_stats = state["recent_stats"]


#: TensorBoard names of metrics.jsonl keys whose name alone would mislead
TB_NAMES = {"revived": "revived_total"}


class RunLog:
    """What this loop reports beside the skeleton's: the windowed codebook usage every
    ``train.usage_window`` steps (all-reduced, so every process takes part), the metrics line every
    ``train.log_every`` steps (:meth:`record`), image grids every ``train.image_every`` steps.
    Files on rank 0 only, through ``run`` (metrics.jsonl, its TensorBoard writer)."""

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
        self.state.recent.update(q.indices)
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
        """One metrics.jsonl line (after its ``step``): losses, the quantizer's terms and extra statistics, lr,
        usage window.

        ``codebook_lr`` only when the optimizer trains a codebook (an M-step or EMA codebook has no
        learning rate; lines of runs before 2026-12 carry the encoder's lr under that name).
        ``revived`` (DDCL) is cumulative: codes re-seeded since the run began (TensorBoard:
        ``revived_total``); ``revived_new``: those re-seeded since the previous line."""
        q = out.quantizer
        record = {"time": round(time.time() - self.t_start, 3), "wall": round(time.time(), 3),
                  "loss": loss.item(), "recon_mse": recon_loss.item(), "quantizer_loss": q.loss.item(),
                  "perplexity_batch": float(q.perplexity), "lr": optimizer.param_groups[0]["lr"]}
        codebook_group = [g for g in optimizer.param_groups if g.get("name") == "codebook"]
        if codebook_group:
            record["codebook_lr"] = codebook_group[0]["lr"]
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
        model = self.model
        model.eval()
        with torch.no_grad():
            hard = model.reconstruct(self.preview, "hard")
            soft = model.reconstruct(self.preview, "soft") if model.quantizer.has_soft_codes else None
        model.train()
        from torchvision.utils import make_grid
        rows = [self.preview, hard] + ([soft] if soft is not None else [])
        grid = make_grid(torch.cat(rows).clamp(0, 1), nrow=self.preview.shape[0], padding=1)
        self.run.writer.add_image("reconstructions/original_hard_soft", grid, step)


def end_of_run_evaluation(model: VQVAE, test_set, cfg: Config, device: torch.device) -> Dict:
    """Hard- (and soft-) code reconstruction and dataset-level codebook usage on the first
    ``train.eval_images`` test images, for summary.json."""
    result = reconstruction_pass(model, test_set, batch_size=EVAL_BATCH_SIZE, device=device,
                                 max_images=cfg.train.eval_images, num_workers=resolve_workers(cfg.data, test_set))
    usage = result["usage"]
    return dict(split="test", num_images=result["num_images"], hard=result["hard"], soft=result["soft"],
                codebook={k: v for k, v in usage.to_dict().items() if k != "counts"})


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
    """One training step on the batch ``x``: forward, the loss (the plain MSE, or ``gan``'s generator loss: pixel,
    perceptual, adversarial), backward, gradient clipping, the optimizer and lr-schedule steps; then the discriminator's
    step (``gan``) and the quantizer's per-step state. -> (loss, recon_loss, out). ``step``: optimizer steps done before
    this one; ``forward``: the module to call (the DDP wrapper of ``model``), default ``model``; ``autocast``,
    ``scaler``: :func:`mixed_precision` (default: none). The training loop and ``ddcl-vq bench`` both call this."""
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


def train(cfg: Config, quiet: bool = False, stop_after: Optional[int] = None) -> Dict:
    """Train (or resume) the run described by ``cfg``; returns the end-of-run summary.

    ``stop_after``: leave after this many steps in this session, with a checkpoint, as if the job were pre-empted
    (time-sliced clusters); running again resumes where it stopped. SIGTERM and SIGINT do the same at the step under way
    and raise :class:`~ddcl_vq.common.errors.Stopped`.

    The run directory is locked while training (a second training there is refused); a run resumes only with the config
    it was trained with (RESUMABLE keys aside); a finished run with its summary is left as it is; when the end-of-run
    evaluation fails, the finished training is kept and running the same command again only evaluates.
    """
    t = cfg.train
    run = TrainingRun(cfg.run.dir, t.steps, checkpoint_every=t.checkpoint_every, log_every=t.log_every,
                      name=cfg.run.name, device=t.device, quiet=quiet, stop_after=stop_after, config=cfg.to_dict(),
                      threads=t.threads)
    try:
        with run:
            return _train(cfg, run)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err):
            raise NotEnoughMemory(f"out of memory on {run.device} ({one_line(err)}); lower quantizer.num_codes "
                                  "(or model.latent_dim, data.batch_size, model.channels)") from err
        raise


def _train(cfg: Config, run: TrainingRun) -> Dict:
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
        from ddcl_vq.tokenizer.init_from import init_from_export
        init_from_export(model, t.init_from)
    optimizer = build_optimizer(model, t, cfg.quantizer.type)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    # the loss section beyond the plain MSE (perceptual, discriminator): None for the defaults
    gan = GANStep.from_config(cfg, model, image_channels(cfg.data), device, world)
    # The training batches' iterator is made BEFORE the RNG state is restored: making a DataLoader
    # iterator draws its base seed from the global RNG, which training draws from too (DDCL's revival,
    # torch.multinomial). A straight run draws it here, after building the model; a resumed run
    # draws it here too, then restores the RNG state its checkpoint saved, so it continues the
    # straight run's random stream exactly (its data order has its own generator, EpochBatches).
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
    if t.eval_images > 0 and step >= t.steps:
        try:
            t_eval = time.time()
            summary.update(end_of_run_evaluation(model, test_set, cfg, device))
            summary["seconds"]["evaluate"] = round(time.time() - t_eval, 1)
        except Exception as err:
            if is_main:
                summary["evaluation_error"] = f"{type(err).__name__}: {one_line(err)}"
                (run.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            kept = (f"training finished and was saved ({step} steps, {run.dir / 'checkpoints' / 'last.pt'}); the "
                    f"end-of-run evaluation failed")
            again = "Fix that and run the same command again: it evaluates without training again"
            if isinstance(err, UserError):
                raise EndOfRunEvaluationFailed(f"{kept}: {err}. {again}") from err
            print(f"{kept}. {again}", file=sys.stderr)
            raise
    if is_main:
        (run.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not run.quiet:
            print(format_summary(summary, run.dir))
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
        from ddcl_vq.common.threads import chosen
        print(f"threads: {torch.get_num_threads()} ({chosen or 'set'}; train.threads sets it)", file=sys.stderr)
    ddp_model.train()
    for step, (images, _) in run.steps(batches, step):
        x = images.to(device, non_blocking=True)
        loss, recon_loss, out = training_step(model, x, step, optimizer, scheduler, t, forward=ddp_model,
                                              autocast=autocast, scaler=scaler, gan=gan)
        log.after_step(step + 1, loss, recon_loss, out, optimizer)
    return run.step


def format_summary(summary: Dict, run_dir: Path) -> str:
    lines = [f"done: {summary['step']} steps ({summary['train_seconds']:.0f} s this session) -> {run_dir}"]
    if "hard" not in summary:
        lines[0] = (f"stopped at step {summary['step']} ({summary['train_seconds']:.0f} s this session); "
                    f"checkpoint in {run_dir / 'checkpoints'}; run the same command again to resume")
    if "hard" in summary:
        c = summary["codebook"]
        lines.append(f"test set, {summary['num_images']} images, hard codes: MSE {summary['hard']['mse']:.5f}  "
                     f"PSNR {summary['hard']['psnr']:.2f} dB"
                     + (f"   (soft codes: PSNR {summary['soft']['psnr']:.2f} dB)" if summary.get("soft") else ""))
        lines.append(f"codebook: utilization {c['utilization']:.1%} ({c['active_codes']}/{c['num_codes']} active, "
                     f"{c['dead_codes']} dead), perplexity {c['perplexity']:.1f}")
        r = summary.get("training_usage")
        if r and r.get("queue_utilization") is not None:
            lines.append(f"training's last indices: queue utilization {r['queue_utilization']:.1%} of the last "
                         f"{r['queue_indices']:,} (uniform ceiling {r['queue_ceiling']:.1%}), per-batch "
                         f"{r['batch_utilization']:.1%} (ceiling {r['batch_ceiling']:.1%})")
        lines.append("definitions:\n  " + USAGE_DEFINITIONS.replace("\n", "\n  "))
    seconds = summary.get("seconds") or {}
    if seconds:
        names = {"setup": "set-up (data, model)", "train": "training", "evaluate": "test-set evaluation"}
        parts = [f"{what} {seconds[key]:.0f} s" for key, what in names.items() if key in seconds]
        lines.append(f"time: {', '.join(parts)}; {sum(seconds.values()):.0f} s in all")
    from ddcl_vq.common.hints import tensorboard_hint, tool, where
    lines.append(f"TensorBoard: {tensorboard_hint(run_dir / 'tb')}")
    lines.append(f"full evaluation (SSIM, LPIPS): {tool('ddcl-vq')} evaluate {where(run_dir)}")
    return "\n".join(lines)
