"""HardVQ, EMAVQ and the vector-quantize-pytorch adapter behind the common interface."""
import pytest
import torch

from ddcl_vq import EMAVQ, HardVQ, QuantizerOutput, VQPQuantizer


def test_hardvq_indices_loss_and_gradients():
    torch.manual_seed(0)
    q = HardVQ(16, 4, beta=0.5).double()
    z = torch.randn(2, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    out = q(z)
    flat = z.detach().permute(0, 2, 3, 1).reshape(-1, 4)
    d = (flat[:, None] - q.weight.detach()[None]).pow(2).sum(-1)
    assert torch.equal(out.indices.reshape(-1), d.argmin(1))
    assert torch.equal(out.quantized, q.lookup(out.indices))
    mind = d.min(1).values.mean()
    assert torch.allclose(out.terms["codebook"], mind) and torch.allclose(out.terms["commitment"], mind)
    assert torch.allclose(out.loss, (1 + 0.5) * mind / 4)
    out.quantized.sum().backward()
    assert torch.allclose(z.grad, torch.ones_like(z))  # straight-through identity


def test_hardvq_cosine_uses_normalised_codes():
    torch.manual_seed(0)
    q = HardVQ(8, 4, distance="cosine")
    out = q(torch.randn(2, 4, 3, 3) * 10)
    norms = out.quantized.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)


def test_hardvq_kmeans_init_uses_data():
    torch.manual_seed(0)
    q = HardVQ(8, 4, kmeans_init=True)
    z = torch.randn(4, 4, 8, 8) + 100.0
    assert not bool(q.initialized)
    q.train()(z)
    assert bool(q.initialized)
    assert (q.weight.detach() - 100).abs().max() < 5  # centroids sit in the data, not at init
    assert len(torch.unique(q.weight.detach(), dim=0)) == 8


def test_ema_codebook_moves_to_data_and_has_no_gradient():
    torch.manual_seed(0)
    q = EMAVQ(4, 2, decay=0.5)
    z = torch.randn(8, 2, 4, 4) * 0.1 + 3.0
    before = q.codebook.clone()
    for _ in range(20):
        q.train()(z)
    used = torch.unique(q(z).indices)
    assert (q.codebook[used] - 3.0).abs().max() < 0.5
    assert not (q.codebook == before).all()
    assert not any(p.requires_grad for p in q.parameters())


def test_ema_dead_code_restart_revives_unused_codes():
    torch.manual_seed(0)
    kwargs = dict(decay=0.8, dead_code_threshold=0.5)
    data = torch.randn(16, 4, 4, 4) * 0.5 + 5.0
    plain, restart = EMAVQ(64, 4, decay=0.8), EMAVQ(64, 4, **kwargs)
    restart.load_state_dict(plain.state_dict())
    for _ in range(30):
        plain.train()(data)
        restart.train()(data)
    plain.eval(), restart.eval()
    used_plain = torch.unique(plain(data).indices).numel()
    used_restart = torch.unique(restart(data).indices).numel()
    assert int(restart.restarts) > 0
    assert used_restart > 2 * used_plain, (used_plain, used_restart)


def test_vqp_adapter_runs_the_real_peer():
    import vector_quantize_pytorch

    torch.manual_seed(0)
    q = VQPQuantizer(32, 8)
    assert isinstance(q.vq, vector_quantize_pytorch.VectorQuantize)
    z = torch.randn(2, 8, 4, 4, requires_grad=True)
    out = q.train()(z)
    assert isinstance(out, QuantizerOutput)
    assert out.quantized.shape == z.shape and out.indices.shape == (2, 4, 4)
    out.quantized.sum().add(out.loss).backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    q.eval()
    out = q(z)
    assert torch.allclose(out.quantized, q.lookup(out.indices), atol=1e-6)


def test_vqp_adapter_channel_last_and_kwargs():
    q = VQPQuantizer(16, 4, channel_dim=-1, kmeans_init=True, threshold_ema_dead_code=2)
    out = q.train()(torch.randn(3, 10, 4))
    assert out.indices.shape == (3, 10)


