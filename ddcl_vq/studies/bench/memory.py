"""Peak-memory probes of the bench: in-process (VmHWM reset per probe) or in a fresh process."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import subprocess
import sys
from typing import Optional, Tuple

def _status_kb(field: str) -> Optional[int]:
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    return None


def release_held_buffers() -> None:
    """Free what the DDCL fused path keeps between steps (its q buffer), so that a probed run
    counts that memory as its own instead of finding it in the baseline."""
    from ddcl_vq.fused import release_buffers
    release_buffers()


class RssProbe:
    """Peak extra resident memory of a block of code, in MiB (Linux only).

    start(): free the DDCL fused path's held q buffer, collect garbage, give freed heap back to the OS (malloc_trim),
    reset the high-water mark (write "5" to /proc/self/clear_refs) and read VmRSS as the baseline. stop(): VmHWM −
    baseline.
    """

    def __init__(self):
        self._libc, self.base_kb = None, 0
        with contextlib.suppress(OSError):
            self._libc = ctypes.CDLL("libc.so.6")

    @staticmethod
    def available() -> bool:
        if _status_kb("VmHWM") is None:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        release_held_buffers()
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base_kb = _status_kb("VmRSS") or 0

    def stop(self) -> float:
        return max(0, (_status_kb("VmHWM") or 0) - self.base_kb) / 1024.0


class CudaProbe:
    """Peak extra CUDA memory of a block of code, in MiB: torch's allocator high-water mark
    (``max_memory_allocated``, reset per probe) above what was allocated at ``start``."""

    def __init__(self, device="cuda"):
        import torch
        self.torch, self.device, self.base = torch, torch.device(device), 0

    def start(self) -> None:
        release_held_buffers()
        gc.collect()
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        self.base = self.torch.cuda.memory_allocated(self.device)

    def stop(self) -> float:
        self.torch.cuda.synchronize(self.device)
        return max(0, self.torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20


def available_memory_bytes(device: str = "cpu") -> int:
    """Free memory on ``device``: MemAvailable on the CPU, the free GPU memory on CUDA."""
    if device != "cpu":
        import torch
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 8 << 30


def probe_subprocess(name: str, shape: Tuple[int, int, int]) -> Optional[float]:
    """Peak extra memory of one run of ``name`` in a fresh interpreter (ru_maxrss growth)."""
    n, d, k = shape
    cmd = [sys.executable, "-m", "ddcl_vq.studies.bench", "--_probe", name, str(n), str(d), str(k)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])
    except (subprocess.CalledProcessError, ValueError, KeyError, IndexError):
        return None


def probe_main(name: str, n: int, d: int, k: int) -> int:
    """The child side of :func:`probe_subprocess` (``python -m ddcl_vq bench --_probe ...``)."""
    from ddcl_vq.studies.bench.steps import make_inputs, make_step
    import resource
    small = make_inputs(64, d, min(k, 64))
    make_step(name, small)()                  # load kernels and lazy state on a tiny shape
    inp = make_inputs(n, d, k)
    step = make_step(name, inp)
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cur = _status_kb("VmRSS")
    base = max(base, cur or 0) if cur is not None else base
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": max(0, peak - base) / 1024.0}))
    return 0
