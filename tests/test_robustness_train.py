"""Issue 24, the training side: each defect reproduced on real parts (real Fashion-MNIST, real
files, real processes), and the fix checked.

1. a copied or moved run trains its own folder; 2. a resumed run equals the uninterrupted run
bit for bit, across a codebook revival, and metrics.jsonl holds each step once; 3. 16-bit images
keep their scale (--check-data names those that cannot be converted faithfully); 4. an empty
run.dir is refused; 6. config files are bounded (size, nesting, aliases); 7. a full disk while
saving a checkpoint is one line and the previous checkpoint survives; 10. a configuration the
machine cannot hold is refused up front with the figure; and the rough edges.
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ddcl_vq.common.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ddcl_vq.tokenizer.train import main as train_main
from ddcl_vq.tokenizer.config import Config, ConfigError, load_config
from ddcl_vq.common.data import DataUnavailable, ImageFiles, build_dataset, fashion_mnist_arrays
from ddcl_vq.tokenizer.train import train
from ddcl_vq.tokenizer.memory import NotEnoughMemory, check_fits, estimate
from ddcl_vq.common.rundir import RunDirError
from ddcl_vq.common.config import MAX_VALUES
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY_MODEL + ["quantizer.num_codes=32", "data.batch_size=16", "train.eval_images=16", "train.log_every=1",
                     "train.image_every=1000", "train.usage_window=5"]


def one_error_line(capsys, prog="train"):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith(f"ddcl-vq {prog}: error: ")]
    assert len(errors) == 1 and len(err) == 1, err
    return errors[0]


def snapshot(run: Path):
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def records(run: Path):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> None:
    sa, sb = load_checkpoint(a), load_checkpoint(b)
    assert sa["step"] == sb["step"]
    assert sa["model"].keys() == sb["model"].keys()
    for key, value in sa["model"].items():
        assert torch.equal(value, sb["model"][key]), key  # bit for bit


# --------------------------------------------------------------------------- 1. copied / moved runs

def test_copied_and_moved_runs_train_their_own_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    base = ["--quiet", *TINY, "train.checkpoint_every=2"]
    p1 = tmp_path / "p1"
    assert train_main(["--config", "configs/fashion_ddcl.yaml", *base, "train.steps=2", f"run.dir={p1}"]) == 0
    before = snapshot(p1)
    copy = tmp_path / "p1copy"
    subprocess.run(["cp", "-a", str(p1), str(copy)], check=True)
    capsys.readouterr()
    assert train_main(["--config", str(copy / "config.yaml"), "--quiet", "train.steps=4"]) == 0
    err = capsys.readouterr().err
    assert f"says run.dir '{p1}'" in err and f"training '{copy}'" in err  # the note says which folder
    assert snapshot(p1) == before  # the original is untouched
    assert load_checkpoint(copy / "checkpoints" / "last.pt")["step"] == 4
    assert [r["step"] for r in records(copy)] == [1, 2, 3, 4]
    assert load_config(copy / "config.yaml").run.dir == str(copy)  # the copy now names itself

    moved = tmp_path / "p2moved"
    subprocess.run(["mv", str(p1), str(moved)], check=True)
    assert train_main(["--config", str(moved / "config.yaml"), "--quiet", "train.steps=4"]) == 0
    assert not p1.exists()  # no new run started in the old place
    assert load_checkpoint(moved / "checkpoints" / "last.pt")["step"] == 4
    assert [r["step"] for r in records(moved)] == [1, 2, 3, 4]
    # the config's folder agrees with its run.dir: nothing to say; an explicit run.dir= still wins
    capsys.readouterr()
    other = tmp_path / "other"
    assert train_main(["--config", str(moved / "config.yaml"), "--quiet", "train.steps=2", f"run.dir={other}"]) == 0
    assert "says run.dir" not in capsys.readouterr().err
    assert load_checkpoint(other / "checkpoints" / "last.pt")["step"] == 2


# --------------------------------------------------------------------------- 2. resume = straight run

#: revival fires within the first steps (a code below half its share of the batch is re-seeded)
REVIVING = [*TINY, "quantizer.revive_threshold=0.5", "quantizer.warmup_steps=0", "train.steps=16", "train.threads=2",
            "train.checkpoint_every=4"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", REVIVING + [f"run.dir={run}"]), quiet=True)
    return run


def test_resume_across_a_revival_is_bit_identical(straight_run, tmp_path):
    revived = [r["revived"] for r in records(straight_run)]
    first = next(i + 1 for i, n in enumerate(revived) if n > 0)  # the step of the first revival
    assert 2 <= first <= 8 and revived[-1] > revived[first - 1]  # revivals before and after the stops
    for stop in (first - 1, first + 2):  # killed before the first revival, and after one
        run = tmp_path / f"stop{stop}"
        cfg = load_config(ROOT / "configs/fashion_ddcl.yaml", REVIVING + [f"run.dir={run}"])
        train(cfg, quiet=True, stop_after=stop)
        assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == stop
        train(cfg, quiet=True)
        same_weights(straight_run / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
        strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time", "wall")} for r in rs]  # noqa: E731
        assert strip(records(run)) == strip(records(straight_run)), stop


KILLER = """
import os, signal, sys
from ddcl_vq.tokenizer import train as loop
from ddcl_vq.tokenizer.train import main
after_step = loop.RunLog.after_step
def kill_after(self, step, *args, **kwargs):
    after_step(self, step, *args, **kwargs)
    if step == {target}:  # its metrics line is written; its checkpoint (if one is due) is not
        os.kill(os.getpid(), signal.SIGKILL)
