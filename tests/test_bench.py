"""The bench machinery on tiny shapes (no timing assertions: speed goals live in the bench)."""
import json
import statistics

import pytest
import torch

from ddcl_vq.studies.bench.cli import main as bench_main
from ddcl_vq.studies.bench.steps import IMPLS, plan_measurements
from ddcl_vq.studies.bench.cli import format_table
from ddcl_vq.studies.bench.run import run_bench
from ddcl_vq.studies.bench.steps import e2e_rows


def test_the_memory_probe_measures_a_known_allocation():
    """The peak a bench row reports is the probe's: 32 MiB written inside the probed block read as about 32 MiB."""
    from ddcl_vq.studies.bench.run import RssProbe
    if not RssProbe.available():
        pytest.skip("no /proc/self/clear_refs: the bench measures in a subprocess here")
    probe = RssProbe()
    probe.start()
    block = torch.ones(32 << 20, dtype=torch.uint8)  # every page written
    peak = probe.stop()
    del block
    assert 30 <= peak <= 200, peak


def test_run_bench_tiny_shapes_every_impl():
    rows = run_bench([(48, 8, 16)], list(IMPLS), warmup=1, repeats=1,
                           budget_seconds=5, max_seconds=10, calibration=1e-10)
    assert len(rows) == len(IMPLS)
    for r in rows:
        assert {"impl", "N", "D", "K", "ms", "peak_mb"} <= set(r)
        if r.get("skipped"):
            assert r["ms"] is None
            continue
        assert r["ms"] > 0
        assert isinstance(r["peak_mb"], float), r  # measured: a probe that failed leaves None
        assert r["pct_matmul6"] > 0
        if r["impl"] != "vqp":
            assert r.get("x_vqp") is None or r["x_vqp"] > 0
    text = format_table(rows)
    assert "ddcl-soft-chunked" in text and "matmul6" in text


def test_plan_skips_what_does_not_fit_and_says_why():
    cal = 1e-11
    plans = plan_measurements([(65536, 64, 65536)], ["ddcl-soft-reference", "ddcl-soft-chunked", "vqp"], warmup=1,
                              repeats=5, max_seconds=1e9, budget_seconds=60, mem_budget=8 * 2**30, cal=cal)
    by = {p.name: p for p in plans}
    assert "memory" in by["ddcl-soft-reference"].skip and "memory" in by["vqp"].skip
    assert by["ddcl-soft-chunked"].skip is None
    plans = plan_measurements([(65536, 64, 65536)], ["ddcl-soft-chunked"], warmup=1, repeats=5, max_seconds=0.001,
                                    budget_seconds=60, mem_budget=8 * 2**30, cal=cal)
    assert "time" in plans[0].skip


