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

Images are in [0, 1]; LPIPS and the discriminator see them mapped to [-1, 1]. The discriminator has its own Adam
(beta = (0.5, 0.9)) and the generator's learning-rate schedule. The training loop drives it through :class:`GANStep`.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddcl_vq.common.config import ConfigError


class NLayerDiscriminator(nn.Module):
    """taming-transformers' PatchGAN discriminator (4x4 convs, BatchNorm, LeakyReLU 0.2, taming's weights_init):
    (B, C, H, W) images -> (B, 1, h, w) logits."""

    def __init__(self, in_channels: int = 3, channels: int = 64, n_layers: int = 3):
        super().__init__()
        if n_layers < 1 or channels < 1:
            raise ValueError(f"expected n_layers >= 1 and channels >= 1, got {n_layers} and {channels}")
        layers, mult = [nn.Conv2d(in_channels, channels, 4, 2, 1), nn.LeakyReLU(0.2, True)], 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2 ** n, 8)
            layers += [nn.Conv2d(channels * prev, channels * mult, 4, 2 if n < n_layers else 1, 1, bias=False),
                       nn.BatchNorm2d(channels * mult), nn.LeakyReLU(0.2, True)]
        self.main = nn.Sequential(*layers, nn.Conv2d(channels * mult, 1, 4, 1, 1))
        self.n_layers = n_layers
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.02)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.normal_(m.weight, 1.0, 0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.main(x)


def _choice(table: Dict[str, Callable], kind: str, what: str) -> Callable:
    if kind not in table:
        raise ValueError(f"expected a {what} in {', '.join(table)}, got {kind!r}")
    return table[kind]


_LOGISTIC = lambda real, fake: 0.5 * (F.softplus(-real).mean() + F.softplus(fake).mean())  # noqa: E731
DISC_LOSSES = {"hinge": lambda real, fake: 0.5 * (F.relu(1.0 - real).mean() + F.relu(1.0 + fake).mean()),
               "vanilla": _LOGISTIC, "non_saturating": _LOGISTIC}
GEN_LOSSES = {"hinge": lambda fake: -fake.mean(), "vanilla": lambda fake: -fake.mean(),
              "non_saturating": lambda fake: F.softplus(-fake).mean()}  # = -mean log sigmoid D(x_hat)
PIXEL_LOSSES = {"l2": F.mse_loss, "l1": F.l1_loss}


def discriminator_loss(kind: str, logits_real: Tensor, logits_fake: Tensor) -> Tensor:
    """hinge: taming's hinge_d_loss; vanilla and non_saturating: the logistic (softplus) loss."""
    return _choice(DISC_LOSSES, kind, "discriminator loss")(logits_real, logits_fake)


def generator_adv_loss(kind: str, logits_fake: Tensor) -> Tensor:
    """hinge, vanilla: -mean D(x_hat) (taming); non_saturating: mean softplus(-D(x_hat)) = -mean log sigmoid."""
    return _choice(GEN_LOSSES, kind, "discriminator loss")(logits_fake)


def adaptive_weight(rec_loss: Tensor, g_loss: Tensor, last_layer: Tensor, disc_weight: float) -> Tensor:
    """taming's calculate_adaptive_weight: ||grad L_rec|| / (||grad L_G|| + 1e-4) at ``last_layer``,
    clamped to [0, 1e4], detached, times ``disc_weight``."""
    rec_grad = torch.autograd.grad(rec_loss, last_layer, retain_graph=True)[0]
    g_grad = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    weight = torch.linalg.vector_norm(rec_grad) / (torch.linalg.vector_norm(g_grad) + 1e-4)
    return torch.clamp(weight, 0.0, 1e4).detach() * disc_weight


def decoder_last_layer(model: nn.Module) -> nn.Parameter:
    """The weight of the decoder's last layer (``decoder.last_layer``, else its last convolution)."""
    decoder = getattr(model, "decoder", model)
    if isinstance(getattr(decoder, "last_layer", None), nn.Parameter):
        return decoder.last_layer
    convs = [m for m in decoder.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    if not convs:
        raise ValueError(f"expected a decoder with a convolution as its last layer, got {type(decoder).__name__}")
    return convs[-1].weight


def is_plain_mse(loss_cfg) -> bool:
    """True for the defaults (pixel l2 at weight 1, no perceptual loss, no discriminator): the loop's own MSE."""
    return (loss_cfg.pixel == "l2" and loss_cfg.pixel_weight == 1.0 and loss_cfg.perceptual_weight == 0
            and loss_cfg.disc_weight == 0)


class GANStep:
    """Everything the VQGAN recipe adds to one training step; the loop calls

    - ``loss, recon_mse = gan.generator_loss(x, recon, quantizer_loss, step)`` instead of the MSE;
    - ``gan.discriminator_step(x, recon, step)`` after the generator's optimizer step;
    - ``state_dict`` / ``load_state_dict`` through the checkpoint (discriminator and its optimizer; its
      lr follows the generator's schedule, set from the step), ``log_stats()`` for metrics.jsonl / TensorBoard.

    ``step`` is the number of optimizer steps done before this one (0 on the first); images are (B, C, H, W).
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
            # its own seeded RNG (the global stream is the same without it), the same on every process: gradients
            # are averaged and BatchNorm statistics taken from rank 0 (DDP refuses two forwards before one backward)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((seed + 7919) % 2 ** 64)
                self.disc = NLayerDiscriminator(in_channels, loss_cfg.disc_channels, loss_cfg.disc_layers)
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
        from ddcl_vq.tokenizer.config import lr_lambda
        return cls(cfg.loss, in_channels=in_channels, last_layer=decoder_last_layer(model), lr=cfg.train.lr,
                   lr_lambda=lr_lambda(cfg.train), device=device, world=world, seed=cfg.run.seed, autocast=autocast)

    def disc_active(self, step: int) -> bool:
        return self.disc is not None and step >= self.cfg.disc_start

    def _d(self, images: Tensor) -> Tensor:
        with (self.autocast() if self.autocast is not None else nullcontext()):
            return self.disc(images * 2 - 1).float()

    def perceptual_loss(self, recon: Tensor, x: Tensor) -> Tensor:
        """Mean LPIPS over the batch (grayscale repeated to 3 channels), inputs mapped to [-1, 1]."""
        if recon.shape[1] == 1:
            recon, x = recon.repeat(1, 3, 1, 1), x.repeat(1, 3, 1, 1)
        return self.perceptual(recon * 2 - 1, x * 2 - 1).mean()

    def generator_loss(self, x: Tensor, recon: Tensor, quantizer_loss: Tensor, step: int) -> Tuple[Tensor, Tensor]:
        """-> (total generator loss, pixel MSE for the logs). ``quantizer_loss`` is already weighted."""
        c, recon = self.cfg, recon.float()
        rec = c.pixel_weight * _choice(PIXEL_LOSSES, c.pixel, "pixel loss")(recon, x)
        stats: Dict[str, Any] = {"loss_pixel": rec.detach()}
        if self.perceptual is not None:
            p = self.perceptual_loss(recon, x)
            rec = rec + c.perceptual_weight * p
            stats["loss_perceptual"] = p.detach()
        loss = rec + quantizer_loss
        stats["loss_rec"] = rec.detach()
        if self.disc_active(step):
            self.disc.requires_grad_(False)  # the generator's step: no gradient into D
            try:
                g_loss = generator_adv_loss(c.disc_loss, self._d(recon))
            finally:
                self.disc.requires_grad_(True)
            weight = (adaptive_weight(rec, g_loss, self.last_layer, c.disc_weight) if c.adaptive_weight
                      else torch.tensor(float(c.disc_weight), device=g_loss.device))
            loss = loss + weight * g_loss
            stats.update(loss_g_adv=g_loss.detach(), disc_lambda=weight.detach())
        elif self.disc is not None:
            stats.update(loss_g_adv=0.0, disc_lambda=0.0)
        self._stats = stats
        with torch.no_grad():
            return loss, F.mse_loss(recon.detach(), x)

    def discriminator_step(self, x: Tensor, recon: Tensor, step: int) -> Optional[Tensor]:
        """One Adam step of the discriminator from ``disc_start`` on (else loss 0); -> its loss (None without D)."""
        if self.disc is None:
            return None
        if not self.disc_active(step):
            self._stats.update(loss_d=0.0, logits_real=0.0, logits_fake=0.0)
            return torch.zeros((), device=x.device)
        logits_real, logits_fake = self._d(x.detach()), self._d(recon.detach().float())
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
        for p in self.disc.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= self.world
        for b in self.disc.buffers():
            dist.broadcast(b, 0)

    def log_stats(self) -> Dict[str, float]:
        """The last step's losses, lambda and mean logits, as floats (for metrics.jsonl)."""
        out = {k: float(v) for k, v in self._stats.items()}
        if self.optimizer is not None:
            out["disc_lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def state_dict(self) -> Dict[str, Any]:
        if self.disc is None:
            return {}
        return {"discriminator": self.disc.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.disc is None:
            if state:
                raise ValueError("expected no discriminator state (loss.disc_weight is 0), got one")
            return
        self.disc.load_state_dict(state["discriminator"])
        self.optimizer.load_state_dict(state["optimizer"])
