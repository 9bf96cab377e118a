"""Studies with seeds (mean ± sd tables), ms per training step, and the headline and ablation configs."""
import csv
import json
import statistics
from pathlib import Path

import pytest
import yaml

from ddcl_vq.common.runlog import ms_per_step
from ddcl_vq.studies.cli import main as study_main
from ddcl_vq.studies.study import load_study
from ddcl_vq.studies.tables import aggregate, mean_sd, mean_sd_table
from ddcl_vq.studies.report import headline
from ddcl_vq.tokenizer.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = ROOT / "configs" / "study_headline.yaml"
ABLATION = ROOT / "configs" / "study_ablation.yaml"


def _diff(a: Config, b: Config):
    a, b = a.to_dict(), b.to_dict()  # a key only one has (another quantizer's): None in the other
    return {f"{s}.{k}": (a[s].get(k), b[s].get(k)) for s in a for k in {**a[s], **b[s]} if a[s].get(k) != b[s].get(k)}


# --------------------------------------------------------------------------- the two configs

def test_headline_config_validates_and_matches_the_baseline_configs():
    study = load_study(HEADLINE)
    assert study.seeds == [0, 1, 2] and len(study.arms) == 10 * 3 * 3
    assert [a.name for a in study.arms[:6]] == ["ddcl_k1024_s0", "hard_k1024_s0", "ema_restart_k1024_s0",
                                                "vqp_default_k1024_s0", "vqp_kmeans_expiry_k1024_s0", "fsq_k1024_s0"]
    assert {a.config.run.seed for a in study.arms} == {0, 1, 2}
    assert {a.config.quantizer["num_codes"] for a in study.arms} == {256, 1024, 4096}
    assert study.eval.max_images == 0 and study.eval.split == "test"  # the full test split
    # the default model and budget, and each baseline as its configs/fashion_*.yaml means it
    by_group = {a.group: a.config for a in study.arms if a.seed == 0}
    for group, reference in [("ddcl_k1024", "fashion_ddcl"), ("hard_k1024", "fashion_hard"),
                             ("ema_restart_k1024", "fashion_ema"), ("vqp_default_k1024", "fashion_vqp")]:
        diff = _diff(by_group[group], load_config(ROOT / "configs" / f"{reference}.yaml"))
        assert set(diff) == {"run.name", "run.dir", "quantizer.num_codes", "train.eval_images"}, (group, diff)
    expiry = by_group["vqp_kmeans_expiry_k1024"].quantizer
    util = load_study(ROOT / "configs" / "study_utilization.yaml")
    assert expiry == next(a for a in util.arms if a.name == "vqp_kmeans_expiry_k1024").config.quantizer
    assert expiry == {"type": "vqp", "num_codes": 1024, "kmeans_init": True, "threshold_ema_dead_code": 2}
    assert by_group["ddcl_k1024"].quantizer == {**Config().quantizer, "num_codes": 1024}  # library defaults
    # the two FSQ arms differ only in the projections' learning rate (the model's, or the codebooks' 3x)
    assert _diff(by_group["fsq_k1024"], by_group["fsq_lr3x_k1024"]).keys() == {"run.name", "run.dir",
                                                                               "train.codebook_lr_ratio"}
    assert by_group["fsq_lr3x_k1024"].train.codebook_lr_ratio == 3.0
    # the two fair SimVQ arms differ only in the encoder gradient (rotation trick, or plain straight-through)
    assert _diff(by_group["simvq_fair_k1024"], by_group["simvq_fair_no_rotation_k1024"]).keys() == {
        "run.name", "run.dir", "quantizer.rotation_trick"}
    assert by_group["simvq_fair_no_rotation_k1024"].quantizer == {
        **by_group["simvq_fair_k1024"].quantizer, "rotation_trick": False}