loop.RunLog.after_step = kill_after
sys.exit(main({argv!r}))
"""


def test_kill_9_between_checkpoints_resumes_as_the_straight_run_and_logs_each_step_once(straight_run, tmp_path):
    """A real kill -9 (SIGKILL, sent by the training process to itself at a chosen step) after a
    revival and between two checkpoints: the killed session logged steps past its last checkpoint;
    the resumed run logs them again, once, with the straight run's values and ends with its weights."""
    run = tmp_path / "killed"
    first = next(i + 1 for i, r in enumerate(records(straight_run)) if r["revived"] > 0)
    target = (first // 4 + 1) * 4 + 2  # two steps past the first checkpoint after the first revival
    argv = ["--quiet", "--config", "configs/fashion_ddcl.yaml", *REVIVING, f"run.dir={run}"]
    proc = subprocess.run([sys.executable, "-c", KILLER.format(target=target, argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    saved = load_checkpoint(run / "checkpoints" / "last.pt")["step"]
    assert first < saved == target - 2
    assert [r["step"] for r in records(run)] == list(range(1, target + 1))  # logged past the checkpoint
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", REVIVING + [f"run.dir={run}"]), quiet=True)
    same_weights(straight_run / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time", "wall")} for r in rs]  # noqa: E731
    assert strip(records(run)) == strip(records(straight_run))  # each step once, the straight run's values


def test_a_resumed_run_keeps_the_thread_count_it_was_trained_with_whatever_the_load(straight_run, tmp_path,
                                                                                   monkeypatch, capsys):
    """Automatic threads (no train.threads): a run started where the choice was 2 threads and resumed where it
    would be 1 (here through OMP_NUM_THREADS, what a loaded machine does through the idle-core count) trains on
    with 2, says so, and ends bit for bit as the uninterrupted 2-thread run; a count set on resume wins, and
    the resume says that it is not the count the run was trained with."""
    auto = ["--config", "configs/fashion_ddcl.yaml", *(a for a in REVIVING if not a.startswith("train.threads="))]
    before = torch.get_num_threads()
    try:
        run = tmp_path / "auto"
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert train_main([*auto, f"run.dir={run}", "--quiet", "--stop-after", "7"]) == 0
        assert load_checkpoint(run / "checkpoints" / "last.pt")["threads"] == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        capsys.readouterr()
        assert train_main([*auto, f"run.dir={run}"]) == 0
        assert "with the 2 threads it was trained with" in capsys.readouterr().err
        same_weights(straight_run / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
        told = tmp_path / "told"
        assert train_main([*auto, f"run.dir={told}", "--quiet", "--stop-after", "7"]) == 0  # 1 thread
        capsys.readouterr()
        assert train_main([*auto, f"run.dir={told}", "train.threads=2"]) == 0
        assert "with 2 as set (trained with 1 thread: not bit-identical" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- 3. 16-bit images

def gradient_folder(root: Path, n=(16, 4)) -> Path:
    """Class folders of 16-bit grey PNGs: a horizontal gradient 0..65535, mean 0.5."""
    from PIL import Image
    ramp = np.tile(np.linspace(0, 65535, 24).round().astype(np.uint16), (24, 1))
    for split, count in zip(("train", "test"), n):
        (root / split / "ramps").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.fromarray(ramp).save(root / split / "ramps" / f"{i}.png")
    return root


def test_16_bit_images_keep_their_scale(tmp_path, capsys):
    from PIL import Image
    root = gradient_folder(tmp_path / "img")
    assert Image.open(root / "train" / "ramps" / "0.png").mode == "I;16"
    cfg = load_config(ROOT / "configs/fashion_ddcl.yaml", ["data.name=image_folder", f"data.root={root}",
                                                           "data.image_size=16"])
    x = torch.stack([build_dataset(cfg.data, "train")[i][0] for i in range(4)])
    assert x.shape == (4, 3, 16, 16)
    assert abs(float(x.mean()) - 0.5) < 0.01 and float((x > 0.99).float().mean()) < 0.1  # not white
    assert float(x.min()) < 0.05 and float(x.max()) > 0.95
    # 8-bit images load as before: exactly what torchvision's own ImageFolder pipeline gives
    from torchvision import datasets, transforms
    eight = tmp_path / "eight"
    (eight / "c").mkdir(parents=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)).save(eight / "c" / "rgb.png")
    Image.fromarray(rng.integers(0, 256, (24, 20), dtype=np.uint8)).save(eight / "c" / "grey.png")
    ours = ImageFiles(eight, 16)
    theirs = datasets.ImageFolder(str(eight), transform=transforms.Compose(
        [transforms.Resize(16), transforms.CenterCrop(16), transforms.ToTensor()]))
    for i in range(2):
        assert torch.equal(ours[i][0], theirs[i][0])
    shutil.copy(eight / "c" / "rgb.png", root / "train" / "ramps" / "rgb8.png")
    args = ["--config", "configs/fashion_ddcl.yaml", "--check-data", "data.name=image_folder", f"data.root={root}",
            "data.image_size=16"]
    assert train_main(args) == 0
    assert "every image can be read" in capsys.readouterr().out
    # images whose scale would be a guess: named by --check-data (and by training)
    Image.fromarray(np.full((24, 24), 1000.0, np.float32)).save(root / "train" / "ramps" / "float.tiff")
    Image.fromarray(np.full((24, 24), 70000, np.int32)).save(root / "test" / "ramps" / "int32.tiff")
    assert train_main(args) == 2
    out = capsys.readouterr()
    assert f"unreadable: {root / 'train' / 'ramps' / 'float.tiff'} (UnfaithfulImage: floating-point" in out.out
    assert f"unreadable: {root / 'test' / 'ramps' / 'int32.tiff'} (UnfaithfulImage: 32-bit integer" in out.out
    assert "2 image(s) cannot be read" in out.err


# --------------------------------------------------------------------------- 4. empty run.dir

def test_empty_run_dir_is_refused(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("# my own notes\ntrain: {steps: 2}\n")
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    for empty in ("run.dir=", "run.dir=''", 'run.dir="  "'):
        assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), "--quiet", *TINY, empty]) == 2
        assert "run.dir is empty" in one_error_line(capsys)
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    with pytest.raises(RunDirError, match="run.dir is empty"):
        train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + ["run.dir="]), quiet=True)


# --------------------------------------------------------------------------- 6. bounded YAML

def alias_bomb(levels=9, width=9) -> str:
    lines = ["anchors:", "  a0: &a0 [" + ",".join(['"lol"'] * width) + "]"]
    lines += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nrun:\n  name: *a{levels}\n"


def test_yaml_alias_bomb_deep_nesting_and_huge_files_are_one_line(tmp_path, capsys):
    files = {"bomb.yaml": (alias_bomb(), f"expands to more than {MAX_VALUES:,} values"),
             "deep.yaml": ("run:\n  name: " + "[" * 50000 + "]" * 50000 + "\n", "levels deep"),
             "loop.yaml": ("run:\n  name: &a [1, *a]\n", "recursive alias"),
             "huge.yaml": ("# " + "x" * (2 << 20) + "\n", "more than the 1,048,576")}
    for name, (text, message) in files.items():
        (tmp_path / name).write_text(text)
        start = time.time()
        assert train_main(["--config", str(tmp_path / name)]) == 2
        line = one_error_line(capsys)
        assert message in line and "lol" not in line and len(line) < 400, line
        assert time.time() - start < 10, name
    start = time.time()
    bomb = "[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], " \
           "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]]"
    assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), f"run.name={bomb}"]) == 2
    assert "override 'run.name' expands to more than" in one_error_line(capsys)
    assert time.time() - start < 10
    # an alias that expands to little is fine
    (tmp_path / "ok.yaml").write_text("base: &b {steps: 3, lr: 1.0e-3}\ntrain: *b\n")
    with pytest.raises(ConfigError, match="unknown config key 'base'"):
        load_config(tmp_path / "ok.yaml")


