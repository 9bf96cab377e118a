"""Training on real Fashion-MNIST with tiny budgets: every quantizer, resume, checkpoints, errors."""
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddcl_vq.common import data as data_module
from ddcl_vq.tokenizer.config import build_model
from ddcl_vq.common.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from ddcl_vq.tokenizer.train import main as train_main
from ddcl_vq.tokenizer.config import Config, ConfigError, dump_config, load_config
from ddcl_vq.common.data import DataUnavailable, build_dataset, fashion_mnist_arrays
from ddcl_vq.tokenizer.train import train
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("qtype", ["ddcl", "hard", "ema", "vqp"])
def test_few_step_run_for_each_quantizer(tiny_config, qtype):
    cfg = tiny_config(f"quantizer.type={qtype}", config=f"configs/fashion_{qtype}.yaml")
    summary = train(cfg, quiet=True)
    run = Path(cfg.run.dir)
    assert (run / "config.yaml").exists() and (run / "checkpoints" / "last.pt").exists()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    if qtype == "ddcl":  # the split the loop asks for on the steps it logs only (Quantizer.report_terms)
        assert all(math.isclose(r["term_ols"] + r["term_variance"], r["term_distortion"], rel_tol=1e-4) for r in records)
    assert summary["num_images"] == 256 and summary["step"] == 6
    assert 0 < summary["codebook"]["active_codes"] <= 32
    assert (summary["soft"] is not None) == (qtype == "ddcl")
    assert load_config(run / "config.yaml") == cfg  # resolved config round-trips


def test_resume_equals_straight_run(tiny_config, tmp_path):
    """10 + 10 steps = 20 steps, the quantizer's temperature schedule included."""
    schedule = ["train.steps=20", "train.checkpoint_every=5", "quantizer.temperature=0.1",
                "quantizer.temperature_schedule=cosine", "quantizer.temperature_final=0.01"]
    straight = tiny_config(*schedule, run_dir=tmp_path / "a")
    train(straight, quiet=True)
    resumed = tiny_config(*schedule, run_dir=tmp_path / "b")
    train(resumed, quiet=True, stop_after=10)
    assert load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")["step"] == 10
    train(resumed, quiet=True)
    a = load_checkpoint(tmp_path / "a" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 20
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.allclose(value.float(), b["model"][key].float(), atol=1e-6), key
    assert int(a["model"]["quantizer.schedule_step"]) == 20
    records = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in "ab"}
    assert [r["step"] for r in records["b"]] == list(range(2, 21, 2))
    # each record reports the τ its step trained at: the schedule's value before that step
    tau = [0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * (r["step"] - 1) / 20)) for r in records["a"]]
    assert [r["temperature"] for r in records["a"]] == pytest.approx(tau, rel=1e-12)
    assert [r["temperature"] for r in records["b"]] == [r["temperature"] for r in records["a"]]


