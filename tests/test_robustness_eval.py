"""Nothing lost, nothing silently wrong — second round, the evaluation and token side (issue 24):

- item 5: compare refuses runs of different datasets up front (no false table, no partial files);
- item 7: a full disk (a real kernel error: RLIMIT_FSIZE in a subprocess gives EFBIG) during
  export, tokenize, decode and compare is one line, and leaves no empty folder, no partial file,
  and the earlier file where there was one;
- item 8: tampered or mismatched model files and garbage token files are one line each, refused
  before anything large is allocated;
- rough edges: evaluate/compare of a read-only run (--out, OUT/evals); freshness by the
  checkpoint's content; compare does not overwrite or mislabel an evaluate result; decode notes
  another grid and refuses tokens of another K; export of an unfinished run warns; evaluate of a
  run in training says so quietly.
"""
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ddcl_vq import cli
from ddcl_vq.tokenizer.evaluate import evaluate_run
from ddcl_vq.studies.freshness import needs_eval
from ddcl_vq.tokenizer.export import export_run
from ddcl_vq.models import VQVAE
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.tokenizer.train import train
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY_MODEL + ["quantizer.num_codes=32", "data.batch_size=32", "train.steps=6", "train.checkpoint_every=3",
                     "train.eval_images=0"]
OUTPUTS = ("table.md", "table.csv", "table.json", "usage_histograms.png", "usage_over_training.png",
           "psnr_vs_utilization.png", "reconstructions.png")


def one_error_line(capsys, prog):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"ddcl-vq {prog}: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "ddcl"
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + [f"run.dir={run}", "run.name=tiny"]), quiet=True)
    return run


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "tiny"
    export_run(run, out)
    return out


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)  # copy2: file times kept, like cp -p
    (dest / "eval.json").unlink(missing_ok=True)
    shutil.rmtree(dest / "tb", ignore_errors=True)
    return dest


# --------------------------------------------------------------------------- a real full disk

