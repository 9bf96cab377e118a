"""The VQGAN recipe's losses, in one place: pixel (l1 | l2), LPIPS perceptual, PatchGAN adversarial.

taming-transformers' ``VQLPIPSWithDiscriminator`` (Esser et al. 2021), as the ``loss:`` section of a training config
names it::

    L_rec = pixel_weight * pixel(x, x_hat) + perceptual_weight * LPIPS(x, x_hat)
    L_G   = hinge | vanilla: -mean D(x_hat);  non_saturating: mean softplus(-D(x_hat))
    loss  = L_rec + quantizer loss + lambda * L_G            (L_G only once step >= disc_start)
    lambda = clamp(||grad_{G_L} L_rec|| / (||grad_{G_L} L_G|| + 1e-4), 0, 1e4) * disc_weight
             (adaptive_weight; G_L = the decoder's last layer's weight), else disc_weight
    L_D   = hinge: 0.5 (mean relu(1 - D(x)) + mean relu(1 + D(x_hat)))
            vanilla | non_saturating: 0.5 (mean softplus(-D(x)) + mean softplus(D(x_hat)))

Images are in [0, 1]; LPIPS and the discriminator see them mapped to [-1, 1]. The LPIPS trunk is frozen and always
carries real ImageNet weights (:mod:`ddcl_vq.common.lpips_weights`); without them a perceptual loss is a ConfigError,
never a random trunk. The discriminator is taming's ``NLayerDiscriminator`` (PatchGAN: 4x4 convs, BatchNorm, LeakyReLU
0.2) with its own Adam (beta = (0.5, 0.9)) and the generator's learning-rate schedule; before ``disc_start`` it is
neither run nor updated (its loss is 0 and the generator gets no adversarial gradient).

The training loop drives it through :class:`GANStep`; with the defaults (pixel l2, weight 1, no perceptual, no
discriminator) there is none and the loop runs exactly as before.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddcl_vq.common.config import ConfigError

__all__ = ["NLayerDiscriminator", "hinge_d_loss", "vanilla_d_loss", "discriminator_loss", "generator_adv_loss",
           "pixel_loss", "adaptive_weight", "decoder_last_layer", "GANStep", "is_plain_mse", "PIXEL_LOSSES",
           "DISC_LOSSES", "PERCEPTUAL_NETS"]

PIXEL_LOSSES = ("l1", "l2")
DISC_LOSSES = ("hinge", "vanilla", "non_saturating")
PERCEPTUAL_NETS = ("vgg", "alex")


# --------------------------------------------------------------------------- discriminator
class NLayerDiscriminator(nn.Module):
    """PatchGAN discriminator as in pix2pix and taming-transformers: a conv (stride 2) + LeakyReLU,
    ``n_layers - 1`` convs (stride 2) + BatchNorm + LeakyReLU doubling the channels (capped at 8x),
    one stride-1 conv + BatchNorm + LeakyReLU, and a stride-1 conv to one logit per patch; 4x4
    kernels, padding 1. Weights N(0, 0.02), BatchNorm scales N(1, 0.02) (taming's weights_init)."""

    def __init__(self, in_channels: int = 3, channels: int = 64, n_layers: int = 3):
        super().__init__()
        if n_layers < 1 or channels < 1:
            raise ValueError(f"expected n_layers >= 1 and channels >= 1, got {n_layers} and {channels}")
        kw, pad = 4, 1
        layers = [nn.Conv2d(in_channels, channels, kw, 2, pad), nn.LeakyReLU(0.2, True)]
        mult = 1
        for n in range(1, n_layers):
            prev, mult = mult, min(2 ** n, 8)
            layers += [nn.Conv2d(channels * prev, channels * mult, kw, 2, pad, bias=False),
                       nn.BatchNorm2d(channels * mult), nn.LeakyReLU(0.2, True)]
        prev, mult = mult, min(2 ** n_layers, 8)
        layers += [nn.Conv2d(channels * prev, channels * mult, kw, 1, pad, bias=False),
                   nn.BatchNorm2d(channels * mult), nn.LeakyReLU(0.2, True),
                   nn.Conv2d(channels * mult, 1, kw, 1, pad)]
        self.main = nn.Sequential(*layers)
        self.n_layers = n_layers
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.02)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.normal_(m.weight, 1.0, 0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.main(x)


# --------------------------------------------------------------------------- loss functions
def hinge_d_loss(logits_real: Tensor, logits_fake: Tensor) -> Tensor:
    return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())