def test_killed_run_resumes_from_last_checkpoint(tmp_path):
    run = tmp_path / "killed"
    args = [sys.executable, "-m", "ddcl_vq", "train", "--config", "configs/fashion_hard.yaml", "--quiet",
            f"run.dir={run}", "train.steps=400", "train.checkpoint_every=2", *TINY_MODEL, "model.num_res_blocks=2",
            "quantizer.num_codes=32", "data.batch_size=32", "train.eval_images=64"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = run / "checkpoints" / "last.pt"
    deadline = time.time() + 120
    while time.time() < deadline and not last.exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = load_checkpoint(last)["step"]
    assert 0 < killed_at < 400
    out = subprocess.run(args[:-1] + ["train.eval_images=64", "train.steps=" + str(killed_at + 4)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert load_checkpoint(last)["step"] == killed_at + 4


def test_corrupted_checkpoint_clear_error_and_previous_survives(tiny_config, capsys):
    cfg = tiny_config("train.steps=6", "train.checkpoint_every=3")
    train(cfg, quiet=True)
    ckpt = Path(cfg.run.dir) / "checkpoints"
    data = (ckpt / "last.pt").read_bytes()
    (ckpt / "last.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"last\.pt.*truncated or corrupted"):
        load_checkpoint(ckpt / "last.pt")
    state, path = latest_checkpoint(ckpt)
    assert path.name == "step_0000006.pt" and state["step"] == 6
    assert "trying an older checkpoint" in capsys.readouterr().err


def test_atomic_save_keeps_old_file_on_crash(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"model": {}, "step": 1}, path)

    def broken_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        save_checkpoint({"model": {}, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_unknown_config_key_names_itself(capsys):
    code = train_main(["--config", "configs/fashion_ddcl.yaml", "quantizer.temprature=0.1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown config key 'quantizer.temprature'; did you mean 'quantizer.temperature'?" in err
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stesp'; did you mean 'train.steps'"):
        Config.from_dict({"train": {"stesp": 3}})
    with pytest.raises(ConfigError, match=r"'train.lr': expected float, got 'fast'"):
        load_config("configs/fashion_ddcl.yaml", ["train.lr=fast"])


def test_a_diverging_run_ends_in_one_line(tmp_path, capsys):
    """lr 1e30 without clipping: the encoder's features go NaN at once; one line with the hint, exit 2."""
    code = train_main(["--config", "configs/fashion_ddcl.yaml", "--quiet", *TINY_MODEL, "quantizer.num_codes=32",
                       "data.batch_size=32", "train.steps=6", "train.eval_images=0", "train.lr=1e30",
                       "train.grad_clip=0", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("ddcl-vq train: error: step ") and "diverged" in err and "lower train.lr" in err


def test_missing_data_names_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "DEBIAN_FASHION_DIR", tmp_path / "nothing")
    monkeypatch.delenv("DDCL_VQ_FASHION_DIR", raising=False)
    with pytest.raises(DataUnavailable) as err:
        fashion_mnist_arrays("test", root=tmp_path / "data", download=False)
    message = str(err.value)
    assert "apt-get install dataset-fashion-mnist" in message and "torchvision" in message


def test_real_data_splits_are_apart():
    train_x, train_y = fashion_mnist_arrays("train")
    test_x, test_y = fashion_mnist_arrays("test")
    assert train_x.shape == (60000, 28, 28) and test_x.shape == (10000, 28, 28)
    assert set(train_y.tolist()) == set(range(10))
    cfg = Config()
    image, _ = build_dataset(cfg.data, "test")[0]
    assert image.shape == (1, 32, 32) and 0 <= float(image.min()) and float(image.max()) <= 1


def test_natural_patches_are_colour_and_split_by_photograph():
    cfg = load_config(None, ["data.name=natural_patches", "data.patches_per_image=8"])
    train_set, test_set = build_dataset(cfg.data, "train"), build_dataset(cfg.data, "test")
    assert train_set[0][0].shape == (3, 32, 32)
    assert len(train_set) == 6 * 8 and len(test_set) == 2 * 2


def test_decode_indices_of_encode_indices_is_hard_reconstruction(tiny_config):
    cfg = tiny_config()
    model = build_model(cfg, 1).eval()
    x = build_dataset(cfg.data, "test")[0][0][None].repeat(3, 1, 1, 1)
    idx = model.encode_indices(x)
    assert idx.shape == (3, 8, 8) and idx.dtype == torch.long
    assert torch.allclose(model.decode_indices(idx), model.reconstruct(x, "hard"))


def test_temperature_schedule_lives_in_the_quantizer_section(tmp_path):
    cfg = load_config(None, ["train.steps=100", "quantizer.temperature=1.0", "quantizer.temperature_schedule=cosine",
                             "quantizer.temperature_final=0.1"])
    q = build_model(cfg, 1).quantizer
    assert (q.temperature, q.temperature_final, q.temperature_schedule, q.schedule_steps) == (1.0, 0.1, "cosine", 100)
    with pytest.raises(ConfigError, match="quantizer.temperature_final"):
        load_config(None, ["quantizer.temperature_schedule=cosine"])
    # the keys that moved to quantizer.* long ago are unknown keys now, like any other
    with pytest.raises(ConfigError, match="unknown config key 'train.temperature_schedule'"):
        load_config(None, ["train.temperature_schedule=cosine"])


def test_mstep_codebook_is_not_given_to_the_optimizer(tiny_config, recwarn):
    from ddcl_vq.tokenizer.config import build_optimizer
    cfg = tiny_config("train.codebook_lr_ratio=1.0")             # the default: M-step codebook
    model = build_model(cfg, 1)
    opt = build_optimizer(model, cfg.train, "ddcl")
    assert [g["name"] for g in opt.param_groups] == ["encoder_decoder"]
    assert all(p is not model.quantizer.weight for g in opt.param_groups for p in g["params"])
    assert not [w for w in recwarn if "timescale" in str(w.message)]


def test_a_run_config_of_another_version_is_refused_naming_the_version(tmp_path, capsys):
    """Issue 49: the migrations of old runs are retired: a run's saved config with keys since retired or renamed, or
    without keys this version has, is refused in one line naming the version (evaluate, train --config RUN/config.yaml);
    a user's own config file is read as always (missing keys get today's defaults)."""
    from ddcl_vq.tokenizer.evaluate import main as evaluate_main
    run = tmp_path / "old"
    (run / "checkpoints").mkdir(parents=True)
    raw = yaml.safe_load(dump_config(load_config(None, [f"run.dir={run}"])))
    raw["quantizer"]["revive_twins"] = True          # an option retired in 0.2.0
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="was written by ddcl-vq 0.1.0 before quantizer.revive_twins was retired"):
        load_config(run / "config.yaml", saved=True)
    del raw["quantizer"]["revive_twins"], raw["quantizer"]["warmup_steps"]  # a key this version has and it lacks
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    for main, argv, prog in ((evaluate_main, [str(run)], "evaluate"),
                             (train_main, ["--config", str(run / "config.yaml")], "train")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddcl-vq {prog}: error: ") and \
            "written by ddcl-vq 0.1.0 before quantizer.warmup_steps existed; evaluate it with ddcl-vq 0.1.x or " \
            "retrain it" in err[0], err
    assert load_config(run / "config.yaml").quantizer["warmup_steps"] == load_config(None).quantizer["warmup_steps"]


#: a resolved config of ddcl-vq 0.2.0: one quantizer section with every type's keys (decay null: the quantizer's
#: own), the peers' sections and fsq_levels; one model section with both architectures' keys
QUANTIZER_0_2_0 = dict(type="ddcl", num_codes=512, temperature=0.03, temperature_final=None,
                       temperature_schedule="constant", mode="straight_through", beta=0.25, beta_final=1.0,
                       revive_threshold=0.03, warmup_steps=100, codebook_init="kmeans", implementation="auto",
                       distance="euclidean", kmeans_init=False, dead_code_threshold=0.0, logits="dot",
                       entropy_weight=0.05, entropy_temperature=0.01, patch_size=4, bridge_dim=256, bridge_depth=2,
                       bridge_heads=4, decay=None, vqp={}, fsq_levels=None, simvq={}, lfq={})
MODEL_0_2_0 = dict(channels=64, num_res_blocks=2, num_downsamples=2, latent_dim=64, res_hidden=32, arch="vqvae",
                   ch=128, ch_mult=[1, 1, 2, 2, 4], attn_resolutions=[16], z_channels=256, norm_groups=32)


def as_0_2_0(raw):
    """``raw`` (a resolved config of this version) as ddcl-vq 0.2.0 wrote it."""
    q, m = raw["quantizer"], raw["model"]
    old = {**QUANTIZER_0_2_0, **{k: v for k, v in q.items() if k in QUANTIZER_0_2_0}}
    if q["type"] in ("vqp", "simvq", "lfq"):
        old[q["type"]] = {k: v for k, v in q.items() if k not in QUANTIZER_0_2_0}
    old["fsq_levels"] = q.get("levels")
    return {**raw, "quantizer": old, "model": {**MODEL_0_2_0, **{k: v for k, v in m.items() if k in MODEL_0_2_0}}}


def test_migrate_0_2_0_keeps_the_keys_of_the_type_and_the_arch():
    from ddcl_vq.tokenizer.config import migrate_0_2_0
    assert Config.from_dict(migrate_0_2_0(as_0_2_0(Config().to_dict()))) == Config()
    old = {"quantizer": {**QUANTIZER_0_2_0, "type": "vqp", "vqp": {"kmeans_init": True, "decay": 0.9}},
           "model": MODEL_0_2_0}
    assert migrate_0_2_0(old)["quantizer"] == {"type": "vqp", "num_codes": 512, "kmeans_init": True, "decay": 0.9}
    old["quantizer"].update(type="fsq", fsq_levels=[5, 5, 5])
    assert migrate_0_2_0(old)["quantizer"] == {"type": "fsq", "num_codes": 512, "levels": [5, 5, 5]}
    old["quantizer"].update(type="ema", dead_code_threshold=0.1)  # decay null: EMAVQ's own 0.99
    assert Config.from_dict(migrate_0_2_0(old)).quantizer == {"type": "ema", "num_codes": 512, "decay": 0.99,
                                                              "eps": 1e-5, "beta": 0.25, "dead_code_threshold": 0.1}
    old["model"] = {**MODEL_0_2_0, "arch": "vqgan", "latent_dim": 8}
    assert migrate_0_2_0(old)["model"] == {"arch": "vqgan", "num_res_blocks": 2, "latent_dim": 8, "ch": 128,
                                           "ch_mult": [1, 1, 2, 2, 4], "attn_resolutions": [16], "z_channels": 256,
                                           "norm_groups": 32}
    assert migrate_0_2_0({"quantizer": {"type": "vqp"}}) == {"quantizer": {"type": "vqp"}}  # not 0.2.0's: as it is


def test_a_run_of_0_2_0_is_migrated_on_load(tiny_config, tmp_path, capsys):
    """A 0.2.0 run (its config.yaml, its checkpoints' config and its export's config.json) is read by this version:
    evaluated, resumed and loaded as the same model."""
    from ddcl_vq.models import VQVAE
    from ddcl_vq.tokenizer.evaluate import main as evaluate_main
    from ddcl_vq.tokenizer.export import export_run

    cfg = tiny_config("train.steps=2", "train.eval_images=0", "quantizer.type=ema", "quantizer.decay=0.95")
    train(cfg, quiet=True)
    run = Path(cfg.run.dir)
    export_run(run, tmp_path / "export")
    (run / "config.yaml").write_text(yaml.safe_dump(as_0_2_0(cfg.to_dict()), sort_keys=False))
    for path in (run / "checkpoints").glob("*.pt"):
        state = torch.load(path, weights_only=True)
        state["config"] = as_0_2_0(state["config"])
        torch.save(state, path)
    assert load_config(run / "config.yaml", saved=True) == cfg
    assert evaluate_main([str(run), "--max-images", "32", "--quiet"]) == 0
    assert train_main(["--config", str(run / "config.yaml"), "--quiet", "train.steps=3"]) == 0
    assert latest_checkpoint(run / "checkpoints")[0]["step"] == 3
    # the export's config.json as 0.2.0 wrote it (encoder_kwargs, decoder_kwargs, quantizer_type, quantizer_kwargs)
    path = tmp_path / "export" / "config.json"
    new = json.loads(path.read_text())
    model, q = dict(new.pop("model")), dict(new.pop("quantizer"))
    arch, channels = model.pop("arch"), model.pop("in_channels")
    path.write_text(json.dumps({**new, "arch": arch, "encoder_kwargs": {"in_channels": channels, **model},
                                "decoder_kwargs": {"out_channels": channels, **model}, "quantizer_type": q.pop("type"),
                                "quantizer_kwargs": {**q, "dim": model["latent_dim"]}}))
    loaded = VQVAE.from_pretrained(str(tmp_path / "export"))
    assert loaded.config["model"] == {"arch": arch, "in_channels": channels, **model}
    assert loaded.config["quantizer"]["decay"] == 0.95 and type(loaded.quantizer).__name__ == "EMAVQ"


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "configs").glob("*.yaml")
                                         if not p.name.startswith(("study_", "prior_"))))  # own tests
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.run.dir.startswith("runs/")


def test_config_defaults_are_the_library_defaults():
    """One schema (issue 58): the model and quantizer sections are the constructors' keyword arguments with the
    constructors' defaults (type and num_codes aside), and an export's config.json holds those same sections (plus
    what the data and train.steps fix); a user who trains with the YAML defaults and one who writes
    DDCLQuantizer(K, D) get the same quantizer."""
    import inspect

    from ddcl_vq import DDCLQuantizer
    from ddcl_vq.models import Decoder, Encoder
    from ddcl_vq.models.vqvae import QUANTIZER_TYPES
    from ddcl_vq.tokenizer.config import NOT_IN_CONFIG, build_model, model_config, resolve_quantizer

    for qtype, cls in QUANTIZER_TYPES.items():
        q = resolve_quantizer({"type": qtype})
        params = inspect.signature(cls).parameters
        taken = {n for n, p in params.items() if n not in NOT_IN_CONFIG and p.kind is not p.VAR_KEYWORD}
        assert set(q) == taken | {"type"}, qtype
        assert all(q[n] == params[n].default for n in taken - {"num_codes"}), qtype
    assert resolve_quantizer({"type": "ema"})["decay"] == 0.99 and resolve_quantizer({})["decay"] == 0.9
    cfg = Config()
    for name in ("channels", "num_res_blocks", "num_downsamples", "latent_dim", "res_hidden"):
        assert cfg.model[name] == inspect.signature(Encoder).parameters[name].default \
            == inspect.signature(Decoder).parameters[name].default, name
    config = model_config(cfg, 1)
    assert config["model"] == {**cfg.model, "in_channels": 1}
    assert config["quantizer"] == {**cfg.quantizer, "schedule_steps": cfg.train.steps}
    built, direct = build_model(cfg, 1).quantizer, DDCLQuantizer(512, 64, schedule_steps=cfg.train.steps)
    assert built.describe() == direct.describe() and built.temperature == 0.03


def test_config_choices_are_what_the_quantizers_accept():
    """Each allowed value of a quantizer's choice (the library's tuples) builds the quantizer, and a value outside
    them is refused by the config naming the key: the quantizer's own argument check, run on the meta device."""
    from ddcl_vq.ddcl.arguments import DDCL_CHOICES
    from ddcl_vq.hard import HARDVQ_CHOICES
    from ddcl_vq.ibq import IBQ_LOGITS
    from ddcl_vq.tokenizer.config import build_model

    choices = [("ddcl", k, v) for k, v in DDCL_CHOICES.items()] + [("hard", k, v) for k, v in HARDVQ_CHOICES.items()]
    for qtype, key, values in choices + [("ibq", "logits", IBQ_LOGITS)]:
        for value in values:
            extra = ["quantizer.temperature_final=0.01"] if key == "temperature_schedule" else []
            cfg = load_config(None, TINY_MODEL + [f"quantizer.type={qtype}", f"quantizer.{key}={value}"] + extra)
            assert getattr(build_model(cfg, 1).quantizer, key, value) == value, (key, value)
        with pytest.raises(ConfigError, match=rf"config key 'quantizer\.{key}': expected"):
            load_config(None, [f"quantizer.type={qtype}", f"quantizer.{key}=not_a_choice"])
    with pytest.raises(ConfigError, match=r"config key 'quantizer\.type': expected one of \['ddcl', 'hard'"):
        load_config(None, ["quantizer.type=ddlc"])


def test_automatic_threads_use_the_idle_cores_and_the_setting_is_checked():
    """train.threads (and every heavy command's --threads): null = OMP_NUM_THREADS when set, one per
    process under a launcher, else the idle physical cores (at most 4); a set value is applied as it is."""
    import subprocess

    import torch

    from ddcl_vq.common.threads import AUTO_MAX, auto_threads, busy_cpus, set_threads, usable_cpus

    assert auto_threads({"OMP_NUM_THREADS": "3"}, cores=64)[0] == 3
    assert auto_threads({"LOCAL_WORLD_SIZE": "2"}, cores=16) == (1, "one per process, 2 processes on this machine")
    assert [auto_threads({}, cores=c, busy=0.0)[0] for c in (1, 2, 3, 4, 8, 64)] == [1, 2, 3, 4, AUTO_MAX, AUTO_MAX]
    n, why = auto_threads({}, cores=2, busy=0.9)
    assert n == 1 and why == "1 of 2 cores busy with other work"
    assert auto_threads({}, cores=2, busy=2.0)[0] == 1 and auto_threads({}, cores=2, busy=0.3)[0] == 2
    assert auto_threads({}, cores=8, busy=None) == (4, "half the 8 cores (their load cannot be read here)")
    # a process that keeps one CPU busy is seen on that CPU
    cpu = usable_cpus()[-1]
    burner = subprocess.Popen([sys.executable, "-c", "import os, time\nos.sched_setaffinity(0, {%d})\n"
                               "t = time.time()\nwhile time.time() - t < 20: pass" % cpu])
    try:
        time.sleep(0.5)
        assert busy_cpus([cpu], seconds=0.5) > 0.7
    finally:
        burner.kill()
        burner.wait()
    assert load_config(None, []).train.threads is None
    with pytest.raises(ConfigError, match=r"config key 'train\.threads': expected a value > 0, got 0"):
        load_config(None, ["train.threads=0"])
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert 1 <= set_threads(None) == torch.get_num_threads() <= AUTO_MAX
    finally:
        torch.set_num_threads(before)


def test_printed_hints_work_from_any_folder():
    """The commands a training prints to follow up (TensorBoard, evaluate) name the scripts by absolute
    path (the folder of the running Python) and the run directory absolutely."""
    import shlex

    from ddcl_vq.tokenizer.train import format_summary

    text = format_summary({"step": 3, "train_seconds": 1.0}, Path("runs") / "x")
    tb = shlex.split(next(l for l in text.splitlines() if l.startswith("TensorBoard: ")).split(": ", 1)[1])
    ev = shlex.split(next(l for l in text.splitlines() if l.startswith("full evaluation")).split(": ", 1)[1])
    bin_dir = Path(sys.executable).parent
    assert tb[0] == str((bin_dir / "tensorboard").absolute()) and Path(tb[0]).is_file()
    assert tb[1:3] == ["--logdir", str(Path.cwd() / "runs" / "x" / "tb")]
    assert ev == [str((bin_dir / "ddcl-vq").absolute()), "evaluate", str(Path.cwd() / "runs" / "x")]
