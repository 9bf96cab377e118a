"""The training loop, top to bottom: set-up, resume, steps, logging, checkpoints, summary.

:func:`train` reads on one screen; its named pieces are :class:`Checkpoints` (resume and
atomic saves), :class:`RunLog` (metrics.jsonl, TensorBoard, progress bar, usage window,
image grids), :func:`training_step` (one step: forward, loss, backward, optimizer, discriminator;
``ddcl-vq bench`` times it too) and :func:`end_of_run_evaluation`. The quantizer is driven only through the
``ddcl_vq.Quantizer`` interface: ``step()`` once per optimizer step (DDCL advances its
temperature schedule), ``log_stats()`` for extra scalars, ``has_soft_codes`` for image grids.

Distributed training is detected from the environment (torchrun sets RANK, WORLD_SIZE,
LOCAL_RANK): the process group starts with NCCL on GPUs, gloo on CPUs; the model is
wrapped in DistributedDataParallel; data.batch_size is the *global* batch, split evenly
over processes, and train.lr applies to that global batch (DDP averages gradients), so a
config means the same optimisation on 1 or N processes. Only rank 0 writes files.
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddcl_vq import USAGE_DEFINITIONS, CodebookUsage, UsageStats
from ddcl_vq.distributed import all_reduce_sum_, replicas_identical
from ddcl_vq.models import VQVAE, VQVAEOutput

from .builders import build_model, build_optimizer, lr_lambda
from .checkpoint import latest_checkpoint, load_into, prune_periodic, save_checkpoint
from .config import Config, TrainConfig, dump_config
from .data import EpochBatches, build_dataset, image_channels, make_loader, resolve_workers
from .errors import UserError, one_line
from .losses import GANStep
from .progress import Progress
from .memory import NotEnoughMemory, check_fits
from .rundir import (RunLock, check_resume, check_run_dir_setting, finished_summary, first_missing,
                     keep_logged_steps, note, remove_failed_start, saved_config)
from .settings import ConfigError
from .testset import EVAL_BATCH_SIZE, reconstruction_pass


def setup_distributed(device_pref: str) -> Dict:
    """Initialise torch.distributed from torchrun's environment variables, if present."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'train.device': 'cuda' asked, but no CUDA device is available here; use "
                          "train.device=auto or cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return {"rank": rank, "world": dist.get_world_size() if dist.is_initialized() else 1, "device": device}


def teardown_distributed() -> None:
    """Wait for every process, then destroy the process group (if one was started).

    Leaving a gloo/NCCL group alive at interpreter exit can abort the process
    ('terminate called without an active exception'), so every command ends with this."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _rng_state(device: torch.device) -> Dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: Dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _image_grid(x, hard, soft):
    from torchvision.utils import make_grid
    rows = [x, hard] + ([soft] if soft is not None else [])
    return make_grid(torch.cat(rows).clamp(0, 1), nrow=x.shape[0], padding=1)


def _due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last


class Checkpoints:
    """RUN_DIR/checkpoints: find the newest readable one, check that it was trained with this
    config (only what :data:`~ddcl_vq.train.rundir.RESUMABLE` names may change) and resume from it;
    save last.pt (and a periodic step_XXXXXXX.pt, the newest few kept) atomically, on rank 0,
    after checking that every process holds the same model."""

    def __init__(self, run_dir: Path, cfg: Config, device: torch.device, world: int, is_main: bool):
        self.run_dir, self.dir = run_dir, run_dir / "checkpoints"
        self.cfg, self.device, self.world, self.is_main = cfg, device, world, is_main
        self.model = self.optimizer = self.scheduler = None
        self.log_state: Optional[LogState] = None  # the log's running figures, resumed with the run
        self.extra: Dict = {}  # more state to save and resume, by name (the VQGAN loss's discriminator: "gan")
        self.found = latest_checkpoint(self.dir, map_location=device) if self.dir.is_dir() else None
        self.step = int(self.found[0]["step"]) if self.found else 0

    def check_config(self) -> List[str]:
        """RunDirError when the newest checkpoint was trained with another config; -> notes."""
        if self.found is None:
            return []
        saved = saved_config(self.found[0], self.run_dir)
        return [] if saved is None else check_resume(saved, self.cfg, self.step, self.run_dir)

    def resume(self, model: VQVAE, optimizer, scheduler, announce: bool) -> int:
        """Load the newest checkpoint (model, optimizer, lr schedule, RNG) into these; -> its step (0 if none)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        if self.found is None:
            return 0
        state, path = self.found
        load_into(model, state["model"], path, "model")
        load_into(optimizer, state["optimizer"], path, "optimizer")
        load_into(scheduler, state["scheduler"], path, "learning-rate schedule")
        for name, part in self.extra.items():
            load_into(part, state.get(name, {}), path, name)
        if self.log_state is not None:
            self.log_state.load_state_dict(state.get("log_state"), self.is_main)
        _set_rng_state(state["rng"], self.device)
        self.found = None  # let the loaded copy go
        if announce:
            print(f"resuming {self.run_dir} from {path.name} at step {self.step}", file=sys.stderr)
        return self.step

    def save(self, step: int, periodic: bool) -> None:
        if self.world > 1 and not replicas_identical(self.model):
            raise RuntimeError(f"step {step}: model replicas differ across processes; the codebook is no "
                               "longer one codebook (a quantizer update that is not synchronised?)")
        log_state = None if self.log_state is None else self.log_state.state_dict()  # on every process
        if not self.is_main:
            return
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "step": step, "rng": _rng_state(self.device),
                 "config": self.cfg.to_dict()}
        state.update({name: part.state_dict() for name, part in self.extra.items()})
        if log_state is not None:
            state["log_state"] = log_state
        save_checkpoint(state, self.dir / "last.pt")
        if periodic:
            save_checkpoint(state, self.dir / f"step_{step:07d}.pt")
            prune_periodic(self.dir)