def test_study_files_are_bounded_like_configs(tmp_path, capsys):
    """Both study commands read their YAML through the same bounded reader as a training config."""
    from ddcl_vq.studies.prior_study import read_prior_study
    from ddcl_vq.studies.study import read_study_file

    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    for read in (read_study_file, read_prior_study):
        start = time.time()
        with pytest.raises(ConfigError, match=f"expands to more than {MAX_VALUES:,} values") as err:
            read(tmp_path / "bomb.yaml")
        assert "lol" not in str(err.value) and time.time() - start < 10
        with pytest.raises(ConfigError, match="expected a mapping at the top, got list"):
            read(tmp_path / "list.yaml")


# --------------------------------------------------------------------------- 7. full disk

def test_full_disk_while_saving_is_one_line_and_the_previous_checkpoint_survives(tmp_path):
    run = tmp_path / "run"
    cfg_args = [*TINY, "train.checkpoint_every=2", f"run.dir={run}"]
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", cfg_args + ["train.steps=2"]), quiet=True)
    last = run / "checkpoints" / "last.pt"
    good = last.read_bytes()
    limit = len(good) // 2  # the kernel refuses to grow any file past this: EFBIG, as a full disk's ENOSPC

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = subprocess.run([sys.executable, "-m", "ddcl_vq", "train", "--quiet", "--config", str(run / "config.yaml"),
                          "train.steps=4"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         preexec_fn=small_files)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("note: train.steps 2 -> 4")]
    assert len(lines) == 1 and lines[0].startswith("ddcl-vq train: error: could not write checkpoint "), lines
    assert "File too large (EFBIG)" in lines[0] and "the previous checkpoint is intact" in lines[0]
    assert last.read_bytes() == good and load_checkpoint(last)["step"] == 2
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporary file left
    # with room again, the same command resumes
    out = subprocess.run([sys.executable, "-m", "ddcl_vq", "train", "--quiet", "--config", str(run / "config.yaml"),
                          "train.steps=4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert load_checkpoint(last)["step"] == 4 and [r["step"] for r in records(run)] == [1, 2, 3, 4]


# --------------------------------------------------------------------------- 10. memory

@pytest.mark.parametrize("config,num_codes", [("fashion_ddcl", 1_000_000_000), ("fashion_hard", 1_000_000_000),
                                              ("fashion_hard", 5_000_000), ("fashion_ema", 5_000_000)])
def test_a_configuration_the_machine_cannot_hold_is_refused_with_the_figure(config, num_codes, tmp_path, capsys):
    run = tmp_path / "run"
    start = time.time()
    assert train_main(["--config", f"configs/{config}.yaml", "--quiet", f"quantizer.num_codes={num_codes}",
                       f"run.dir={run}"]) == 2
    line = one_error_line(capsys)
    assert "this configuration needs at least" in line and "GiB of memory" in line and "available" in line, line
    assert f"quantizer.num_codes={num_codes:,}" in line
    assert time.time() - start < 20
    assert not run.exists()  # refused before anything was written


def test_memory_estimate_counts_the_real_model(tmp_path):
    from ddcl_vq.tokenizer.config import build_model
    cfg = load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + ["quantizer.type=hard"])  # a codebook in training
    model = build_model(cfg, 1)
    state = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    need = estimate(cfg, 1, torch.device("cpu"))
    assert need.state == state and need.training == 3 * trainable and need.step > 0
    assert check_fits(cfg, 1, torch.device("cpu")) == need  # a tiny model fits
    huge = load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + ["quantizer.num_codes=1000000000"])
    with pytest.raises(NotEnoughMemory, match=r"needs at least [\d,.]+ GiB of memory, this machine has"):
        check_fits(huge, 1, torch.device("cpu"))


