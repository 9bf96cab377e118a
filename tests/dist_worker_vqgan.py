"""Launched by torchrun from tests/test_vqgan.py: the VQGAN loss's discriminator on two processes (gloo,
CPU). Each rank takes discriminator steps on its own images and saves the discriminator; then the
whole recipe trains a few steps with the real loop (DDP generator, synchronised discriminator)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.tokenizer.losses import GANStep
from ddcl_vq.common.skeleton import teardown_distributed


def main(out_dir: str, tiny: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    overrides = tiny.split(" ")
    cfg = load_config(None, overrides + ["loss.disc_start=0"])
    gan = GANStep(cfg.loss, in_channels=3, last_layer=torch.nn.Parameter(torch.zeros(1)), lr=1e-3, world=world,
                  seed=cfg.run.seed)
    g = torch.Generator().manual_seed(100 + rank)  # different images on each rank
    for step in range(3):
        x, fake = torch.rand(4, 3, 32, 32, generator=g), torch.rand(4, 3, 32, 32, generator=g)
        gan.discriminator_step(x, fake, step)
    torch.save(gan.state_dict()["discriminator"], out / f"disc_rank{rank}.pt")
    dist.barrier()
    from ddcl_vq.tokenizer.train import train
    train(load_config(None, overrides + ["train.steps=2", f"run.dir={out / 'run'}"]), quiet=True)
    teardown_distributed()  # a barrier first: a rank leaving while the other still talks can abort it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