def test_ablation_config_validates_chain_ends_at_the_defaults():
    study = load_study(ABLATION)
    assert study.seeds == [0] and len(study.arms) == 7
    assert all(a.name == a.group + "_s0" and a.config.quantizer["num_codes"] == 1024 for a in study.arms)
    cfg = {a.group: a.config for a in study.arms}
    steps = [(cfg["e_revival"], cfg["d_data_temperature"]), (cfg["f_warmup"], cfg["e_revival"]),
             (cfg["g_sharp_mstep"], cfg["f_warmup"]), (cfg["h_commitment_ramp"], cfg["g_sharp_mstep"])]
    changed = [set(_diff(new, old)) - {"run.name", "run.dir"} for new, old in steps]
    assert changed == [{"quantizer.revive_threshold"}, {"quantizer.warmup_steps"}, {"quantizer.temperature"},
                       {"quantizer.beta_final"}]
    assert cfg["f_warmup"].quantizer["temperature"] == 0.1 and cfg["g_sharp_mstep"].quantizer["temperature"] == 0.03
    default = Config.from_dict({"quantizer": {"num_codes": 1024}, "train": {"eval_images": 0}})
    base = load_config(ROOT / "configs" / "fashion_ddcl.yaml", ["quantizer.num_codes=1024", "train.eval_images=0"])
    assert set(_diff(cfg["h_commitment_ramp"], base)) == {"run.name", "run.dir"}  # h = the library default
    assert _diff(cfg["h_commitment_ramp"], default).keys() <= {"run.name", "run.dir"}
    assert cfg["g_sharp_mstep"].quantizer["beta_final"] is None and cfg["h_commitment_ramp"].quantizer["beta_final"] == 1.0
    alts = {g: set(_diff(cfg[g], cfg["g_sharp_mstep"])) - {"run.name", "run.dir"} for g in cfg if g.startswith("alt_")}
    assert alts == {"alt_decay_099": {"quantizer.decay"},
                    "alt_anneal": {"quantizer.temperature", "quantizer.temperature_schedule",
                                   "quantizer.temperature_final"}}
    assert {a.group: a.vs for a in study.arms}["alt_anneal"] == "g_sharp_mstep"
    assert len(load_study(ABLATION, seeds=[0, 1, 2]).arms) == 21


# --------------------------------------------------------------------------- aggregation (pure functions)

def _row(name, group, seed, psnr, util, dead, ms, lpips=0.2, qtype="ddcl", k=256):
    return {"name": name, "group": group, "seed": seed, "type": qtype, "num_codes": k, "settings": "s",
            "hard_psnr": psnr, "hard_ssim": 0.5, "hard_lpips": lpips, "utilization": util, "dead_codes": dead,
            "perplexity": 10.0, "ms_per_step": ms}


def test_mean_sd_is_the_sample_sd():
    assert mean_sd([1.0, 2.0, 3.0, 4.0]) == (2.5, statistics.stdev([1, 2, 3, 4]), 4)
    assert mean_sd([1.0, 2.0, 3.0, 4.0])[1] == pytest.approx((5 / 3) ** 0.5)
    assert mean_sd([7.0]) == (7.0, None, 1)
    assert mean_sd([None, 2.0, None, 4.0]) == (3.0, pytest.approx(2 ** 0.5), 2)
    assert mean_sd([None]) == (None, None, 0)


def test_aggregate_hand_made_rows():
    rows = [_row("a_s0", "a", 0, 20.0, 0.5, 10, 3.0), _row("b_s0", "b", 0, 22.0, 1.0, 0, 5.0, qtype="hard"),
            _row("a_s1", "a", 1, 22.0, 0.7, 6, 5.0, lpips=None), _row("a_s2", "a", 2, 24.0, 0.9, 2, 4.0)]
    a, b = aggregate(rows)
    assert (a["name"], a["n"], a["seeds"], a["runs"]) == ("a", 3, [0, 1, 2], ["a_s0", "a_s1", "a_s2"])
    assert (a["hard_psnr"], a["hard_psnr_sd"], a["hard_psnr_n"]) == (22.0, 2.0, 3)
    assert a["utilization"] == pytest.approx(0.7) and a["utilization_sd"] == pytest.approx(0.2)
    assert a["dead_codes"] == 6.0 and a["dead_codes_sd"] == 4.0
    assert a["ms_per_step"] == 4.0 and a["ms_per_step_sd"] == 1.0
    assert (a["hard_lpips"], a["hard_lpips_n"]) == (0.2, 2) and a["hard_lpips_sd"] == 0.0
    assert (b["name"], b["type"], b["n"], b["hard_psnr"], b["hard_psnr_sd"]) == ("b", "hard", 1, 22.0, None)
    table = mean_sd_table([a, b])
    assert "| a | ddcl | 256 | s | 0,1,2 (3) | 22.00 ± 2.00 |" in table
    assert "0.2000 ± 0.0000 (n=2)" in table and "70.0% ± 20.0%" in table and "4.0 ± 1.0 |" in table
    assert "| b | hard | 256 | s | 0 (1) | 22.00 ± — |" in table
    # rows without seeds: one group per run name
    assert [g["name"] for g in aggregate([{"name": "x", "hard_psnr": 1.0}, {"name": "y"}])] == ["x", "y"]


