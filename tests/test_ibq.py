"""IBQ (index backpropagation quantization) against its authors' formulation.

The reference below is TencentARC/SEED-Voken's ``IndexPropagationQuantize.forward`` and
``compute_entropy_loss`` written out on (N, D) features (every N×K tensor materialised); the library's
blocked autograd path must give the same codes, indices, loss and gradients — in every row-block size,
with and without the entropy term, for both logits. Plus the interface rules every quantizer follows,
and a tiny run through the commands.
"""
import json
from pathlib import Path

import pytest
import torch

import ddcl_vq.ibq as ibq_module
from ddcl_vq import IBQQuantizer, QuantizerOutput
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def authors_ibq(z, weight, *, beta=0.25, logits="dot", entropy_weight=0.05, entropy_temperature=0.01):
    """SEED-Voken src/IBQ/modules/vqvae/quantize.py, IndexPropagationQuantize.forward (with its
    compute_entropy_loss, weighted as its ImageNet configs weight it) on (N, D) features."""
    if logits == "dot":
        lg = z @ weight.t()
    else:
        lg = -((z[:, None, :] - weight[None, :, :]) ** 2).sum(-1)
    soft_one_hot = torch.softmax(lg, 1)
    ind = soft_one_hot.max(1, keepdim=True)[1]
    hard_one_hot = torch.zeros_like(lg).scatter_(1, ind, 1.0)
    one_hot = hard_one_hot - soft_one_hot.detach() + soft_one_hot
    z_q = one_hot @ weight
    z_q_2 = hard_one_hot @ weight
    loss = ((z_q - z) ** 2).mean() + ((z_q_2.detach() - z) ** 2).mean() + beta * ((z_q_2 - z.detach()) ** 2).mean()
    if entropy_weight > 0:
        probs = torch.softmax(lg / entropy_temperature, -1)
        log_probs = torch.log_softmax(lg / entropy_temperature + 1e-5, -1)
        avg_probs = probs.mean(0)
        avg_entropy = -torch.sum(avg_probs * torch.log(avg_probs + 1e-5))
        sample_entropy = torch.mean(-torch.sum(probs * log_probs, -1))
        loss = loss + entropy_weight * (sample_entropy - avg_entropy)
    return z_q, ind.reshape(-1), loss


@pytest.mark.parametrize("logits", ["dot", "distance"])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.05])
@pytest.mark.parametrize("block_elements", [1 << 22, 8 * 7])   # one block, and blocks of 7 rows of 8 codes
def test_matches_the_authors_formulation(logits, entropy_weight, block_elements, monkeypatch):
    monkeypatch.setattr(ibq_module, "BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    q = IBQQuantizer(8, 4, logits=logits, entropy_weight=entropy_weight, channel_dim=-1).double()
    with torch.no_grad():
        q.weight.mul_(0.3)
    z = (torch.randn(37, 4, dtype=torch.float64) * 0.5).requires_grad_()
    upstream = torch.randn(37, 4, dtype=torch.float64)
    out = q(z)
    (out.loss + (out.quantized * upstream).sum()).backward()

    z_ref = z.detach().clone().requires_grad_()
    w_ref = q.weight.detach().clone().requires_grad_()
    zq_ref, ind_ref, loss_ref = authors_ibq(z_ref, w_ref, logits=logits, entropy_weight=entropy_weight)
    (loss_ref + (zq_ref * upstream).sum()).backward()

    assert torch.equal(out.indices, ind_ref)
    assert torch.equal(out.quantized, q.weight.detach()[out.indices])  # the value is exactly the hard code
    assert torch.allclose(out.quantized, zq_ref, atol=1e-12)
    assert out.loss.item() == pytest.approx(loss_ref.item(), abs=1e-12)
    assert torch.allclose(z.grad, z_ref.grad, atol=1e-12)
    assert torch.allclose(q.weight.grad, w_ref.grad, atol=1e-12)
    assert (q.weight.grad.abs().sum(1) > 0).all()  # every code is trained, not only the chosen ones


def test_every_code_gets_a_gradient_and_the_encoder_learns_through_the_softmax():
    torch.manual_seed(0)
    q = IBQQuantizer(64, 8, entropy_weight=0.0)
    z = torch.randn(2, 8, 4, 4, requires_grad=True)
    out = q(z)
    assert isinstance(out, QuantizerOutput) and out.indices.shape == (2, 4, 4) and out.quantized.shape == z.shape
    assert set(out.terms) == {"double", "commitment", "codebook", "entropy"}
    out.quantized.square().sum().backward()  # the task's gradient alone, no quantizer loss
    assert z.grad.abs().sum() > 0 and (q.weight.grad.abs().sum(1) > 0).sum() > 32


@pytest.mark.parametrize("logits", ["dot", "distance"])
def test_index_rule_and_lookup(logits):
    torch.manual_seed(0)
    q = IBQQuantizer(32, 8, logits=logits).eval()
    z = torch.randn(3, 8, 5, 5)
    with torch.no_grad():
        out = q(z)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 8)
    expected = (flat @ q.codebook.t()).argmax(1) if logits == "dot" else torch.cdist(flat, q.codebook).argmin(1)
    assert torch.equal(out.indices.reshape(-1), expected)
    assert torch.equal(q.lookup(out.indices), out.quantized)
    assert q.assigns_nearest_code == (logits == "distance")  # what decoding by nearest code may rely on


def test_float32_under_autocast_and_bad_arguments():
    q = IBQQuantizer(16, 8, channel_dim=-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(torch.randn(4, 8).bfloat16())
    assert out.quantized.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    for kwargs, match in [({"logits": "cosine"}, "logits 'dot' or 'distance'"), ({"beta": -1}, "beta >= 0"),
                          ({"entropy_weight": float("inf")}, "entropy_weight"),
                          ({"entropy_temperature": 0}, "entropy_temperature > 0")]:
        with pytest.raises(ValueError, match=match):
            IBQQuantizer(16, 8, **kwargs)
    with pytest.raises(ValueError, match="with D=8"):
        q(torch.randn(4, 5))


@pytest.mark.parametrize("training", [True, False])
def test_empty_batch(training):
    q = IBQQuantizer(16, 8).train(training)
    z = torch.zeros(0, 8, 3, 3, requires_grad=True)
    out = q(z)
    assert out.indices.shape == (0, 3, 3) and out.loss.item() == 0.0
    out.loss.backward()


def test_config_keys_and_a_tiny_run_through_the_commands(tmp_path, capsys):
    from ddcl_vq import cli
    from ddcl_vq.tokenizer.config import ConfigError, load_config
    from ddcl_vq.tokenizer.train import train

    with pytest.raises(ConfigError, match="quantizer.logits"):
        load_config(None, ["quantizer.type=ibq", "quantizer.logits=cosine"])
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs/fashion_ddcl.yaml",
                      TINY + ["quantizer.type=ibq", "train.eval_images=0", f"run.dir={run}"])
    train(cfg, quiet=True)
    assert cli.main(["evaluate", str(run), "--max-images", "64", "--quiet"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["quantizer"] == {"type": "ibq", "num_codes": 32, "dim": 8, "logits": "dot", "entropy_weight": 0.05}
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"term_double", "term_commitment", "term_codebook", "term_entropy"} <= set(record)
    capsys.readouterr()