class LogState:
    """What the log carries from step to step, saved in checkpoints so that a resumed run logs what
    the straight run logs: the usage window being accumulated (``train.usage_window``), the last
    completed window's figures, the cumulative ``revived`` count at the last metrics line."""

    def __init__(self, model: VQVAE, device: torch.device):
        self.usage = CodebookUsage(model.quantizer.num_codes, device=device)
        self.stats: Optional[UsageStats] = None
        self.revived_logged = float(getattr(model.quantizer, "revived", 0))  # for revived_new

    def state_dict(self) -> Dict:
        """Every process calls this (the window's counts are summed over processes: rank 0 saves them all)."""
        counts, mass = self.usage.counts.clone(), self.usage.soft_mass.clone()
        all_reduce_sum_(counts)
        all_reduce_sum_(mass)
        return {"counts": counts.cpu(), "soft_mass": mass.cpu(), "has_soft": self.usage.has_soft,
                "stats": None if self.stats is None else {**self.stats.to_dict(), "counts": torch.tensor(self.stats.counts)},
                "revived_logged": self.revived_logged}

    def load_state_dict(self, state: Optional[Dict], is_main: bool) -> None:
        """A checkpoint's log state (none in checkpoints from before it was saved: the window starts empty)."""
        if not state:
            return
        if is_main:  # the others start from zero: the next all-reduce sums to the saved window plus the new steps
            self.usage.counts.copy_(state["counts"])
            self.usage.soft_mass.copy_(state["soft_mass"])
        self.usage.has_soft = bool(state["has_soft"])
        stats = state["stats"]
        self.stats = None if stats is None else UsageStats(**{**stats, "counts": stats["counts"].tolist()})
        self.revived_logged = float(state["revived_logged"])


#: TensorBoard names of metrics.jsonl keys whose name alone would mislead
TB_NAMES = {"revived": "revived_total"}