# --------------------------------------------------------------------------- rough edges

def test_learning_rates_in_exponent_notation_are_floats(tmp_path):
    for text, value in (("1e-3", 1e-3), ("1e+9", 1e9), ("2E-4", 2e-4), ("1.5e-3", 1.5e-3)):
        assert load_config(ROOT / "configs/fashion_ddcl.yaml", [f"train.lr={text}"]).train.lr == value
    (tmp_path / "c.yaml").write_text("train:\n  lr: 1e-3\n  codebook_lr_ratio: 3e+0\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.train.lr == 1e-3 and cfg.train.codebook_lr_ratio == 3.0
    assert load_config(ROOT / "configs/fashion_ddcl.yaml", ["train.steps=1e3"]).train.steps == 1000  # issue 40
    with pytest.raises(ConfigError, match=r"'train.lr': expected float, got 'e-3'"):
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["train.lr=e-3"])


def test_malicious_pickle_checkpoint_is_named_and_never_loaded(tmp_path, capsys):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "checkpoints"
    save_checkpoint({"model": {"w": torch.ones(2)}, "step": 3}, ckpt / "step_0000003.pt")
    torch.save({"model": Payload(), "step": 5}, ckpt / "last.pt")
    state, path = latest_checkpoint(ckpt)
    assert path.name == "step_0000003.pt" and state["step"] == 3
    err = capsys.readouterr().err
    assert "last.pt' is not a plain checkpoint of tensors" in err and "may be malicious" in err
    assert "nothing in it ran" in err and "posix.system" in err
    assert "weights_only" not in err and "truncated or corrupted" not in err
    assert not marker.exists()