def test_headline_compares_means_against_the_larger_sd():
    def group(name, qtype, psnr, sd, n=3):
        return {"name": name, "type": qtype, "num_codes": 1024, "n": n, "hard_psnr": psnr, "hard_psnr_sd": sd,
                "utilization": 1.0, "dead_codes": 0.0}
    ahead = headline([group("ddcl", "ddcl", 24.0, 0.1), group("vqp", "vqp", 23.5, 0.2), group("hard", "hard", 20, 1)])
    assert "best baseline vqp 23.50 ± 0.20 dB (n = 3)" in ahead[0] and "+0.50 dB vs the best baseline" in ahead[0]
    assert "exceeds the best baseline mean by more than the larger sd (0.20 dB)" in ahead[0]
    close = headline([group("ddcl", "ddcl", 23.6, 0.3), group("vqp", "vqp", 23.5, 0.2)])[0]
    assert "within the larger sd (0.30 dB): not separated" in close
    behind = headline([group("ddcl", "ddcl", 23.0, 0.1), group("vqp", "vqp", 23.5, 0.2)])[0]
    assert "below the best baseline mean by more than the larger sd (0.20 dB)" in behind
    one = headline([group("ddcl", "ddcl", 23.0, None, 1), group("vqp", "vqp", 23.5, None, 1)])[0]
    assert "spread not measured" in one
    # per-run rows (a study without seeds): the lines as before
    plain = headline([{"name": "d", "type": "ddcl", "num_codes": 8, "hard_psnr": 20.0, "utilization": 0.5,
                       "dead_codes": 4}, {"name": "h", "type": "hard", "num_codes": 8, "hard_psnr": 19.0,
                                          "utilization": 0.25, "dead_codes": 6}])
    assert plain == ["- K = 8: best baseline h 19.00 dB at 25.0% utilization; best DDCL d 20.00 dB at 50.0% "
                     "utilization (4 dead), +1.00 dB vs the best baseline; highest DDCL utilization d 50.0% "
                     "(20.00 dB); DDCL arms with 0 dead codes: none."]


def test_ms_per_step_from_metrics_jsonl(tmp_path):
    def write(records):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ms_per_step(tmp_path) is None
    # first session: steps 10..30 in 0.4 s (the first window, start-up included, is left out) ...
    # ... then a resumed session (time restarts) re-logs step 30 and goes on: 30..50 in 0.2 s
    write([{"step": 10, "time": 5.0}, {"step": 20, "time": 5.2}, {"step": 30, "time": 5.4},
           {"step": 30, "time": 0.3}, {"step": 40, "time": 0.4}, {"step": 50, "time": 0.5}, "cut"])
    assert ms_per_step(tmp_path) == pytest.approx(1000 * (0.4 + 0.2) / (20 + 20))
    write([{"step": 4, "time": 0.2}])  # one record: its time over its step
    assert ms_per_step(tmp_path) == pytest.approx(50.0)


# --------------------------------------------------------------------------- loading: seeds, selection, errors

def _study_file(tmp_path, **extra):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": {"run": {"seed": 7}, "quantizer": {"num_codes": 16}},
                                    "sweep": {"quantizer.num_codes": [16, 8]},
                                    "arms": [{"name": "d", "overrides": {"quantizer.type": "ddcl"}},
                                             {"name": "h", "overrides": ["quantizer.type=hard"], "vs": "d"}],
                                    **extra}))
    return path


def test_a_study_without_seeds_is_as_before(tmp_path):
    study = load_study(_study_file(tmp_path), out=tmp_path / "o")
    assert study.seeds is None and [a.name for a in study.arms] == ["d_k16", "h_k16", "d_k8", "h_k8"]
    assert all(a.group == a.name and a.seed is None and a.config.run.seed == 7 for a in study.arms)
    assert study.arms[1].overrides == ["quantizer.num_codes=16", "quantizer.type=hard"]
    assert study.arms[1].config.run.dir == str(tmp_path / "o" / "runs" / "h_k16")
    assert [a.vs for a in study.arms] == [None, "d_k16", None, "d_k8"]


