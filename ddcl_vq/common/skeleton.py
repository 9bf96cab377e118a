"""What every training loop does around its step, written once: the tokenizer's, the prior's and the readout arms'
loops keep only what is their own (model, optimizer, one step, evaluation, summary) and run inside a
:class:`TrainingRun`::

    with TrainingRun(run_dir, total_steps, checkpoint_every=..., log_every=..., name=...) as run:  # torchrun, lock
        found = run.latest()                    # the newest checkpoint (the loop checks its config)
        ...build model, optimizer, scheduler...
        run.keep(model=model, optimizer=optimizer, scheduler=scheduler)   # what a checkpoint holds
        step = run.resume(found)                # its step, with RNG state (0 when there is none)
        for step, batch in run.steps(batches, step):   # step = optimizer steps done before this one
            ...one step...; run.log(step + 1, {"loss": ...}) when run.due(run.log_every, step + 1)

``run.steps`` ends at ``total_steps``; after ``stop_after`` steps of this session (with a checkpoint); and on SIGTERM or
SIGINT: the step under way finishes, a checkpoint is saved (every process at the same step) and :class:`Stopped` is
raised. A second signal stops at once (a checkpoint being written is abandoned whole).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ddcl_vq.common.checkpoint import latest_checkpoint, load_into, prune_periodic, save_checkpoint
from ddcl_vq.common.errors import SignalScope, Stopped
from ddcl_vq.common.rundir import RunLock, check_run_dir_setting, first_missing, keep_logged_steps, remove_failed_start


# ----------------------------------------------------------------------------- torchrun
def setup_distributed(device_pref: str = "auto") -> Dict:
    """Initialise torch.distributed from torchrun's environment, if any (NCCL on GPUs, gloo on CPUs).
    -> {"rank", "world", "device"}."""
    from ddcl_vq.common.config import ConfigError
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'train.device': 'cuda' asked, but no CUDA device is available here; use "
                          "train.device=auto or cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    return {"rank": rank, "world": dist.get_world_size() if dist.is_initialized() else 1, "device": device}


def teardown_distributed() -> None:
    """Wait for every process, then destroy the process group, if any (alive at exit, it can abort the process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel, its buffers left alone (a quantizer all-reduces its own statistics)."""
    import inspect
    import warnings
    # a 1-channel layer's gradient has another stride than its bucket's (the same layout): torch warns every process
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    buffers = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True, **buffers)


# ----------------------------------------------------------------------------- schedule and RNG
def lr_schedule(steps: int, schedule: str = "cosine", warmup: int = 0, floor: float = 0.1) -> Callable[[int], float]:
    """The learning-rate factor at each step (for ``LambdaLR``): a linear warm-up over ``warmup`` steps,
    then ``"constant"`` 1, or ``"cosine"`` from 1 down to ``floor`` at ``steps`` (and ``floor`` after). ``"anneal"``
    (FVQ's): from 0.005 up over 10% of ``steps``, 1 for 30% of the rest, then linear to 0.01 (its own warm-up)."""
    def factor(step: int) -> float:
        if schedule == "anneal":
            ramp = int(0.1 * steps)
            if step < ramp:
                return 0.005 + 0.995 * step / max(1, ramp)
            rest = max(0.0, min(1.0, (step - ramp) / max(1, steps - 1 - ramp)) - 0.3) / 0.7
            return 0.01 + 0.99 * (1 - rest)
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        span = max(steps - warmup, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step - warmup, span) / span))
    return factor


def rng_state(device: torch.device) -> Dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------- signals
class _Signals(SignalScope):
    """SIGTERM and SIGINT set a flag while the steps run; a second signal stops at once: :class:`Stopped` with
    ``again(signum)``, what was kept."""

    def __init__(self, world: int, again: Callable[[int], str]):
        self.caught: Optional[int] = None
        self.twice: Optional[int] = None
        self.again = again
        self.group = None
        if world > 1:  # agree on a CPU tensor, also when the training's group is NCCL (no device sync per step)
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def _handler(self, signum, frame) -> None:
        if self.caught is None:
            self.caught = signum
            return
        self.twice = signum
        raise Stopped(self.again(signum), 128 + signum)

    def agreed(self) -> Optional[int]:
        """The signal caught by any process (every process calls this once per step under torchrun)."""
        if self.group is None:
            return self.caught
        flag = torch.tensor([self.caught or 0], dtype=torch.long)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag) or None


