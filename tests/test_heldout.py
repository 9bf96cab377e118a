"""Held-out data (issue 22): natural_patches' photographs chosen by config, the UCI digits, evaluation
on another dataset (RUN_DIR/eval_<dataset>.json), and studies with parts (one table per part)."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ddcl_vq.tokenizer.evaluate import main as evaluate_main
from ddcl_vq.studies.cli import main as study_main
from ddcl_vq.studies.study import load_study
from ddcl_vq.tokenizer.train import main as train_main
from ddcl_vq.tokenizer.config import ConfigError, load_config
from ddcl_vq.common.data import (NATURAL_TEST_PHOTOS, NATURAL_TRAIN_PHOTOS, PHOTOGRAPHS, build_dataset,
                                digits_arrays, image_channels, natural_patches)
from ddcl_vq.tokenizer.train import train
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "configs" / "study_heldout.yaml"
TINY = TINY + ["train.eval_images=0"]


def _sha(images: torch.Tensor) -> str:
    return hashlib.sha256(images.numpy().tobytes()).hexdigest()


# --------------------------------------------------------------------------- photographs

def test_photo_lists_are_checked_up_front(capsys):
    with pytest.raises(ConfigError, match=r"data.train_photos.*unknown photograph 'lena'.*astronaut, chelsea"):
        load_config(None, ["data.name=natural_patches", "data.train_photos=[astronaut, lena]"])
    with pytest.raises(ConfigError, match=r"data.test_photos.*unknown photograph 'eagle'"):  # downloads: refused
        load_config(None, ["data.test_photos=[eagle]"])
    with pytest.raises(ConfigError, match=r"data.test_photos.*at least one photograph"):
        load_config(None, ["data.test_photos=[]"])
    with pytest.raises(ConfigError, match=r"data.train_photos.*coffee twice"):
        load_config(None, ["data.train_photos=[coffee, coffee]"])
    # the command: one line, exit 2, naming the valid photographs
    assert train_main(["--config", "configs/natural_patches_ddcl.yaml", "--print-config",
                       "data.test_photos=[astronot]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ddcl-vq train: error:")
    assert "'astronot'" in err and all(name in err for name in PHOTOGRAPHS)


def test_overlapping_photo_lists_are_refused():
    with pytest.raises(ConfigError, match=r"share chelsea.*leak"):
        load_config(None, ["data.train_photos=[astronaut, chelsea]", "data.test_photos=[chelsea]"])
    # the default test photographs count too: a training list that takes one of them is refused
    with pytest.raises(ConfigError, match=r"share stereo_motorcycle"):
        load_config(None, ["data.name=natural_patches", "data.train_photos=[stereo_motorcycle]"])
    cfg = load_config(None, ["data.train_photos=[astronaut, rocket]", "data.test_photos=[coffee]"])
    assert (cfg.data.train_photos, cfg.data.test_photos) == (["astronaut", "rocket"], ["coffee"])


#: sha256 of natural_patches' uint8 patches as the code made them before the photographs became
#: config keys (commit b6aa5da): the defaults must keep the data bit for bit
BEFORE = {("train", 8, 0): "1fcfeae145bd722e9927992ccaadea88b761167b62d756257ff1de3cfc992a4a",
          ("train", 12, 3): "db89376579b112e1b3f864c29e3753b550eb80a5283b83ef4de6da16c08b3540",
          ("test", 8, 0): "33a1a181e80766ccb7604f953aafa8ae57ceb26119a51c1b58ba36adb1060666",
          ("test", 12, 3): "beb4212c05c863e89e49bf36363a92d217b48b9424435317f4d686dddef2d9db"}


def test_default_natural_patches_are_bit_identical_to_before():
    for (split, per_image, seed), digest in BEFORE.items():
        assert _sha(natural_patches(split, 32, per_image, seed).images) == digest, (split, per_image, seed)
        cfg = load_config(None, ["data.name=natural_patches", f"data.patches_per_image={per_image}"])
        assert (cfg.data.train_photos, cfg.data.test_photos) == (list(NATURAL_TRAIN_PHOTOS), list(NATURAL_TEST_PHOTOS))
        assert _sha(build_dataset(cfg.data, split, seed).images) == digest, (split, per_image, seed)


def test_chosen_photographs_make_the_splits():
    cfg = load_config(None, ["data.name=natural_patches", "data.patches_per_image=8",
                             "data.train_photos=[astronaut, camera]", "data.test_photos=[coffee]"])
    train_set, test_set = build_dataset(cfg.data, "train"), build_dataset(cfg.data, "test")
    assert tuple(train_set.images.shape) == (16, 3, 32, 32) and tuple(test_set.images.shape) == (2, 3, 32, 32)
    grey = train_set.images[8:]  # camera: a grey photograph as three equal channels
    assert torch.equal(grey[:, 0], grey[:, 1]) and torch.equal(grey[:, 0], grey[:, 2])
    colour = train_set.images[:8]
    assert not torch.equal(colour[:, 0], colour[:, 1])
    # the first photograph's patches do not depend on what else is in the list
    alone = natural_patches("train", 32, 8, 0, train_photos=("astronaut",), test_photos=("coffee",))
    assert torch.equal(alone.images, colour)


# --------------------------------------------------------------------------- digits

def test_digits_load_with_the_right_shapes_range_and_split():
    from sklearn.datasets import load_digits

    reference = load_digits()
    train_x, train_y = digits_arrays("train")
    test_x, test_y = digits_arrays("test")
    assert train_x.shape == (1297, 28, 28) and test_x.shape == (500, 28, 28) and train_x.dtype == np.uint8
    assert np.array_equal(np.concatenate([train_y, test_y]), reference.target)
    assert train_x.max() == 255 and train_x.min() == 0
    # 28x28 is the 8x8 original (0..16 -> 0..255) upsampled bilinearly: Pillow's bilinear resize agrees
    from PIL import Image
    pil = np.stack([np.asarray(Image.fromarray((r * 255 / 16).astype(np.float32), mode="F").resize(
        (28, 28), Image.BILINEAR)) for r in reference.images[1297:]])
    assert np.abs(np.clip(np.round(pil), 0, 255) - test_x).max() <= 1  # rounding
    cfg = load_config(None, ["data.name=digits"])
    assert image_channels(cfg.data) == 1
    test_set = build_dataset(cfg.data, "test")
    image, label = test_set[0]
    assert len(test_set) == 500 and tuple(image.shape) == (1, 32, 32) and int(label) == reference.target[1297]
    assert image.dtype == torch.float32 and 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    assert float(image[:, :2].abs().sum() + image[:, -2:].abs().sum()) == 0.0  # padded 28 -> 32 like Fashion-MNIST
    with pytest.raises(ConfigError, match="data.image_size"):
        build_dataset(load_config(None, ["data.name=digits", "data.image_size=16", "model.num_downsamples=2"]).data,
                      "test")


def test_a_fashion_run_evaluated_on_digits_keeps_its_own_eval(tmp_path, capsys):
    run = tmp_path / "fashion"
    train(load_config("configs/fashion_ddcl.yaml", TINY + [f"run.dir={run}"]), quiet=True)
    assert evaluate_main([str(run), "--quiet", "--max-images", "64"]) == 0
    own = (run / "eval.json").read_bytes()
    assert evaluate_main([str(run), "--quiet", "data.name=digits"]) == 0
    assert (run / "eval.json").read_bytes() == own  # not overwritten
    ev = json.loads((run / "eval_digits.json").read_text())
    assert ev["dataset"] == "digits" and ev["trained_on"] == "fashion_mnist" and ev["num_images"] == 500
    assert ev["overrides"] == ["data.name=digits"] and "data.name=digits" in ev["command"]
    assert json.loads(own)["dataset"] == "fashion_mnist"
    # an override that keeps the data (where it runs) still writes the run's own eval.json
    assert evaluate_main([str(run), "--quiet", "--max-images", "32", "train.device=cpu"]) == 0
    assert json.loads((run / "eval.json").read_text())["num_images"] == 32
    # evaluate measures the model as trained: the other data must fit it (1 channel, not 3)
    assert evaluate_main([str(run), "--quiet", "data.name=natural_patches"]) == 2
    capsys.readouterr()


# --------------------------------------------------------------------------- the study

def test_heldout_study_config_lists_every_part_and_arm():
    study = load_study(HELDOUT)
    assert study.seeds == [0, 1, 2] and [p.name for p in study.parts] == ["photos_a", "photos_b", "photos_c",
                                                                           "fashion_to_digits"]
    arms = ["ddcl", "hard", "ema_restart", "vqp_default", "vqp_kmeans_expiry", "fsq", "fsq_888", "simvq",
            "simvq_fair", "simvq_fair_no_rotation"]
    assert len(study.arms) == 4 * len(arms) * 3
    assert [a.name for a in study.arms[:len(arms)]] == [f"photos_a_{a}_s0" for a in arms]
    assert {a.group for a in study.arms} == {f"{p.name}_{a}" for p in study.parts for a in arms}
    types = {a.config.quantizer["type"] for a in study.arms}
    assert types == {"ddcl", "hard", "ema", "vqp", "fsq", "simvq"}
    ddcl = [a.config.quantizer for a in study.arms if a.config.quantizer["type"] == "ddcl"]
    defaults = load_config(None).quantizer
    assert all(q == {**defaults, "num_codes": q["num_codes"]} for q in ddcl)  # the library defaults
    photos = [p for p in study.parts if p.name.startswith("photos_")]
    assert len(photos) >= 3
    splits = set()
    for part in photos:
        cfgs = [a.config for a in study.arms if a.part == part.name]
        assert {c.data.name for c in cfgs} == {"natural_patches"} and {c.quantizer["num_codes"] for c in cfgs} == {512}
        train_photos, test_photos = cfgs[0].data.train_photos, cfgs[0].data.test_photos
        assert 2 <= len(train_photos) <= 3 and len(test_photos) == 1 and test_photos[0] not in train_photos
        assert all((c.data.train_photos, c.data.test_photos) == (train_photos, test_photos) for c in cfgs)
        splits.add((tuple(train_photos), test_photos[0]))
    assert len({test for _, test in splits}) == len(photos)  # a different held-out photograph each
    cross = next(p for p in study.parts if p.name == "fashion_to_digits")
    assert cross.eval_overrides == ["data.name=digits"]
    cfgs = [a.config for a in study.arms if a.part == cross.name]
    assert {c.data.name for c in cfgs} == {"fashion_mnist"} and {c.quantizer["num_codes"] for c in cfgs} == {1024}
    vqp = {a.group: a.config.quantizer for a in study.arms if a.config.quantizer["type"] == "vqp"}
    assert vqp["photos_a_vqp_kmeans_expiry"] == {"type": "vqp", "num_codes": 512, "kmeans_init": True,
                                                 "threshold_ema_dead_code": 2}
    assert vqp["photos_a_vqp_default"] == {"type": "vqp", "num_codes": 512}
    assert {a.vs for a in study.arms if a.part == "photos_b"} == {None, "photos_b_ddcl"}


def test_study_parts_are_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    base = {"base": {"data": {"name": "natural_patches"}}, "arms": [{"name": "ddcl"}]}
    bad.write_text(yaml.safe_dump({**base, "parts": [{"name": "p", "overrides": {"data.test_photos": ["lena"]}}]}))
    with pytest.raises(ConfigError, match=r"arm 'p_ddcl'.*unknown photograph 'lena'"):
        load_study(bad)
    bad.write_text(yaml.safe_dump({**base, "parts": [{"name": "p", "eval_overrides": {"quantizer.num_codes": 8}}]}))
    with pytest.raises(ConfigError, match=r"part 'p'.*data\.\* keys only"):
        load_study(bad)
    bad.write_text(yaml.safe_dump({**base, "parts": [{"name": "p", "eval_overrides": {"data.name": "digitz"}}]}))
    with pytest.raises(ConfigError, match=r"arm 'p_ddcl'.*data.name"):
        load_study(bad)
    bad.write_text(yaml.safe_dump({**base, "parts": [{"name": "p"}, {"name": "p"}]}))
    with pytest.raises(ConfigError, match="distinct part names"):
        load_study(bad)


def test_a_study_with_parts_compares_each_part_on_its_own(tmp_path):
    """Two parts (held-out photographs; Fashion-MNIST evaluated on digits) x two arms, --quick:
    one table per part and per evaluation data, never one table over both."""
    study = tmp_path / "study_parts.yaml"
    study.write_text(yaml.safe_dump({
        "name": "parts", "base": {"data": {"patches_per_image": 40}, "quantizer": {"num_codes": 16}},
        "eval": {"max_images": 48},
        "parts": [{"name": "photos", "description": "astronaut -> coffee",
                   "overrides": {"data.name": "natural_patches", "data.train_photos": ["astronaut"],
                                 "data.test_photos": ["coffee"]}},
                  {"name": "f2d", "overrides": {"data.name": "fashion_mnist"},
                   "eval_overrides": {"data.name": "digits"}}],
        "arms": [{"name": "ddcl", "overrides": {"quantizer.type": "ddcl"}},
                 {"name": "hard", "overrides": ["quantizer.type=hard"], "vs": "ddcl"}]}))
    out = tmp_path / "report"
    assert study_main(["--config", str(study), "--quick", "--out", str(out)]) == 0
    runs = out / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["f2d_ddcl", "f2d_hard", "photos_ddcl", "photos_hard"]
    photos = json.loads((runs / "photos_ddcl" / "eval.json").read_text())
    assert photos["dataset"] == "natural_patches" and photos["photos"] == ["coffee"] and photos["num_images"] == 10
    own = json.loads((runs / "f2d_hard" / "eval.json").read_text())
    held = json.loads((runs / "f2d_hard" / "eval_digits.json").read_text())
    assert own["dataset"] == "fashion_mnist" and held["dataset"] == "digits" and held["num_images"] == 64  # --quick: 64
    tables = {name: json.loads((out / name / "table.json").read_text()) for name in ("photos", "f2d", "f2d/digits")}
    assert {k: [r["name"] for r in t["rows"]] for k, t in tables.items()} == {
        "photos": ["photos_ddcl", "photos_hard"], "f2d": ["f2d_ddcl", "f2d_hard"],
        "f2d/digits": ["f2d_ddcl", "f2d_hard"]}
    digits_row = {r["name"]: r for r in tables["f2d/digits"]["rows"]}["f2d_hard"]
    assert digits_row["hard_psnr"] == held["recon"]["hard"]["psnr"]  # the table is the digits evaluation
    assert "Evaluated on the digits test split" in (out / "f2d" / "digits" / "table.md").read_text()
    assert "Evaluated on the fashion_mnist test split" in (out / "f2d" / "table.md").read_text()
    report = (out / "report.md").read_text()
    heads = [line for line in report.splitlines() if line.startswith("### ")]
    assert heads == ["### Trained on natural_patches (astronaut), evaluated on natural_patches (coffee) (test split)",
                     "### Trained on fashion_mnist, evaluated on fashion_mnist (test split)",
                     "### Trained on fashion_mnist, evaluated on digits (test split; held out: data.name=digits)"]
    for section in report.split("### ")[1:]:  # each table holds its own part's runs only
        names = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")} - {"run"}
        assert len({n.split("_")[0] for n in names}) == 1, names
    for path in ("photos/report.md", "f2d/report.md", "f2d/digits/report.md", "f2d/digits/reconstructions.png"):
        assert (out / path).is_file(), path
    assert "evaluated on the digits test split" in (out / "f2d" / "digits" / "report.md").read_text()
    summary = json.loads((out / "study.json").read_text())
    assert [p["part"] for p in summary["parts"]] == ["photos", "f2d"]
    assert summary["parts"][1]["heldout"]["evaluated_on"] == "digits"
    # run again: finished arms are not retrained and the held-out evaluation is reused
    stamp = (runs / "f2d_hard" / "eval_digits.json").stat().st_mtime_ns
    assert study_main(["--config", str(study), "--quick", "--out", str(out), "--report-only"]) == 0
    assert (runs / "f2d_hard" / "eval_digits.json").stat().st_mtime_ns == stamp


def test_compare_refuses_runs_tested_on_other_photographs(tmp_path):
    from ddcl_vq.studies.compare import check_one_dataset
    from ddcl_vq.tokenizer.evaluate import EvaluateError
    from ddcl_vq.tokenizer.config import dump_config

    def run(name, *overrides):
        (tmp_path / name).mkdir()
        cfg = load_config(None, ["data.name=natural_patches", *overrides])
        (tmp_path / name / "config.yaml").write_text(dump_config(cfg))
        return tmp_path / name

    a = run("a", "data.train_photos=[astronaut]", "data.test_photos=[coffee]")
    b = run("b", "data.train_photos=[rocket]", "data.test_photos=[coffee]")
    c = run("c", "data.train_photos=[astronaut]", "data.test_photos=[chelsea]")
    assert check_one_dataset([a, b]) == "natural_patches 3x32x32 (test photographs coffee)"
    with pytest.raises(EvaluateError, match=r"different datasets.*test photographs chelsea.*test photographs coffee"):
        check_one_dataset([a, c])
