"""What a run's metrics.jsonl says about its training: the records, wall-clock time, milliseconds per step."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from ddcl_vq.common.skeleton import metrics_records  # every record of metrics.jsonl (a line cut by a kill skipped)


def read_metrics(run_dir: Path) -> List[Dict]:
    # a resumed run appends again from the checkpoint's step: keep the last record per step
    by_step = {r["step"]: r for r in metrics_records(run_dir)}
    return [by_step[s] for s in sorted(by_step)]


def train_seconds(run_dir: Path) -> Optional[float]:
    """Sum over training sessions of the last logged 'time' (it restarts at 0 each session)."""
    total, last = 0.0, None
    for record in metrics_records(run_dir):
        try:
            t = float(record["time"])
        except (KeyError, TypeError, ValueError):
            continue
        if last is not None and t < last:
            total += last
        last = t
    return total + (last or 0.0) if last is not None else None


def ms_per_step(run_dir: Path) -> Optional[float]:
    """Milliseconds per training step: 'time' differences over 'step' differences between consecutive records of
    one session (see COLUMN_DEFINITIONS); else the first record's time / step."""
    points = []
    for record in metrics_records(run_dir):
        try:
            points.append((float(record["time"]), int(record["step"])))
        except (KeyError, TypeError, ValueError):
            continue
    seconds = steps = 0.0
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t1 >= t0 and s1 > s0:
            seconds += t1 - t0
            steps += s1 - s0
    if steps > 0:
        return 1000.0 * seconds / steps
    return 1000.0 * points[0][0] / points[0][1] if points and points[0][1] > 0 else None