class RunLog:
    """What training reports: metrics.jsonl and TensorBoard scalars every ``train.log_every`` steps,
    the windowed codebook usage every ``train.usage_window`` steps (all-reduced, so every process
    takes part), image grids every ``train.image_every`` steps, the progress (a bar on a terminal,
    else one line every ``train.log_every`` steps). Files and progress on rank 0 only."""

    def __init__(self, cfg: Config, model: VQVAE, preview: torch.Tensor, step: int, device: torch.device,
                 is_main: bool, quiet: bool, state: Optional["LogState"] = None):
        self.cfg, self.t, self.model, self.preview = cfg, cfg.train, model, preview
        self.state = state if state is not None else LogState(model, device)  # resumed with the run
        self.extra_stats: Callable[[], Dict] = dict
        self.writer = self.metrics = self.progress = None
        run_dir = Path(cfg.run.dir)
        if is_main:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=step if step else None)
            # a fresh start (no checkpoint): lines left by an attempt that saved none describe nothing;
            # a resumed run: lines past the checkpoint's step are logged again from here, so they go
            if step:
                keep_logged_steps(run_dir / "metrics.jsonl", step)
            self.metrics = open(run_dir / "metrics.jsonl", "a" if step else "w")
            if not quiet:  # a bar on a terminal, one line per train.log_every steps in a log file
                self.progress = Progress(self.t.steps, cfg.run.name, unit="step", initial=step,
                                         every=self.t.log_every)
        self.t_start = time.time()

    def after_step(self, step: int, loss: torch.Tensor, recon_loss: torch.Tensor, out: VQVAEOutput,
                   optimizer: torch.optim.Optimizer) -> None:
        q = out.quantizer
        window = self.state.usage
        window.update(q.indices, q.soft_counts)
        if _due(step, self.t.usage_window, self.t.steps):
            self.state.stats = window.compute()  # all-reduced across processes
            window.reset()
            if self.writer is not None:
                self.writer.add_histogram("usage/code_counts",
                                          torch.tensor(self.state.stats.counts, dtype=torch.float32), step)
        if self.writer is None:
            return
        if _due(step, self.t.log_every, self.t.steps):
            self.scalars(step, self.record(step, loss, recon_loss, out, optimizer))
        if _due(step, self.t.image_every, self.t.steps):
            self.images(step)

    def record(self, step: int, loss, recon_loss, out: VQVAEOutput, optimizer) -> Dict:
        """One metrics.jsonl line: losses, the quantizer's terms and extra statistics, lr, usage window.

        ``codebook_lr`` only when the optimizer trains a codebook (an M-step or EMA codebook has no
        learning rate; lines of runs before 2026-12 carry the encoder's lr under that name).
        ``revived`` (DDCL) is cumulative: codes re-seeded since the run began (TensorBoard:
        ``revived_total``); ``revived_new``: those re-seeded since the previous line."""
        q = out.quantizer
        record = {"step": step, "time": round(time.time() - self.t_start, 3), "wall": round(time.time(), 3),
                  "loss": loss.item(), "recon_mse": recon_loss.item(), "quantizer_loss": q.loss.item(),
                  "perplexity_batch": float(q.perplexity),
                  "lr": optimizer.param_groups[0]["lr"]}
        codebook_group = [g for g in optimizer.param_groups if g.get("name") == "codebook"]
        if codebook_group:  # a codebook trained by the optimizer (an M-step or EMA codebook has no learning rate)
            record["codebook_lr"] = codebook_group[0]["lr"]
        record.update({f"term_{k}": float(v) for k, v in q.terms.items()})
        record.update(self.model.quantizer.log_stats())
        if "revived" in record:  # cumulative (codes re-seeded since the run began); revived_new: since the last line
            record["revived_new"] = record["revived"] - self.state.revived_logged
            self.state.revived_logged = record["revived"]
        record.update(self.extra_stats())  # the VQGAN loss: its parts, lambda, logits on real and fake
        if self.state.stats is not None:
            w = self.state.stats
            record.update(utilization_window=w.utilization, dead_codes_window=w.dead_codes,
                          perplexity_window=w.perplexity)
        return record

    def scalars(self, step: int, record: Dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        for k, v in record.items():
            if k not in ("step", "time", "wall"):
                self.writer.add_scalar(TB_NAMES.get(k, k).replace("term_", "terms/"), v, step)
        if self.progress is not None:
            w = self.state.stats
            self.progress.set_postfix(loss=f"{record['loss']:.4f}", ppl=f"{record['perplexity_batch']:.0f}",
                                      util=f"{w.utilization:.0%}" if w else "-")

    def images(self, step: int) -> None:
        """original | hard-code | soft-code (when the quantizer has soft codes) reconstructions."""
        model = self.model
        model.eval()
        with torch.no_grad():
            hard = model.reconstruct(self.preview, "hard")
            soft = model.reconstruct(self.preview, "soft") if model.quantizer.has_soft_codes else None
        model.train()
        self.writer.add_image("reconstructions/original_hard_soft", _image_grid(self.preview, hard, soft), step)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.update(1)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
            self.metrics.close()


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
    """One training step on the batch ``x``: forward, the loss (the plain MSE, or ``gan``'s generator
    loss: pixel, perceptual, adversarial), backward, gradient clipping, the optimizer and lr-schedule
    steps; then the discriminator's step (``gan``) and the quantizer's per-step state.
    -> (loss, recon_loss, out). ``step``: optimizer steps done before this one; ``forward``: the module
    to call (the DDP wrapper of ``model``), default ``model``; ``autocast``, ``scaler``:
    :func:`mixed_precision` (default: none). The training loop and ``ddcl-vq bench`` both call this."""
    forward = model if forward is None else forward
    scaler = torch.amp.GradScaler("cuda", enabled=False) if scaler is None else scaler
    with autocast():
        out = forward(x)
    if gan is None:
        recon_loss = F.mse_loss(out.reconstruction.float(), x)
        loss = recon_loss + t.quantizer_loss_weight * out.quantizer.loss
    else:  # the loss section: pixel, perceptual, adversarial (recon_loss: the pixel MSE, logged)
        loss, recon_loss = gan.generator_loss(x, out.reconstruction, t.quantizer_loss_weight * out.quantizer.loss,
                                              step)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"step {step}: loss is {loss.item()}; lower train.lr or check the data")
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

    ``stop_after``: leave after this many steps in this session, with a checkpoint, as if the
    job were pre-empted (time-sliced clusters); running again resumes where it stopped.

    The run directory is locked while training (a second training there is refused); a run
    resumes only with the config it was trained with (RESUMABLE keys aside); a finished run with
    its summary is left as it is; when the end-of-run evaluation fails, the finished training is
    kept and running the same command again only evaluates.
    """
    run_dir = check_run_dir_setting(cfg.run.dir)  # never the current folder by accident
    env = setup_distributed(cfg.train.device)
    created = first_missing(run_dir) if env["rank"] == 0 else None
    lock = RunLock(run_dir).acquire() if env["rank"] == 0 else None
    failed = True
    try:
        result = _train(cfg, env, quiet, stop_after)
        failed = False
        return result
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err):
            raise NotEnoughMemory(f"out of memory on {env['device']} ({one_line(err)}); lower quantizer.num_codes "
                                  "(or model.latent_dim, data.batch_size, model.channels)") from err
        raise
    finally:
        if lock is not None:
            lock.release()
        if failed and created is not None:
            remove_failed_start(run_dir, created)  # a run that never got going leaves no folder behind


def _train(cfg: Config, env: Dict, quiet: bool, stop_after: Optional[int]) -> Dict:
    world, device, is_main = env["world"], env["device"], env["rank"] == 0
    t = cfg.train
    run_dir = Path(cfg.run.dir)
    torch.manual_seed(cfg.run.seed)

    checkpoints = Checkpoints(run_dir, cfg, device, world, is_main)
    notes = checkpoints.check_config()  # before anything is built: a run is resumed only as itself
    if checkpoints.found is not None and checkpoints.step >= t.steps:
        done = finished_summary(run_dir, checkpoints.step, cfg)
        if done is not None:
            if is_main and not quiet:
                print(f"{run_dir} is finished ({checkpoints.step} of train.steps={t.steps} steps, summary.json "
                      f"written); nothing to do. To train longer, raise train.steps; for a new run, give another "
                      "run.dir", file=sys.stderr)
            return done

    check_fits(cfg, image_channels(cfg.data), device, world)  # a model the machine cannot hold: refused with the figure
    train_set = build_dataset(cfg.data, "train", cfg.run.seed)
    test_set = build_dataset(cfg.data, "test", cfg.run.seed)
    model = build_model(cfg, image_channels(cfg.data)).to(device)
    if t.init_from and checkpoints.found is None:  # a new run from an exported model (a resumed one has its own)
        from .init_from import init_from_export
        init_from_export(model, t.init_from)
    optimizer = build_optimizer(model, t, cfg.quantizer.type)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    # the loss section beyond the plain MSE (perceptual, discriminator): None for the defaults
    gan = GANStep.from_config(cfg, model, image_channels(cfg.data), device, world)
    if gan is not None:
        checkpoints.extra["gan"] = gan
    # The training batches' iterator is made BEFORE the RNG state is restored: making a DataLoader
    # iterator draws its base seed from the global RNG, which training draws from too (DDCL's revival,
    # torch.multinomial). A straight run draws it here, after building the model; a resumed run
    # draws it here too, then restores the RNG state its checkpoint saved, so it continues the
    # straight run's random stream exactly (its data order has its own generator, EpochBatches).
    batches = None
    if checkpoints.step < t.steps:
        batches = iter(make_loader(train_set, EpochBatches(len(train_set), cfg.data.batch_size, cfg.run.seed,
                                                           env["rank"], world, start_step=checkpoints.step),
                                   resolve_workers(cfg.data, train_set), device))
    checkpoints.log_state = LogState(model, device)
    # the quantizer's state (its temperature schedule included) comes with the model
    step = checkpoints.resume(model, optimizer, scheduler, announce=is_main and not quiet)
    if is_main:
        for text in notes:
            note(text)
        (run_dir / "config.yaml").write_text(dump_config(cfg))

    t_start = time.time()
    if step < t.steps:
        step = _steps(cfg, env, model, optimizer, scheduler, checkpoints, batches, test_set, step, quiet,
                      stop_after, gan)
    batches = None  # the training loader's worker processes (if any) end here, before the evaluation
    train_seconds = time.time() - t_start

    summary = {"run": str(run_dir), "step": step, "train_seconds": round(train_seconds, 1),
               "eval_images": t.eval_images}
    if t.eval_images > 0 and step >= t.steps:
        try:
            summary.update(end_of_run_evaluation(model, test_set, cfg, device))
        except Exception as err:
            if is_main:
                summary["evaluation_error"] = f"{type(err).__name__}: {one_line(err)}"
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            kept = (f"training finished and was saved ({step} steps, {run_dir / 'checkpoints' / 'last.pt'}); the "
                    f"end-of-run evaluation failed")
            again = "Fix that and run the same command again: it evaluates without training again"
            if isinstance(err, UserError):
                raise EndOfRunEvaluationFailed(f"{kept}: {err}. {again}") from err
            print(f"{kept}. {again}", file=sys.stderr)
            raise
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not quiet:
            print(format_summary(summary, run_dir))
    return summary


def _steps(cfg: Config, env: Dict, model: VQVAE, optimizer, scheduler, checkpoints: Checkpoints, batches, test_set,
           step: int, quiet: bool, stop_after: Optional[int], gan: Optional[GANStep] = None) -> int:
    """The training steps of this session, from ``step``, over ``batches`` (an iterator of (images,
    labels) that starts at ``step``); -> the step reached."""
    world, device, is_main = env["world"], env["device"], env["rank"] == 0
    t = cfg.train
    ddp_model = model
    if world > 1:
        # broadcast_buffers=False: quantizer statistics are all-reduced by the quantizers
        # themselves, and replicas_identical() checks that at every checkpoint.
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    autocast, scaler = mixed_precision(t.amp, device)
    preview = torch.stack([test_set[i][0] for i in range(min(8, len(test_set)))]).to(device)
    log = RunLog(cfg, model, preview, step, device, is_main, quiet, checkpoints.log_state)
    if gan is not None:
        gan.autocast, log.extra_stats = autocast, gan.log_stats

    first_step = step
    ddp_model.train()
    try:
        for images, _ in batches:
            if step >= t.steps:
                break
            if stop_after is not None and step - first_step >= stop_after:
                checkpoints.save(step, periodic=False)
                break
            x = images.to(device, non_blocking=True)
            loss, recon_loss, out = training_step(model, x, step, optimizer, scheduler, t, forward=ddp_model,
                                                  autocast=autocast, scaler=scaler, gan=gan)
            step += 1

            log.after_step(step, loss, recon_loss, out, optimizer)
            if _due(step, t.checkpoint_every, t.steps):
                checkpoints.save(step, periodic=step % t.checkpoint_every == 0)
            log.advance()
    finally:
        log.close()
    return step


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
        lines.append("definitions:\n  " + USAGE_DEFINITIONS.replace("\n", "\n  "))
    from .hints import tensorboard_hint, tool, where
    lines.append(f"TensorBoard: {tensorboard_hint(run_dir / 'tb')}")
    lines.append(f"full evaluation (SSIM, LPIPS): {tool('ddcl-vq')} evaluate {where(run_dir)}")
    return "\n".join(lines)
