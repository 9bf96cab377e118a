"""No silent wrong results (issue 13), one test (or more) per item:

1. a run resumes only with the config it was trained with; a finished run is left as it is;
2. one training at a time per run directory (train.lock, taken over when its process is gone);
3. compare reuses an eval.json only when it was computed exactly as asked;
4. an unreadable image is named; --check-data lists them all; a failed end-of-run evaluation
   keeps the finished training and the same command evaluates again;
5. bad input is one line naming the cause, exit status 2 (--debug: the traceback); evaluate and
   compare check they can write before the work and print their results when writing fails;
   an empty split or a dataset smaller than one batch is a one-line error too.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ddcl_vq import cli
from ddcl_vq.studies.compare import compare, needs_eval
from ddcl_vq.tokenizer.evaluate import evaluate_run
from ddcl_vq.tokenizer.evaluate import main as evaluate_main
from ddcl_vq.common.checkpoint import load_checkpoint
from ddcl_vq.tokenizer.train import main as train_main
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import UnreadableImage
from ddcl_vq.common.errors import UserError
from ddcl_vq.tokenizer.train import EndOfRunEvaluationFailed, train
from ddcl_vq.common.rundir import LOCK_NAME, RunDirError, RunLock
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.eval_images=32"]


def one_error_line(capsys, prog="train"):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"ddcl-vq {prog}: error: "), err
    return err[0]


def snapshot(run: Path):
    """Every file of a run directory with its bytes (what 'changes nothing' means)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_every_new_error_is_a_user_error():
    for cls in (RunDirError, UnreadableImage, EndOfRunEvaluationFailed):
        assert issubclass(cls, UserError), cls


# --------------------------------------------------------------------------- 1. resume

def test_resume_with_another_config_is_refused_and_changes_nothing(tiny_config):
    cfg = tiny_config(*SMALL)
    train(cfg, quiet=True)
    run = Path(cfg.run.dir)
    before = snapshot(run)
    for overrides, config, named in [
        (["quantizer.temperature=0.2"], "configs/fashion_ddcl.yaml", "quantizer.temperature 0.03 -> 0.2"),
        ([], "configs/fashion_hard.yaml", "quantizer.type 'ddcl' -> 'hard'"),
        (["train.lr=0.05"], "configs/fashion_ddcl.yaml", "train.lr 0.002 -> 0.05"),
        (["quantizer.num_codes=16"], "configs/fashion_ddcl.yaml", "quantizer.num_codes 32 -> 16"),
    ]:
        with pytest.raises(RunDirError, match="holds a run trained 6 steps with another config") as err:
            train(tiny_config(*SMALL, *overrides, config=config), quiet=True)
        assert named in str(err.value) and "another run.dir" in str(err.value)
        assert f"--config {run / 'config.yaml'}" in str(err.value)
    assert snapshot(run) == before


def test_finished_run_with_the_same_config_changes_nothing(tiny_config, capsys):
    cfg = tiny_config(*SMALL)
    summary = train(cfg, quiet=True)
    run = Path(cfg.run.dir)
    before = snapshot(run)
    assert train(cfg) == summary
    assert "is finished (6 of train.steps=6 steps" in capsys.readouterr().err
    # its own config.yaml continues it as well; a logging interval may change
    assert train_main(["--config", str(run / "config.yaml"), "train.log_every=3"]) == 0
    assert snapshot(run) == before


def test_resume_may_train_longer_but_not_shorter(tiny_config, capsys):
    cfg = tiny_config(*SMALL)
    train(cfg, quiet=True)
    longer = train(tiny_config(*SMALL, "train.steps=9", "train.log_every=3"), quiet=True)
    assert longer["step"] == 9 and longer["hard"]["psnr"] > 0
    assert "the learning-rate schedule was laid out for 6 steps" in capsys.readouterr().err
    assert load_config(Path(cfg.run.dir) / "config.yaml").train.steps == 9
    with pytest.raises(RunDirError, match="has trained 9 steps; train.steps=6 is fewer"):
        train(tiny_config(*SMALL), quiet=True)


