"""Launched by torchrun from tests/test_distributed.py: k DDP steps per quantizer on real
Fashion-MNIST, then each rank saves its state and its usage counts for the test to compare."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddcl_vq import CodebookUsage
from ddcl_vq.tokenizer.config import build_model, build_optimizer
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import EpochBatches, build_dataset
from ddcl_vq.common.skeleton import teardown_distributed
from conftest import TINY_MODEL

TINY = TINY_MODEL + ["quantizer.num_codes=64", "data.batch_size=32"]


def main(out_dir: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    for qtype, extra in [("ddcl", ["quantizer.codebook_init=kmeans", "quantizer.warmup_steps=2"]), ("hard", ["quantizer.kmeans_init=true"]),
                         ("ema", ["quantizer.dead_code_threshold=0.9", "quantizer.decay=0.8"])]:
        cfg = load_config(None, TINY + [f"quantizer.type={qtype}", "train.codebook_lr_ratio=2"] + extra)
        torch.manual_seed(rank + 1)  # different init on each rank: DDP must make them one model
        model = build_model(cfg, 1)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
        opt = build_optimizer(model, cfg.train, qtype)
        data = build_dataset(cfg.data, "train")
        batches = iter(EpochBatches(len(data), cfg.data.batch_size, 0, rank, world))
        for _ in range(steps):
            x = torch.stack([data[i][0] for i in next(batches)])
            o = ddp(x)
            loss = F.mse_loss(o.reconstruction, x) + o.quantizer.loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        test = build_dataset(cfg.data, "test")
        usage = CodebookUsage(model.quantizer.num_codes)
        with torch.no_grad():
            x = torch.stack([test[i][0] for i in range(rank, 64, world)])  # disjoint shares of 64 images
            usage.update(model(x).quantizer.indices)
        stats = usage.compute()
        torch.save({"state": model.state_dict(), "counts": torch.tensor(stats.counts)},
                   out / f"{qtype}_rank{rank}.pt")
    teardown_distributed()  # a barrier first: a rank leaving while the other still talks can abort it


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
