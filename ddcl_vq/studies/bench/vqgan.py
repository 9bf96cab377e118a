"""One VQGAN-recipe training step with DDCL vs HardVQ (issue 23's cost goal: DDCL <= 1.05x HardVQ).

The models, optimizers, learning-rate schedules and losses are built from configs/vqgan_photos64.yaml through the
training package as ``ddcl-vq train`` builds them (the taming/diffusers encoder and decoder, L1 + LPIPS + hinge PatchGAN
with the adaptive weight), once with the config's DDCL quantizer and once as configs/study_vqgan.yaml's ``hard`` arm
(HardVQ, beta 0.25, codebook lr ratio 1). Each timed call is the loop's own :func:`ddcl_vq.tokenizer.train.training_step`
(generator forward, loss, backward, AdamW step, lr schedule, then the discriminator's Adam step, then the quantizer's
per-step state) from step ``loss.disc_start`` on, so the discriminator is on; DDCL is past its warm-up. The batch is
real training crops (the config's data, the first ``batch`` of a seeded permutation).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import List

import torch

from ddcl_vq.studies.bench.steps import CONFIGS_DIR, assignment_path, paired_times, ratios_vs_hardvq, skip_warmup, synchronized

VQGAN_CONFIG = "vqgan_photos64.yaml"
#: label -> overrides of configs/vqgan_photos64.yaml; "hardvq" is configs/study_vqgan.yaml's "hard" arm
VQGAN_ARMS = (("ddcl", ("quantizer.type=ddcl",)),
              ("hardvq", ("quantizer.type=hard", "quantizer.beta=0.25", "train.codebook_lr_ratio=1.0")))


def vqgan_setups(configs: Path = CONFIGS_DIR, device: str = "cpu"):
    """-> ((label -> (cfg, model, optimizer, scheduler, gan, autocast, scaler), the config's training set), None), built
    as the training loop builds them; or (None, the reason) when the recipe cannot be built here (the training package
    or the config missing, or no LPIPS weights). An invalid config is an error (a ConfigError naming it)."""
    try:
        from ddcl_vq.tokenizer.builders import build_model, build_optimizer, lr_lambda
        from ddcl_vq.tokenizer.config import load_config
        from ddcl_vq.common.data import build_dataset, image_channels
        from ddcl_vq.tokenizer.losses import GANStep
        from ddcl_vq.tokenizer.train import mixed_precision
        from ddcl_vq.common.config import ConfigError
    except ImportError as err:
        return None, f"the training package cannot be imported ({err})"
    path = configs / VQGAN_CONFIG
    if not path.is_file():
        return None, f"{VQGAN_CONFIG} not found in {configs}"
    dev = torch.device(device)
    setups = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, overrides in VQGAN_ARMS:
            cfg = load_config(path, overrides)
            channels = image_channels(cfg.data)
            torch.manual_seed(cfg.run.seed)                     # as the loop: seed, then build
            model = build_model(cfg, channels).to(dev)
            optimizer = build_optimizer(model, cfg.train, cfg.quantizer.type)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
            try:
                gan = GANStep.from_config(cfg, model, channels, dev, 1)
            except ConfigError as err:                          # e.g. no LPIPS weights here
                return None, str(err)
            autocast, scaler = mixed_precision(cfg.train.amp, dev)
            if gan is not None:
                gan.autocast = autocast
            setups[label] = (cfg, model, optimizer, scheduler, gan, autocast, scaler)
    cfg = setups["ddcl"][0]
    return (setups, build_dataset(cfg.data, "train", cfg.run.seed)), None


def vqgan_rows(repeats: int = 5, warmup: int = 2, batch: int = 16, device: str = "cpu",
               configs: Path = CONFIGS_DIR) -> List[dict]:
    """Rows ``vqgan-step-ddcl`` and ``vqgan-step-hardvq``: the wall-clock median of one generator + discriminator
    training step, its ratios to HardVQ's step in the same rounds (of the medians, and the median of the per-round
    ratios) and the same from process CPU time, for a batch of ``batch`` training crops (input_shape). When the recipe
    cannot be built here the rows are skipped, with the reason."""
    built, reason = vqgan_setups(configs, device)
    if built is None:
        return [dict(impl=f"vqgan-step-{label}", N=None, D=None, K=None, ms=None, peak_mb=None,
                     skipped=f"VQGAN-recipe step: {reason}") for label, _ in VQGAN_ARMS]
    setups, train_set = built
    from ddcl_vq.tokenizer.train import training_step
    perm = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0))[:batch]
    x = torch.stack([train_set[int(i)][0] for i in perm]).to(device)
    skip_warmup(setups["ddcl"][1].quantizer)   # time the steady state, past the quantization warm-up
    n_vectors = {}

    def make(label: str, cfg, model, optimizer, scheduler, gan, autocast, scaler):
        model.train()
        state = {"step": cfg.loss.disc_start}       # the discriminator is on from here

        def step():
            _, _, out = training_step(model, x, state["step"], optimizer, scheduler, cfg.train, autocast=autocast,
                                      scaler=scaler, gan=gan)
            n_vectors[label] = out.quantizer.indices.numel()
            state["step"] += 1
        return synchronized(step, torch.device(device))

    times, cpu, faults = paired_times({label: make(label, *setups[label]) for label, _ in VQGAN_ARMS}, repeats, warmup)
    rows = []
    for label, overrides in VQGAN_ARMS:
        cfg, model, _, _, gan = setups[label][:5]
        rows.append(dict(impl=f"vqgan-step-{label}", N=n_vectors[label], D=cfg.model.latent_dim,
                         K=cfg.quantizer.num_codes, peak_mb=None, batch=batch, input_shape=list(x.shape),
                         runs=repeats, path=assignment_path(model.quantizer, n_vectors[label]),
                         source=f"configs/{VQGAN_CONFIG} " + " ".join(overrides),
                         disc_on=bool(gan is not None and gan.disc_active(cfg.loss.disc_start)),
                         perceptual_net=cfg.loss.perceptual_net if cfg.loss.perceptual_weight > 0 else None,
                         **ratios_vs_hardvq(label, times, cpu, faults)))
    return rows