def vanilla_d_loss(logits_real: Tensor, logits_fake: Tensor) -> Tensor:
    return 0.5 * (F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean())


def discriminator_loss(kind: str, logits_real: Tensor, logits_fake: Tensor) -> Tensor:
    """hinge: taming's hinge_d_loss; vanilla and non_saturating: the logistic (softplus) loss."""
    if kind == "hinge":
        return hinge_d_loss(logits_real, logits_fake)
    if kind in ("vanilla", "non_saturating"):
        return vanilla_d_loss(logits_real, logits_fake)
    raise ValueError(f"expected a discriminator loss in {', '.join(DISC_LOSSES)}, got {kind!r}")


def generator_adv_loss(kind: str, logits_fake: Tensor) -> Tensor:
    """hinge, vanilla: -mean D(x_hat) (taming); non_saturating: mean softplus(-D(x_hat)) = -mean log sigmoid."""
    if kind in ("hinge", "vanilla"):
        return -logits_fake.mean()
    if kind == "non_saturating":
        return F.softplus(-logits_fake).mean()
    raise ValueError(f"expected a discriminator loss in {', '.join(DISC_LOSSES)}, got {kind!r}")


def pixel_loss(kind: str, recon: Tensor, x: Tensor) -> Tensor:
    """l2: F.mse_loss (mean over every value), l1: F.l1_loss."""
    if kind == "l2":
        return F.mse_loss(recon, x)
    if kind == "l1":
        return F.l1_loss(recon, x)
    raise ValueError(f"expected a pixel loss in {', '.join(PIXEL_LOSSES)}, got {kind!r}")


ADAPTIVE_EPS, ADAPTIVE_MAX = 1e-4, 1e4


def adaptive_weight(rec_loss: Tensor, g_loss: Tensor, last_layer: Tensor, disc_weight: float) -> Tensor:
    """taming's calculate_adaptive_weight: ||grad L_rec|| / (||grad L_G|| + 1e-4) at ``last_layer``,
    clamped to [0, 1e4], detached, times ``disc_weight``."""
    rec_grad = torch.autograd.grad(rec_loss, last_layer, retain_graph=True)[0]
    g_grad = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    weight = torch.linalg.vector_norm(rec_grad) / (torch.linalg.vector_norm(g_grad) + ADAPTIVE_EPS)
    return torch.clamp(weight, 0.0, ADAPTIVE_MAX).detach() * disc_weight


