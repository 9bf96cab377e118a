"""What machine a report was measured on (every report takes it from here)."""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Dict, List, Optional


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform reports."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> Optional[List[float]]:
    """The 1/5/15-minute load averages, rounded to 0.01, or None where the OS has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info() -> Dict:
    """cpu, cores, torch threads, load average, torch and Python versions, CUDA, GPU, date (JSON-ready)."""
    import torch
    cuda = torch.cuda.is_available()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "loadavg": load_average(), "torch": torch.__version__, "python": platform.python_version(),
            "cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "date": _dt.datetime.now().isoformat(timespec="seconds")}


def describe_machine(info: Optional[Dict] = None) -> str:
    """One line for a report: cores and CPU model, GPU, torch and its threads, Python, load average."""
    info = machine_info() if info is None else info
    load = ", ".join(f"{x:.1f}" for x in info["loadavg"]) if info["loadavg"] is not None else "n/a"
    return (f"{info['cores']} CPU cores ({info['cpu']}), {info['gpu'] or 'no GPU'}; torch {info['torch']} with "
            f"{info['threads']} intra-op thread(s); Python {info['python']}; load average (1/5/15 min) {load}")
