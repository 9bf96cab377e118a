"""The training loop, top to bottom: set-up, resume, steps, logging, checkpoints, summary.

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
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddcl_vq import USAGE_DEFINITIONS, CodebookUsage
from ddcl_vq.distributed import replicas_identical

from .builders import build_model, build_optimizer, lr_lambda
from .checkpoint import latest_checkpoint, prune_periodic, save_checkpoint
from .config import Config, dump_config
from .data import EpochBatches, build_dataset, image_channels
from .testset import reconstruction_pass


def setup_distributed(device_pref: str) -> Dict:
    """Initialise torch.distributed from torchrun's environment variables, if present."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available; use train.device=auto or cpu")
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


def train(cfg: Config, quiet: bool = False, stop_after: Optional[int] = None) -> Dict:
    """Train (or resume) the run described by ``cfg``; returns the end-of-run summary.

    ``stop_after``: leave after this many steps in this session, with a checkpoint, as if the
    job were pre-empted (time-sliced clusters); running again resumes where it stopped.
    """
    env = setup_distributed(cfg.train.device)
    rank, world, device = env["rank"], env["world"], env["device"]
    is_main = rank == 0
    run_dir = Path(cfg.run.dir)
    ckpt_dir = run_dir / "checkpoints"
    torch.manual_seed(cfg.run.seed)

    train_set = build_dataset(cfg.data, "train", cfg.run.seed)
    channels = image_channels(cfg.data)
    model = build_model(cfg, channels).to(device)
    optimizer = build_optimizer(model, cfg.train, cfg.quantizer.type)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    quantizer = model.quantizer

    step = 0
    resumed = latest_checkpoint(ckpt_dir, map_location=device) if ckpt_dir.exists() else None
    if resumed is not None:
        state, path = resumed
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"], device)
        step = int(state["step"])
        if is_main and not quiet:
            print(f"resuming {run_dir} from {path.name} at step {step}", file=sys.stderr)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))

    ddp_model = model
    if world > 1:
        # broadcast_buffers=False: quantizer statistics are all-reduced by the quantizers
        # themselves, and replicas_identical() checks that at every checkpoint.
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

    batches = EpochBatches(len(train_set), cfg.data.batch_size, cfg.run.seed, rank, world, start_step=step)
    loader = DataLoader(train_set, batch_sampler=batches, num_workers=cfg.data.num_workers,
                        pin_memory=device.type == "cuda")
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.amp]
    if amp_dtype is torch.float16 and device.type != "cuda":
        raise RuntimeError("train.amp=fp16 needs a CUDA device; use train.amp=bf16 or none on CPU")
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else nullcontext
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype is torch.float16)

    writer = None
    metrics_file = None
    if is_main:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(run_dir / "tb"), purge_step=step if step else None)
        metrics_file = open(run_dir / "metrics.jsonl", "a")
    test_set = build_dataset(cfg.data, "test", cfg.run.seed)
    preview = torch.stack([test_set[i][0] for i in range(min(8, len(test_set)))]).to(device)

    window = CodebookUsage(quantizer.num_codes, device=device)
    window_stats = None
    progress = None
    if is_main and not quiet:
        from tqdm import tqdm
        progress = tqdm(total=cfg.train.steps, initial=step, desc=cfg.run.name, unit="step", dynamic_ncols=True)

    def checkpoint(periodic: bool) -> None:
        if world > 1 and not replicas_identical(model):
            raise RuntimeError(f"step {step}: model replicas differ across processes; the codebook is no "
                               "longer one codebook (a quantizer update that is not synchronised?)")
        if not is_main:
            return
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "step": step, "rng": _rng_state(device), "config": cfg.to_dict()}
        save_checkpoint(state, ckpt_dir / "last.pt")
        if periodic:
            save_checkpoint(state, ckpt_dir / f"step_{step:07d}.pt")
            prune_periodic(ckpt_dir)

    t_start = time.time()
    first_step = step
    ddp_model.train()
    for images, _ in loader:
        if step >= cfg.train.steps:
            break
        if stop_after is not None and step - first_step >= stop_after:
            checkpoint(periodic=False)
            break
        x = images.to(device, non_blocking=True)
        with autocast():
            out = ddp_model(x)
        recon_loss = F.mse_loss(out.reconstruction.float(), x)
        loss = recon_loss + cfg.train.quantizer_loss_weight * out.quantizer.loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss is {loss.item()}; lower train.lr or check the data")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cfg.train.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        quantizer.step()  # per-step quantizer state (DDCL: the temperature schedule)
        step += 1
        window.update(out.quantizer.indices, out.quantizer.soft_counts)

        if step % cfg.train.usage_window == 0 or step == cfg.train.steps:
            window_stats = window.compute()  # all-reduced across processes
            window.reset()
            if writer is not None:
                writer.add_histogram("usage/code_counts", torch.tensor(window_stats.counts, dtype=torch.float32), step)
        if is_main and (step % cfg.train.log_every == 0 or step == cfg.train.steps):
            record = {"step": step, "time": round(time.time() - t_start, 3), "wall": round(time.time(), 3),
                      "loss": loss.item(),
                      "recon_mse": recon_loss.item(), "quantizer_loss": out.quantizer.loss.item(),
                      "perplexity_batch": float(out.quantizer.perplexity),
                      "lr": optimizer.param_groups[0]["lr"], "codebook_lr": optimizer.param_groups[-1]["lr"]}
            record.update({f"term_{k}": float(v) for k, v in out.quantizer.terms.items()})
            record.update(quantizer.log_stats())
            if window_stats is not None:
                record.update(utilization_window=window_stats.utilization, dead_codes_window=window_stats.dead_codes,
                              perplexity_window=window_stats.perplexity)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            for k, v in record.items():
                if k not in ("step", "time", "wall"):
                    writer.add_scalar(k.replace("term_", "terms/"), v, step)
            if progress is not None:
                progress.set_postfix(loss=f"{record['loss']:.4f}", ppl=f"{record['perplexity_batch']:.0f}",
                                     util=f"{window_stats.utilization:.0%}" if window_stats else "-")
        if is_main and (step % cfg.train.image_every == 0 or step == cfg.train.steps):
            model.eval()
            with torch.no_grad():
                hard = model.reconstruct(preview, "hard")
                soft = model.reconstruct(preview, "soft") if quantizer.has_soft_codes else None
            model.train()
            writer.add_image("reconstructions/original_hard_soft", _image_grid(preview, hard, soft), step)
        if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
            checkpoint(periodic=step % cfg.train.checkpoint_every == 0)
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    train_seconds = time.time() - t_start

    summary = {"run": str(run_dir), "step": step, "train_seconds": round(train_seconds, 1)}
    if cfg.train.eval_images > 0 and step >= cfg.train.steps:
        result = reconstruction_pass(model, test_set, batch_size=256, device=device, max_images=cfg.train.eval_images)
        usage = result["usage"]
        summary.update(split="test", num_images=result["num_images"], hard=result["hard"], soft=result["soft"],
                       codebook={k: v for k, v in usage.to_dict().items() if k != "counts"})
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        writer.close()
        metrics_file.close()
        if not quiet:
            print(format_summary(summary, run_dir))
    return summary


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
    lines.append(f"TensorBoard: .venv/bin/tensorboard --logdir {run_dir / 'tb'} --host 127.0.0.1")
    lines.append(f"full evaluation (SSIM, LPIPS): .venv/bin/ddcl-vq evaluate {run_dir}")
    return "\n".join(lines)
