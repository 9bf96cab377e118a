"""Use what you trained: export -> VQVAE.from_pretrained, tokenize, decode, readable logs.

- ``ddcl-vq export`` writes config.json + model.safetensors (+ README.md), no pickle; the folder
  alone reproduces the run's hard reconstructions and indices bit for bit, quantizer state
  (temperature schedule, buffers) included; the baselines export too;
- ``ddcl-vq tokenize`` gives ``encode_indices``' indices, in uint8 / uint16 by K, with labels,
  as .npy or safetensors read without ddcl-vq; ``ddcl-vq decode`` turns them back into the
  model's hard reconstruction;
- a training run whose progress goes to a log file writes one line per logging interval.
"""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ddcl_vq import cli
from ddcl_vq.tokenizer.evaluate import load_run
from ddcl_vq.tokenizer.decode import decode_indices
from ddcl_vq.tokenizer.export import export_run
from ddcl_vq.tokenizer.tokens import index_dtype, read_tokens
from ddcl_vq.tokenizer.tokens import tokenize_run
from ddcl_vq.models import VQVAE
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import build_dataset
from ddcl_vq.tokenizer.train import train
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
TINY = TINY + ["train.eval_images=0"]
CONFIGS = {"ddcl": "configs/fashion_ddcl.yaml", "hard": "configs/fashion_hard.yaml",
           "ema": "configs/fashion_ema.yaml", "vqp": "configs/fashion_vqp.yaml"}
# a schedule and non-default options, so the quantizer's constructor arguments and state matter
DDCL_EXTRA = ["quantizer.temperature_schedule=cosine", "quantizer.temperature_final=0.03",
              "quantizer.revive_threshold=0.05", "quantizer.decay=0.8"]


def _train(base: Path, name: str, config: str, extra=()) -> Path:
    cfg = load_config(ROOT / config, TINY + [f"run.dir={base / name}", f"run.name={name}"] + list(extra))
    train(cfg, quiet=True)
    return base / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {"ddcl": _train(base, "ddcl", CONFIGS["ddcl"], DDCL_EXTRA)}


@pytest.fixture(scope="module")
def images():
    ds = build_dataset(load_config().data, "test")
    return torch.stack([ds[i][0] for i in range(40)]), torch.tensor([ds[i][1] for i in range(40)])


def _no_pickle(folder: Path):
    """Every file is text (config.json, README.md) or safetensors (8-byte header length + JSON header
    + raw tensor bytes): nothing a loader would unpickle."""
    for path in folder.iterdir():
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + n])
            assert all(set(v) >= {"dtype", "shape", "data_offsets"} for k, v in header.items() if k != "__metadata__")
        else:
            data.decode("utf-8")
            assert path.suffix in (".json", ".md")


# --------------------------------------------------------------------------- export