def test_seeds_name_the_runs_and_set_run_seed(tmp_path):
    study = load_study(_study_file(tmp_path, seeds=[3, 1]), out=tmp_path / "o")
    assert [a.name for a in study.arms] == ["d_k16_s3", "h_k16_s3", "d_k16_s1", "h_k16_s1",
                                            "d_k8_s3", "h_k8_s3", "d_k8_s1", "h_k8_s1"]
    assert [a.config.run.seed for a in study.arms] == [3, 3, 1, 1, 3, 3, 1, 1]
    assert study.arms[1].group == "h_k16" and study.arms[1].config.run.dir.endswith("runs/h_k16_s3")
    assert [a.name for a in load_study(_study_file(tmp_path, seeds=[3, 1]), seeds=[0], only=["h*"]).arms] == \
        ["h_k16_s0", "h_k8_s0"]
    assert [a.name for a in load_study(_study_file(tmp_path), seeds=[0], only=["*_k8"]).arms] == ["d_k8_s0", "h_k8_s0"]
    with pytest.raises(ConfigError, match=r"option --arms: no arm matches 'x\*'; the arms are d_k16, h_k16"):
        load_study(_study_file(tmp_path), only=["x*"])
    with pytest.raises(ConfigError, match="key 'seeds': expected a non-empty list of distinct seeds"):
        load_study(_study_file(tmp_path, seeds=[1, 1]))
    with pytest.raises(ConfigError, match="key 'seeds': expected a non-empty list"):
        load_study(_study_file(tmp_path, seeds=[]))
    with pytest.raises(ConfigError, match=r"key 'seeds\[0\]': expected int"):
        load_study(_study_file(tmp_path, seeds=["a"]))
    with pytest.raises(ConfigError, match="run.seed is set by 'seeds'"):
        load_study(_study_file(tmp_path, seeds=[0]), overrides=["run.seed=4"])
    bad = _study_file(tmp_path)
    bad.write_text(bad.read_text().replace("vs: d", "vs: nope"))
    with pytest.raises(ConfigError, match=r"arm 'h': 'vs' must name another arm of the study \(d\), got 'nope'"):
        load_study(bad)
    assert study_main(["--config", str(_study_file(tmp_path)), "--seeds", "0,-1", "--list"]) == 2


def test_an_arm_s_own_seeds_and_sweep_points(tmp_path):
    def spec(first_arm=None, **top):
        arm = {"name": "d", "overrides": {"quantizer.type": "ddcl"}, "seeds": [0, 1],
               "sweep": {"quantizer.num_codes": [16]}, **(first_arm or {})}
        return {"base": {"quantizer": {"num_codes": 16}}, "seeds": [0], "sweep": {"quantizer.num_codes": [16, 8]},
                "arms": [arm, {"name": "d", "overrides": {"quantizer.type": "ddcl"},
                               "sweep": {"quantizer.num_codes": [8]}},
                         {"name": "h", "overrides": ["quantizer.type=hard"]}], **top}

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec()))
    study = load_study(path, out=tmp_path / "o")
    assert [a.name for a in study.arms] == ["d_k16_s0", "h_k16_s0", "d_k16_s1", "d_k8_s0", "h_k8_s0"]
    assert [a.name for a in load_study(path, seeds=[1]).arms] == ["d_k16_s1", "h_k16_s1", "d_k8_s1", "h_k8_s1"]
    for bad, match in [(spec({"sweep": {"quantizer.num_codes": [32]}}),
                        r"arm 'd': 'sweep' quantizer.num_codes: expected a non-empty list of the study's values"),
                       (spec({"sweep": {"model.channels": [16]}}),
                        r"arm 'd': 'sweep' key 'model.channels' is not swept by the study"),
                       (spec(seeds=None), r"arm 'd': 'seeds' needs the study's own 'seeds'")]:
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=match):
            load_study(path)


def test_large_k_config_runs_what_the_issue_asks():
    study = load_study(ROOT / "configs" / "study_large_k.yaml")
    names = {a.name for a in study.arms}
    for k in (16384, 65536):
        assert {f"{arm}_k{k}_s{s}" for arm in ("ddcl", "simvq_fair", "vqp_kmeans_expiry", "fvq")
                for s in (0, 1, 2)} <= names
        assert {f"{arm}_k{k}_s0" for arm in ("hard", "ema_restart", "ibq", "fsq")} <= names
    assert {a.name for a in study.arms if a.config.quantizer["num_codes"] == 262144} == \
        {"ddcl_k262144_s0", "simvq_fair_k262144_s0", "ibq_k262144_s0", "fvq_k262144_s0"}
    fvq = [a.config for a in study.arms if a.config.quantizer["type"] == "fvq"]
    assert {(c.train.lr_schedule, c.train.codebook_lr_ratio) for c in fvq} == {("anneal", 1.0)}
    assert len(study.arms) == 36 and study.eval.max_images == 0


# --------------------------------------------------------------------------- quick runs of the two configs

