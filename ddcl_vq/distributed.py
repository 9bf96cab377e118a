"""Small torch.distributed helpers; every function is a no-op in a single process."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_reduce_sum_(t: Tensor) -> Tensor:
    """Sum ``t`` in place over all processes (no-op when not distributed)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_(t: Tensor, src: int = 0) -> Tensor:
    """Overwrite ``t`` in place with rank ``src``'s copy (no-op when not distributed)."""
    if is_distributed():
        dist.broadcast(t, src=src)
    return t


def gather_rows(x: Tensor, rows_per_rank: int, generator: torch.Generator | None = None) -> Tensor:
    """``rows_per_rank`` rows of (N, D) ``x`` sampled on every process (with replacement when N is
    smaller), concatenated in rank order: the same (world·rows, D) matrix on every process."""
    n = x.shape[0]
    if n >= rows_per_rank:
        pick = torch.randperm(n, generator=generator, device="cpu")[:rows_per_rank]
    else:
        pick = torch.randint(n, (rows_per_rank,), generator=generator, device="cpu")
    sample = x[pick.to(x.device)].contiguous()
    if not is_distributed():
        return sample
    parts = [torch.empty_like(sample) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, sample)
    return torch.cat(parts, 0)


@torch.no_grad()
def replicas_identical(module: torch.nn.Module) -> bool:
    """True when every floating parameter and buffer of ``module`` is bit-identical on all processes."""
    if not is_distributed():
        return True
    tensors = [t.detach().reshape(-1).double() for t in list(module.parameters()) + list(module.buffers())
               if t.is_floating_point()]
    if not tensors:
        return True
    flat = torch.cat(tensors)
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))
