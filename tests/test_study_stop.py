"""A study under signals and concurrency (issue 51, items 1 and 4).

- SIGTERM (or Ctrl-C to the process group) stopped the arm in training with a checkpoint but logged it FAILED, trained
  the next arm to the end, wrote a report without the stopped arm and exited 1; with --jobs 2 the parent exited 143
  silently and its worker trainings went on as orphans. Now: the arms in training save a checkpoint and stop, no other
  arm starts, one line, exit 128 + the signal.
- Two studies into one --out: the second trained both arms, the first hit an arm's train.lock and wrote a report without
  an arm that trained. Now the second is refused at once, naming the holder; the lock goes with its holder.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import TINY_MODEL
from ddcl_vq.common.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200_000  # far more than a test waits for: the arms are stopped, never finished
ARGS = TINY_MODEL + ["quantizer.num_codes=16", "data.batch_size=8", f"train.steps={STEPS}", "train.log_every=5",
                     "train.usage_window=5", "train.checkpoint_every=1000000", "train.image_every=1000000",
                     "train.eval_images=0", "train.threads=1"]


def _study(tmp_path: Path, arms) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": {"data": {"name": "fashion_mnist"}},
                                    "arms": [{"name": a, "overrides": {"quantizer.type": a}} for a in arms]}))
    return path


def _start(config: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "ddcl_vq", "study", "--config", str(config), "--out", str(out),
                             *extra, *ARGS], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_training(proc: subprocess.Popen, out: Path, arms, timeout: float = 240) -> None:
    """Until every one of ``arms`` has logged training steps."""
    logs = [out / "runs" / arm / "metrics.jsonl" for arm in arms]
    start = time.time()
    while not all(log.is_file() and log.stat().st_size > 0 for log in logs):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - start < timeout, "the arms did not start training"
        time.sleep(0.5)


def _processes_naming(out: Path):
    """Processes whose command line names ``out`` (the study's workers name their arm's config there)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(out) in cmd:
            found.append((pid, cmd))
    return found


def _check_stopped(proc, out: Path, signum: int, trained, never):
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signum, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"ddcl-vq study: stopped by {signal.Signals(signum).name}"), lines
    assert not any("FAILED" in line or "Traceback" in line for line in lines), lines
    for arm in trained:  # stopped with a checkpoint, far from the end
        assert 0 < load_checkpoint(out / "runs" / arm / "checkpoints" / "last.pt")["step"] < STEPS
    for arm in never:  # no other arm started
        assert not (out / "runs" / arm / "checkpoints").exists()
    assert not (out / "report.md").exists()
    time.sleep(1)
    assert not _processes_naming(out)  # no worker left behind


def test_sigterm_stops_a_study_training_in_this_process(tmp_path):
    out = tmp_path / "out"
    proc = _start(_study(tmp_path, ["ddcl", "hard"]), out, "--jobs", "1")
    _wait_training(proc, out, ["ddcl"])
    proc.send_signal(signal.SIGTERM)
    _check_stopped(proc, out, signal.SIGTERM, trained=["ddcl"], never=["hard"])


def test_sigterm_stops_a_study_and_its_workers(tmp_path):
    out = tmp_path / "out"
    proc = _start(_study(tmp_path, ["ddcl", "hard", "ema"]), out, "--jobs", "2")
    _wait_training(proc, out, ["ddcl", "hard"])
    proc.send_signal(signal.SIGTERM)
    _check_stopped(proc, out, signal.SIGTERM, trained=["ddcl", "hard"], never=["ema"])


def test_ctrl_c_to_the_process_group_stops_a_study_and_its_workers(tmp_path):
    out = tmp_path / "out"
    proc = _start(_study(tmp_path, ["ddcl", "hard", "ema"]), out, "--jobs", "2")
    _wait_training(proc, out, ["ddcl", "hard"])
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the study's whole process group
    _check_stopped(proc, out, signal.SIGINT, trained=["ddcl", "hard"], never=["ema"])


def test_a_second_study_into_the_same_out_is_refused_while_the_first_runs(tmp_path):
    config, out = _study(tmp_path, ["ddcl"]), tmp_path / "out"
    first = _start(config, out, "--jobs", "1")
    try:
        _wait_training(first, out, ["ddcl"])
        start = time.time()
        second = _start(config, out, "--jobs", "1")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and time.time() - start < 60, err
        assert err.strip().splitlines() == [
            f"ddcl-vq study: error: the output folder {str(out)!r} is in use by another study (pid {first.pid} on "
            f"{os.uname().nodename}, since {err.split('since ', 1)[1].split(')', 1)[0]}); wait for it to end or stop "
            "it, or give this one another --out"], err
    finally:
        first.kill()  # however the holder ends, the lock goes with it
        first.communicate(timeout=60)
    again = _start(config, out, "--report-only")  # takes the lock: trains nothing, finds no finished arm
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2 and err.strip().splitlines()[-1] == \
        "ddcl-vq study: error: study s: no arm finished (0 failed, 1 unfinished)", err


def test_a_study_with_two_jobs_trains_every_arm_in_workers_and_reports_them(tmp_path):
    from ddcl_vq.studies.cli import main as study_main
    out = tmp_path / "out"
    config = _study(tmp_path, ["ddcl", "hard", "ema"])
    assert study_main(["--config", str(config), "--quick", "--jobs", "2", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert all(f"| {arm} |" in report for arm in ("ddcl", "hard", "ema")) and "Not in the table" not in report
    for arm in ("ddcl", "hard", "ema"):
        assert load_checkpoint(out / "runs" / arm / "checkpoints" / "last.pt")["step"] == 4
    assert not (out / ".study.lock").exists() and not _processes_naming(out)