def test_failed_runs_leave_no_empty_run_directory(tmp_path, capsys):
    missing = tmp_path / "no-images"
    for i, extra in enumerate((["data.name=image_folder", f"data.root={missing}"],  # fails before the model
                               ["train.amp=fp16", "train.device=cpu"])):            # fails after config.yaml
        run = tmp_path / f"new{i}" / "deeper" / "run"
        assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), "--quiet", *TINY, "train.steps=2",
                           f"run.dir={run}", *extra]) == 2
        one_error_line(capsys)
        assert not (tmp_path / f"new{i}").exists()
    # a folder that was there before is left as it was
    kept = tmp_path / "kept"
    kept.mkdir()
    assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), "--quiet", *TINY,
                       f"run.dir={kept}", "train.amp=fp16", "train.device=cpu"]) == 2
    assert kept.is_dir()


def test_unknown_key_suggests_only_a_close_key(capsys):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["model.foo=1"])
    assert "did you mean" not in str(err.value) and "the keys of 'model' are arch, channels" in str(err.value)
    with pytest.raises(ConfigError, match=r"did you mean 'model.channels'\?"):
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["model.chanels=1"])
    with pytest.raises(ConfigError, match=r"did you mean 'quantizer.temperature'\?"):
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["quantizer.temprature=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stesp'; did you mean 'train.steps'\?"):
        Config.from_dict({"train": {"stesp": 3}})
    with pytest.raises(ConfigError, match=r"unknown config key 'foo'; no key is close; the sections are data, .*model, quantizer, run, train"):
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["foo=1"])


