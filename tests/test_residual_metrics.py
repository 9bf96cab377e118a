"""Per-level evaluation of a quantizer with several codebooks (issue 59): a tiny VQVAE whose quantizer is a
ResidualDDCL (or a GroupedDDCL), trained a few steps on real Fashion-MNIST, through the evaluator's pass, its
eval.json codebook block and report, and the compare tables; a single-codebook run keeps its output."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Subset

from ddcl_vq import CodebookUsage, DDCLQuantizer, GroupedDDCL, ResidualDDCL
from ddcl_vq.common.data import build_dataset
from ddcl_vq.models import VQVAE
from ddcl_vq.models.vqvae import Decoder, Encoder
from ddcl_vq.studies.tables import make_row, markdown_table, write_tables
from ddcl_vq.tokenizer import evaluate as evaluate_module
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.tokenizer.evaluate import (codebook_block, evaluate_run, format_report, load_run,
                                        reconstruction_by_levels, reconstruction_pass)
from ddcl_vq.tokenizer.metrics import definitions
from ddcl_vq.tokenizer.train import train
from conftest import TINY

K, D, L = 32, 8, 3
#: eval.json's codebook block of a single-codebook quantizer, in order (what it was before per-level fields)
SINGLE_KEYS = ["utilization", "active_codes", "dead_codes", "perplexity", "soft_perplexity", "entropy_bits",
               "num_vectors", "utilization_ceiling", "queue_utilization", "queue_indices", "queue_ceiling",
               "batch_utilization", "batch_ceiling", "min_code_distance", "mean_code_distance",
               "min_active_code_distance", "mean_active_code_distance"]


@pytest.fixture(scope="module")
def images():
    ds = build_dataset(load_config().data, "test")
    return Subset(ds, list(range(640)))


def tiny_model(quantizer, images, steps=40, seed=0):
    torch.manual_seed(seed)
    model = VQVAE(Encoder(1, 16, 1, 2, D, 8), quantizer, Decoder(1, 16, 1, 2, D, 8))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    x_all = torch.stack([images[i][0] for i in range(len(images))])
    model.train()
    for step in range(steps):
        x = x_all[(step * 64) % len(x_all):][:64]
        out = model(x)
        loss = F.mse_loss(out.reconstruction, x) + out.quantizer.loss / D
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.quantizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def residual_model(images):
    return tiny_model(ResidualDDCL(K, D, L, warmup_steps=0), images)


def test_the_pass_counts_every_level_and_reconstructs_from_the_first_levels(residual_model, images):
    model = residual_model
    result = reconstruction_pass(model, images, batch_size=64, max_images=192)
    usage = result["usage"]
    assert usage.codebooks == L and result["num_images"] == 192
    with torch.no_grad():
        x = torch.stack([images[i][0] for i in range(192)])
        indices = model.encode_indices(x)                                    # (B, 8, 8, L)
    assert indices.shape == (192, 8, 8, L)
    for i in range(L):  # each level's figures: those of its own indices alone
        alone = CodebookUsage(K)
        alone.update(indices[..., i])
        one = alone.compute()
        assert usage.utilization_per_codebook[i] == one.utilization
        assert usage.dead_codes_per_codebook[i] == one.dead_codes
        assert usage.perplexity_per_codebook[i] == pytest.approx(one.perplexity)
    block = codebook_block(model.quantizer, usage)
    for key in ("utilization", "dead_codes", "perplexity", "active_codes", "entropy_bits", "soft_perplexity"):
        assert block[key] == pytest.approx(sum(block[f"{key}_per_level"]) / L), key  # the mean over levels
    assert block["levels"] == L and block["num_vectors"] == 192 * 64
    assert block["num_vectors_per_level"] == [192 * 64] * L
    assert block["entropy_bits_per_level"] == pytest.approx([math.log2(p) for p in block["perplexity_per_level"]])
    assert 0 < block["utilization_ceiling"] <= 1 and block["min_code_distance"] > 0
    assert len(block["utilization_per_level"]) == len(block["dead_codes_per_level"]) == L
    # reconstruction against the levels used: l = L is the hard reconstruction; fewer levels decode worse
    by = result["hard_by_levels"]
    assert [r["levels"] for r in by] == [1, 2, 3]
    assert by[-1]["mse"] == result["hard"]["mse"] and by[-1]["psnr"] == result["hard"]["psnr"]
    with torch.no_grad():
        first = model.decoder(model.quantizer.lookup(indices[..., :1])).clamp(0, 1)
    mse_img = (first - x).pow(2).flatten(1).mean(1).double()
    assert by[0]["mse"] == pytest.approx(float(mse_img.mean()), rel=1e-5)
    assert by[0]["psnr"] == pytest.approx(float((10 * torch.log10(1 / mse_img)).mean()), rel=1e-5)
    assert by[0]["psnr"] < by[-1]["psnr"]
    assert reconstruction_by_levels(model, images, batch_size=64, max_images=192) == by


def test_grouped_has_per_group_usage_and_no_prefix_reconstruction(images):
    model = tiny_model(GroupedDDCL(K, D, 2, warmup_steps=0), images, steps=6)
    result = reconstruction_pass(model, images, batch_size=64, max_images=64)
    assert result["usage"].codebooks == 2 and "hard_by_levels" not in result
    block = codebook_block(model.quantizer, result["usage"])
    assert block["levels"] == 2 and block["num_vectors"] == 64 * 64
    assert block["utilization"] == pytest.approx(sum(block["utilization_per_level"]) / 2)
    with pytest.raises(ValueError, match="decodes the first l of its levels"):
        reconstruction_by_levels(model, images, max_images=64)


def test_a_single_codebook_and_a_one_level_chain_keep_the_single_codebook_fields(images):
    model = tiny_model(DDCLQuantizer(K, D, warmup_steps=0), images, steps=6)
    result = reconstruction_pass(model, images, batch_size=64, max_images=64)
    assert set(result) == {"num_images", "hard", "soft", "usage"} and result["usage"].codebooks is None
    assert list(codebook_block(model.quantizer, result["usage"])) == SINGLE_KEYS
    with pytest.raises(ValueError, match="decodes the first l of its levels"):
        reconstruction_by_levels(model, images, max_images=64)
    one = tiny_model(ResidualDDCL(K, D, 1, warmup_steps=0), images, steps=6)
    result = reconstruction_pass(one, images, batch_size=64, max_images=64)
    assert result["usage"].codebooks is None and "hard_by_levels" not in result
    assert result["usage"].num_vectors == 64 * 64
    assert "several codebooks" not in definitions() and "several codebooks" in definitions(per_level=True)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "ddcl"
    train(load_config("configs/fashion_ddcl.yaml", TINY + [f"run.dir={run}", "run.name=tiny_ddcl",
                                                           "train.eval_images=0"]), quiet=True)
    return run


def test_eval_json_and_compare_tables_gain_per_level_fields(tiny_run, residual_model, monkeypatch, tmp_path):
    single = evaluate_run(tiny_run, max_images=64, batch_size=64, write=False)
    assert list(single["codebook"]) == SINGLE_KEYS and set(single["recon"]) == {"hard", "soft", "soft_minus_hard"}
    assert single["definitions"] == definitions()
    cfg, _, step, ckpt = load_run(tiny_run)
    # the run's config and checkpoint file, a residual model in its place (no config builds one yet)
    monkeypatch.setattr(evaluate_module, "load_run", lambda *a, **k: (cfg, residual_model, step, ckpt))
    ev = evaluate_run(tiny_run, max_images=64, batch_size=64, write=False)
    c = ev["codebook"]
    assert c["levels"] == L and len(c["utilization_per_level"]) == L and ev["latent_positions_per_image"] == 64
    assert c["dead_codes"] == pytest.approx(sum(c["dead_codes_per_level"]) / L)
    assert len(ev["usage_counts"]) == L * K and sum(ev["usage_counts"]) == L * 64 * 64
    assert [r["levels"] for r in ev["recon"]["hard_by_levels"]] == [1, 2, 3]
    assert "several codebooks" in ev["definitions"] and json.loads(json.dumps(ev)) == ev
    short = format_report(ev)
    assert len(short.splitlines()) <= 11 and "per level (the figures above: their means): utilization" in short
    assert "hard codes of the first l levels: l=1 PSNR" in short
    assert "per level" in format_report(ev, verbose=True)
    assert "per level" not in format_report(single)
    # compare: per-level columns in table.csv and table.json only; the markdown table keeps its columns
    rows = [make_row(tiny_run, single, "single"), make_row(tiny_run, ev, "residual")]
    assert "utilization_per_level" not in rows[0]
    assert rows[1]["dead_codes_per_level"] == c["dead_codes_per_level"] and rows[1]["levels"] == L
    assert rows[1]["hard_psnr_by_levels"] == [r["psnr"] for r in ev["recon"]["hard_by_levels"]]
    write_tables(tmp_path, rows, [single, ev], "test", 64)
    header, first, second = (tmp_path / "table.csv").read_text().splitlines()
    assert "utilization_per_level" in header.split(",") and "hard_psnr_by_levels" in header.split(",")
    assert first.endswith(",,,,,,,,")  # the single-codebook run: empty per-level cells
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["rows"][1]["perplexity_per_level"] == c["perplexity_per_level"]
    assert "utilization_per_level" not in table["rows"][0] and "*_per_level" in table["column_definitions"]
    md = (tmp_path / "table.md").read_text()
    assert md.splitlines()[0] == markdown_table(rows[:1]).splitlines()[0]  # the same columns
    assert "per_level" not in md.split("\n\n")[0]


@pytest.mark.parametrize("qtype,extra,books", [("residual_ddcl", "quantizer.num_levels=2", 2),
                                               ("grouped_ddcl", "quantizer.groups=2", 2)])
def test_a_config_trains_resumes_and_evaluates_a_multi_codebook_model(qtype, extra, books, tmp_path):
    """quantizer.type=residual_ddcl / grouped_ddcl: one registry entry each; the training log's usage window and queue
    count (codebook, code) pairs, the summary and eval.json carry each codebook's figures, a resume is the straight run."""
    def run(name):
        return load_config("configs/fashion_ddcl.yaml", TINY + [
            f"quantizer.type={qtype}", extra, "train.threads=1", f"run.dir={tmp_path / name}", "train.eval_images=64"])
    summary = train(run("straight"), quiet=True)
    c = summary["codebook"]
    assert c["codebooks"] == books and len(c["utilization_per_codebook"]) == books
    assert c["active_codes"] == sum(c["active_codes_per_codebook"])
    assert summary["training_usage"]["queue_indices"] == 6 * 32 * 64 * books
    train(run("resumed"), quiet=True, stop_after=4)
    train(run("resumed"), quiet=True)
    straight, resumed = (torch.load(tmp_path / n / "checkpoints" / "last.pt", weights_only=True)["model"]
                         for n in ("straight", "resumed"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    ev = evaluate_run(tmp_path / "straight", max_images=64, batch_size=64, write=False)
    assert ev["codebook"]["levels"] == books and len(ev["codebook"]["dead_codes_per_level"]) == books
    assert ("hard_by_levels" in ev["recon"]) == (qtype == "residual_ddcl")


def test_a_misspelt_level_option_names_the_key_and_the_nearest():
    from ddcl_vq.common.config import ConfigError
    with pytest.raises(ConfigError, match=r"'quantizer.tempertaure'; did you mean 'quantizer.temperature'"):
        load_config("configs/fashion_ddcl.yaml", ["quantizer.type=residual_ddcl", "quantizer.tempertaure=0.1"])
    cfg = load_config("configs/fashion_ddcl.yaml", ["quantizer.type=grouped_ddcl", "quantizer.temperature=0.1"])
    assert cfg.quantizer["temperature"] == 0.1 and cfg.quantizer["groups"] == 2
