"""Two processes (gloo, CPU, real Fashion-MNIST) launched with the real torchrun."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddcl_vq import CodebookUsage
from ddcl_vq.tokenizer.config import build_model
from ddcl_vq.common.checkpoint import load_checkpoint
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import build_dataset
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    torchrun(str(ROOT / "tests" / "dist_worker.py"), str(out), "3")
    return out


@pytest.mark.parametrize("qtype", ["ddcl", "hard", "ema"])
def test_all_parameters_and_codebooks_identical_on_both_ranks(worker_results, qtype):
    a = torch.load(worker_results / f"{qtype}_rank0.pt", weights_only=True)["state"]
    b = torch.load(worker_results / f"{qtype}_rank1.pt", weights_only=True)["state"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{qtype}: {key} differs across ranks"
    if qtype == "ema":
        assert int(a["quantizer.restarts"]) > 0  # dead-code restarts happened, identically
    assert bool(a.get("quantizer.initialized", torch.tensor(True)))


@pytest.mark.parametrize("qtype", ["ddcl", "hard", "ema"])
def test_usage_counts_summed_across_ranks_equal_single_process(worker_results, qtype):
    saved = torch.load(worker_results / f"{qtype}_rank0.pt", weights_only=True)
    other = torch.load(worker_results / f"{qtype}_rank1.pt", weights_only=True)
    assert torch.equal(saved["counts"], other["counts"])  # every rank reports the global counts
    cfg = load_config(None, TINY_MODEL + ["quantizer.num_codes=64", f"quantizer.type={qtype}"])
    model = build_model(cfg, 1)
    model.load_state_dict(saved["state"])
    model.eval()
    test = build_dataset(cfg.data, "test")
    usage = CodebookUsage(64)
    with torch.no_grad():
        usage.update(model(torch.stack([test[i][0] for i in range(64)])).quantizer.indices)
    assert torch.equal(torch.tensor(usage.compute().counts), saved["counts"])
    assert int(saved["counts"].sum()) == 64 * 8 * 8


def test_torchrun_training_writes_once_and_resumes(tmp_path):
    run = tmp_path / "ddp"
    common = ["-m", "ddcl_vq", "train", "--config", "configs/fashion_ddcl.yaml", "--quiet", f"run.dir={run}",
              *TINY_MODEL, "quantizer.num_codes=32", "data.batch_size=32", "train.log_every=2", "train.checkpoint_every=4",
              "train.eval_images=128", "train.codebook_lr_ratio=2"]
    out = torchrun(*common, "train.steps=4")
    assert "Grad strides" not in out.stderr and "Warning" not in out.stderr, out.stderr[-2000:]  # nothing per process
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.pt", "step_0000004.pt"]
    torchrun(*common, "train.steps=8")
    assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 8
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6, 8]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_images"] == 128 and sum([summary["codebook"]["active_codes"]]) > 0


def test_distributed_evaluate_equals_single_process(tmp_path):
    from ddcl_vq.tokenizer.evaluate import main as evaluate_main
    from ddcl_vq.tokenizer.train import train as train_run

    cfg = load_config("configs/fashion_ddcl.yaml", [
        f"run.dir={tmp_path / 'run'}", *TINY_MODEL, "quantizer.num_codes=32", "data.batch_size=32", "train.steps=6",
        "train.eval_images=0"])
    train_run(cfg, quiet=True)
    run = tmp_path / "run"
    assert evaluate_main([str(run), "--max-images", "300", "--quiet"]) == 0
    single = json.loads((run / "eval.json").read_text())
    (run / "eval.json").unlink()
    torchrun("-m", "ddcl_vq.cli", "evaluate", str(run), "--max-images", "300", "--quiet")
    multi = json.loads((run / "eval.json").read_text())
    assert multi["num_images"] == single["num_images"] == 300
    assert multi["usage_counts"] == single["usage_counts"]
    assert sum(multi["usage_counts"]) == 300 * 8 * 8
    for codes in ("hard", "soft"):
        for metric, value in single["recon"][codes].items():
            if isinstance(value, float):
                assert multi["recon"][codes][metric] == pytest.approx(value, rel=1e-5, abs=1e-7), (codes, metric)
    for key in ("utilization", "perplexity", "soft_perplexity", "entropy_bits"):
        assert multi["codebook"][key] == pytest.approx(single["codebook"][key], rel=1e-6)


def test_sigterm_to_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """A job scheduler's SIGTERM goes to torchrun, which passes it to both processes: they finish the step
    under way, agree on one step, save it, and the same command resumes to the uninterrupted run's weights."""
    import os
    import signal
    import time

    def cmd(run):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "-m", "ddcl_vq", "train", "--config", "configs/fashion_ddcl.yaml",
                "--quiet", f"run.dir={run}", *TINY_MODEL, "quantizer.num_codes=32", "data.batch_size=32",
                "train.steps=40", "train.log_every=1", "train.checkpoint_every=100", "train.eval_images=0"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    subprocess.run(cmd(straight), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    proc = subprocess.Popen(cmd(stopped), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = stopped / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "stopped by SIGTERM after step" in err and "Traceback" not in err.split("stopped by SIGTERM")[0], err[-3000:]
    saved = load_checkpoint(stopped / "checkpoints" / "last.pt")["step"]
    assert 3 <= saved < 40
    assert f"after step {saved} of 40" in err
    done = subprocess.run(cmd(stopped), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a = load_checkpoint(straight / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(stopped / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 41))