def test_download_false_does_not_say_it_tried_to_download(tmp_path, monkeypatch):
    from ddcl_vq.common import data as data_module
    monkeypatch.setattr(data_module, "DEBIAN_FASHION_DIR", tmp_path / "nothing")
    monkeypatch.delenv("DDCL_VQ_FASHION_DIR", raising=False)
    with pytest.raises(DataUnavailable) as err:
        fashion_mnist_arrays("test", root=tmp_path / "data", download=False)
    assert "download" in str(err.value) and "data.download=true" in str(err.value)
    assert "failed" not in str(err.value) and "could not download" not in str(err.value)
    cfg = load_config(ROOT / "configs/fashion_ddcl.yaml", ["data.name=mnist", f"data.root={tmp_path}",
                                                           "data.download=false"])
    with pytest.raises(DataUnavailable) as err:
        build_dataset(cfg.data, "test")
    assert "could not download" not in str(err.value) and "data.download=true" in str(err.value)


def test_image_size_hint_is_two_different_sizes_or_fewer_downsamples():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["model.num_downsamples=9"])
    assert "512 or 512" not in str(err.value) and "model.num_downsamples=5 or fewer" in str(err.value)
    with pytest.raises(ConfigError, match=r"got 30; e\.g\. 28 or 32"):
        load_config(ROOT / "configs/fashion_ddcl.yaml", ["data.image_size=30"])


def test_codebook_lr_only_for_a_codebook_with_a_learning_rate_and_revived_is_cumulative(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    mstep = tmp_path / "mstep"
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", REVIVING + ["train.steps=8", f"run.dir={mstep}"]),
          quiet=True)
    rs = records(mstep)
    assert all("codebook_lr" not in r for r in rs)
    total = 0.0
    for r in rs:  # revived: codes re-seeded since the run began; revived_new: since the previous line
        total += r["revived_new"]
        assert r["revived"] == total and r["revived_new"] >= 0
    assert total > 0
    tags = EventAccumulator(str(mstep / "tb")).Reload().Tags()["scalars"]
    assert "revived_total" in tags and "revived_new" in tags and "revived" not in tags and "codebook_lr" not in tags
    gradient = tmp_path / "gradient"  # a codebook trained by gradient (HardVQ's)
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + ["train.steps=2", "quantizer.type=hard",
                                                                   f"run.dir={gradient}"]), quiet=True)
    assert all(r["codebook_lr"] == pytest.approx(r["lr"] * 3.0) for r in records(gradient))


def test_new_errors_are_user_errors_and_a_refused_allocation_is_one_line(capsys):
    from ddcl_vq.common.checkpoint import CheckpointWriteError
    from ddcl_vq.common.data import UnfaithfulImage
    from ddcl_vq.common.errors import UserError, entry_point

    for cls in (CheckpointWriteError, NotEnoughMemory, RunDirError):
        assert issubclass(cls, UserError), cls
    assert issubclass(UnfaithfulImage, ValueError)  # raised inside the loader; named by UnreadableImage

    @entry_point("ddcl-vq x")
    def main(argv):
        if argv == ["torch"]:
            torch.empty(1 << 60, dtype=torch.uint8)  # the CPU allocator refuses: RuntimeError
        elif argv == ["python"]:
            bytearray(1 << 62)  # MemoryError
        else:
            raise RuntimeError("a bug")

    for what in ("torch", "python"):
        assert main([what]) == 2
        assert "ddcl-vq x: error: out of memory (" in one_error_line(capsys, "x")
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        main(["other"])
    with pytest.raises(MemoryError):
        main(["python", "--debug"])


# --------------------------------------------------------------------------- issue 40: config files and values

def test_a_config_file_whose_top_level_is_not_a_mapping_is_one_line_naming_the_file(tmp_path, capsys):
    """Item 8: a list at the top crashed (AttributeError: 'list' object has no attribute 'setdefault') as soon as
    an override was given, in train and in prior train."""
    from ddcl_vq import cli

    path = tmp_path / "list.yaml"
    path.write_text("- train.steps: 2\n- train.lr: 1e-3\n")
    expected = f"config file '{path}': expected a mapping at the top, got list"
    for overrides in ([], ["train.steps=2"]):
        assert train_main(["--config", str(path), *overrides, f"run.dir={tmp_path / 'run'}"]) == 2
        assert expected in one_error_line(capsys)
        assert cli.main(["prior", "train", str(tmp_path / "no_tokenizer"), "--tokens", str(tmp_path / "t.npy"),
                         "--config", str(path), *overrides]) == 2
        assert expected in one_error_line(capsys, "prior train")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="expected a mapping at the top, got list"):
        from ddcl_vq.tokenizer.config import apply_overrides
        apply_overrides([1, 2], ["train.steps=2"])