def test_export_then_from_pretrained_reproduces_the_run_bit_for_bit(runs, images, tmp_path, capsys):
    out = tmp_path / "exported"
    assert cli.main(["export", str(runs["ddcl"]), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bit for bit" in printed and "from_pretrained" in printed
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    _no_pickle(out)

    cfg, run_model, step, _ = load_run(runs["ddcl"])
    model = VQVAE.from_pretrained(str(out))
    assert not model.training
    x = images[0]
    assert torch.equal(model.reconstruct(x, "hard"), run_model.reconstruct(x, "hard"))
    assert torch.equal(model.encode_indices(x), run_model.encode_indices(x))
    assert torch.equal(model.reconstruct(x, "soft"), run_model.reconstruct(x, "soft"))
    # every tensor of the state (buffers, DDCL's float64 schedule entry) round-trips exactly
    a, b = model.state_dict(), run_model.state_dict()
    assert a.keys() == b.keys() and "quantizer.schedule" in a
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    q = model.quantizer
    assert (q.temperature, q.temperature_schedule, int(q.schedule_step)) == \
        (run_model.quantizer.temperature, "cosine", 6)

    config = json.loads((out / "config.json").read_text())
    # one schema (issue 58): config.json's sections are the run's config.yaml sections as they are, plus what the
    # data (the image channels) and train.steps (the schedules' length) fix
    saved = yaml.safe_load((runs["ddcl"] / "config.yaml").read_text())
    assert config["model"] == {**saved["model"], "in_channels": 1}
    assert config["quantizer"] == {**saved["quantizer"], "schedule_steps": saved["train"]["steps"]}
    assert config["quantizer"]["decay"] == 0.8 and config["quantizer"]["revive_threshold"] == 0.05
    assert config["quantizer_state"]["schedule_step"] == 6
    assert config["quantizer_state"]["temperature"] == pytest.approx(run_model.quantizer.temperature)
    assert config["source"]["step"] == step == 6 and config["data"]["image_size"] == 32
    assert "VQVAE.from_pretrained" in (out / "README.md").read_text()

    # save_pretrained of the loaded model writes the same weights
    again = tmp_path / "again"
    model.save_pretrained(again)
    c = VQVAE.from_pretrained(str(again))
    assert torch.equal(c.reconstruct(x, "hard"), run_model.reconstruct(x, "hard"))


@pytest.mark.parametrize("qtype", ["hard", "ema", "vqp"])
def test_baseline_quantizers_export_too(qtype, images, tmp_path):
    if qtype == "vqp":
        pytest.importorskip("vector_quantize_pytorch")
    run = _train(tmp_path, qtype, CONFIGS[qtype])
    done = export_run(run, tmp_path / "out")
    assert done["quantizer_type"] == qtype
    _no_pickle(tmp_path / "out")
    _, run_model, _, _ = load_run(run)
    model = VQVAE.from_pretrained(str(tmp_path / "out"))
    x = images[0]
    assert torch.equal(model.reconstruct(x, "hard"), run_model.reconstruct(x, "hard"))
    assert torch.equal(model.encode_indices(x), run_model.encode_indices(x))
    if qtype == "vqp":
        assert "vector-quantize-pytorch" in (tmp_path / "out" / "README.md").read_text()


def test_save_pretrained_needs_constructor_arguments(tmp_path):
    from ddcl_vq import HardVQ
    from ddcl_vq.models import Decoder, Encoder

    model = VQVAE(Encoder(latent_dim=8), HardVQ(16, 8), Decoder(latent_dim=8))
    with pytest.raises(ValueError, match="VQVAE.from_config"):
        model.save_pretrained(tmp_path / "x")


@pytest.mark.parametrize("argv, message", [
    (["export", "no/such/run", "out"], "run directory 'no/such/run' does not exist"),
    (["tokenize", "no/such/run", "--out", "t.npy"], "run directory 'no/such/run' does not exist"),
    (["tokenize", "no/such/run", "--out", "t.pt"], "expected a token file ending in .npy or .safetensors"),
    (["tokenize", "no/such/run", "--split", "val", "--out", "t.npy"], "option --split: expected one of"),
    (["decode", "no/such/run", "no/such.npy", "--out", "g.png"], "token file 'no/such.npy' does not exist"),
    (["decode", "no/such/run", "t.npy", "--out", "g.jpg"], "expected --out to end in .png"),
])
def test_user_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddcl-vq {argv[0]}: error: "), err
    assert message in err[0]


def test_export_refuses_a_non_empty_folder_and_decode_checks_the_range(runs, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert cli.main(["export", str(runs["ddcl"]), str(out)]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "keep me"
    np.save(tmp_path / "bad.npy", np.full((2, 8, 8), 32, dtype=np.int64))  # K = 32: 32 is out of range
    assert cli.main(["decode", str(runs["ddcl"]), str(tmp_path / "bad.npy"), "--out", str(tmp_path / "g.png")]) == 2
    assert "expected indices in [0, 32)" in capsys.readouterr().err


def test_commands_explain_themselves(capsys):
    for name in ("export", "tokenize", "decode"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert f"ddcl-vq {name}" in out and len(out.splitlines()) > 8


# --------------------------------------------------------------------------- tokenize / decode

def test_index_dtype_is_the_smallest_unsigned_type_that_holds_k():
    assert index_dtype(2) == np.uint8 and index_dtype(256) == np.uint8
    assert index_dtype(257) == np.uint16 and index_dtype(65_536) == np.uint16
    assert index_dtype(65_537) == np.uint32


@pytest.mark.parametrize("suffix", [".npy", ".safetensors"])
def test_tokenize_gives_encode_indices_with_labels(suffix, runs, images, tmp_path, capsys):
    out = tmp_path / f"test{suffix}"
    assert cli.main(["tokenize", str(runs["ddcl"]), "--split", "test", "--out", str(out), "--max-images", "40",
                     "--batch-size", "16"]) == 0
    printed = capsys.readouterr()
    assert "40 images -> indices 40x8x8 uint8" in printed.out
    assert re.search(r"tokenize: batch 3/3", printed.err)  # progress as lines (not a terminal here)
    # read without ddcl-vq
    if suffix == ".npy":
        indices = np.load(out)
        labels = np.load(tmp_path / "test.labels.npy")
    else:
        from safetensors.numpy import load_file
        from safetensors import safe_open

        tensors = load_file(str(out))
        indices, labels = tensors["indices"], tensors["labels"]
        with safe_open(str(out), framework="numpy") as f:
            meta = f.metadata()
        assert meta["num_codes"] == "32" and meta["split"] == "test"
    assert indices.dtype == np.uint8 and indices.shape == (40, 8, 8)
    _, model, _, _ = load_run(runs["ddcl"])
    assert np.array_equal(indices, model.encode_indices(images[0]).numpy())
    assert np.array_equal(labels, images[1].numpy())

    # decode is the other way: the model's hard reconstruction, and its PNG grid
    read, _, _ = read_tokens(out)
    hard = model.reconstruct(images[0], "hard").clamp(0, 1)
    assert torch.equal(decode_indices(model, read, batch_size=16), hard)
    png = tmp_path / "grid.png"
    assert cli.main(["decode", str(runs["ddcl"]), str(out), "--out", str(png), "--count", "16", "--nrow", "4"]) == 0
    from PIL import Image
    from torchvision.utils import save_image

    expected = tmp_path / "expected.png"
    save_image(hard[:16], str(expected), nrow=4, padding=2)
    assert np.array_equal(np.asarray(Image.open(png)), np.asarray(Image.open(expected)))


def test_tokenize_uses_uint16_above_256_codes_and_decode_reads_an_export(tmp_path, images):
    run = _train(tmp_path, "k300", CONFIGS["ddcl"], ["quantizer.num_codes=300"])
    done = tokenize_run(run, "test", tmp_path / "t.npy", max_images=24)
    indices = np.load(tmp_path / "t.npy")
    assert done["dtype"] == "uint16" and indices.dtype == np.uint16
    export_run(run, tmp_path / "exported")
    model = VQVAE.from_pretrained(str(tmp_path / "exported"))
    assert np.array_equal(indices, model.encode_indices(images[0][:24]).numpy())
    assert torch.equal(decode_indices(model, indices), model.reconstruct(images[0][:24], "hard").clamp(0, 1))
    assert cli.main(["decode", str(tmp_path / "exported"), str(tmp_path / "t.npy"), "--out",
                     str(tmp_path / "g.png")]) == 0


# --------------------------------------------------------------------------- readable logs

def test_a_training_log_has_one_progress_line_per_logging_interval(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DDCL_VQ_PROGRESS", raising=False)
    cfg = load_config(ROOT / CONFIGS["ddcl"], TINY + [f"run.dir={tmp_path / 'r'}", "run.name=logged",
                                                       "train.steps=8", "train.log_every=2"])
    train(cfg)  # stderr is captured: not a terminal
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("logged: step ")]
    assert [int(re.match(r"logged: step (\d+)/8", line).group(1)) for line in lines] == [2, 4, 6, 8]
    assert all("loss=" in line and "step/s" in line for line in lines)
    # resumed: lines continue from the step it resumed at
    cfg = load_config(ROOT / CONFIGS["ddcl"], TINY + [f"run.dir={tmp_path / 'r'}", "run.name=logged",
                                                       "train.steps=12", "train.log_every=2"])
    train(cfg)
    err = capsys.readouterr().err
    steps = [int(m.group(1)) for m in re.finditer(r"^logged: step (\d+)/12", err, re.M)]
    assert steps == [10, 12]


def test_push_to_hub_uploads_the_export_and_a_failure_is_one_line(runs, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create", repo_id, kwargs.get("private")))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, **kwargs):
            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "pushed"
    assert cli.main(["export", str(runs["ddcl"]), str(out), "--push-to-hub", "me/tiny", "--private"]) == 0
    assert calls == [("create", "me/tiny", True),
                     ("upload", "me/tiny", ["README.md", "config.json", "model.safetensors"])]
    assert "pushed to https://huggingface.co/me/tiny" in capsys.readouterr().out

    class OfflineApi(FakeApi):
        def create_repo(self, repo_id, **kwargs):
            raise ConnectionError("Name or service not known\nmore detail")

    monkeypatch.setattr(huggingface_hub, "HfApi", OfflineApi)
    assert cli.main(["export", str(runs["ddcl"]), str(out), "--overwrite", "--push-to-hub", "me/tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "upload to the hub repository 'me/tiny' failed" in err[0]
    assert VQVAE.from_pretrained(str(out)).quantizer.num_codes == 32  # the export itself is complete


# --------------------------------------------------------------------------- the token path without seams

@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "ddcl"
    export_run(runs["ddcl"], out)
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_decode_indices_takes_any_integer_dtype_as_maps_or_flat_sequences(dtype, exported, images):
    model = VQVAE.from_pretrained(str(exported))
    grid = model.encode_indices(images[0][:6]).numpy()
    hard = model.reconstruct(images[0][:6], "hard")
    assert model.latent_shape() == (8, 8)
    codes = grid.astype(dtype)
    for layout in (codes, codes.reshape(6, 64)):  # (N, h, w) maps and what a prior emits, (N, h*w)
        assert torch.equal(model.decode_indices(torch.from_numpy(layout)), hard)
        assert torch.equal(decode_indices(model, layout), hard.clamp(0, 1))
    assert torch.equal(model.decode_indices(torch.from_numpy(codes.reshape(6, 64)), shape=(8, 8)), hard)
    with pytest.raises(ValueError, match=r"h\*w = 8\*8 = 64 indices .* got 60"):
        model.decode_indices(torch.from_numpy(codes.reshape(-1)[:360].reshape(6, 60)))
    with pytest.raises(ValueError, match="expected integer code indices, got dtype torch.float32"):
        model.decode_indices(torch.from_numpy(codes.astype(np.float32)))


def test_decode_command_reads_flat_uint16_tokens_and_an_explicit_shape(runs, exported, tmp_path, capsys):
    grid = tmp_path / "grid.npy"
    assert cli.main(["tokenize", str(exported), "--split", "test", "--max-images", "12", "--out", str(grid),
                     "--quiet"]) == 0
    codes = np.load(grid)
    np.save(tmp_path / "flat16.npy", codes.reshape(12, 64).astype(np.uint16))
    pngs = {}
    for name, source, tokens, extra in [("grid", exported, grid, []), ("flat", exported, "flat16.npy", []),
                                         ("run", runs["ddcl"], "flat16.npy", []),
                                         ("shape", exported, "flat16.npy", ["--shape", "8", "8"])]:
        out = tmp_path / f"{name}.png"
        assert cli.main(["decode", str(source), str(tmp_path / tokens), "--out", str(out)] + extra) == 0, name
        pngs[name] = out.read_bytes()
    assert "12 images of 1x32x32" in capsys.readouterr().out
    assert pngs["flat"] == pngs["grid"] == pngs["run"] == pngs["shape"]
    np.save(tmp_path / "bad.npy", codes.reshape(12, 64)[:, :60])
    assert cli.main(["decode", str(exported), str(tmp_path / "bad.npy"), "--out", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "h*w = 8*8 = 64 indices (the latent grid), got 60 per sequence" in err[0]
    assert not (tmp_path / "b.png").exists()


def test_tokenize_reads_an_exported_folder_and_a_hub_id_as_decode_does(runs, exported, tmp_path):
    import os
    import subprocess
    import sys

    assert cli.main(["tokenize", str(runs["ddcl"]), "--split", "test", "--max-images", "20",
                     "--out", str(tmp_path / "run.safetensors"), "--quiet"]) == 0
    assert cli.main(["tokenize", str(exported), "--split", "test", "--max-images", "20",
                     "--out", str(tmp_path / "export.safetensors"), "--quiet"]) == 0
    a, la, meta = read_tokens(tmp_path / "run.safetensors")
    b, lb, meta_b = read_tokens(tmp_path / "export.safetensors")
    assert np.array_equal(a, b) and np.array_equal(la, lb) and meta_b["num_codes"] == "32"
    # a Hub id, read from the local Hugging Face cache (offline: what a download leaves there)
    cache = tmp_path / "hub"
    revision = "0" * 40
    snapshot = cache / "models--me--tiny-ddcl" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (cache / "models--me--tiny-ddcl" / "refs").mkdir()
    (cache / "models--me--tiny-ddcl" / "refs" / "main").write_text(revision)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).write_bytes((exported / name).read_bytes())
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "ddcl_vq", "tokenize", "me/tiny-ddcl", "--split", "test",
                           "--max-images", "20", "--out", str(tmp_path / "hub.npy"), "--quiet"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(np.load(tmp_path / "hub.npy"), a)
    done = subprocess.run([sys.executable, "-m", "ddcl_vq", "decode", "me/not-there", str(tmp_path / "hub.npy"),
                           "--out", str(tmp_path / "g.png")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and err[-1].startswith("ddcl-vq decode: error: cannot load the exported model "
                                                       "'me/not-there' (not a folder here, so read as a Hugging Face Hub id)")


def test_init_from_starts_a_new_run_from_an_export_and_refuses_another_shape(exported, tmp_path, capsys):
    from ddcl_vq.tokenizer.config import build_model
    from ddcl_vq.tokenizer.tokens import NEW_RUN_STATE, init_from_export

    cfg = load_config(ROOT / CONFIGS["ddcl"], TINY + [f"run.dir={tmp_path / 'ft'}", f"train.init_from={exported}",
                                                       "train.steps=2", "quantizer.temperature_schedule=constant"])
    model = build_model(cfg, 1)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    init_from_export(model, str(exported))
    source = VQVAE.from_pretrained(str(exported)).state_dict()
    for key, value in model.state_dict().items():  # the export's weights and codebook state; the run's own schedule
        assert torch.equal(value, fresh[key] if key in NEW_RUN_STATE else source[key]), key
    assert int(model.quantizer.schedule_step) == 0 and bool(model.quantizer.initialized)

    summary = train(cfg, quiet=True)  # a new run: step 0 -> 2, its own checkpoints
    steps = [json.loads(line)["step"] for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 2 and summary["step"] == 2
    assert cli.main(["train", "--config", str(ROOT / CONFIGS["ddcl"]), *TINY, "model.channels=32",
                     "quantizer.num_codes=64", f"run.dir={tmp_path / 'other'}", f"train.init_from={exported}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ddcl-vq train: error: train.init_from" in err[0]
    assert "model.channels: export 16, this config 32" in err[0] and "quantizer.num_codes: export 32, this config 64" in err[0]
    assert not (tmp_path / "other" / "checkpoints").exists()