def decoder_last_layer(model: nn.Module) -> nn.Parameter:
    """The weight of the decoder's last layer (``decoder.last_layer`` when the decoder names it, else
    its last Conv2d / ConvTranspose2d): where the adaptive weight compares gradients."""
    decoder = getattr(model, "decoder", model)
    named = getattr(decoder, "last_layer", None)
    if isinstance(named, nn.Parameter):
        return named
    convs = [m for m in decoder.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    if not convs:
        raise ValueError(f"expected a decoder with a convolution as its last layer, got {type(decoder).__name__}")
    return convs[-1].weight


def is_plain_mse(loss_cfg) -> bool:
    """True for the defaults (pixel l2 at weight 1, no perceptual loss, no discriminator): the loop's
    own MSE, bit for bit as before the loss section existed."""
    return (loss_cfg.pixel == "l2" and loss_cfg.pixel_weight == 1.0 and loss_cfg.perceptual_weight == 0
            and loss_cfg.disc_weight == 0)


# --------------------------------------------------------------------------- the training step's losses
class GANStep:
    """Everything the VQGAN recipe adds to one training step; the loop calls

    - ``loss, recon_mse = gan.generator_loss(x, recon, quantizer_loss, step)`` instead of the MSE;
    - ``gan.discriminator_step(x, recon, step)`` after the generator's optimizer step;
    - ``state_dict`` / ``load_state_dict`` through the checkpoint (discriminator and its optimizer; its
      lr follows the generator's schedule, set from the step), ``log_stats()`` for metrics.jsonl / TensorBoard.

    ``step`` is the number of optimizer steps done before this one (0 on the first).
    """

    def __init__(self, loss_cfg, *, in_channels: int, last_layer: nn.Parameter, lr: float,
                 lr_lambda: Optional[Callable[[int], float]] = None, device: torch.device | str = "cpu",
                 world: int = 1, seed: int = 0, autocast: Optional[Callable] = None):
        self.cfg, self.last_layer, self.device, self.autocast = loss_cfg, last_layer, torch.device(device), autocast
        self.perceptual = self.perceptual_note = None
        if loss_cfg.perceptual_weight > 0:
            from ddcl_vq.common.lpips_weights import build_lpips
            self.perceptual, self.perceptual_note = build_lpips(self.device, loss_cfg.perceptual_net)
            if self.perceptual is None:
                raise ConfigError(f"config key 'loss.perceptual_weight': a perceptual loss needs LPIPS with real "
                                  f"ImageNet {loss_cfg.perceptual_net} weights; {self.perceptual_note}")
        self.disc, self.optimizer, self.world = None, None, world
        if loss_cfg.disc_weight > 0:
            # built on its own seeded RNG: the global RNG stream (data, quantizer) is the same with or without it
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 7919)
                self.disc = NLayerDiscriminator(in_channels, loss_cfg.disc_channels, loss_cfg.disc_layers)
            # the same seed on every process: one discriminator; its gradients are averaged across processes
            # and its BatchNorm statistics taken from rank 0 at each step (what DDP would do; DDP itself refuses
            # the two forwards, real and fake, before one backward)
            self.disc = self.disc.to(self.device)
            d_lr = loss_cfg.disc_lr if loss_cfg.disc_lr is not None else lr
            self.optimizer = torch.optim.Adam(self.disc.parameters(), lr=d_lr, betas=(0.5, 0.9))
            self.base_lr, self.lr_lambda = d_lr, lr_lambda or (lambda s: 1.0)
        self._stats: Dict[str, Any] = {}

    @classmethod
    def from_config(cls, cfg, model: nn.Module, in_channels: int, device, world: int = 1,
                    autocast: Optional[Callable] = None) -> Optional["GANStep"]:
        """None for the defaults (:func:`is_plain_mse`); else the step for ``cfg.loss``."""
        if is_plain_mse(cfg.loss):
            return None
        if cfg.train.amp == "fp16" and cfg.loss.disc_weight > 0:
            raise ConfigError("config key 'train.amp': the adversarial loss is not supported with fp16 (one "
                              "GradScaler for two optimizers); use train.amp=bf16 or none")
        from ddcl_vq.tokenizer.builders import lr_lambda
        return cls(cfg.loss, in_channels=in_channels, last_layer=decoder_last_layer(model), lr=cfg.train.lr,
                   lr_lambda=lr_lambda(cfg.train), device=device, world=world, seed=cfg.run.seed, autocast=autocast)

    # -- helpers -------------------------------------------------------------------------------
    def disc_active(self, step: int) -> bool:
        return self.disc is not None and step >= self.cfg.disc_start

    def _d(self, images: Tensor, module: nn.Module) -> Tensor:
        with (self.autocast() if self.autocast is not None else nullcontext()):
            return module(images * 2 - 1).float()

    def perceptual_loss(self, recon: Tensor, x: Tensor) -> Tensor:
        """Mean LPIPS over the batch (grayscale repeated to 3 channels), inputs mapped to [-1, 1]."""
        if recon.shape[1] == 1:
            recon, x = recon.repeat(1, 3, 1, 1), x.repeat(1, 3, 1, 1)
        return self.perceptual(recon * 2 - 1, x * 2 - 1).mean()

    # -- the loop's calls ----------------------------------------------------------------------
    def generator_loss(self, x: Tensor, recon: Tensor, quantizer_loss: Tensor, step: int) -> Tuple[Tensor, Tensor]:
        """-> (total generator loss, pixel MSE for the logs). ``quantizer_loss`` is already weighted."""
        c = self.cfg
        recon = recon.float()
        rec = c.pixel_weight * pixel_loss(c.pixel, recon, x)
        stats: Dict[str, Any] = {"loss_pixel": rec.detach()}
        if self.perceptual is not None:
            p = self.perceptual_loss(recon, x)
            rec = rec + c.perceptual_weight * p
            stats["loss_perceptual"] = p.detach()
        loss = rec + quantizer_loss
        stats["loss_rec"] = rec.detach()
        if self.disc_active(step):
            for p_ in self.disc.parameters():  # the generator's step: no gradient into D
                p_.requires_grad_(False)
            try:
                logits_fake = self._d(recon, self.disc)
            finally:
                for p_ in self.disc.parameters():
                    p_.requires_grad_(True)
            g_loss = generator_adv_loss(c.disc_loss, logits_fake)
            if c.adaptive_weight:
                weight = adaptive_weight(rec, g_loss, self.last_layer, c.disc_weight)
            else:
                weight = torch.tensor(float(c.disc_weight), device=g_loss.device)
            loss = loss + weight * g_loss
            stats.update(loss_g_adv=g_loss.detach(), disc_lambda=weight.detach())
        elif self.disc is not None:
            stats.update(loss_g_adv=0.0, disc_lambda=0.0)
        with torch.no_grad():
            mse = F.mse_loss(recon.detach(), x)
        self._stats = stats
        return loss, mse

    def discriminator_step(self, x: Tensor, recon: Tensor, step: int) -> Optional[Tensor]:
        """One Adam step of the discriminator on real ``x`` and the detached ``recon`` (from step
        ``disc_start`` on; before it nothing runs and the loss is 0); -> its loss (None without D)."""
        if self.disc is None:
            return None
        if not self.disc_active(step):
            self._stats.update(loss_d=0.0, logits_real=0.0, logits_fake=0.0)
            return torch.zeros((), device=x.device)
        logits_real = self._d(x.detach(), self.disc)
        logits_fake = self._d(recon.detach().float(), self.disc)
        d_loss = discriminator_loss(self.cfg.disc_loss, logits_real, logits_fake)
        for group in self.optimizer.param_groups:  # the generator's lr schedule, at this step
            group["lr"] = self.base_lr * self.lr_lambda(step)
        self.optimizer.zero_grad(set_to_none=True)
        d_loss.backward()
        if self.world > 1:
            self._synchronise()
        self.optimizer.step()
        self._stats.update(loss_d=d_loss.detach(), logits_real=logits_real.detach().mean(),
                           logits_fake=logits_fake.detach().mean())
        return d_loss.detach()

    def _synchronise(self) -> None:
        """Average the discriminator's gradients over the processes; its buffers (BatchNorm) from rank 0."""
        import torch.distributed as dist
        grads = [p.grad for p in self.disc.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        for b in self.disc.buffers():
            dist.broadcast(b, 0)

    def log_stats(self) -> Dict[str, float]:
        """The last step's losses, lambda and mean logits, as floats (for metrics.jsonl)."""
        out = {k: float(v) for k, v in self._stats.items()}
        if self.optimizer is not None:
            out["disc_lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self.disc is None:
            return {}
        return {"discriminator": self.disc.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.disc is None:
            if state:
                raise ValueError("expected no discriminator state (loss.disc_weight is 0), got one")
            return
        missing = [k for k in ("discriminator", "optimizer") if k not in state]
        if missing:
            raise KeyError(f"expected the discriminator's {', '.join(missing)} in the checkpoint")
        self.disc.load_state_dict(state["discriminator"])
        self.optimizer.load_state_dict(state["optimizer"])