def test_duplicate_yaml_keys_are_refused_naming_the_key(tmp_path, capsys):
    """Rough edge: a key given twice in one mapping silently kept the last value."""
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 5\n  lr: 1.0e-3\n  steps: 7\nrun: {name: a}\n")
    assert train_main(["--config", str(path), f"run.dir={tmp_path / 'run'}"]) == 2
    line = one_error_line(capsys)
    assert f"config file '{path}' has the key 'steps' twice in one mapping (lines 2 and 4)" in line, line
    (tmp_path / "top.yaml").write_text("run: {name: a}\ntrain: {steps: 3}\nrun: {name: b}\n")
    with pytest.raises(ConfigError, match=r"has the key 'run' twice in one mapping \(lines 1 and 3\)"):
        load_config(tmp_path / "top.yaml")
    with pytest.raises(ConfigError, match="override 'quantizer.vqp' has the key 'decay' twice"):
        load_config(None, ["quantizer.type=vqp", "quantizer.vqp={decay: 0.9, decay: 0.8}"])
    # the same key in two mappings, and a merge key, are fine
    (tmp_path / "ok.yaml").write_text("run: {name: a}\ntrain: &t {steps: 3}\ndata: {batch_size: 3}\n")
    assert load_config(tmp_path / "ok.yaml").train.steps == 3