def test_a_checkpoint_of_an_older_version_is_refused_on_resume_naming_the_version(tiny_config):
    """Issue 49: a run whose checkpoint was trained with keys since retired does not resume as something else: one
    line names the version."""
    cfg = tiny_config(*SMALL)
    train(cfg, quiet=True)
    run = Path(cfg.run.dir)
    for path in (run / "checkpoints").glob("*.pt"):
        state = torch.load(path, weights_only=True)
        state["config"]["quantizer"]["codebook_update"] = "gradient"  # an option retired in 0.2.0
        torch.save(state, path)
    with pytest.raises(RunDirError, match="cannot be read by this version .*written by ddcl-vq 0.1.0 before "
                                          "quantizer.codebook_update was retired or renamed"):
        train(tiny_config(*SMALL, "train.steps=8"), quiet=True)


# --------------------------------------------------------------------------- 2. one training per folder

def test_second_training_in_a_locked_folder_is_refused_naming_the_pid(tiny_config):
    cfg = tiny_config(*SMALL)
    run = Path(cfg.run.dir)
    with RunLock(run):
        assert f"pid {os.getpid()} on " in (run / LOCK_NAME).read_text()
        with pytest.raises(RunDirError, match=rf"is in use by another training \(pid {os.getpid()} on "):
            train(cfg, quiet=True)
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert not (run / LOCK_NAME).exists()
    train(cfg, quiet=True)  # free again
    assert not (run / LOCK_NAME).exists()


def test_lock_of_a_process_that_is_gone_is_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ddcl_vq.common.rundir import RunLock\n"
        f"RunLock(Path({str(run)!r})).acquire(); print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"pid {holder.pid} on "):
            RunLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"pid {holder.pid} " in (run / LOCK_NAME).read_text()  # left behind by kill -9
    lock = RunLock(run).acquire()
    assert f"pid {os.getpid()} " in (run / LOCK_NAME).read_text()
    lock.release()


def test_two_trainings_at_once_one_refused_and_one_clean_log(tmp_path):
    run = tmp_path / "two"
    args = [sys.executable, "-m", "ddcl_vq", "train", "--quiet", "--config", "configs/fashion_hard.yaml",
            f"run.dir={run}", "train.steps=400", "train.log_every=10", "train.checkpoint_every=400",
            *TINY_MODEL, "model.num_res_blocks=2", "quantizer.num_codes=32", "data.batch_size=16", "train.eval_images=0"]
    first = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.1)
        second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            line for line in second.stderr.strip().splitlines() if line.startswith("ddcl-vq train: error: ")]
        assert f"is in use by another training (pid {first.pid} on " in second.stderr
    finally:
        first.wait(timeout=600)
    assert first.returncode == 0, first.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(10, 401, 10))
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1


# --------------------------------------------------------------------------- 3. stale evaluations

@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "ddcl"
    tiny = TINY_MODEL + ["quantizer.num_codes=32", "data.batch_size=32", "train.steps=6", "train.checkpoint_every=3",
                         "train.eval_images=0"]
    train(load_config("configs/fashion_ddcl.yaml", tiny + [f"run.dir={run}"]), quiet=True)
    return run


def test_evaluation_records_what_it_was_made_with_and_is_reused_only_on_an_exact_match(small_run):
    ev = evaluate_run(small_run, max_images=40, batch_size=64, overrides=["data.num_workers=0"])
    assert (ev["overrides"], ev["step"], ev["split"], ev["num_images"], ev["max_images"]) == (
        ["data.num_workers=0"], 6, "test", 40, 40)
    assert Path(ev["checkpoint"]).name == "last.pt"
    assert needs_eval(small_run, "test", 40)                            # other overrides
    assert not needs_eval(small_run, "test", 40, ["data.num_workers=0"])
    evaluate_run(small_run, max_images=40, batch_size=64)
    assert not needs_eval(small_run, "test", 40)
    assert needs_eval(small_run, "test", 50) and needs_eval(small_run, "train", 40)
    ev = json.loads((small_run / "eval.json").read_text())
    for key, value in (("step", 5), ("checkpoint", "step_0000003.pt")):
        (small_run / "eval.json").write_text(json.dumps(dict(ev, **{key: value})))
        assert needs_eval(small_run, "test", 40), key
    del ev["overrides"]  # written before evaluations recorded their overrides
    (small_run / "eval.json").write_text(json.dumps(ev))
    assert needs_eval(small_run, "test", 40)


