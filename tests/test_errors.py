"""Every bad input listed in DESIGN.md raises ValueError naming what was expected and what came."""
import pytest
import torch

from ddcl_vq import DDCLQuantizer, EMAVQ, HardVQ

QUANTIZERS = [lambda: DDCLQuantizer(8, 4), lambda: HardVQ(8, 4), lambda: EMAVQ(8, 4)]


@pytest.mark.parametrize("make", QUANTIZERS)
def test_wrong_channel_size(make):
    with pytest.raises(ValueError, match=r"D=4.*got shape \(2, 5, 3, 3\)"):
        make()(torch.randn(2, 5, 3, 3))


@pytest.mark.parametrize("make", QUANTIZERS)
def test_wrong_rank(make):
    with pytest.raises(ValueError, match=r"expected a channel-first tensor.*got rank 1"):
        make()(torch.randn(4))


@pytest.mark.parametrize("make", QUANTIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf(make, bad):
    z = torch.randn(2, 4, 3, 3)
    z[0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match=r"expected finite encoder features, got 1 NaN/Inf"):
        make()(z)


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), float("inf")])
def test_non_positive_temperature(tau):
    with pytest.raises(ValueError, match=r"expected a finite temperature > 0, got"):
        DDCLQuantizer(8, 4, temperature=tau)
    q = DDCLQuantizer(8, 4)
    with pytest.raises(ValueError, match="temperature"):
        q.temperature = tau


@pytest.mark.parametrize("cls", [DDCLQuantizer, HardVQ, EMAVQ])
@pytest.mark.parametrize("k", [0, -3, 2.5])
def test_bad_num_codes(cls, k):
    with pytest.raises(ValueError, match=r"expected num_codes to be a positive int, got"):
        cls(k, 4)


@pytest.mark.parametrize("make", QUANTIZERS)
def test_lookup_out_of_range(make):
    with pytest.raises(ValueError, match=r"expected indices in \[0, 7\], got values in \[0, 8\]"):
        make().lookup(torch.tensor([[0, 8]]))
    with pytest.raises(ValueError, match=r"expected indices in \[0, 7\], got values in \[-1, 2\]"):
        make().lookup(torch.tensor([-1, 2]))


def test_bad_mode():
    with pytest.raises(ValueError, match=r"expected mode in .*got 'hard'"):
        DDCLQuantizer(8, 4, mode="hard")


def test_channel_last_wrong_size():
    with pytest.raises(ValueError, match=r"channel-last tensor \(\.\.\., D\) with D=4, got shape \(3, 5\)"):
        DDCLQuantizer(8, 4, channel_dim=-1)(torch.randn(3, 5))
