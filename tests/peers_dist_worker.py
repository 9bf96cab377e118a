"""Launched by torchrun from tests/test_peers.py: a few DDP steps per newer peer (FSQ, SimVQ with its
data-matched start, LFQ) on real Fashion-MNIST, each rank starting from a different seed; each rank
saves its state for the test to compare."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddcl_vq.tokenizer.config import build_model, build_optimizer
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import EpochBatches, build_dataset
from ddcl_vq.common.skeleton import teardown_distributed
from conftest import TINY_MODEL

TINY = TINY_MODEL + ["data.batch_size=32"]
ARMS = {"fsq": ["quantizer.type=fsq", "quantizer.num_codes=256"],
        "simvq": ["quantizer.type=simvq", "quantizer.num_codes=64", "quantizer.codebook_bias=true",
                  "quantizer.data_init=true", "quantizer.rotation_trick=false"],
        "lfq": ["quantizer.type=lfq", "quantizer.num_codes=64"]}


def main(out_dir: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for qtype, extra in ARMS.items():
        cfg = load_config(None, TINY + extra)
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
        torch.save({"state": model.state_dict()}, Path(out_dir) / f"{qtype}_rank{rank}.pt")
    teardown_distributed()  # a barrier first: a rank leaving while the other still talks can abort it


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