def test_main_writes_json_and_e2e_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_main(["--shapes", "32,4,8", "--impls", "ddcl-mstep", "ddcl-soft-fused", "ddcl-soft-chunked", "matmul6", "hardvq",
                       "--repeats", "1", "--no-e2e", "--no-vqgan", "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["cores"] >= 1 and data["meta"]["memory_method"] in ("rss", "subprocess")
    assert {r["impl"] for r in data["rows"]} == {"ddcl-mstep", "ddcl-soft-fused", "ddcl-soft-chunked", "matmul6", "hardvq"}
    printed = capsys.readouterr().out
    assert "peak MB" in printed and "% 6mm" in printed
    rows = e2e_rows(repeats=1, warmup=0, batch=2)
    assert {r["impl"] for r in rows} == {"vqvae-step-ddcl", "vqvae-step-hardvq"}
    assert all(r["ms"] > 0 and r["K"] == 512 and r["D"] == 64 for r in rows)
    assert all(r["cpu_ms"] >= 0 and r["cpu_paired_ratio_vs_hardvq"] >= 0 and r["page_faults"] >= 0 for r in rows)


def test_paired_times_count_the_page_faults_of_each_step():
    """A step that touches 64 MB of fresh memory (above glibc's mmap threshold: new pages every call)
    shows thousands of minor faults a call; a step that reuses its buffer shows none."""
    from ddcl_vq.studies.bench.steps import paired_times, ratios_vs_hardvq
    kept = torch.zeros(1 << 24)
    steps = {"ddcl": lambda: kept.fill_(1.0), "hardvq": lambda: torch.ones(1 << 24).sum()}
    times, cpu, faults = paired_times(steps, repeats=3, warmup=1)
    assert min(faults["hardvq"]) > 4000 and max(faults["ddcl"]) < 100
    assert ratios_vs_hardvq("hardvq", times, cpu, faults)["page_faults"] == int(statistics.median(faults["hardvq"]))


def test_e2e_row_is_the_default_mstep_quantizer():
    # the default DDCL (M-step codebook, straight_through) takes no assignment path
    rows = {r["impl"]: r for r in e2e_rows(repeats=1, warmup=0, batch=2)}
    assert set(rows) == {"vqvae-step-ddcl", "vqvae-step-hardvq"}
    assert rows["vqvae-step-ddcl"]["path"] == "mstep"
    assert "CPU time" in format_table(list(rows.values()))


def test_help_explains_options(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--quick", "--json", "--memory", "--max-seconds", "--threads"):
        assert option in text


def test_e2e_models_fall_back_only_for_missing_configs_and_say_why(tmp_path):
    from ddcl_vq.studies.bench.steps import CONFIGS_DIR, e2e_models
    from ddcl_vq.common.config import ConfigError
    models, source, fallback = e2e_models()
    assert fallback is None and "configs/fashion_ddcl.yaml" in source and set(models) == {"ddcl", "hardvq"}
    stand_ins, source, fallback = e2e_models(tmp_path)            # an installed copy without configs/
    assert "the training config's defaults" in source and set(stand_ins) == {"ddcl", "hardvq"}
    assert "fashion_ddcl.yaml, fashion_hard.yaml not found in" in fallback and str(tmp_path) in fallback
    for label in models:  # the stand-ins are the configs' settings
        assert stand_ins[label][0] == models[label][0]
        assert repr(stand_ins[label][1]) == repr(models[label][1])
    (tmp_path / "fashion_ddcl.yaml").write_text((CONFIGS_DIR / "fashion_ddcl.yaml").read_text())
    (tmp_path / "fashion_hard.yaml").write_text("quantizer: {type: hard, num_codez: 3}\n")
    with pytest.raises(ConfigError, match="num_codez"):       # a broken config is an error, not a fallback
        e2e_models(tmp_path)


def test_first_batch_row_measures_a_fresh_quantizer():
    rows = {r["impl"]: r for r in run_bench([(64, 4, 16)], ["ddcl-first", "ddcl-mstep"], warmup=1,
                                            repeats=1, budget_seconds=5, max_seconds=10, calibration=1e-10)}
    assert rows["ddcl-first"]["ms"] > 0 and rows["ddcl-first"]["floor_matmuls"] == 3
    assert rows["ddcl-mstep"]["ms"] > 0 and rows["ddcl-mstep"]["floor_matmuls"] == 3
    assert "ddcl-first" in format_table(list(rows.values()))
    assert "first training batch" in IMPLS["ddcl-first"]


def test_vqgan_rows_time_the_recipe_step_with_the_discriminator_on():
    # real modules: configs/vqgan_photos64.yaml through the training package, LPIPS with its real weights
    from ddcl_vq.studies.bench.steps import VQGAN_ARMS, vqgan_setups, vqgan_rows
    rows = {r["impl"]: r for r in vqgan_rows(repeats=2, warmup=0, batch=2)}
    assert set(rows) == {"vqgan-step-ddcl", "vqgan-step-hardvq"}
    for r in rows.values():
        assert r["ms"] > 0 and r["cpu_ms"] > 0 and r["runs"] == 2
        assert r["ratio_vs_hardvq"] > 0 and r["paired_ratio_vs_hardvq"] > 0 and r["cpu_paired_ratio_vs_hardvq"] > 0
        assert r["input_shape"] == [2, 3, 64, 64] and r["batch"] == 2
        assert r["N"] == 2 * 16 * 16 and r["D"] == 32 and r["K"] == 1024
        assert r["disc_on"] is True and r["perceptual_net"] == "alex"
    assert rows["vqgan-step-hardvq"]["ratio_vs_hardvq"] == 1.0
    assert rows["vqgan-step-ddcl"]["path"] == "mstep"
    text = format_table(list(rows.values()))
    assert "vqgan-step-ddcl" in text and "input 2x3x64x64, discriminator on" in text
    # the arms are the recipe's DDCL and configs/study_vqgan.yaml's hard arm, built as the loop builds them
    from ddcl_vq.common.config import read_yaml_mapping as read_yaml
    from ddcl_vq.studies.bench.steps import CONFIGS_DIR
    study = read_yaml(CONFIGS_DIR / "study_vqgan.yaml", "study")
    hard = next(a for a in study["arms"] if a["name"] == "hard")["overrides"]
    assert dict(VQGAN_ARMS)["hardvq"] == tuple(f"{k}={v}" for k, v in hard.items())
    (setups, _), reason = vqgan_setups()
    assert reason is None
    assert type(setups["hardvq"][1].quantizer).__name__ == "HardVQ" and setups["hardvq"][1].quantizer.beta == 0.25
    assert type(setups["ddcl"][1].quantizer).__name__ == "DDCLQuantizer"
    assert all(s[4].disc is not None and s[4].perceptual is not None for s in setups.values())


def test_vqgan_rows_are_skipped_with_the_reason_without_the_config(tmp_path, capsys):
    from ddcl_vq.studies.bench.steps import vqgan_rows
    rows = vqgan_rows(repeats=1, warmup=0, batch=2, configs=tmp_path)
    assert [r["impl"] for r in rows] == ["vqgan-step-ddcl", "vqgan-step-hardvq"]
    assert all(r["ms"] is None and "vqgan_photos64.yaml not found" in r["skipped"] for r in rows)
    assert "skipped: VQGAN-recipe step" in format_table(rows)


def test_residual_rows_compare_residual_ddcl_with_residual_vq(capsys):
    # ResidualDDCL (4 levels) against vector-quantize-pytorch's ResidualVQ(num_quantizers=4) at the same K and D
    rows = {r["impl"]: r for r in run_bench([(64, 4, 16)], ["ddcl-residual4", "vqp-residual4", "vqp", "matmul6"],
                                            warmup=1, repeats=1, budget_seconds=5, max_seconds=10,
                                            calibration=1e-10)}
    ddcl, rvq = rows["ddcl-residual4"], rows["vqp-residual4"]
    assert ddcl["ms"] > 0 and rvq["ms"] > 0 and (ddcl["peak_mb"] is None or ddcl["peak_mb"] >= 0)
    assert ddcl["x_vqp"] == round(ddcl["ms"] / rvq["ms"], 3) and rvq["x_vqp"] == 1.0
    assert ddcl["x_vqp_of"] == "vqp-residual4" and "x_vqp_of" not in rows["vqp"] and rows["vqp"]["x_vqp"] == 1.0
    assert ddcl["pct_matmul6"] == round(100.0 * 4 * rows["matmul6"]["ms"] / ddcl["ms"], 1)
    assert "x VQP against vqp-residual4" in format_table(list(rows.values()))
    # quick mode: the residual rows at the smaller K only
    assert bench_main(["--quick", "--dry-run", "--impls", "ddcl-residual4", "vqp-residual4", "ddcl-mstep"]) == 0
    planned = [line.split()[:4] for line in capsys.readouterr().out.splitlines() if line.startswith(("ddcl", "vqp"))]
    assert sorted(p[0] for p in planned if p[3] == "K=8192") == ["ddcl-mstep"]
    assert sorted(p[0] for p in planned if p[3] == "K=1024") == ["ddcl-mstep", "ddcl-residual4", "vqp-residual4"]
