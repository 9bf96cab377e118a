"""How many torch intra-op (CPU) threads a command uses: one rule for every heavy command
(``train.threads`` in a training config, ``--threads`` on evaluate, compare, tokenize and study).

PyTorch starts one intra-op thread per core. When other processes keep those cores busy (several
trainings, a test suite, other users on a shared machine) every parallel operation waits for its
slowest thread and a step slows down many times over (docs/performance.md has the measurement).
The automatic choice (``threads: null`` / no ``--threads``) is therefore:

- ``OMP_NUM_THREADS`` when it is set (the user's or the launcher's choice; torchrun sets it to 1
  for each of several processes);
- else half the cores this process may use, at most :data:`AUTO_MAX`, at least 1, divided among
  the processes a distributed launcher starts on this machine (``LOCAL_WORLD_SIZE``): a second
  process, or other work, still finds cores free.

It depends on the machine only, never on its momentary load: the thread count can change the last
bits of a result (the order of a parallel sum), so the same command on the same machine gives the
same numbers, and a run resumed on the same machine continues with the threads it started with.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from .settings import option

#: the most threads the automatic choice takes (small convolutional models gain little beyond a few)
AUTO_MAX = 4
AUTO_TEXT = "auto: OMP_NUM_THREADS if set, else half the cores, at most 4"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def auto_threads(env: Optional[Mapping[str, str]] = None, cores: Optional[int] = None) -> int:
    """The automatic thread count (see the module docstring); ``cores``: :func:`usable_cores`."""
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    cores = usable_cores() if cores is None else cores
    local = env.get("LOCAL_WORLD_SIZE", "1").strip()
    processes = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, min(AUTO_MAX, cores // 2) // processes)


def set_threads(threads: Optional[int] = None) -> int:
    """Set torch's intra-op threads to ``threads`` (None: :func:`auto_threads`); returns the number set."""
    import torch

    n = threads if threads else auto_threads()
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def threads_option(help: str = "torch intra-op (CPU) threads") -> Optional[int]:
    """The ``--threads`` option of a command (None = automatic, :func:`auto_threads`)."""
    return option(None, help, default_text=AUTO_TEXT, metavar="N")