def test_whole_numbers_in_exponent_notation_are_integers(tmp_path, capsys):
    """Rough edge: train.steps=1e3 was refused as a string while train.lr=1e-3 was read as a number."""
    for text, value in (("1e3", 1000), ("2E+4", 20000), ("1.0e3", 1000), ("1000.0", 1000)):
        assert load_config(None, [f"train.steps={text}"]).train.steps == value
    (tmp_path / "c.yaml").write_text("train:\n  steps: 1e3\n  log_every: 2.5e1\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.train.steps, cfg.train.log_every) == (1000, 25) and isinstance(cfg.train.steps, int)
    for text, shown in (("1.5", "1.5"), ("1.5e0", "'1.5e0'"), ("1e300", "'1e300'")):
        with pytest.raises(ConfigError, match=rf"config key 'train.steps': expected an integer, got {shown} "
                                              r"\(not a whole number"):
            load_config(None, [f"train.steps={text}"])
    with pytest.raises(ConfigError, match="too large to be exact"):
        load_config(None, ["train.steps=1e300"])
    # command-line options read the same way
    from ddcl_vq.common.config import Options, option
    from dataclasses import dataclass

    @dataclass
    class Opts:
        count: int = option(1, "how many")

    opts = Options(Opts, prog="ddcl-vq x")
    assert opts.parse(["--count", "1e3"]).count == 1000
    with pytest.raises(ConfigError, match="option --count: expected an integer, got '1.5e0'"):
        opts.parse(["--count", "1.5e0"])


def test_non_finite_option_values_are_refused(capsys):
    """Rough edge: prior sample --temperature inf was accepted (every command's float options now say no)."""
    from ddcl_vq import cli

    for value in ("inf", "-inf", "nan", "1e999"):
        assert cli.main(["prior", "sample", "no/such/prior", "--count", "4", "--out", "s.png",
                         f"--temperature={value}"]) == 2
        line = one_error_line(capsys, "prior sample")
        assert "option --temperature: expected a finite number, got" in line or \
            "option --temperature: expected a value >= 0" in line, line
    assert cli.main(["prior", "evaluate", "no/such/prior", "--temperature", "inf"]) == 2
    assert "option --temperature: expected a finite number, got inf" in one_error_line(capsys, "prior evaluate")


def test_init_from_a_path_that_is_not_an_export_says_what_it_is(tmp_path, capsys):
    """Rough edge: train.init_from=/no/such/dir printed the Hugging Face Hub's repo-id validation text."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {name: r}\n")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {"/no/such/dir": "no such folder here, and not a Hugging Face Hub id (user/name) either",
             str(run): "is a run directory, not an exported model: export it first",
             str(tmp_path / "a_file"): "is a file; expected a folder written by ddcl-vq export",
             str(tmp_path / "empty"): "is a folder without config.json"}
    for source, message in cases.items():
        assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), "--quiet", *TINY, "train.steps=1",
                           f"train.init_from={source}", f"run.dir={tmp_path / 'new'}"]) == 2
        line = one_error_line(capsys)
        assert f"train.init_from '{source}'" in line and message in line and "Repo id" not in line, line
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- issue 51

def test_a_seed_torch_does_not_take_is_one_line_and_any_it_takes_trains(tmp_path, capsys):
    """Issue 51, item 3: run.seed=9223372036854775808 (or 2**64, 1e20) was a traceback (ValueError 'Overflow when
    unpacking long long'). Every seed torch.manual_seed takes, -2**63 .. 2**64 - 1, trains (a negative seed is the same
    seed as seed + 2**64, in the data order too); others are refused in one line."""
    for seed in ("18446744073709551616", "-9223372036854775809", "1e20"):
        assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), *TINY, f"run.seed={seed}",
                           f"run.dir={tmp_path / 'refused'}"]) == 2
        line = one_error_line(capsys)
        assert "config key 'run.seed'" in line and ("seed torch accepts" in line or "1e20" in line), line
    assert not (tmp_path / "refused").exists()
    for seed in (2 ** 63, 2 ** 64 - 1, -1):
        cfg = load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + ["train.steps=2", "train.eval_images=0",
                                                                      f"run.seed={seed}", f"run.dir={tmp_path / str(seed)}"])
        assert train(cfg, quiet=True)["step"] == 2
    assert torch.equal(load_checkpoint(tmp_path / "-1" / "checkpoints" / "last.pt")["model"]["encoder.net.0.weight"],
                       load_checkpoint(tmp_path / str(2 ** 64 - 1) / "checkpoints" / "last.pt")["model"]
                       ["encoder.net.0.weight"])


def test_a_dangling_run_dir_link_and_a_last_pt_link_loop_say_what_they_are(tmp_path, capsys):
    """Issue 51: a dangling symlink as run.dir was 'cannot be written (File exists)'; a last.pt link loop was 'has no
    checkpoint'."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), *TINY, f"run.dir={link}"]) == 2
    line = one_error_line(capsys)
    assert f"run.dir '{link}' is a symbolic link to '{tmp_path / 'gone'}', which leads to no folder" in line, line
    run = tmp_path / "run"
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + ["train.steps=2", "train.eval_images=0",
                                                                  f"run.dir={run}"]), quiet=True)
    for p in (run / "checkpoints").iterdir():
        p.unlink()
    (run / "checkpoints" / "last.pt").symlink_to(run / "checkpoints" / "last.pt")
    from ddcl_vq.tokenizer.evaluate import main as evaluate_main
    assert evaluate_main([str(run)]) == 2
    line = one_error_line(capsys, "evaluate")
    assert "is a symbolic link that leads to no file (a loop of links)" in line and "has no checkpoint" not in line


def test_discriminator_settings_without_a_discriminator_do_not_block_resuming(tmp_path, capsys):
    """Issue 51: loss.disc_start is accepted on a run without a discriminator (loss.disc_weight=0), where it does
    nothing: a change of it does not block resuming (a change with a discriminator still does)."""
    base = ["train.eval_images=0", f"run.dir={tmp_path / 'run'}"]
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + base + ["train.steps=2", "loss.disc_start=5"]),
          quiet=True)
    assert train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + base + ["train.steps=3"]),
                 quiet=True)["step"] == 3


def test_init_from_a_diffusers_export_says_it_is_one(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "VQModel", "in_channels": 1}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    assert train_main(["--config", str(ROOT / "configs/fashion_ddcl.yaml"), *TINY, f"train.init_from={folder}",
                       f"run.dir={tmp_path / 'new'}"]) == 2
    line = one_error_line(capsys)
    assert f"train.init_from '{folder}' is a diffusers folder (ddcl-vq export --format diffusers" in line, line
    assert "encoder_kwargs" not in line and len(line) < 400