# ----------------------------------------------------------------------------- the run
def is_due(every: int, step: int, total_steps: int) -> bool:
    """Whether what is done every ``every`` steps is due after ``step`` of ``total_steps`` (always at the last)."""
    return step % every == 0 or step == total_steps


class TrainingRun:
    """One training in its run directory, from torchrun set-up and the lock to the last checkpoint.

    checkpoint_every: periodic checkpoints (step_XXXXXXX.pt) beside last.pt; name: the progress line's label;
    stop_after: leave after this many steps of this session, with a checkpoint; config, extra: plain values saved in
    every checkpoint; threads: the configured CPU threads (None: a resumed run takes the count it was trained with)."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, checkpoint_every: int, log_every: int, name: str,
                 device: str = "auto", quiet: bool = False, stop_after: Optional[int] = None,
                 config: Optional[Dict] = None, extra: Optional[Dict] = None, env: Optional[Dict] = None,
                 threads: Optional[int] = None):
        self.dir = check_run_dir_setting(str(run_dir))
        self.total_steps, self.checkpoint_every, self.log_every = total_steps, checkpoint_every, log_every
        self.name, self.quiet, self.stop_after, self.threads = name, quiet, stop_after, threads
        self.config, self.extra = config or {}, dict(extra or {})
        self.env = env if env is not None else setup_distributed(device)
        self.rank, self.world, self.device = self.env["rank"], self.env["world"], self.env["device"]
        self.is_main = self.rank == 0
        self.parts: Dict[str, Any] = {}
        self.writer = self.progress = self._metrics = None
        self.postfix: Callable[[Dict], Dict] = lambda record: {}
        self._lock: Optional[RunLock] = None
        self._created: Optional[Path] = None
        self._saved_at: Optional[int] = None  # the step of the last checkpoint this session saved
        self._kept: Optional[int] = None      # the step of the newest complete checkpoint (resumed from or saved)
        self._writing: Optional[int] = None   # the step of the checkpoint being written
        self._signals: Optional[_Signals] = None
        self.step = 0  # steps done: where resume left it, then advanced by steps()

    def __enter__(self) -> "TrainingRun":
        if self.is_main:
            self._created = first_missing(self.dir)
            self._lock = RunLock(self.dir).acquire()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close()  # the steps' files, also when a second signal stopped them at once
        if self._lock is not None:
            self._lock.release()
        if exc_type is not None and not issubclass(exc_type, Stopped) and self._created is not None:
            remove_failed_start(self.dir, self._created)  # a run that never got going leaves no folder behind

    def latest(self) -> Optional[Tuple[Dict, Path]]:
        """The newest readable checkpoint (state, path), or None."""
        return latest_checkpoint(self.dir / "checkpoints", map_location=self.device)

    def keep(self, **parts: Any) -> None:
        """What every checkpoint holds, by name: objects with ``state_dict``/``load_state_dict``."""
        self.parts.update(parts)

    def resume(self, found: Optional[Tuple[Dict, Path]], announce: bool = True) -> int:
        """Load ``found`` (from :meth:`latest`) into the kept parts and restore the RNG; -> its step (0: none)."""
        if found is None:
            return 0
        state, path = found
        for name, part in self.parts.items():
            if name in state:
                load_into(part, state[name], path, name)
        set_rng_state(state["rng"], self.device)
        step = self.step = self._kept = int(state["step"])
        saved = state.get("threads")
        same = ""
        if self.device.type == "cpu" and saved and saved != torch.get_num_threads():
            trained = f"{saved} thread{'s' if saved > 1 else ''}"
            if self.threads is None:  # automatic: the count the run was trained with, whatever the load now
                torch.set_num_threads(int(saved))
                same = f" with the {trained} it was trained with"
            else:
                same = (f" with {torch.get_num_threads()} as set (trained with {trained}: not bit-identical to an "
                        "uninterrupted run)")
        if announce and self.is_main and not self.quiet:
            print(f"resuming {self.dir} from {path.name} at step {step}{same}", file=sys.stderr)
        return step

    def save(self, step: int, periodic: bool = False) -> None:
        """Every process calls this; rank 0 writes last.pt (and step_XXXXXXX.pt when ``periodic``) atomically."""
        from ddcl_vq.distributed import replicas_identical
        model = self.parts.get("model")
        if self.world > 1 and model is not None and not replicas_identical(model):
            raise RuntimeError(f"step {step}: model replicas differ across processes (an update that is not "
                               "synchronised?)")
        states = {name: part.state_dict() for name, part in self.parts.items()}
        self._saved_at = step
        if not self.is_main:
            return
        state = {**states, **self.extra, "step": step, "rng": rng_state(self.device), "config": self.config,
                 "threads": torch.get_num_threads()}
        self._writing = step
        try:
            save_checkpoint(state, self.dir / "checkpoints" / "last.pt")
            self._kept = step
            if periodic:
                save_checkpoint(state, self.dir / "checkpoints" / f"step_{step:07d}.pt")
                prune_periodic(self.dir / "checkpoints")
        except Exception:  # noqa: BLE001 - a second signal, raised inside torch.save, comes out as its RuntimeError
            if self._signals is None or self._signals.twice is None:
                raise
            raise Stopped(self._again(self._signals.twice), 128 + self._signals.twice) from None
        finally:
            self._writing = None

    def due(self, every: int, step: int) -> bool:
        return is_due(every, step, self.total_steps)

    def steps(self, batches: Iterable, start: int) -> Iterator[Tuple[int, Any]]:
        """(steps done before this one, batch) until total_steps, with checkpoints, stop_after and signals."""
        step = first = self.step = start
        batches = iter(batches)
        self._open(start)
        try:
            with _Signals(self.world, self._again) as signals:
                self._signals = signals
                while step < self.total_steps:
                    if self.stop_after is not None and step - first >= self.stop_after:
                        self.save(step)
                        return
                    try:
                        batch = next(batches)
                    except StopIteration:
                        return
                    except Exception:  # noqa: BLE001 - a data worker that the same Ctrl-C ended
                        if signals.caught is None:
                            raise
                        self._stop(signals.caught, step)
                    yield step, batch
                    step = self.step = step + 1
                    if self.progress is not None:
                        self.progress.update(1)
                    if self.due(self.checkpoint_every, step):
                        self.save(step, periodic=step % self.checkpoint_every == 0)
                    caught = signals.agreed()
                    if caught is not None:
                        self._stop(caught, step)
        finally:
            self._close()

    def _again(self, signum: int) -> str:
        """What a second signal says: what it stopped, and which checkpoint is kept."""
        name = signal.Signals(signum).name
        what = (f"while the checkpoint of step {self._writing} was being written (abandoned: not a partial file)"
                if self._writing is not None else f"after step {self.step}")
        kept = (f"the checkpoint of step {self._kept} is kept ({self.dir / 'checkpoints' / 'last.pt'})"
                if self._kept is not None else "no checkpoint was saved")
        return f"stopped at once by a second {name} {what}; {kept}; run the same command again to resume"

    def _stop(self, signum: int, step: int) -> None:
        """Save (unless this step's checkpoint is saved), then leave :meth:`steps` (whose ``finally`` closes files)."""
        if self._saved_at != step:
            self.save(step)
        name = signal.Signals(signum).name
        raise Stopped(f"stopped by {name} after step {step} of {self.total_steps}; checkpoint saved in "
                      f"{self.dir / 'checkpoints' / 'last.pt'}; run the same command again to resume", 128 + signum)

    def _open(self, step: int) -> None:
        if not self.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter
        from ddcl_vq.common.progress import Progress
        self.writer = SummaryWriter(str(self.dir / "tb"), purge_step=step if step else None)
        metrics = self.dir / "metrics.jsonl"
        if step:  # lines past the checkpoint's step are logged again from here
            keep_logged_steps(metrics, step)
        self._metrics = open(metrics, "a" if step else "w")
        if not self.quiet:  # a bar on a terminal, one line per log_every steps in a log file
            self.progress = Progress(self.total_steps, self.name, unit="step", initial=step, every=self.log_every)

    def _close(self) -> None:
        for name in ("progress", "writer", "_metrics"):
            if getattr(self, name) is not None:
                getattr(self, name).close()
                setattr(self, name, None)

    def log(self, step: int, record: Dict, scalar_names: Optional[Dict[str, str]] = None) -> None:
        """One metrics.jsonl line and its TensorBoard scalars (``scalar_names`` renames some); rank 0 only."""
        if not self.is_main or self._metrics is None:
            return
        record = {"step": step, **record}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        for key, value in record.items():
            if key not in ("step", "time", "wall") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar((scalar_names or {}).get(key, key), value, step)
        if self.progress is not None:
            self.progress.set_postfix(**self.postfix(record))


def metrics_records(run_dir: str | Path) -> List[Dict]:
    """RUN_DIR/metrics.jsonl as a list of records (a torn last line skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out