LIMITED = """\
import contextlib, io, json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
import matplotlib.pyplot, torch, torchvision  # imported (caches written) before any limit
from ddcl_vq import cli
results = []
for limit, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))  # the soft limit: raised again below
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def limited(tmp_path: Path, *commands) -> list:
    """Each ``(limit, argv)``: ``ddcl-vq ARGV`` unable to write a file larger than ``limit`` bytes
    (RLIMIT_FSIZE: the kernel's EFBIG, what a full disk looks like to a writer), all in one process;
    -> [(exit status, stderr), ...]."""
    script = tmp_path / "limited.py"
    script.write_text(LIMITED)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    spec = json.dumps([[limit, [str(a) for a in argv]] for limit, argv in commands])
    done = subprocess.run([sys.executable, str(script), spec], capture_output=True, text=True, env=env, timeout=900,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script.unlink()
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_one_line(result, prog: str) -> str:
    code, stderr = result
    err = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("tokenize: ", "evaluate: "))]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"ddcl-vq {prog}: error: "), stderr
    return err[0]


def test_a_full_disk_is_one_line_and_leaves_nothing_partial(run, exported, tmp_path):
    """export, tokenize (.npy, .safetensors), decode and compare under a file size limit."""
    models = tmp_path / "models"
    models.mkdir()
    out = models / "tiny"
    earlier = models / "earlier"
    export_run(run, earlier)
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    codes = tmp_path / "t.npy"
    np.save(codes, np.zeros((20, 8, 8), dtype=np.uint8))
    png = tmp_path / "grid.png"
    png.write_bytes(b"an earlier grid")
    cmp = tmp_path / "cmp"
    results = limited(
        tmp_path,
        (20_000, ["export", run, out]),  # the weights are ~47 KB
        (20_000, ["export", run, earlier, "--overwrite"]),
        (1000, ["tokenize", run, "--split", "test", "--max-images", "40", "--out", tokens / "t.npy", "--quiet"]),
        (1000, ["tokenize", run, "--split", "test", "--max-images", "40", "--out", tokens / "t.safetensors",
                "--quiet"]),  # 40 x 8 x 8 codes: 2.6 KB
        (100, ["decode", exported, codes, "--out", png]),
        (20_000, ["compare", copy_run(run, tmp_path / "r"), "--out", cmp, "--max-images", "16", "--quiet"]))

    line = assert_one_line(results[0], "export")
    assert "could not write the export" in line and "File too large" in line and "nothing was written" in line
    assert sorted(p.name for p in models.iterdir()) == ["earlier"]  # no folder, no hidden staging folder
    assert_one_line(results[1], "export")
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before  # an earlier export stays as it was

    for result, name in zip(results[2:4], ("t.npy", "t.safetensors")):
        line = assert_one_line(result, "tokenize")
        assert f"could not write '{tokens / name}'" in line and "File too large" in line
    assert list(tokens.iterdir()) == []  # no partial or temporary file

    line = assert_one_line(results[4], "decode")
    assert "could not write" in line and "the earlier file is unchanged" in line
    assert png.read_bytes() == b"an earlier grid" and not list(tmp_path.glob(".grid.png*"))

    assert "could not write the comparison" in assert_one_line(results[5], "compare")
    assert list(cmp.iterdir()) == []  # the plots failed: no table.md either, no staging folder


# --------------------------------------------------------------------------- compare across datasets

def image_folder(root: Path, train=24, test=8) -> Path:
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        (root / split / "things").mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(root / split / "things" / f"{i}.png")
    return root


def test_compare_refuses_runs_of_different_datasets_before_any_work(run, tmp_path, capsys):
    folder_run = tmp_path / "folder_run"
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + [
        f"run.dir={folder_run}", "data.name=image_folder", f"data.root={image_folder(tmp_path / 'images')}",
        "data.image_size=16", "data.batch_size=8", "train.steps=2"]), quiet=True)
    fashion = copy_run(run, tmp_path / "fashion_run")
    out = tmp_path / "cmp"
    assert cli.main(["compare", str(fashion), str(folder_run), "--out", str(out), "--max-images", "8", "--quiet"]) == 2
    line = one_error_line(capsys, "compare")
    assert "different datasets" in line and "fashion_mnist 1x32x32" in line and "image_folder 3x16x16" in line
    assert str(folder_run) in line and str(fashion) in line
    assert not out.exists()  # no table saying both were evaluated on one dataset, no partial plots
    assert not (fashion / "eval.json").exists() and not (folder_run / "eval.json").exists()  # nothing evaluated


# --------------------------------------------------------------------------- tampered model files

def _edit(section, key, value):
    def edit(folder: Path):
        config = json.loads((folder / "config.json").read_text())
        config[section][key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _weights_of_another_model(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    config["model"]["channels"] = 32
    other = VQVAE.from_config({k: config[k] for k in ("model", "quantizer")})
    other.save_pretrained(folder / "other")
    shutil.move(folder / "other" / "model.safetensors", folder / "model.safetensors")
    shutil.rmtree(folder / "other")


def _as_0_2_0(folder: Path, **sizes):
    """config.json as ddcl-vq 0.2.0 wrote it (encoder_kwargs, decoder_kwargs, quantizer_type, quantizer_kwargs)."""
    config = json.loads((folder / "config.json").read_text())
    model, q = config.pop("model"), config.pop("quantizer")
    arch, channels = model.pop("arch"), model.pop("in_channels")
    model.update(sizes)
    config.update(arch=arch, encoder_kwargs={"in_channels": channels, **model},
                  decoder_kwargs={"out_channels": channels, **model}, quantizer_type=q.pop("type"),
                  quantizer_kwargs={**q, "dim": model["latent_dim"]})
    (folder / "config.json").write_text(json.dumps(config))


def _truncate(keep: int):
    def cut(folder: Path):
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:keep])
    return cut


TAMPERED = {
    "num_codes changed": (_edit("quantizer", "num_codes", 16), "do not fit the model config.json describes"),
    "in_channels changed": (_edit("model", "in_channels", 3), "size mismatch for encoder"),
    "weights of another model": (_weights_of_another_model, "do not fit the model config.json describes"),
    "config.json a JSON list": (lambda f: (f / "config.json").write_text("[1, 2, 3]"), "got a JSON list"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{oops"), "to hold JSON"),
    "num_codes=1e12 (float)": (_edit("quantizer", "num_codes", 1e12), "to be a positive integer, got 1000000000000.0"),
    "num_codes=10**12": (_edit("quantizer", "num_codes", 10**12), "(a 32.0 TB codebook) but"),
    "channels=10**9": (_edit("model", "channels", 10**9), "model.channels"),
    # the 0.2.0 form of config.json is read (migrated); a tampered size in it is refused all the same
    "0.2.0 config.json, channels=10**9": (lambda f: _as_0_2_0(f, channels=10 ** 9), "model.channels"),
    "weights cut in the tensors": (_truncate(30_000), "is truncated: its header lists"),
    "weights cut in the header": (_truncate(100), "it is truncated or not safetensors"),
    # issue 51: a NaN in the quantizer's schedule was "weights do not fit"; a float16 re-save loaded silently
    "NaN in the schedule": (lambda f: _poison(lambda k, t: k == "quantizer.schedule", False, float("nan"))(f),
                            "hold values that are not finite (NaN or Inf): 1 of 4 in quantizer.schedule"),
    "re-saved as float16": (lambda f: _half(f), "as float16 (and"),
}


def _half(folder: Path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: t.half() if t.dtype == torch.float32 else t for k, t in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_model_files_are_one_line_before_any_allocation(case, exported, tmp_path, capsys):
    tamper, message = TAMPERED[case]
    folder = tmp_path / "model"
    shutil.copytree(exported, folder)
    tamper(folder)
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.zeros((2, 8, 8), dtype=np.uint8))
    assert cli.main(["decode", str(folder), str(tokens), "--out", str(tmp_path / "g.png")]) == 2
    line = one_error_line(capsys, "decode")
    assert f"cannot load the exported model in '{folder}'" in line and message in line, line
    assert cli.main(["tokenize", str(folder), "--split", "test", "--out", str(tmp_path / "x.npy")]) == 2
    assert message in one_error_line(capsys, "tokenize")
    with pytest.raises(ValueError, match=re.escape(message)):
        VQVAE.from_pretrained(str(folder))
    assert not (tmp_path / "g.png").exists() and not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("name, data, message", [
    ("garbage.safetensors", os.urandom(300), "not a .safetensors token file or cut off"),
    ("garbage.npy", b"\x93NUMPY" + os.urandom(100), "not a .npy token file or cut off"),
    ("short.npy", None, "not a .npy token file or cut off"),
])
def test_a_garbage_token_file_is_one_line(name, data, message, exported, tmp_path, capsys):
    path = tmp_path / name
    if data is None:  # a real token file cut short
        np.save(path, np.zeros((20, 8, 8), dtype=np.uint8))
        data = path.read_bytes()[:500]
    path.write_bytes(data)
    assert cli.main(["decode", str(exported), str(path), "--out", str(tmp_path / "g.png")]) == 2
    assert message in one_error_line(capsys, "decode")


# --------------------------------------------------------------------------- decode: grid and K

def test_decode_notes_another_grid_and_refuses_tokens_of_another_k(exported, tmp_path, capsys):
    from ddcl_vq.tokenizer.tokens import write_tokens

    small = tmp_path / "small.npy"
    np.save(small, np.zeros((3, 4, 4), dtype=np.int32))
    assert cli.main(["decode", str(exported), str(small), "--out", str(tmp_path / "g.png")]) == 0
    err = capsys.readouterr().err
    assert "note: the maps are 4x4 codes, the model was trained on 8x8" in err
    from PIL import Image
    assert Image.open(tmp_path / "g.png").size == (3 * 18 + 2, 18 + 2)  # three 16x16 images, padding 2

    other_k = tmp_path / "other_k.safetensors"
    write_tokens(other_k, np.zeros((2, 8, 8), dtype=np.uint16), None, {"num_codes": 512, "run": "runs/big"})
    assert cli.main(["decode", str(exported), str(other_k), "--out", str(tmp_path / "h.png")]) == 2
    line = one_error_line(capsys, "decode")
    assert "K = 512 codebook (made by runs/big), this model has K = 32" in line
    assert not (tmp_path / "h.png").exists()


# --------------------------------------------------------------------------- read-only runs

@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made read-only for real: a read-only bind mount as root (root ignores permission
    bits), permission bits otherwise; skips where neither is possible."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
        for p in modes:
            p.chmod(modes[p] & ~0o222)
        try:
            yield folder
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mount = folder.with_name(folder.name + "_ro")
    mount.mkdir()
    done = subprocess.run(["mount", "--bind", str(folder), str(mount)], capture_output=True)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip("no read-only mount possible here (root without mount rights)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], capture_output=True).returncode != 0:
            pytest.skip("no read-only remount possible here")
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        mount.rmdir()


def test_a_read_only_run_is_evaluated_and_compared_with_results_written_elsewhere(run, tmp_path, capsys):
    archived = copy_run(run, tmp_path / "archived")
    with read_only(archived) as ro:
        assert cli.main(["evaluate", str(ro), "--max-images", "16", "--quiet"]) == 2
        line = one_error_line(capsys, "evaluate")
        assert "cannot be written" in line and "pass --out PATH" in line
        assert cli.main(["evaluate", str(ro), "--max-images", "16", "--quiet", "--out", str(tmp_path / "ev.json")]) == 0
        ev = json.loads((tmp_path / "ev.json").read_text())
        assert ev["num_images"] == 16 and ev["made_by"] == "evaluate" and ev["run"] == str(ro)
        assert cli.main(["evaluate", str(ro), "--max-images", "16", "--quiet", "--out", str(tmp_path / "evals")]) == 0
        assert json.loads((tmp_path / "evals" / "eval.json").read_text())["num_images"] == 16

        out = tmp_path / "cmp"
        assert cli.main(["compare", str(ro), "--out", str(out), "--max-images", "16", "--quiet"]) == 0
        assert all((out / name).is_file() for name in OUTPUTS)
        (stored,) = (out / "evals").glob("*.json")
        assert json.loads(stored.read_text())["num_images"] == 16
        before = stored.stat().st_mtime_ns
        assert cli.main(["compare", str(ro), "--out", str(out), "--max-images", "16", "--quiet"]) == 0
        assert stored.stat().st_mtime_ns == before  # reused
    assert not (archived / "eval.json").exists()


# --------------------------------------------------------------------------- freshness and labels

def test_freshness_is_by_the_checkpoints_content_not_its_file_time(run, tmp_path):
    copy = copy_run(run, tmp_path / "copy")
    ev = evaluate_run(copy, max_images=32, batch_size=32)
    assert not needs_eval(copy, "test", 32)
    # another checkpoint of the same step and name, with an older file time (cp -p of another run's file)
    ckpt = copy / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=True)
    stamp = ckpt.stat()
    key = next(k for k, v in state["model"].items() if k.startswith("decoder") and v.is_floating_point())
    state["model"][key] = state["model"][key] * 0.5
    torch.save(state, ckpt)
    os.utime(ckpt, ns=(stamp.st_atime_ns - 10**12, stamp.st_mtime_ns - 10**12))
    assert (copy / "eval.json").stat().st_mtime > ckpt.stat().st_mtime and state["step"] == ev["step"]
    assert needs_eval(copy, "test", 32)
    rows = cli_compare([copy], tmp_path / "cmp", 32)
    truth = evaluate_run(copy, max_images=32, batch_size=32, write=False)
    assert rows[0]["hard_psnr"] == truth["recon"]["hard"]["psnr"] != ev["recon"]["hard"]["psnr"]


def cli_compare(runs, out: Path, max_images: int):
    assert cli.main(["compare", *map(str, runs), "--out", str(out), "--max-images", str(max_images), "--quiet"]) == 0
    return json.loads((out / "table.json").read_text())["rows"]


def test_compare_keeps_an_evaluate_result_and_labels_its_own(run, tmp_path):
    copy = copy_run(run, tmp_path / "copy")
    assert cli.main(["evaluate", str(copy), "--max-images", "16", "--quiet"]) == 0
    mine = (copy / "eval.json").read_bytes()
    rows = cli_compare([copy], tmp_path / "cmp", 8)
    assert rows[0]["num_images"] == 8
    assert (copy / "eval.json").read_bytes() == mine  # not overwritten
    assert json.loads(mine)["command"].startswith("ddcl-vq evaluate") and json.loads(mine)["num_images"] == 16
    (stored,) = (tmp_path / "cmp" / "evals").glob("*.json")
    ev = json.loads(stored.read_text())
    assert ev["num_images"] == 8 and ev["made_by"] == "compare" and ev["command"].startswith("ddcl-vq compare")
    # a run without an evaluate result gets compare's evaluation in RUN_DIR/eval.json, labelled as such
    fresh = copy_run(run, tmp_path / "fresh")
    cli_compare([fresh], tmp_path / "cmp2", 8)
    assert json.loads((fresh / "eval.json").read_text())["made_by"] == "compare"


# --------------------------------------------------------------------------- unfinished runs

def test_export_and_evaluate_of_an_unfinished_run_say_so_quietly(run, tmp_path, capsys):
    unfinished = copy_run(run, tmp_path / "unfinished")
    raw = yaml.safe_load((unfinished / "config.yaml").read_text())
    raw["train"]["steps"] = 12  # a training of 12 steps that has saved step 6 so far
    (unfinished / "config.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["export", str(unfinished), str(tmp_path / "exp"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "is at step 6 of 12" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["evaluate", str(unfinished), "--max-images", "8", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "is at step 6 of 12" in err
    assert "does not exist" not in err and "trying an older checkpoint" not in err
    assert cli.main(["export", str(run), str(tmp_path / "exp2"), "--quiet"]) == 0
    assert "warning:" not in capsys.readouterr().err  # a finished run: no warning


# --------------------------------------------------------------------------- issue 40: token files and exports

def test_a_safetensors_token_file_without_indices_is_refused(run, exported, tmp_path, capsys):
    """Item 6: a .safetensors file holding only 'labels' was decoded (labels as codes) and read by prior train
    as a code map."""
    from safetensors.numpy import save_file

    path = tmp_path / "labels_only.safetensors"
    save_file({"labels": np.arange(64, dtype=np.int64) % 10}, str(path))  # 64 values < K: one 8x8 "map"
    assert cli.main(["decode", str(exported), str(path), "--out", str(tmp_path / "g.png")]) == 2
    line = one_error_line(capsys, "decode")
    assert f"token file '{path}' has no 'indices' tensor (it holds 'labels')" in line, line
    assert cli.main(["prior", "train", str(run), "--tokens", str(path), f"run.dir={tmp_path / 'prior'}",
                     "train.steps=1", "--quiet"]) == 2
    assert "has no 'indices' tensor" in one_error_line(capsys, "prior train")
    assert not (tmp_path / "g.png").exists()


def test_decode_of_maps_with_a_zero_size_side_is_one_line(exported, tmp_path, capsys):
    """Item 9: np.zeros((4, 0, 8)) ended in a raw RuntimeError."""
    for shape in ((4, 0, 8), (4, 8, 0)):
        path = tmp_path / "empty_side.npy"
        np.save(path, np.zeros(shape, np.uint8))
        assert cli.main(["decode", str(exported), str(path), "--out", str(tmp_path / "g.png")]) == 2
        line = one_error_line(capsys, "decode")
        assert f"expected index maps of at least 1x1 codes, got maps of {shape[1]}x{shape[2]}" in line, line
    assert not (tmp_path / "g.png").exists()


def _poison(name_filter, row: bool, value: float):
    def poison(folder: Path):
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(folder / "model.safetensors"))
        name = next(k for k, t in tensors.items() if name_filter(k, t))
        if row:
            tensors[name][0] = value
        else:
            tensors[name].view(-1)[0] = value
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return name
    return poison


def test_an_export_with_non_finite_weights_is_refused_on_load(exported, tmp_path, capsys):
    """Rough edge: an export with a NaN codebook row or an Inf decoder weight loaded and decoded with rc 0."""
    from ddcl_vq.tokenizer.decode import decode_indices

    tokens = tmp_path / "t.npy"
    np.save(tokens, np.zeros((2, 8, 8), dtype=np.uint8))
    cases = {"nan codebook row": _poison(lambda k, t: k == "quantizer.weight", True, float("nan")),
             "inf decoder weight": _poison(lambda k, t: k.startswith("decoder.") and t.is_floating_point(), False,
                                           float("inf"))}
    for case, poison in cases.items():
        folder = tmp_path / case.replace(" ", "_")
        shutil.copytree(exported, folder)
        name = poison(folder)
        assert cli.main(["decode", str(folder), str(tokens), "--out", str(tmp_path / "g.png")]) == 2
        line = one_error_line(capsys, "decode")
        assert "hold values that are not finite (NaN or Inf)" in line and f" in {name}" in line, (case, line)
        with pytest.raises(ValueError, match="not finite"):
            VQVAE.from_pretrained(str(folder))
    assert not (tmp_path / "g.png").exists()
    model = VQVAE.from_pretrained(str(exported))  # the healthy export still loads and decodes
    assert decode_indices(model, np.zeros((1, 8, 8), np.uint8)).isfinite().all()


def test_tokenize_replaces_an_existing_file_only_with_overwrite(run, exported, tmp_path, capsys):
    """Rough edge: tokenize --out EXISTING silently replaced a token file and its labels; a file in the way of
    --out's folder ended, after the work, in a bare 'File exists'."""
    out = tmp_path / "t.npy"
    base = ["tokenize", str(run), "--split", "test", "--max-images", "8", "--quiet"]
    assert cli.main(base + ["--out", str(out)]) == 0
    before = (out.read_bytes(), (tmp_path / "t.labels.npy").read_bytes())
    assert cli.main(base[:-2] + ["4", "--quiet", "--out", str(out)]) == 2
    assert one_error_line(capsys, "tokenize").endswith(
        f"--out '{out}' exists; pass --overwrite to replace it (and its labels t.labels.npy)")
    assert (out.read_bytes(), (tmp_path / "t.labels.npy").read_bytes()) == before
    assert cli.main(base[:-2] + ["4", "--quiet", "--out", str(out), "--overwrite"]) == 0
    assert np.load(out).shape[0] == 4 and np.load(tmp_path / "t.labels.npy").shape == (4,)

    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("not a folder")
    expected = f"'{in_the_way}' is a file, not a folder"
    for prog, argv in (("tokenize", base + ["--out", str(in_the_way / "x.npy")]),
                       ("decode", ["decode", str(exported), str(out), "--out", str(in_the_way / "g.png")]),
                       ("export", ["export", str(run), str(in_the_way / "exp")])):
        assert cli.main(argv) == 2
        line = one_error_line(capsys, prog)
        assert expected in line and "File exists" not in line, line
    (tmp_path / "folder.npy").mkdir()
    assert cli.main(base + ["--out", str(tmp_path / "folder.npy"), "--overwrite"]) == 2
    assert f"--out '{tmp_path / 'folder.npy'}' is a folder" in one_error_line(capsys, "tokenize")


@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """A tiny image folder of 32x32 colour images (train/ and test/)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    g = np.random.default_rng(0)
    for split in ("train", "test"):
        (root / split / "a").mkdir(parents=True)
        for i in range(8):
            Image.fromarray((g.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / split / "a" / f"{i}.png")
    return root


def test_tokenize_of_an_image_folder_export_says_the_export_does_not_record_the_root(colour_folder, tmp_path,
                                                                                     capsys, monkeypatch):
    """Rough edge: tokenize of an image-folder export without data.root gave no hint that the export does not
    record where the folder is."""
    run = tmp_path / "run"
    overrides = ["data.name=image_folder", f"data.root={colour_folder}", "data.image_size=32", "data.batch_size=4",
                 "train.steps=1", f"run.dir={run}"]
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY + overrides), quiet=True)
    export_run(run, tmp_path / "exp")
    monkeypatch.chdir(tmp_path)  # no ./data here
    argv = ["tokenize", str(tmp_path / "exp"), "--split", "test", "--quiet"]
    assert cli.main(argv + ["--out", "t.npy"]) == 2
    line = one_error_line(capsys, "tokenize")
    assert "image_folder" in line and "an export records its dataset's name and image size, not where an image " \
                                      "folder is: pass data.root=" in line, line
    assert cli.main(argv + ["--out", "t.npy", f"data.root={colour_folder}"]) == 0
    assert np.load(tmp_path / "t.npy").shape[0] == 8


def test_a_run_evaluated_on_images_of_other_channels_says_so(run, colour_folder, tmp_path, capsys):
    """Rough edge: a 1-channel run evaluated on a 3-channel folder blamed 'another number of codes'."""
    assert cli.main(["evaluate", str(run), "--out", str(tmp_path / "e"), "data.name=image_folder",
                     f"data.root={colour_folder}"]) == 2
    line = one_error_line(capsys, "evaluate")
    assert "holds a model of 1-channel images, the model built from the config takes 3-channel images" in line
    assert "number of codes" not in line


def test_compare_lists_a_run_given_twice_once_with_a_note(run, tmp_path, capsys):
    """Rough edge: compare R R listed one run twice."""
    out = tmp_path / "cmp"
    assert cli.main(["compare", str(run), f"{run}/", str(run.parent / ".." / run.parent.name / run.name), "--out",
                     str(out), "--max-images", "8", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"is the run '{run}' again; compared once") == 2, err
    assert len(json.loads((out / "table.json").read_text())["rows"]) == 1


def test_prior_sample_refuses_a_count_the_machine_cannot_hold_with_the_figure(run, tmp_path, capsys):
    """Rough edge: prior sample --count 100000000 had no up-front limit (1.8 GB after 25 s, silently)."""
    import time

    tokens = tmp_path / "t.npy"
    assert cli.main(["tokenize", str(run), "--split", "test", "--max-images", "64", "--out", str(tokens),
                     "--quiet"]) == 0
    prior = tmp_path / "prior"
    assert cli.main(["prior", "train", str(run), "--tokens", str(tokens), f"run.dir={prior}", "train.steps=1",
                     "train.batch_size=8", "model.dim=16", "model.layers=1", "model.heads=2", "train.eval_images=0",
                     "train.device=cpu", "--quiet"]) == 0
    start = time.time()
    assert cli.main(["prior", "sample", str(prior), "--count", "100000000", "--out", str(tmp_path / "s.png"),
                     "--device", "cpu"]) == 2
    line = one_error_line(capsys, "prior sample")
    assert "--count 100,000,000: the codes, decoded images and PNG grid need about" in line and "GB" in line, line
    assert "this machine has" in line and "sample fewer (--count" in line
    assert time.time() - start < 30 and not (tmp_path / "s.png").exists()
    assert cli.main(["prior", "sample", str(prior), "--count", "4", "--out", str(tmp_path / "s.png"),
                     "--device", "cpu"]) == 0  # a count that fits is sampled as before
    assert np.load(tmp_path / "s.npy").shape == (4, 8, 8)
    (tmp_path / "a_file").write_text("x")  # a file in the way of --out's folder: named before sampling
    assert cli.main(["prior", "sample", str(prior), "--count", "4", "--out", str(tmp_path / "a_file" / "s.png"),
                     "--device", "cpu"]) == 2
    assert f"'{tmp_path / 'a_file'}' is a file, not a folder" in one_error_line(capsys, "prior sample")


# --------------------------------------------------------------------------- issue 51: rough edges

def test_a_short_file_of_zeros_is_not_a_npy_file_and_tokens_of_another_run_get_a_note(run, exported, tmp_path,
                                                                                       capsys):
    zeros = tmp_path / "zeros.npy"
    zeros.write_bytes(bytes(100))
    assert cli.main(["decode", str(exported), str(zeros), "--out", str(tmp_path / "g.png")]) == 2
    line = one_error_line(capsys, "decode")
    assert "it is not a .npy file (it does not begin with numpy's header" in line and "pickled" not in line, line
    tokens = tmp_path / "t.safetensors"
    assert cli.main(["tokenize", str(run), "--split", "test", "--max-images", "8", "--out", str(tokens),
                     "--quiet"]) == 0
    other = copy_run(run, tmp_path / "other")  # the same K: decodable, but another run's codebook
    for model, noted in ((run, False), (exported, False), (other, True)):
        assert cli.main(["decode", str(model), str(tokens), "--out", str(tmp_path / "g.png")]) == 0
        err = capsys.readouterr().err
        assert (f"note: the tokens were made by {run} (step 6), not by '{other}'" in err) == noted, err


def _concurrently(*argvs):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "ddcl_vq", *map(str, argv)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for argv in argvs]
    return [(p.wait(timeout=600), p.stderr.read()) for p in procs]


def test_two_exports_or_tokenizes_to_one_new_target_do_not_both_succeed(run, tmp_path):
    """Issue 51: two concurrent exports into one new folder, or tokenizes to one file without --overwrite, both
    succeeded (the second silently replaced the first); now one of them fails in one line."""
    out, tokens = tmp_path / "out", tmp_path / "t.npy"
    for argvs, name in ((2 * [["export", run, out, "--quiet"]], "export"),
                        (2 * [["tokenize", run, "--split", "test", "--max-images", "500", "--out", tokens, "--quiet"]],
                         "tokenize")):
        results = _concurrently(*argvs)
        assert sorted(code for code, _ in results) == [0, 2], results
        err = next(e for code, e in results if code == 2).strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddcl-vq {name}: error: ") and "--overwrite" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder, no hidden file


def test_a_read_only_folder_is_named_not_the_hidden_temporary_file(run, exported, tmp_path, capsys):
    target = tmp_path / "ro"
    target.mkdir()
    codes = tmp_path / "c.npy"
    np.save(codes, np.zeros((2, 8, 8), dtype=np.uint8))
    with read_only(target) as ro:
        for prog, argv, named in (("export", ["export", run, ro / "out"], ro / "out"),
                                  ("tokenize", ["tokenize", run, "--split", "test", "--max-images", "8", "--out",
                                                ro / "t.npy", "--quiet"], ro / "t.npy"),
                                  ("decode", ["decode", exported, codes, "--out", ro / "g.png"], ro / "g.png")):
            assert cli.main([str(a) for a in argv]) == 2
            line = one_error_line(capsys, prog)
            assert f"'{named}'" in line and "Read-only file system" in line and ".tmp-" not in line \
                and ".export-" not in line, line


def test_tokenize_stopped_by_sigterm_says_so_in_one_line(run, tmp_path):
    out = tmp_path / "t.npy"
    code = ("import os, signal, sys\n"
            "from ddcl_vq.common import progress\n"
            "update = progress.Progress.update\n"
            "def update_then_stop(self, n=1):\n"
            "    update(self, n)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "progress.Progress.update = update_then_stop\n"
            "from ddcl_vq.cli import main\n"
            f"sys.exit(main(['tokenize', {str(run)!r}, '--split', 'test', '--max-images', '600', '--batch-size', "
            f"'100', '--out', {str(out)!r}, '--quiet']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    err = done.stderr.strip().splitlines()
    assert done.returncode == 143 and len(err) == 1, done.stderr[-2000:]
    assert err[0] == f"ddcl-vq tokenize: stopped by SIGTERM while encoding; nothing was written to '{out}'"
    assert not list(tmp_path.iterdir())


def test_evaluate_or_compare_of_a_prior_run_names_the_command_that_evaluates_it(run, tmp_path, capsys):
    tokens, prior = tmp_path / "t.npy", tmp_path / "prior"
    assert cli.main(["tokenize", str(run), "--split", "test", "--max-images", "32", "--out", str(tokens),
                     "--quiet"]) == 0
    assert cli.main(["prior", "train", str(run), "--tokens", str(tokens), f"run.dir={prior}", "train.steps=1",
                     "train.batch_size=8", "model.dim=16", "model.layers=1", "model.heads=2", "train.eval_images=0",
                     "train.device=cpu", "--quiet"]) == 0
    capsys.readouterr()
    for argv, prog in ((["evaluate", prior], "evaluate"), (["compare", prior, "--out", tmp_path / "cmp"], "compare")):
        assert cli.main([str(a) for a in argv]) == 2
        line = one_error_line(capsys, prog)
        assert "is the config of a prior run" in line and "ddcl-vq prior evaluate" in line, line
        assert "unknown config key" not in line
