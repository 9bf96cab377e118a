"""ddcl-vq gap: the quantization-gap diagnostic on tiny runs trained on real Fashion-MNIST."""
import json

import pytest
import torch

from ddcl_vq.tokenizer.evaluate import EvaluateError, load_run
from ddcl_vq.tokenizer.gap import duplicate_codes, lloyd_step, main, nearest_codes, quantization_gap
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import build_dataset
from ddcl_vq.tokenizer.train import train
from ddcl_vq.tokenizer.evaluate import reconstruction_pass
from conftest import TINY

TINY = TINY + ["train.eval_images=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gap")
    out = {}
    for qtype in ("ddcl", "hard"):
        train(load_config(f"configs/fashion_{qtype}.yaml", TINY + [f"run.dir={base / qtype}"]), quiet=True)
        out[qtype] = base / qtype
    train(load_config("configs/fashion_ddcl.yaml", TINY + ["quantizer.type=fsq", "quantizer.num_codes=256",
                                                             f"run.dir={base / 'fsq'}"]), quiet=True)
    out["fsq"] = base / "fsq"
    return out


def test_lloyd_step_never_raises_the_distortion_it_fits():
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(2000, 8, generator=g) * torch.linspace(0.5, 3, 8)
    codebook = torch.randn(40, 8, generator=g) * 4  # some codes far away: they get no vectors
    before = nearest_codes(vectors, codebook)[1].mean()
    refit = lloyd_step(codebook, vectors)
    assert nearest_codes(vectors, refit)[1].mean() <= before + 1e-6
    idx = nearest_codes(vectors, codebook)[0]
    empty = torch.bincount(idx, minlength=40) == 0
    assert empty.any() and torch.equal(refit[empty], codebook[empty])  # codes without vectors stay
    used = (~empty).nonzero()[0, 0]
    assert torch.allclose(refit[used], vectors[idx == used].mean(0), atol=1e-5)


def test_duplicate_codes_are_codes_with_a_neighbour_within_a_hundredth_of_the_median_spacing():
    codebook = torch.tensor([[float(i), 0.0] for i in range(10)])   # spacing 1 (squared 1)
    assert not duplicate_codes(codebook).any()
    codebook = torch.cat([codebook, codebook[[3]] + torch.tensor([0.0, 0.09]),    # squared 0.0081: duplicate
                          codebook[[7]] + torch.tensor([0.0, 0.11])])             # squared 0.0121: not
    assert duplicate_codes(codebook, rows=4).nonzero().flatten().tolist() == [3, 10]


def test_token_flips_grow_with_the_noise_and_duplicates_are_counted(runs):
    small = quantization_gap(runs["ddcl"], images=200, lloyd=0, noise=0.001)
    large = quantization_gap(runs["ddcl"], images=200, lloyd=0, noise=0.1)
    assert 0 <= small["token_flips"] < large["token_flips"] <= 1 and large["noise"] == 0.1
    cfg, model, _, _ = load_run(runs["ddcl"])
    assert small["duplicate_codes"] == int(duplicate_codes(model.quantizer.codebook.detach()).sum())
    assert 0 <= small["duplicate_token_share"] <= 1


@pytest.mark.parametrize("qtype", ["ddcl", "hard", "fsq"])
def test_gap_figures_agree_with_the_evaluation_pass(runs, qtype):
    row = quantization_gap(runs[qtype], images=300, fit_images=300, lloyd=2)
    cfg, model, _, _ = load_run(runs[qtype])
    ref = reconstruction_pass(model, build_dataset(cfg.data, "test", seed=cfg.run.seed), max_images=300)
    assert row["num_images"] == 300 and row["num_codes"] == model.quantizer.num_codes
    assert row["psnr_hard"] == pytest.approx(ref["hard"]["psnr"], abs=1e-3)  # the quantizer's own hard codes
    assert row["utilization_hard"] == pytest.approx(ref["usage"].utilization)
    if qtype == "fsq":   # its index rounds a projection: no nearest-code refit, no unquantized decode
        assert not model.quantizer.assigns_nearest_code and "psnr_lloyd" not in row
        assert row["psnr_unquantized"] is row["gap_db"] is row["relative_distortion"] is None
    else:
        assert row["gap_db"] == pytest.approx(row["psnr_unquantized"] - row["psnr_hard"])
        assert 0 < row["relative_distortion"] < float("inf")
        assert row["lloyd_steps"] == 2 and "psnr_lloyd" in row and 0 < row["utilization_lloyd"] <= 1
        # 300 images' features hold K = 32 codes many times over: the drawn codebook exists and is used
        assert 0 < row["utilization_sampled"] <= 1 and row["psnr_sampled"] > 5


def test_gap_cli_prints_a_table_and_writes_json(runs, tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert main([str(runs["ddcl"]), str(runs["hard"]), "--images", "100", "--lloyd", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "quantization gap" in text and "\n| ddcl | 32 |" in text and "\n| hard | 32 |" in text
    assert "tokens flipped by noise" in text and "(sd 0.005)" in text
    rows = json.loads(out.read_text())
    assert [r["num_images"] for r in rows] == [100, 100] and all("psnr_lloyd" not in r for r in rows)


def test_gap_cli_errors_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddcl-vq gap: error: ") and "does not exist" in err[0]
    assert main([str(tmp_path), "--images", "0"]) == 2
    assert "option --images: expected a value > 0" in capsys.readouterr().err
    assert main([str(tmp_path), "--noise", "0"]) == 2
    assert "option --noise: expected a value > 0" in capsys.readouterr().err


def test_gap_measures_another_dataset_with_data(runs):
    own = quantization_gap(runs["ddcl"], images=100, lloyd=0)
    digits = quantization_gap(runs["ddcl"], images=100, lloyd=0, data="digits")
    assert own["data"] != "digits" and digits["data"] == "digits"
    assert digits["psnr_hard"] != pytest.approx(own["psnr_hard"], abs=1e-6)
    with pytest.raises(EvaluateError, match="--data: expected one of"):
        quantization_gap(runs["ddcl"], images=100, lloyd=0, data="no_such_data")
