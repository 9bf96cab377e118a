"""The newer peers from vector-quantize-pytorch behind the common interface: FSQ, SimVQ, LFQ.

- shapes and layouts, indices in range, ``lookup(indices)`` equals what the decoder saw (eval mode),
  gradients reach the encoder, float32 under autocast;
- FSQ: the FSQ paper's levels for K, the closest entry (with a warning) for another K, usage
  counted against the grid's real size prod(levels);
- state_dict round trip (SimVQ's frozen codebook included);
- config keys (quantizer.type fsq/simvq/lfq, quantizer.levels, the peer's keywords flat under quantizer);
- a tiny run end to end: train 6 steps -> evaluate -> export -> tokenize -> decode.
"""
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vector_quantize_pytorch")

from ddcl_vq import CodebookUsage, FSQQuantizer, LFQQuantizer, QuantizerOutput, SimVQQuantizer  # noqa: E402
from ddcl_vq.fsq import FSQ_LEVELS, fsq_levels  # noqa: E402
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
BUILD = {
    "fsq": lambda k, d: FSQQuantizer(k, d),
    "simvq": lambda k, d: SimVQQuantizer(k, d),
    "simvq_fair": lambda k, d: SimVQQuantizer(k, d, rotation_trick=False, codebook_bias=True, data_init=True),
    "lfq": lambda k, d: LFQQuantizer(k, d),
}


@pytest.mark.parametrize("name", list(BUILD))
def test_interface_shapes_indices_and_lookup(name):
    torch.manual_seed(0)
    q = BUILD[name](256, 8)
    z = torch.randn(3, 8, 5, 4, requires_grad=True)
    out = q.train()(z)
    assert isinstance(out, QuantizerOutput)
    assert out.quantized.shape == z.shape and out.quantized.dtype == z.dtype
    assert out.indices.shape == (3, 5, 4) and out.indices.dtype == torch.long
    assert 0 <= int(out.indices.min()) and int(out.indices.max()) < q.num_codes
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert 1.0 <= float(out.perplexity) <= q.num_codes
    (out.quantized.square().sum() + out.loss).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0  # the encoder learns through the quantizer
    trained = [p for p in q.parameters() if p.requires_grad]
    if name == "lfq":  # log2(256) = 8 = D: no projections, nothing to learn in the quantizer
        assert not trained
    else:  # FSQ's projections, SimVQ's linear map
        assert trained and any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)

    q.eval()
    with torch.no_grad():
        ev = q(z)
        assert torch.allclose(q.lookup(ev.indices), ev.quantized, atol=1e-5)
        assert q.codebook.shape == (q.num_codes, 8)
        # the index picks the code the decoder sees: a different code is farther away
        codes = q.codebook
        flat = ev.quantized.permute(0, 2, 3, 1).reshape(-1, 8)
        assert torch.cdist(flat, codes).argmin(1).eq(ev.indices.reshape(-1)).float().mean() > 0.99


