"""A small process-wide pool of single-threaded CPU workers for blocked computations.

:func:`run_blocks` runs one computation made of independent row blocks (the fused and
chunked DDCL assignment in :mod:`ddcl_vq.fused`): one worker does the set-up, every
worker takes a static round-robin share of the blocks (so float sums are deterministic),
one worker reduces and finishes. Each worker's ops are single-threaded, so a call costs two
barriers instead of one intra-op fork/join per op (dozens per block), which matters most
when the cores are shared with other jobs.

What it costs, and the switch:

* the pool is created on first use, once per process and worker count (the caller's
  ``torch.get_num_threads()``), and recreated in a forked child;
* one call runs on the pool at a time: the blocks of a call wait for each other, so
  concurrent callers (other Python threads) queue behind a lock;
* ``set_parallel_blocks(False)`` (or ``DDCL_VQ_PARALLEL_BLOCKS=0`` in the environment at
  import) turns it off: blocks then run in the calling thread with torch's intra-op
  threads, no pool, no lock. The results are the same up to float summation order.

Nothing here knows about DDCL; only torch and the standard library.
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
    """Run blocked computations on the worker pool (True, the default) or in the calling
    thread (False). Returns the previous setting."""
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
            # torch.set_num_threads in the workers also set the process-wide default that
            # new threads start from; put it back (this thread's own setting is unchanged).
            torch.set_num_threads(restore)
            _POOL, _POOL_KEY = pool, key
        return _POOL


def num_workers(x: Tensor, num_blocks: int) -> int:
    """Workers for a blocked call on ``x``'s device: the caller's intra-op thread count on
    CPU when the pool is enabled and there are at least two blocks, else 1."""
    if x.device.type != "cpu" or num_blocks < 2 or not _ENABLED:
        return 1
    return max(1, min(torch.get_num_threads(), num_blocks))


def run_blocks(x: Tensor, num_blocks: int, setup: Callable[[], Any], make_state: Callable[[Any], Any],
               body: Callable[[Any, Any, int, int], None], finish: Callable[[Any, List[Any]], Any]):
    """Run one blocked computation; returns ``finish(c, states)``.

    ``setup() -> c`` (with ``c.bounds``, the (i0, i1) row range of every block) runs once;
    ``make_state(c)`` gives each worker its private buffers and accumulators;
    ``body(c, state, i0, i1)`` runs once per block (a worker takes blocks rank, rank + W, ...);
    ``finish(c, states)`` reduces the workers' states in rank order. With one worker (GPU
    tensors, one block, the pool switched off) everything runs in the calling thread.
    Worker threads run under ``torch.no_grad()``; an exception in any of them is re-raised here.
    """
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