def test_compare_reevaluates_an_eval_json_made_with_overrides(small_run, tmp_path):
    evaluate_run(small_run, max_images=40, batch_size=64, overrides=["data.num_workers=0"])
    rows = compare([small_run], tmp_path / "cmp", max_images=40, batch_size=64, grid_images=2)
    # compare does not overwrite an `evaluate` result: its own evaluation goes to OUT/evals
    assert json.loads((small_run / "eval.json").read_text())["overrides"] == ["data.num_workers=0"]
    (stored,) = (tmp_path / "cmp" / "evals").glob("*.json")
    assert json.loads(stored.read_text())["overrides"] == []
    assert rows[0]["num_images"] == 40


def test_evaluate_refuses_overrides_of_the_trained_model(small_run, capsys):
    before = (small_run / "eval.json").read_bytes() if (small_run / "eval.json").exists() else None
    assert evaluate_main([str(small_run), "--quiet", "quantizer.temperature=1.0"]) == 2
    line = one_error_line(capsys, "evaluate")
    assert "quantizer.temperature=1.0 (trained with 0.03)" in line and "saved in the checkpoint" in line
    assert evaluate_main([str(small_run), "--quiet", "quantizer.num_codes=16"]) == 2
    assert "quantizer.num_codes=16 (trained with 32)" in one_error_line(capsys, "evaluate")
    after = (small_run / "eval.json").read_bytes() if (small_run / "eval.json").exists() else None
    assert after == before


# --------------------------------------------------------------------------- 4. bad images

def image_folder(root: Path, train=40, test=12) -> Path:
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        (root / split / "things").mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(root / split / "things" / f"{i}.png")
    return root


FOLDER = ["data.name=image_folder", "data.image_size=16", "data.batch_size=8", "train.eval_images=12"]


def truncate(path: Path) -> bytes:
    good = path.read_bytes()
    path.write_bytes(good[:200])
    return good


@pytest.mark.parametrize("workers", [0, 1])
def test_unreadable_training_image_is_named(tiny_config, tmp_path, workers):
    root = image_folder(tmp_path / "images")
    truncate(root / "train" / "things" / "7.png")
    cfg = tiny_config(*FOLDER, f"data.root={root}", f"data.num_workers={workers}")
    with pytest.raises(UnreadableImage, match=r"image '.*train/things/7\.png' cannot be read \(OSError: image "
                                              r"file is truncated\).*--check-data") as err:
        train(cfg, quiet=True)
    assert "\n" not in str(err.value)


def test_check_data_lists_every_unreadable_image(tmp_path, capsys):
    root = image_folder(tmp_path / "images")
    truncate(root / "train" / "things" / "3.png")
    (root / "test" / "things" / "4.png").write_bytes(b"not an image")
    args = ["--config", "configs/fashion_ddcl.yaml", "--check-data", *FOLDER, f"data.root={root}"]
    assert train_main(args) == 2
    out = capsys.readouterr()
    assert "image_folder train: 40 images" in out.out and "image_folder test: 12 images" in out.out
    assert f"unreadable: {root / 'train' / 'things' / '3.png'} (OSError" in out.out
    assert f"unreadable: {root / 'test' / 'things' / '4.png'} (UnidentifiedImageError" in out.out
    assert "2 image(s) cannot be read" in out.err
    shutil.rmtree(root)
    image_folder(root)
    assert train_main(args) == 0
    assert "every image can be read" in capsys.readouterr().out


