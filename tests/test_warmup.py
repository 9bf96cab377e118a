"""DDCL's quantization warm-up: during the first ``warmup_steps`` training batches the decoder sees
z + α·(w_{k*} − z), α rising linearly from 0 to 1, while the M-step codebook already follows the
features; the encoder's gradient is the straight-through one throughout (a state_dict saved before the
warm-up existed is refused: tests/test_ddcl.py)."""
import pytest
import torch

from ddcl_vq import DDCLQuantizer


def batch(n=64, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * torch.linspace(0.5, 2.0, d)).to(dtype)


def test_warmup_blends_from_z_to_the_code_without_step_calls():
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=4, revive_threshold=0.0).double()
    z = batch(seed=1).requires_grad_(True)
    out = quant(z)                                   # batch 0: alpha = 0, the decoder sees z itself
    torch.testing.assert_close(out.quantized, z.detach())
    out.quantized.sum().backward()
    torch.testing.assert_close(z.grad, torch.ones_like(z))   # straight-through identity
    for seen in (1, 2, 3, 4, 5):                      # no quant.step(): a host loop may never call it
        z = batch(seed=1 + seen).requires_grad_(True)
        codes = quant.codebook.detach().clone()      # the codebook this batch is decoded with
        out = quant(z)
        alpha = min(seen / 4, 1.0)
        torch.testing.assert_close(out.quantized, (1 - alpha) * z.detach() + alpha * codes[out.indices])
        out.quantized.sum().backward()
        torch.testing.assert_close(z.grad, torch.ones_like(z))
    assert int(quant.warmup_batches) == 4


def test_the_mstep_codebook_follows_the_features_during_warmup():
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=100, revive_threshold=0.0).double()
    quant(batch(seed=1))
    before = quant.codebook.detach().clone()
    quant(batch(seed=2) * 3.0)
    assert not torch.allclose(quant.codebook.detach(), before)


def test_evaluation_quantizes_even_during_warmup():
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=100).double()
    quant(batch(seed=1))
    quant.eval()
    out = quant(batch(seed=2))
    torch.testing.assert_close(out.quantized, quant.codebook.detach()[out.indices])
    assert int(quant.warmup_batches) == 1            # evaluation batches do not count


def test_warmup_position_is_restored_from_the_state_dict():
    a = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=4, revive_threshold=0.0).double()
    for seed in (1, 2):
        a(batch(seed=seed))
    b = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=4, revive_threshold=0.0).double()
    b.load_state_dict(a.state_dict())
    z = batch(seed=3)
    torch.testing.assert_close(b(z).quantized, a(z).quantized)   # both at alpha = 1/2


def test_warmup_steps_validated():
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="warmup_steps"):
            DDCLQuantizer(8, 4, warmup_steps=bad)


# ------------------------------------------------------------------ used before the warm-up ended: one warning
def warmup_warnings(record):
    return [w for w in record if issubclass(w.category, UserWarning) and "warm-up" in str(w.message)]


def test_evaluating_inside_the_warmup_warns_once_naming_it(recwarn):
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=10).double()
    for seed in (1, 2, 3):
        quant(batch(seed=seed))
    assert not warmup_warnings(recwarn)              # training forwards themselves are quiet
    quant.eval()
    quant(batch(seed=4))
    quant(batch(seed=5))
    quant.state_dict()
    (w,) = warmup_warnings(recwarn)                  # once per instance, whatever comes next
    assert "after 3 of its 10 warm-up training forwards" in str(w.message) and "warmup_steps=10" in str(w.message)
    assert "\n" not in str(w.message)


def test_a_state_dict_inside_the_warmup_warns_once(recwarn):
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=10).double()
    quant(batch(seed=1))
    quant.state_dict()
    quant.state_dict()
    (w,) = warmup_warnings(recwarn)
    assert "saved after 1 of its 10" in str(w.message)


def test_no_warmup_warning_past_the_warmup_without_training_or_when_silenced(recwarn):
    past = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=2).double()
    for seed in (1, 2):                              # exactly the warm-up: its last forward ends it
        past(batch(seed=seed))
    past.eval()(batch(seed=3))
    past.state_dict()
    fresh = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=10).double()
    fresh.eval()(batch(seed=4))                      # no training forward at all
    short = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=10).double()
    short(batch(seed=5))
    loaded = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=10).double()
    loaded.load_state_dict(short.state_dict())
    recwarn.clear()                                  # (short's own state_dict warned: tested above)
    loaded.state_dict()
    loaded.eval()(batch(seed=6))                     # a checkpoint loaded into a fresh module: its training was not here
    quiet = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=10).double()
    quiet.warn_inside_warmup = False                 # a caller that reports it itself (ddcl-vq train)
    quiet(batch(seed=7))
    quiet.eval()(batch(seed=8))
    assert not warmup_warnings(recwarn)


def test_a_swapped_vector_quantize_warns_once_inside_its_warmup(recwarn):
    vqp = pytest.importorskip("vector_quantize_pytorch")
    from ddcl_vq import swap_quantizer
    vq = swap_quantizer(vqp.VectorQuantize(dim=8, codebook_size=16), warmup_steps=50)
    for _ in range(3):                               # a user's own loop, shorter than the warm-up
        vq(torch.randn(2, 32, 8))
    assert not warmup_warnings(recwarn)
    vq.eval()
    vq(torch.randn(2, 32, 8))
    torch.save(vq.state_dict(), __import__("io").BytesIO())
    (w,) = warmup_warnings(recwarn)
    assert "after 3 of its 50 warm-up training forwards (warmup_steps=50)" in str(w.message)
    # past its warm-up, or loaded from the host's checkpoint (which counts as past it): quiet
    done = swap_quantizer(vqp.VectorQuantize(dim=8, codebook_size=16), warmup_steps=2)
    for _ in range(2):
        done(torch.randn(2, 32, 8))
    done.eval()(torch.randn(2, 32, 8))
    host = vqp.VectorQuantize(dim=8, codebook_size=16)
    resumed = swap_quantizer(vqp.VectorQuantize(dim=8, codebook_size=16), warmup_steps=50)
    resumed.load_state_dict(swap_quantizer(host).state_dict())
    resumed.eval()(torch.randn(2, 32, 8))
    resumed.state_dict()
    assert len(warmup_warnings(recwarn)) == 1


def test_ddcl_vq_train_warns_once_not_at_each_checkpoint(tiny_config, tmp_path, recwarn, capsys):
    from ddcl_vq.tokenizer.train import train
    cfg = tiny_config("train.steps=4", "quantizer.warmup_steps=50", "train.checkpoint_every=1",
                      run_dir=tmp_path / "short")
    train(cfg)
    assert capsys.readouterr().err.count("ends inside the quantizer's warm-up") == 1
    assert not warmup_warnings(recwarn)
