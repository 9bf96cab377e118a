"""How many torch intra-op (CPU) threads a command uses (``train.threads``, ``--threads``).

The automatic choice: ``OMP_NUM_THREADS`` when set; one thread per process under torchrun (``LOCAL_WORLD_SIZE``);
else the idle physical cores this process may run on (measured from /proc/stat), from 1 to :data:`AUTO_MAX`.
"""
from __future__ import annotations

import os
import time
from typing import List, Mapping, Optional, Tuple

from ddcl_vq.common.config import option

#: the most threads the automatic choice takes (the small convolutional models gain little beyond a few)
AUTO_MAX = 4
AUTO_TEXT = "auto: OMP_NUM_THREADS if set, one per process under torchrun, else the idle physical cores, at most 4"


def usable_cpus() -> List[int]:
    """The logical CPUs this process may run on (its CPU affinity, else all of the machine's)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The physical cores among :func:`usable_cpus` (hyper-threads of one core count once)."""
    cpus = usable_cpus()
    cores = set()
    for cpu in cpus:
        try:
            siblings = open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add(siblings)
    return max(1, len(cores))


def _cpu_times(cpus: List[int]) -> Optional[Tuple[float, float]]:
    """(busy, total) jiffies summed over ``cpus`` from /proc/stat; None where it cannot be read."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    wanted, busy, total = {f"cpu{c}" for c in cpus}, 0.0, 0.0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [float(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            total += sum(values)
            busy += sum(values) - values[3] - values[4]
    return (busy, total) if total else None


def busy_cpus(cpus: Optional[List[int]] = None, seconds: float = 0.25) -> Optional[float]:
    """How many of ``cpus`` other work keeps busy, measured over ``seconds``; None where /proc/stat is unreadable."""
    cpus = usable_cpus() if cpus is None else cpus
    first = _cpu_times(cpus)
    if first is None:
        return None
    time.sleep(seconds)
    second = _cpu_times(cpus)
    if second is None or second[1] <= first[1]:
        return None
    return len(cpus) * (second[0] - first[0]) / (second[1] - first[1])


def auto_threads(env: Optional[Mapping[str, str]] = None, cores: Optional[int] = None,
                 busy: Optional[float] = -1.0) -> Tuple[int, str]:
    """The automatic thread count and why. ``cores``: :func:`usable_cores`; ``busy``: :func:`busy_cpus` (-1: measure
    now; None: unknown)."""
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    local = env.get("LOCAL_WORLD_SIZE", "1").strip()
    if local.isdigit() and int(local) > 1:
        return 1, f"one per process, {local} processes on this machine"
    cores = usable_cores() if cores is None else cores
    logical = len(usable_cpus())
    busy = busy_cpus() if busy == -1.0 else busy
    if busy is None:
        return max(1, min(AUTO_MAX, cores // 2)), f"half the {cores} cores (their load cannot be read here)"
    others = min(cores, round(busy * cores / max(logical, 1)))  # busy logical CPUs, in physical cores
    n = max(1, min(AUTO_MAX, cores - others))
    if others == 0:
        return n, f"{cores} idle core{'s' if cores > 1 else ''}" + (f", at most {AUTO_MAX}" if cores > AUTO_MAX else "")
    return n, f"{others} of {cores} cores busy with other work"


#: why the last :func:`set_threads` chose its count, for the line a training starts with
chosen = ""


def set_threads(threads: Optional[int] = None) -> int:
    """Set torch's intra-op threads to ``threads`` (None: :func:`auto_threads`); returns the number set."""
    global chosen
    import torch
    n, chosen = (threads, "set") if threads else auto_threads()
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def threads_option(help: str = "torch intra-op (CPU) threads") -> Optional[int]:
    """The ``--threads`` option of a command (None = automatic, :func:`auto_threads`)."""
    return option(None, help, default_text=AUTO_TEXT, metavar="N")