def _copies(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("make", [
    lambda: __import__("ddcl_vq").DDCLQuantizer(8, 4),
    lambda: __import__("ddcl_vq").DDCLQuantizer(8, 4, mode="soft", implementation="fused"),
    lambda: __import__("ddcl_vq").DDCLQuantizer(8, 4, mode="soft_straight_through", implementation="reference"),
    lambda: HardVQ(8, 4, kmeans_init=True),
    lambda: HardVQ(8, 4, distance="cosine"),
    lambda: EMAVQ(8, 4, dead_code_threshold=0.5),
    lambda: VQPQuantizer(8, 4),
], ids=["ddcl", "ddcl-soft-fused", "ddcl-sst-reference", "hard-kmeans", "hard-cosine", "ema", "vqp"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channel_dim", [1, -1])
def test_empty_batch_one_rule_for_every_quantizer(make, training, channel_dim):
    """N = 0: a finite zero loss (backward works), zero terms, empty indices, quantized of the
    input's empty shape, and no state change at all (no k-means start, no EMA or M-step update)."""
    torch.manual_seed(0)
    q = make().train(training)
    if channel_dim == -1:
        q.channel_dim = -1
    before = _copies(q)
    z = (torch.zeros(0, 4, 3, 3) if channel_dim == 1 else torch.zeros(2, 0, 4)).requires_grad_(True)
    out = q(z)
    assert out.quantized.shape == z.shape and out.quantized.dtype == z.dtype
    assert out.indices.shape == ((0, 3, 3) if channel_dim == 1 else (2, 0)) and out.indices.dtype == torch.long
    assert out.loss.dim() == 0 and out.loss.item() == 0.0
    assert out.terms and all(v.item() == 0.0 for v in out.terms.values())
    assert torch.isfinite(out.perplexity)
    out.loss.backward()
    assert z.grad.shape == z.shape
    for p in q.parameters():        # every trainable parameter gets a (zero) gradient: DDP needs one
        assert not p.requires_grad or torch.equal(p.grad, torch.zeros_like(p))
    after = _copies(q)
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    # the next real batch still starts the quantizer as a first batch would
    flat = torch.randn(32, 4)
    torch.manual_seed(0)
    q2 = make().train(training)
    q2.channel_dim = -1
    q.channel_dim = -1
    torch.manual_seed(1)
    a = q(flat)
    torch.manual_seed(1)
    b = q2(flat)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.quantized, b.quantized)


def test_hardvq_kmeans_on_an_empty_first_batch_stays_uninitialised():
    q = HardVQ(8, 4, kmeans_init=True).train()
    q(torch.zeros(0, 4, 2, 2))
    assert not bool(q.initialized)
    q(torch.randn(4, 4, 2, 2))
    assert bool(q.initialized)


@pytest.mark.parametrize("name", ["DDCLQuantizer", "HardVQ", "EMAVQ", "IBQQuantizer", "FVQQuantizer", "VQPQuantizer",
                                  "SimVQQuantizer", "LFQQuantizer", "FSQQuantizer"])
def test_every_quantizer_takes_codebook_size_as_the_keyword_for_num_codes(name):
    """vector-quantize-pytorch's keyword works for every quantizer; positional (num_codes, dim) too; both is
    an error; the signature (what configs and adapters read) still names num_codes."""
    import inspect

    import ddcl_vq
    cls = getattr(ddcl_vq, name)
    assert cls(codebook_size=256, dim=8).num_codes == cls(256, 8).num_codes == cls(num_codes=256, dim=8).num_codes
    assert list(inspect.signature(cls).parameters)[:2] == ["num_codes", "dim"]
    for both in (lambda: cls(256, 8, codebook_size=256), lambda: cls(num_codes=256, dim=8, codebook_size=256)):
        with pytest.raises(ValueError, match="codebook size once, as num_codes or codebook_size, got both"):
            both()
