"""The training skeleton every loop runs in (ddcl_vq.common.skeleton), once on a loop of its own and
then for each real loop through its command: the tokenizer's (``ddcl-vq train``), the prior's
(``ddcl-vq prior train``) and the readout arms' (``ddcl-vq readout-study``).

- a run stopped by SIGTERM or SIGINT mid-run saves a checkpoint at the step it finished, says so in
  one line, exits 128 + the signal, and the same command resumes to the uninterrupted run's weights,
  bit for bit, with each step logged once;
- kill -9 between checkpoints: the resumed run drops the lines the killed one logged past its
  checkpoint and ends with the uninterrupted run's weights and lines;
- the learning-rate schedule, the one definition every loop uses.
"""
import collections
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddcl_vq.common.errors import Stopped
from ddcl_vq.common.skeleton import TrainingRun, lr_schedule, metrics_records

from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the skeleton on a loop of its own

def toy_loop(run_dir: Path, steps: int = 12, signal_at: int = 0, signum: int = signal.SIGTERM,
             stop_after=None) -> torch.Tensor:
    """A linear regression trained by SGD on random batches drawn from the global RNG (so the RNG state
    must resume too), logging every step, checkpoints every 4; -> its final weight."""
    run = TrainingRun(run_dir, steps, checkpoint_every=4, log_every=1, name="toy", device="cpu", quiet=True,
                      stop_after=stop_after, config={"steps": steps})
    with run:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(steps, "cosine", warmup=2))
        run.keep(model=model, optimizer=optimizer, scheduler=scheduler)
        step = run.resume(run.latest())
        batches = iter(lambda: torch.randn(8, 3), None)
        for step, x in run.steps(batches, step):
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.log(step + 1, {"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]})
            if step + 1 == signal_at:
                os.kill(os.getpid(), signum)  # arrives in the middle of the step: it finishes, then the run stops
    return model.weight.detach().clone()


def steps_logged(run_dir: Path):
    return [r["step"] for r in metrics_records(run_dir)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_the_run_resumes_bit_identically(signum, tmp_path):
    straight = toy_loop(tmp_path / "straight")
    before = signal.getsignal(signum)
    with pytest.raises(Stopped) as stop:
        toy_loop(tmp_path / "stopped", signal_at=6, signum=signum)
    assert stop.value.code == 128 + signum
    assert f"after step 6 of 12; checkpoint saved in {tmp_path / 'stopped' / 'checkpoints' / 'last.pt'}" in str(stop.value)
    assert signal.getsignal(signum) is before  # the handlers are put back
    assert torch.load(tmp_path / "stopped" / "checkpoints" / "last.pt", weights_only=True)["step"] == 6
    assert (tmp_path / "stopped" / "metrics.jsonl").is_file() and not (tmp_path / "stopped" / "train.lock").exists()
    resumed = toy_loop(tmp_path / "stopped")
    assert torch.equal(resumed, straight)
    assert steps_logged(tmp_path / "stopped") == list(range(1, 13))
    records = lambda d: [{k: v for k, v in r.items()} for r in metrics_records(d)]  # noqa: E731
    assert records(tmp_path / "stopped") == records(tmp_path / "straight")


def test_lines_past_the_checkpoint_go_and_stop_after_leaves_with_a_checkpoint(tmp_path):
    straight = toy_loop(tmp_path / "straight")
    run = tmp_path / "killed"
    toy_loop(run, stop_after=4)
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == 4
    with open(run / "metrics.jsonl", "a") as f:  # what a session killed (kill -9) after step 6 leaves behind
        f.write(json.dumps({"step": 5, "loss": 0.0}) + "\n" + json.dumps({"step": 6, "loss": 0.0}) + '\n{"step": 7, "lo')
    assert torch.equal(toy_loop(run), straight)
    assert steps_logged(run) == list(range(1, 13))


class SignalWhenSaved:
    """A part of the checkpoint that, once armed, sends this process a SIGTERM while torch.save pickles it: a second
    signal that arrives while the stop's checkpoint is being written."""

    def __init__(self):
        self.armed = False

    def state_dict(self):
        return {"probe": self}

    def load_state_dict(self, state):
        pass

    def __reduce__(self):
        if self.armed:
            os.kill(os.getpid(), signal.SIGTERM)
        return collections.OrderedDict, ()  # what a weights-only load admits


def test_a_second_signal_while_the_checkpoint_is_written_abandons_it_whole(tmp_path):
    """Issue 51, item 2: a second SIGTERM while the first one's checkpoint was written killed the process: no line, no
    checkpoint, a stale lock. Now the checkpoint being written is abandoned whole, the previous one kept, one line."""
    run = TrainingRun(tmp_path / "run", 12, checkpoint_every=4, log_every=1, name="toy", device="cpu", quiet=True)
    probe = SignalWhenSaved()
    with pytest.raises(Stopped) as stop:
        with run:
            model = torch.nn.Linear(3, 1)
            run.keep(model=model, probe=probe)
            for step, x in run.steps(iter(lambda: torch.randn(8, 3), None), run.resume(run.latest())):
                model(x).sum().backward()
                if step + 1 == 6:
                    probe.armed = True
                    os.kill(os.getpid(), signal.SIGTERM)  # the first: the step finishes, its checkpoint is written
    assert stop.value.code == 128 + signal.SIGTERM
    assert ("stopped at once by a second SIGTERM while the checkpoint of step 6 was being written (abandoned: not a "
            "partial file); the checkpoint of step 4 is kept") in str(stop.value)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert torch.load(checkpoints / "last.pt", weights_only=True)["step"] == 4
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.pt", "step_0000004.pt"]  # no partial file
    assert not (tmp_path / "run" / "train.lock").exists()


def test_train_stopped_twice_says_so_in_one_line_and_leaves_no_lock(tmp_path):
    """The same through ``ddcl-vq train``: two SIGTERMs in a row stop at once, one line, exit 143, no stale lock; the
    same command resumes."""
    run = tmp_path / "run"
    argv = TRAIN + [f"run.dir={run}"]
    code = INJECT.format(step=3, signum=int(signal.SIGTERM), argv=argv).replace(
        "os.kill(os.getpid(), 15)", "os.kill(os.getpid(), 15); os.kill(os.getpid(), 15)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = done.stderr.strip().splitlines()
    assert done.returncode == 143 and len(err) == 1, done.stderr[-2000:]
    assert err[0].startswith("ddcl-vq train: stopped at once by a second SIGTERM") and "run the same command" in err[0]
    assert not (run / "train.lock").exists()
    assert command(argv).returncode == 0


def test_lr_schedule():
    f = lr_schedule(100, "cosine", warmup=10, floor=0.1)
    assert [f(0), f(4), f(9)] == [0.1, 0.5, 1.0]
    assert f(10) == 1.0 and f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert lr_schedule(100, "constant")(57) == 1.0
    assert lr_schedule(100, "cosine", floor=0.0)(100) == pytest.approx(0.0)


# --------------------------------------------------------------------------- each loop through its command

#: runs ``ddcl-vq ARGV`` in a process of its own that signals itself (or kill -9s itself) right after the
#: metrics line of step STEP is written: in the middle of that step, as a job scheduler's SIGTERM would
INJECT = """
import os, signal, sys
from ddcl_vq.common import skeleton
from ddcl_vq.cli import main
log = skeleton.TrainingRun.log
def log_then_signal(self, step, record, *args, **kwargs):
    log(self, step, record, *args, **kwargs)
    if step == {step} and not getattr(self, "_sent", False):
        self._sent = True
        os.kill(os.getpid(), {signum})
skeleton.TrainingRun.log = log_then_signal
sys.exit(main({argv!r}))
"""


def command(argv, step=None, signum=None):
    code = INJECT.format(step=step, signum=int(signum), argv=list(argv)) if step else \
        f"import sys; from ddcl_vq.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def weights(path: Path):
    return torch.load(path, weights_only=True)["model"]


def same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def strip(records):
    return [{k: v for k, v in r.items() if k not in ("time", "wall")} for r in records]


def interrupted_then_resumed(argv, run: Path, step: int, signum: int) -> None:
    """The command stopped by ``signum`` after ``step`` (one line, 128 + signum, a checkpoint there), then
    the same command again to the end."""
    done = command(argv, step, signum)
    if signum == signal.SIGKILL:
        assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    else:
        assert done.returncode == 128 + signum, done.stderr[-2000:]
        name = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}[signum]
        lines = [line for line in done.stderr.strip().splitlines() if "stopped by" in line]
        assert len(lines) == 1 and f"stopped by {name} after step {step} of" in lines[0], done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == step
    again = command(argv)
    assert again.returncode == 0, again.stderr[-2000:]


TRAIN = ["train", "--quiet", "--config", "configs/fashion_ddcl.yaml", *TINY, "train.steps=10", "train.log_every=1",
         "train.checkpoint_every=4", "train.eval_images=0", "train.threads=1"]


@pytest.fixture(scope="module")
def straight_train(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    assert command(TRAIN + [f"run.dir={run}"]).returncode == 0
    return run


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_train_stopped_mid_run_resumes_as_the_straight_run(straight_train, signum, tmp_path):
    run = tmp_path / "run"
    interrupted_then_resumed(TRAIN + [f"run.dir={run}"], run, 6, signum)
    same_weights(straight_train / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    assert strip(metrics_records(run)) == strip(metrics_records(straight_train))  # each step once


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    run = folder / "tokenizer"
    assert command(TRAIN + [f"run.dir={run}", "train.steps=2"]).returncode == 0
    for split, n in (("train", 256), ("test", 64)):
        assert command(["tokenize", str(run), "--split", split, "--out", str(folder / f"{split}.npy"),
                        "--max-images", str(n)]).returncode == 0
    return folder


def prior_argv(tokens: Path, prior: Path):
    return ["prior", "train", str(tokens / "tokenizer"), "--tokens", str(tokens / "train.npy"), "--test",
            str(tokens / "test.npy"), "--quiet", f"run.dir={prior}", "model.dim=32", "model.layers=1", "model.heads=2",
            "train.steps=9", "train.batch_size=16", "train.warmup_steps=2", "train.log_every=1",
            "train.checkpoint_every=4", "train.eval_every=3", "train.eval_images=32", "train.device=cpu"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_prior_train_stopped_mid_run_resumes_as_the_straight_run(tokens, signum, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert command(prior_argv(tokens, straight)).returncode == 0
    interrupted_then_resumed(prior_argv(tokens, stopped), stopped, 6, signum)
    same_weights(straight / "checkpoints" / "last.pt", stopped / "checkpoints" / "last.pt")
    assert strip(metrics_records(stopped)) == strip(metrics_records(straight))


READOUT = ["readout-study", "--quick", "--arms", "mean,ddcl", "--steps", "12", "--eval-every", "4", "--log-every", "1",
           "--compressor-steps", "3", "--no-progress", "--threads", "1"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_readout_study_stopped_mid_arm_resumes_as_the_straight_run(signum, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert command(READOUT + ["--out", str(straight)]).returncode == 0
    # stopped in the first arm (mean) at step 6; the same command resumes it, then trains the DDCL arm
    interrupted_then_resumed(READOUT + ["--out", str(stopped)], stopped / "runs" / "mean", 6, signum)
    a = json.loads((straight / "results.json").read_text())
    b = json.loads((stopped / "results.json").read_text())
    for arm in ("mean", "ddcl"):
        for key in ("test_accuracy", "curve", "train_log", "identity_max", "usage"):
            assert a["arms"][arm].get(key) == b["arms"][arm].get(key), (arm, key)
        same_weights(straight / "runs" / arm / "checkpoints" / "last.pt", stopped / "runs" / arm / "checkpoints" / "last.pt")
        assert strip(metrics_records(stopped / "runs" / arm)) == strip(metrics_records(straight / "runs" / arm))
    assert a["compressor"]["stages"] == b["compressor"]["stages"]