@pytest.mark.parametrize("name", ["fsq", "simvq", "lfq"])
def test_channel_last_and_autocast_stay_float32(name):
    torch.manual_seed(0)
    q = {"fsq": lambda: FSQQuantizer(256, 8, channel_dim=-1), "simvq": lambda: SimVQQuantizer(64, 8, channel_dim=-1),
         "lfq": lambda: LFQQuantizer(64, 8, channel_dim=-1)}[name]()
    z = torch.randn(2, 7, 8)
    out = q(z)
    assert out.quantized.shape == (2, 7, 8) and out.indices.shape == (2, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = q(z.bfloat16())
    assert amp.quantized.dtype == torch.bfloat16 and amp.loss.dtype == torch.float32
    with pytest.raises(ValueError, match="with D=8"):
        q(torch.randn(2, 7, 5))


def test_fsq_levels_table_and_closest_entry():
    assert fsq_levels(256) == ((8, 6, 5), True)
    assert fsq_levels(1024) == ((8, 5, 5, 5), True)
    assert fsq_levels(4096) == ((7, 5, 5, 5, 5), True)
    assert fsq_levels(2 ** 14) == ((8, 8, 8, 6, 5), True)
    assert fsq_levels(2 ** 16) == ((8, 8, 8, 5, 5, 5), True)
    assert set(FSQ_LEVELS) == {2 ** 8, 2 ** 10, 2 ** 12, 2 ** 14, 2 ** 16}
    assert fsq_levels(512) == ((8, 6, 5), False)  # |240 - 512| < |1000 - 512|
    assert fsq_levels(3000) == ((7, 5, 5, 5, 5), False)  # 4375 is closer than 1000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = FSQQuantizer(512, 8)
    assert q.levels == [8, 6, 5] and q.num_codes == 240 and q.requested_codes == 512
    assert any("[8, 6, 5]" in str(w.message) and "512" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = FSQQuantizer(1024, 8)  # in the table: no warning
        explicit = FSQQuantizer(512, 8, levels=[8, 8, 8, 8])
    assert q.num_codes == 1000 and explicit.num_codes == 4096 and explicit.describe()["levels"] == [8, 8, 8, 8]
    for bad in ([], [8, 2, 5], [8, 5.0]):
        with pytest.raises(ValueError, match="levels"):
            FSQQuantizer(256, 8, levels=bad)


def test_fsq_usage_is_counted_against_the_grid():
    torch.manual_seed(0)
    q = FSQQuantizer(1024, 8).eval()  # [8, 5, 5, 5]: 1000 codes, not 1024
    usage = CodebookUsage(q.num_codes)
    with torch.no_grad():
        for _ in range(4):
            usage.update(q(torch.randn(16, 8, 8, 8) * 3).indices)
    stats = usage.compute()
    assert stats.num_codes == 1000 and len(stats.counts) == 1000
    assert stats.dead_codes == 1000 - stats.active_codes
    assert stats.utilization == pytest.approx(stats.active_codes / 1000)


def test_simvq_codebook_is_the_frozen_codes_through_the_map():
    torch.manual_seed(0)
    q = SimVQQuantizer(128, 16)
    frozen = q.vq.frozen_codebook
    assert not any(p is frozen for p in q.parameters())
    assert frozen.std().item() == pytest.approx(16 ** -0.5, rel=0.1)  # N(0, 1/D) entries
    w = q.vq.code_transform.weight
    assert torch.allclose(q.codebook, frozen @ w.t())
    biased = SimVQQuantizer(128, 16, codebook_bias=True)
    assert biased.vq.code_transform.bias is not None and biased.describe()["codebook_bias"]
    with pytest.raises(ValueError, match="channel_first"):
        SimVQQuantizer(128, 16, channel_first=True)


def test_simvq_data_init_matches_the_first_batch():
    """Features far from the origin and tightly spread (as a young encoder's are): the library's start
    reaches them with a handful of codes; the moment-matched start puts the codes where they are."""
    torch.manual_seed(0)
    z = torch.randn(64, 16, 4, 4) * 0.01 + 0.3
    plain = SimVQQuantizer(256, 16)
    q = SimVQQuantizer(256, 16, codebook_bias=True, data_init=True)
    assert not bool(q.initialized) and "initialized" in q.state_dict()
    with torch.no_grad():
        q.eval()(z)
        assert not bool(q.initialized)  # evaluation never initialises
        out = q.train()(z)
        few = plain.train()(z).indices.unique().numel()
    assert bool(q.initialized)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 16).double()
    codes = q.codebook.detach().double()
    assert torch.allclose(q.vq.code_transform.bias.double(), flat.mean(0), atol=1e-5)
    # W C^T C W^T / K ~ cov: the codes' spread matches the features' within sampling error
    assert codes.std(0).mean().item() == pytest.approx(flat.std(0).mean().item(), rel=0.15)
    assert out.indices.unique().numel() > 4 * few, (out.indices.unique().numel(), few)
    before = q.vq.code_transform.weight.detach().clone()
    with torch.no_grad():
        q(z * 2)
    assert torch.equal(before, q.vq.code_transform.weight)  # once only
    with pytest.raises(ValueError, match="codebook_bias=True"):
        SimVQQuantizer(256, 16, data_init=True)


def test_lfq_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power of 2"):
        LFQQuantizer(1000, 8)
    assert LFQQuantizer(1024, 8).codebook.shape == (1024, 8)


@pytest.mark.parametrize("name", list(BUILD))
def test_state_dict_round_trip(name):
    torch.manual_seed(0)
    a = BUILD[name](256, 8)
    a.train()(torch.randn(4, 8, 4, 4))
    torch.manual_seed(123)  # a different random start: the state must carry everything
    b = BUILD[name](256, 8)
    b.load_state_dict(a.state_dict())
    z = torch.randn(2, 8, 4, 4)
    a.eval(), b.eval()
    with torch.no_grad():
        oa, ob = a(z), b(z)
    assert torch.equal(oa.indices, ob.indices) and torch.equal(oa.quantized, ob.quantized)
    assert torch.equal(a.codebook, b.codebook)


def test_fsq_without_a_table_entry_warns_once_in_one_clear_line(tmp_path):
    """Issue 40, rough edge: FSQ with K = 7 called 240 "the closest entry" and printed a raw UserWarning twice
    (the memory check builds the model on the meta device, then the training builds it)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ddcl_vq", "train", "--config", str(ROOT / "configs/fashion_ddcl.yaml"),
                           "--quiet", *TINY_MODEL, "quantizer.type=fsq", "quantizer.num_codes=7", "data.batch_size=16",
                           "train.steps=1", "train.eval_images=0", f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert err == ["ddcl-vq train: warning: FSQ: K = 7 is not in the FSQ paper's table of levels (K = 256, 1024, "
                   "4096, 16384, 65536); using the entry whose grid size is nearest, [8, 6, 5] = 240 codes (34.3x "
                   "the 7 asked for); pass levels (quantizer.levels in a config) to choose the grid"], err
    with pytest.warns(UserWarning, match="K = 300 is not in the FSQ paper's table") as caught:
        FSQQuantizer(300, 8)  # 240 codes, within 2x of K: no ratio; the library still warns as Python does
    assert "asked for" not in str(caught[0].message) and "[8, 6, 5] = 240 codes;" in str(caught[0].message)


def test_config_keys_build_the_peers():
    from ddcl_vq.tokenizer.config import ConfigError, build_model, load_config

    def built(*overrides):
        return build_model(load_config(None, TINY_MODEL + list(overrides)), 1).quantizer

    q = built("quantizer.type=fsq", "quantizer.num_codes=256")
    assert isinstance(q, FSQQuantizer) and q.levels == [8, 6, 5] and q.num_codes == 240
    cfg = load_config(None, ["quantizer.type=fsq", "quantizer.levels=[5,5,5]"])
    assert cfg.quantizer == {"type": "fsq", "num_codes": 512, "levels": [5, 5, 5]}
    assert built("quantizer.type=fsq", "quantizer.levels=[5,5,5]").num_codes == 125
    q = built("quantizer.type=simvq", "quantizer.num_codes=64", "quantizer.rotation_trick=false",
              "quantizer.codebook_bias=true")
    assert isinstance(q, SimVQQuantizer) and not q.vq.rotation_trick and q.codebook_bias
    assert isinstance(built("quantizer.type=lfq", "quantizer.num_codes=64"), LFQQuantizer)
    with pytest.raises(ConfigError, match=r"unknown config key 'quantizer.rotation_trik'; did you mean "
                                          r"'quantizer.rotation_trick'\?"):
        load_config(None, ["quantizer.type=simvq", "quantizer.rotation_trik=false"])
    with pytest.raises(ConfigError, match="0.2.0's quantizer.fsq_levels is now quantizer.levels"):
        load_config(None, ["quantizer.type=fsq", "quantizer.fsq_levels=[5,5,5]"])
    with pytest.raises(ConfigError, match="unknown config key 'quantizer.levels'"):  # FSQ's, not DDCL's
        load_config(None, ["quantizer.type=ddcl", "quantizer.levels=[5,5,5]"])
    with pytest.raises(ConfigError, match="power of 2"):
        built("quantizer.type=lfq", "quantizer.num_codes=1000")


TINY = TINY_MODEL + ["data.batch_size=32", "train.steps=6", "train.log_every=2", "train.checkpoint_every=3",
                     "train.usage_window=3", "train.image_every=3", "train.eval_images=0"]


def _cli(*args, capsys):
    from ddcl_vq import cli
    assert cli.main(list(args)) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("qtype,k", [("fsq", 256), ("simvq", 64)])
def test_tiny_run_end_to_end(qtype, k, tmp_path, capsys):
    """train 6 steps -> evaluate -> export -> tokenize -> decode, through the commands."""
    from ddcl_vq.tokenizer.config import load_config
    from ddcl_vq.tokenizer.train import train

    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs/fashion_ddcl.yaml",
                      TINY + [f"quantizer.type={qtype}", f"quantizer.num_codes={k}", f"run.dir={run}"])
    train(cfg, quiet=True)
    _cli("evaluate", str(run), "--max-images", "200", "--quiet", capsys=capsys)
    ev = json.loads((run / "eval.json").read_text())
    grid = 240 if qtype == "fsq" else k
    assert ev["quantizer"]["type"] == qtype and ev["quantizer"]["num_codes"] == grid
    assert len(ev["usage_counts"]) == grid and sum(ev["usage_counts"]) == 200 * 64
    assert ev["codebook"]["utilization"] == pytest.approx(ev["codebook"]["active_codes"] / grid)
    assert math.isfinite(ev["recon"]["hard"]["psnr"])
    out = _cli("export", str(run), str(tmp_path / "exported"), capsys=capsys)
    assert "bit for bit" in out
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["quantizer"]["type"] == qtype
    _cli("tokenize", str(run), "--split", "test", "--out", str(tmp_path / "t.npy"), "--max-images", "40", capsys=capsys)
    tokens = np.load(tmp_path / "t.npy")
    assert tokens.shape == (40, 8, 8) and int(tokens.max()) < grid
    _cli("decode", str(tmp_path / "exported"), str(tmp_path / "t.npy"), "--out", str(tmp_path / "g.png"), capsys=capsys)
    assert (tmp_path / "g.png").stat().st_size > 0

    # the exported folder rebuilds the quantizer with the run's weights and decodes the same tokens
    from ddcl_vq.tokenizer.evaluate import load_run
    from ddcl_vq.models import VQVAE
    _, run_model, _, _ = load_run(run)
    loaded = VQVAE.from_pretrained(str(tmp_path / "exported"))
    idx = torch.from_numpy(tokens[:4].astype(np.int64))
    assert torch.equal(loaded.decode_indices(idx), run_model.decode_indices(idx))


@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("training", [True, False])
def test_empty_batch(name, training):
    """N = 0: the rule every quantizer follows (base.empty_output): a zero loss that backpropagates,
    empty indices, quantized of the input's empty shape, and no state change."""
    torch.manual_seed(0)
    q = BUILD[name](256, 8).train(training)
    before = {k: v.clone() for k, v in q.state_dict().items()}
    z = torch.zeros(0, 8, 3, 3, requires_grad=True)
    out = q(z)
    assert out.quantized.shape == z.shape and out.indices.shape == (0, 3, 3)
    assert out.loss.item() == 0.0 and all(v.item() == 0.0 for v in out.terms.values())
    out.loss.backward()
    assert all(torch.equal(before[k], v) for k, v in q.state_dict().items())


def test_ddcl_vq_imports_without_the_peer_package():
    """vector-quantize-pytorch is optional: ddcl_vq imports without it, and building a peer says how to install it."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['vector_quantize_pytorch'] = None\n"
            "import ddcl_vq\n"
            "for cls in (ddcl_vq.FSQQuantizer, ddcl_vq.SimVQQuantizer, ddcl_vq.LFQQuantizer):\n"
            "    try:\n"
            "        cls(256, 8)\n"
            "    except ImportError as err:\n"
            "        assert 'pip install vector-quantize-pytorch' in str(err), err\n"
            "    else:\n"
            "        raise SystemExit('built without the package')\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_torchrun_ranks_stay_one_model(tmp_path):
    """Two processes (gloo) from different seeds: after DDP steps every parameter and buffer is identical
    on both ranks (SimVQ's frozen codebook broadcast by DDP, its data-matched start from statistics
    summed over the ranks; FSQ and LFQ share nothing but gradients)."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(ROOT / "tests" / "peers_dist_worker.py"), str(tmp_path), "3"]
    done = subprocess.run(cmd, cwd=ROOT / "tests", capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for qtype in ("fsq", "simvq", "lfq"):
        a = torch.load(tmp_path / f"{qtype}_rank0.pt", weights_only=True)["state"]
        b = torch.load(tmp_path / f"{qtype}_rank1.pt", weights_only=True)["state"]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{qtype}: {key} differs across ranks"
    assert bool(a.get("quantizer.initialized", torch.tensor(True)))
    simvq = torch.load(tmp_path / "simvq_rank0.pt", weights_only=True)["state"]
    assert bool(simvq["quantizer.initialized"])