def test_failed_end_of_run_evaluation_keeps_the_training_and_evaluates_again(tiny_config, tmp_path):
    root = image_folder(tmp_path / "images")
    good = truncate(root / "test" / "things" / "9.png")   # the last in file order: after the 8 preview images
    cfg = tiny_config(*FOLDER, f"data.root={root}")
    run = Path(cfg.run.dir)
    with pytest.raises(EndOfRunEvaluationFailed, match=r"training finished and was saved \(6 steps.*9\.png' "
                                                       r"cannot be read.*run the same command again"):
        train(cfg, quiet=True)
    assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 6
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 6 and "9.png" in summary["evaluation_error"] and "hard" not in summary
    metrics = (run / "metrics.jsonl").read_bytes()
    (root / "test" / "things" / "9.png").write_bytes(good)
    summary = train(cfg, quiet=True)  # evaluates only
    assert summary["num_images"] == 12 and summary["hard"]["psnr"] > 0 and "evaluation_error" not in summary
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert json.loads((run / "summary.json").read_text()) == summary


# --------------------------------------------------------------------------- 5. one-line errors

@pytest.fixture
def bad_inputs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "latin1.yaml").write_bytes(b"train:\n  steps: 3\n# caf\xe9\n")
    images = image_folder(tmp_path / "images")
    (images / "train" / "empty_class").mkdir()
    few = image_folder(tmp_path / "few", train=5, test=2)
    empty_test = image_folder(tmp_path / "empty_test", test=0)
    (empty_test / "test" / "things").rmdir()  # test/ holds nothing
    return dict(tmp=tmp_path, file=a_file, images=images, few=few, empty_test=empty_test)


TRAIN = ["train", "--quiet", "--config", "configs/fashion_ddcl.yaml", *TINY_MODEL, "model.num_res_blocks=2",
         "quantizer.num_codes=32", "data.batch_size=16", "train.steps=2", "train.eval_images=16"]
CASES = {
    "run.dir is a file": (lambda d: TRAIN + [f"run.dir={d['file']}"], "run.dir '{file}' is a file, expected a directory"),
    "run.dir cannot be written": (lambda d: TRAIN + ["run.dir=/proc/ddcl-vq-test/run"],
                                  "run.dir '/proc/ddcl-vq-test/run' cannot be written"),
    "config is a directory": (lambda d: ["train", "--config", "configs"], "config file 'configs' is a directory"),
    "config not UTF-8": (lambda d: ["train", "--config", str(d["tmp"] / "latin1.yaml")],
                         "is not UTF-8 text (byte 0xe9 on line 3)"),
    "empty class folder": (lambda d: TRAIN + ["data.name=image_folder", f"data.root={d['images']}",
                                              f"run.dir={d['tmp'] / 'r'}"],
                           "Found no valid file for the classes empty_class"),
    "image size 7": (lambda d: TRAIN + ["data.image_size=7"], "'data.image_size': expected a multiple of 4"),
    "fp16 on the CPU": (lambda d: TRAIN + ["train.amp=fp16", "train.device=cpu", f"run.dir={d['tmp'] / 'r'}"],
                        "'train.amp': fp16 needs a CUDA device"),
    "vqp unknown keyword": (lambda d: TRAIN + ["--config", "configs/fashion_vqp.yaml", "quantizer.decayy=0.9",
                                               f"run.dir={d['tmp'] / 'r'}"],
                            "unknown config key 'quantizer.decayy'; did you mean 'quantizer.decay'?"),
    "0.2.0's peer section": (lambda d: TRAIN + ["--config", "configs/fashion_vqp.yaml", "quantizer.vqp.decay=0.9"],
                             "unknown config key 'quantizer.vqp.decay'; 0.2.0's quantizer.vqp section is gone: its "
                             "keys go straight under quantizer"),
    "a key another quantizer takes": (lambda d: TRAIN + ["quantizer.type=hard", "quantizer.temperature=0.1"],
                                      "unknown config key 'quantizer.temperature'; no key is close; the keys of "
                                      "'quantizer' are type, num_codes, beta, distance, kmeans_init"),
    "infinite temperature": (lambda d: TRAIN + ["quantizer.temperature=.inf"],
                             "'quantizer.temperature': expected a finite number, got inf"),
    "dataset smaller than a batch": (lambda d: TRAIN + ["data.name=image_folder", f"data.root={d['few']}",
                                                        "data.image_size=16", f"run.dir={d['tmp'] / 'r'}"],
                                     "the train split has 5 images, fewer than one batch (data.batch_size=16)"),
    "empty test split": (lambda d: TRAIN + ["data.name=image_folder", f"data.root={d['empty_test']}",
                                            "data.image_size=16", f"run.dir={d['tmp'] / 'r'}"],
                         "empty_test/test': Couldn't find any class folder"),
}
if not torch.cuda.is_available():
    CASES["cuda without a GPU"] = (lambda d: TRAIN + ["train.device=cuda", f"run.dir={d['tmp'] / 'r'}"],
                                   "'train.device': 'cuda' asked, but no CUDA device is available")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, bad_inputs, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    make_argv, message = CASES[case]
    argv = make_argv(bad_inputs)
    assert cli.main(argv) == 2
    assert message.format(**bad_inputs) in one_error_line(capsys, argv[0])