def test_quick_headline_at_k256_with_two_seeds(tmp_path):
    out = tmp_path / "headline"
    assert study_main(["--config", str(HEADLINE), "--quick", "--seeds", "0,1", "--arms", "*_k256",
                       "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| run | quantizer | K | settings | seeds (n) | PSNR hard (dB) |" in report
    assert "| ddcl_k256 | ddcl | 256 |" in report and "| 0,1 (2) |" in report and "### Per seed" in report
    assert "| vqp_kmeans_expiry_k256_s1 | vqp | 256 |" in report and "ms/step" in report
    assert "- K = 256: best baseline" in report and "(means; " in report and "seeds 0, 1" in report
    assert "sample standard deviation" in report and "ms/step         =" in report
    with open(out / "table.csv") as f:
        groups = list(csv.DictReader(f))
    assert [g["name"] for g in groups] == ["ddcl_k256", "hard_k256", "ema_restart_k256", "vqp_default_k256",
                                           "vqp_kmeans_expiry_k256", "fsq_k256", "fsq_lr3x_k256", "simvq_default_k256",
                                           "simvq_fair_k256", "simvq_fair_no_rotation_k256"]
    assert all(g["n"] == "2" and g["seeds"] == "0 1" and float(g["ms_per_step"]) > 0 for g in groups)
    with open(out / "table_runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 20 and runs[0]["name"] == "ddcl_k256_s0" and runs[1]["name"] == "ddcl_k256_s1"
    psnr = [float(r["hard_psnr"]) for r in runs[:2]]
    assert float(groups[0]["hard_psnr"]) == pytest.approx(statistics.mean(psnr))
    assert float(groups[0]["hard_psnr_sd"]) == pytest.approx(statistics.stdev(psnr))
    table = json.loads((out / "table.json").read_text())
    assert len(table["rows"]) == 10 and len(table["runs"]) == 20
    assert json.loads((out / "study.json").read_text())["seeds"] == [0, 1]
    assert yaml.safe_load((out / "runs" / "hard_k256_s1" / "config.yaml").read_text())["run"]["seed"] == 1


def test_quick_ablation_in_full(tmp_path, capsys):
    out = tmp_path / "ablation"
    assert study_main(["--config", str(ABLATION), "--quick", "--out", str(out)]) == 0
    # stderr is not a terminal here: progress in plain lines (no carriage-return redraws)
    printed = capsys.readouterr()
    assert "\r" not in printed.err and "arm 7/7 (100%)" in printed.err
    assert "g_sharp_mstep_s0: PSNR hard " in printed.out
    assert f"report: {out.absolute() / 'report.md'}" in printed.out
    report = (out / "report.md").read_text()
    assert "## What each change buys" in report
    assert "- `e_revival` vs `d_data_temperature`: " in report and "- `alt_decay_099` vs `g_sharp_mstep`: " in report
    assert report.count(" vs `") == 6 and "dB PSNR" in report and "ms/step (" in report
    assert "| e_revival | ddcl | 1024 | straight_through, τ=0.1, M-step, revival 0.03 |" in report
    assert "| f_warmup | ddcl | 1024 | straight_through, τ=0.1, M-step, revival 0.03, warm-up 100 |" in report
    assert "| g_sharp_mstep | ddcl | 1024 | straight_through, τ=0.03, M-step, revival 0.03, warm-up 100 |" in report
    assert ("| h_commitment_ramp | ddcl | 1024 | straight_through, τ=0.03, M-step, revival 0.03, warm-up 100, "
            "β 0.25→1 |") in report
    assert len((out / "table.csv").read_text().strip().splitlines()) == 1 + 7


def test_a_moved_run_directory_is_the_same_run_and_another_config_is_an_error(tmp_path):
    """check_run_dir: a run whose config.yaml differs from the arm's only in the path it was written
    under (a study directory moved or copied) is the arm's run; any other difference is an error
    that names the key."""
    from ddcl_vq.studies.study import StudyError, check_run_dir
    from ddcl_vq.tokenizer.config import dump_config

    arm = load_study(HEADLINE, out=tmp_path / "moved").arms[0]
    run_dir = Path(arm.config.run.dir)
    run_dir.mkdir(parents=True)
    elsewhere = arm.config.to_dict()
    elsewhere["run"]["dir"] = str(tmp_path / "first_place" / "runs" / arm.name)
    (run_dir / "config.yaml").write_text(dump_config(Config.from_dict(elsewhere)))
    check_run_dir(arm)
    elsewhere["train"]["lr"] = 2 * arm.config.train.lr
    (run_dir / "config.yaml").write_text(dump_config(Config.from_dict(elsewhere)))
    with pytest.raises(StudyError, match="train.lr"):
        check_run_dir(arm)
