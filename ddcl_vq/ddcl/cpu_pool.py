"""A small process-wide pool of single-threaded CPU workers for blocked computations (only torch).

:func:`run_blocks` runs one computation made of independent row blocks: one worker sets up, every worker takes a
static round-robin share of the blocks (deterministic sums), one worker reduces. ``set_parallel_blocks(False)`` (or
``DDCL_VQ_PARALLEL_BLOCKS=0`` at import) runs the blocks in the calling thread instead.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, List, Optional

import torch
from torch import Tensor

__all__ = ["set_parallel_blocks", "parallel_blocks_enabled", "num_workers", "run_blocks"]

_ENABLED = os.environ.get("DDCL_VQ_PARALLEL_BLOCKS", "1").strip().lower() not in ("0", "false", "no", "off")

_POOL = None
_POOL_KEY = None
_POOL_LOCK = threading.Lock()     # creating the pool
_CALL_LOCK = threading.Lock()     # one call at a time on the pool (its tasks wait for each other)


def set_parallel_blocks(enabled: bool) -> bool:
    """Run blocked computations on the worker pool (True, the default) or not; -> the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def parallel_blocks_enabled() -> bool:
    return _ENABLED


def _reset_after_fork() -> None:
    """A forked child has none of the parent's worker threads, and its locks may be held."""
    global _POOL, _POOL_KEY, _POOL_LOCK, _CALL_LOCK
    _POOL, _POOL_KEY = None, None
    _POOL_LOCK, _CALL_LOCK = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _init_worker(barrier: threading.Barrier) -> None:
    torch.get_num_threads()          # lazy per-thread init first, so the next call sticks
    torch.set_num_threads(1)         # this thread's OpenMP/MKL setting (thread-local)
    barrier.wait()


def _pool(size: int):
    """A process-local pool of ``size`` single-threaded workers (recreated after fork)."""
    global _POOL, _POOL_KEY
    key = (os.getpid(), size)
    with _POOL_LOCK:
        if _POOL is None or _POOL_KEY != key:
            from concurrent.futures import ThreadPoolExecutor
            restore = torch.get_num_threads()
            barrier = threading.Barrier(size + 1)
            pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="ddcl-blocks",
                                      initializer=_init_worker, initargs=(barrier,))
            for _ in range(size):
                pool.submit(lambda: None)
            barrier.wait()
            # the workers' set_num_threads also set the process-wide default: put it back
            torch.set_num_threads(restore)
            _POOL, _POOL_KEY = pool, key
        return _POOL


def num_workers(x: Tensor, num_blocks: int) -> int:
    """Workers for a blocked call on ``x``: the caller's intra-op threads on the CPU (pool on, 2+ blocks), else 1."""
    if x.device.type != "cpu" or num_blocks < 2 or not _ENABLED:
        return 1
    return max(1, min(torch.get_num_threads(), num_blocks))


def run_blocks(x: Tensor, num_blocks: int, setup: Callable[[], Any], make_state: Callable[[Any], Any],
               body: Callable[[Any, Any, int, int], None], finish: Callable[[Any, List[Any]], Any]):
    """Run one blocked computation; returns ``finish(c, states)``. ``setup() -> c`` (with ``c.bounds``,
    each block's (i0, i1) rows) runs once; ``make_state(c)`` gives each worker its buffers;
    ``body(c, state, i0, i1)`` runs once per block (worker r takes blocks r, r + W, ...);
    ``finish(c, states)`` reduces in rank order. Workers run under ``torch.no_grad()``."""
    workers = num_workers(x, num_blocks)
    if workers <= 1:
        c = setup()
        st = make_state(c)
        for i0, i1 in c.bounds:
            body(c, st, i0, i1)
        return finish(c, [st])
    shared: dict = {}
    barrier = threading.Barrier(workers)

    def task(rank: int) -> Optional[Any]:
        try:
            with torch.no_grad():
                if rank == 0:
                    shared["c"] = setup()
                barrier.wait()
                c = shared["c"]
                st = make_state(c)
                for i0, i1 in c.bounds[rank::workers]:
                    body(c, st, i0, i1)
                shared[rank] = st
                barrier.wait()
                if rank == 0:
                    return finish(c, [shared[r] for r in range(workers)])
                return None
        except BaseException:
            barrier.abort()          # release the others instead of leaving them waiting
            raise

    pool = _pool(workers)
    with _CALL_LOCK:
        futures = [pool.submit(task, r) for r in range(workers)]
        errors = []
        for f in futures:
            try:
                f.result()
            except threading.BrokenBarrierError as err:
                errors.append(err)
            except BaseException as err:  # the real failure goes first
                errors.insert(0, err)
        if errors:
            raise errors[0]
    return futures[0].result()