def test_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(UserError, match="train.stesp"):
        cli.main(["train", "--config", "configs/fashion_ddcl.yaml", "--debug", "train.stesp=3"])
    for command in ("train", "evaluate", "compare"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert "--debug" in capsys.readouterr().out, command


def test_resume_or_evaluate_with_another_k_is_one_line(small_run, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(TRAIN + [f"run.dir={small_run}", "quantizer.num_codes=16"]) == 2
    assert "quantizer.num_codes 32 -> 16" in one_error_line(capsys)
    # a checkpoint that does not fit the config (an edited config.yaml): named, one line
    edited = small_run.parent / "edited"
    shutil.copytree(small_run, edited)
    raw = yaml.safe_load((edited / "config.yaml").read_text())
    raw["quantizer"]["num_codes"] = 16
    (edited / "config.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["evaluate", str(edited), "--quiet"]) == 2
    line = one_error_line(capsys, "evaluate")
    assert "last.pt' does not fit the model built from the config" in line and "size mismatch" in line


def test_compare_checks_its_output_folder_before_evaluating(small_run, tmp_path, capsys):
    (small_run / "eval.json").unlink(missing_ok=True)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert cli.main(["compare", str(small_run), "--out", str(a_file), "--quiet"]) == 2
    assert f"--out '{a_file}' is a file" in one_error_line(capsys, "compare")
    assert not (small_run / "eval.json").exists()  # nothing was evaluated


def test_evaluate_and_compare_print_their_results_when_writing_fails(small_run, tmp_path, capsys):
    (small_run / "eval.json").unlink(missing_ok=True)
    (small_run / "eval.json").mkdir()  # writable folder, but eval.json cannot be replaced
    try:
        assert cli.main(["evaluate", str(small_run), "--max-images", "16", "--quiet"]) == 2
        out = capsys.readouterr()
        assert "test split" in out.out and "16 images" in out.out and "psnr" in out.out.lower()
        assert f"could not write '{small_run / 'eval.json'}'" in out.err and len(out.err.strip().splitlines()) == 1
    finally:
        (small_run / "eval.json").rmdir()
    out_dir = tmp_path / "cmp"
    (out_dir / "table.md").mkdir(parents=True)
    assert cli.main(["compare", str(small_run), "--out", str(out_dir), "--max-images", "16", "--quiet"]) == 2
    out = capsys.readouterr()
    assert "| run | quantizer | K |" in out.out
    assert "could not write the comparison into" in out.err and len(out.err.strip().splitlines()) == 1


def test_an_os_error_is_one_line_naming_the_path(monkeypatch, tmp_path, capsys):
    from ddcl_vq.common.errors import entry_point

    @entry_point("ddcl-vq x")
    def main(argv):
        open(tmp_path / "missing" / "file")

    assert main([]) == 2
    line = one_error_line(capsys, "x")
    assert "No such file or directory" in line and "missing/file" in line and "--debug" in line
    with pytest.raises(FileNotFoundError):
        main(["--debug"])
