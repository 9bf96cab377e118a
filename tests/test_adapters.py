"""The adapters, proven on the real libraries.

diffusers' ``VQModel`` (its ``VectorQuantizer`` is the taming-transformers port, so this also
covers the taming convention) and vector-quantize-pytorch's ``VectorQuantize`` are the real,
installed packages. The VQ-VAE notebook and taming's original ``VectorQuantizer`` are not
packages: small host quantizers written here from their documented conventions stand in.
"""
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import VQModel
from diffusers.models.autoencoders.vae import VectorQuantizer as DiffusersVectorQuantizer
from torch import nn
from vector_quantize_pytorch import ResidualVQ, VectorQuantize

from ddcl_vq import NotebookQuantizerAdapter, TamingQuantizerAdapter, VQPAdapter, swap_quantizer

VQ_MODEL_CONFIG = dict(
    in_channels=1, out_channels=1, down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 16), layers_per_block=1,
    latent_channels=8, num_vq_embeddings=64, norm_num_groups=8, mid_block_add_attention=False,
    lookup_from_codebook=True, sample_size=32)  # 32x32 images -> 8x8 latents, D = 8, K = 64
STEPS, BATCH = 30, 32

# The host's copied codebook kept as it is (the default DDCL codebook starts with k-means on the first
# training batch): forward-equivalent to the host in eval mode (in training the M-step moves the codes
# after each batch, which is decoded with the codes it was assigned to).
SAME_AS_HOST = dict(codebook_init="uniform", warmup_steps=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: intra-op threads only add sync overhead, and on a busy machine
    oversubscribed threads made this file ~20x slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fashion():
    """256 real Fashion-MNIST training images, [0, 1], padded to (256, 1, 32, 32)."""
    from ddcl_vq.common.data import fashion_mnist_arrays

    images, _ = fashion_mnist_arrays("train", download=False)
    x = torch.from_numpy(images[:256].copy()).float().div(255.0).unsqueeze(1)
    return F.pad(x, (2, 2, 2, 2))


def batches(images, steps=STEPS, batch=BATCH):
    per_epoch = images.shape[0] // batch
    for step in range(steps):
        i = step % per_epoch
        yield images[i * batch:(i + 1) * batch]


def assert_same_structure(expected, got, path="output"):
    """Same nesting, same None positions, same tensor shapes and dtypes."""
    if expected is None:
        assert got is None, f"{path}: expected None, got {type(got).__name__}"
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: expected a tensor, got {type(got).__name__}"
        assert (tuple(got.shape), got.dtype) == (tuple(expected.shape), expected.dtype), \
            f"{path}: expected {tuple(expected.shape)} {expected.dtype}, got {tuple(got.shape)} {got.dtype}"
    else:
        assert isinstance(got, tuple) and len(got) == len(expected), f"{path}: expected a {len(expected)}-tuple"
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same_structure(e, g, f"{path}[{i}]")


# ---------------------------------------------------------------- diffusers VQModel

@pytest.fixture(scope="module")
def trained_vqmodel(fashion):
    """A diffusers VQModel, swapped to DDCL, trained 30 steps by an unchanged diffusers loop."""
    torch.manual_seed(0)
    model = VQModel(**VQ_MODEL_CONFIG)
    old_quantizer = model.quantize
    old_codebook = old_quantizer.embedding.weight.detach().clone()
    swapped = swap_quantizer(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x in batches(fashion):
        out = model(x)                                    # encode -> quantize -> decode, diffusers' code
        loss = F.mse_loss(out.sample, x) + out.commit_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return dict(model=model, swapped=swapped, old_quantizer=old_quantizer, old_codebook=old_codebook,
                optimizer=optimizer, losses=losses, last_commit_loss=out.commit_loss.detach())


def test_vqmodel_swap_puts_the_adapter_in_place_with_the_old_codebook(trained_vqmodel):
    model, old = trained_vqmodel["model"], trained_vqmodel["old_quantizer"]
    adapter = model.quantize
    assert isinstance(adapter, TamingQuantizerAdapter)
    assert [tuple(s) for s in trained_vqmodel["swapped"]] == [("quantize", old, adapter)]
    assert adapter.embedding.weight is adapter.ddcl.weight           # one tensor, two names
    params = [p for group in trained_vqmodel["optimizer"].param_groups for p in group["params"]]
    assert sum(p is adapter.ddcl.weight for p in params) == 1
    assert [n for n, _ in model.named_parameters() if n.startswith("quantize")] == ["quantize.embedding.weight"]
    assert (adapter.n_e, adapter.vq_embed_dim, adapter.e_dim, adapter.beta) == (64, 8, 8, old.beta)
    assert (adapter.legacy, adapter.remap, adapter.sane_index_shape) == (old.legacy, None, False)
    assert adapter.ddcl.mode == "straight_through"
    # the codebook started as the old one (the old module is untouched) and then learned
    assert torch.equal(old.embedding.weight.detach(), trained_vqmodel["old_codebook"])
    assert not torch.equal(adapter.embedding.weight.detach(), trained_vqmodel["old_codebook"])


def test_vqmodel_swap_trains_on_fashion_mnist(trained_vqmodel):
    losses = trained_vqmodel["losses"]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    print(f"VQModel + DDCL: loss {first:.4f} (first 5 steps) -> {last:.4f} (last 5 steps)")
    assert last < 0.6 * first, losses
    adapter = trained_vqmodel["model"].quantize
    out = adapter.last_output                                      # what users log
    assert torch.equal(out.loss, trained_vqmodel["last_commit_loss"])
    assert not out.loss.requires_grad and set(out.terms) >= {"distortion", "ols", "variance", "commitment"}
    assert out.perplexity > 2                                       # more than a code or two in use


def test_vqmodel_decodes_from_indices(trained_vqmodel, fashion):
    model = trained_vqmodel["model"].eval()
    x = fashion[:8]
    with torch.no_grad():
        h = model.encode(x).latents                                  # (8, 8, 8, 8) pre-quantization
        z_q, _, (_, _, indices) = model.quantize(h)
        assert indices.shape == (8 * 8 * 8,) and indices.dtype == torch.long
        codebook = model.quantize.embedding.weight
        nearest = torch.cdist(h.permute(0, 2, 3, 1).reshape(-1, 8), codebook).argmin(1)
        assert torch.equal(indices, nearest)                         # hard codes, as the plain host picks
        shape = (8, h.shape[2], h.shape[3], h.shape[1])              # (B, H, W, C), the host's convention
        assert torch.equal(model.quantize.get_codebook_entry(indices, shape), z_q)
        from_latents = model.decode(h).sample
        from_indices = model.decode(indices, force_not_quantize=True, shape=shape).sample
    assert torch.allclose(from_indices, from_latents, atol=1e-6)
    assert F.mse_loss(from_indices, x) < F.mse_loss(torch.full_like(x, 0.5), x)


def test_vqmodel_checkpoint_round_trip(trained_vqmodel, fashion, tmp_path):
    model = trained_vqmodel["model"].eval()
    state = model.state_dict()
    assert set(state) == set(VQModel(**VQ_MODEL_CONFIG).state_dict())   # the host's own keys
    x = fashion[:8]
    with torch.no_grad():
        expected = model(x).sample

    resumed = VQModel(**VQ_MODEL_CONFIG)
    swap_quantizer(resumed)
    resumed.load_state_dict(state)                                   # strict
    with torch.no_grad():
        assert torch.equal(resumed.eval()(x).sample, expected)

    # a k-means swap does not re-initialise over a loaded codebook: the next training batch is decoded
    # with the loaded codes
    kmeans = VQModel(**VQ_MODEL_CONFIG)
    swap_quantizer(kmeans, codebook_init="kmeans")
    assert not bool(kmeans.quantize.ddcl.initialized)
    kmeans.load_state_dict(state)
    assert bool(kmeans.quantize.ddcl.initialized)
    kmeans.train()(x)
    out = kmeans.quantize.last_output
    loaded = state["quantize.embedding.weight"][out.indices].permute(0, 3, 1, 2)
    assert torch.equal(out.quantized, loaded)

    # the plain host loads the checkpoint too, and decodes the same hard codes
    plain = VQModel(**VQ_MODEL_CONFIG)
    plain.load_state_dict(state)
    with torch.no_grad():
        assert torch.allclose(plain.eval()(x).sample, expected, atol=1e-5)

    # diffusers' own save/load (safetensors refuses tensors saved twice)
    model.save_pretrained(tmp_path)
    reloaded = VQModel.from_pretrained(tmp_path)
    swap_quantizer(reloaded)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(x).sample, expected)


@pytest.mark.parametrize("sane_index_shape,remap", [(False, False), (True, False), (False, True), (True, True)])
def test_taming_adapter_speaks_the_diffusers_quantizer_convention(sane_index_shape, remap, tmp_path):
    torch.manual_seed(0)
    kwargs = dict(sane_index_shape=sane_index_shape)
    if remap:
        np.save(tmp_path / "used.npy", np.arange(0, 64, 2))           # half the codes "used"
        kwargs.update(remap=str(tmp_path / "used.npy"), unknown_index="extra")
    original = DiffusersVectorQuantizer(64, 8, beta=0.25, **kwargs).eval()
    adapter = TamingQuantizerAdapter.from_quantizer(original, **SAME_AS_HOST)
    assert torch.equal(adapter.embedding.weight, original.embedding.weight)
    assert (adapter.re_embed, adapter.remap) == (original.re_embed, original.remap)
    z = torch.randn(2, 8, 4, 5, requires_grad=True)
    expected, got = original(z), adapter(z)
    assert_same_structure(expected, got)
    assert got[2][0] is None and got[2][1] is None
    assert torch.equal(got[2][2], expected[2][2])                     # same codebook -> same indices
    assert torch.allclose(got[0], expected[0], atol=1e-6)             # the host's z + sg(z_q - z) rounds
    assert torch.allclose(torch.autograd.grad(got[0].sum(), z)[0], torch.ones_like(z))  # straight-through
    shape = (2, 4, 5, 8)
    assert torch.equal(adapter.get_codebook_entry(got[2][2].clone(), shape),
                       original.get_codebook_entry(expected[2][2].clone(), shape))
    if not remap:
        flat = got[2][2].reshape(-1)
        assert torch.equal(adapter.get_codebook_entry(flat, None), original.get_codebook_entry(flat, None))


def test_taming_adapter_follows_device_dtype_and_takes_options():
    original = DiffusersVectorQuantizer(16, 4, beta=0.5, legacy=False).double().eval()
    adapter = TamingQuantizerAdapter.from_quantizer(original, temperature=0.1, beta=1.0, implementation="reference")
    assert adapter.embedding.weight.dtype == torch.float64 and not adapter.training
    assert (adapter.ddcl.temperature, adapter.beta, adapter.legacy) == (0.1, 1.0, False)
    assert adapter.ddcl.implementation == "reference"
    z = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    assert_same_structure(original(z), adapter(z))
    adapter.beta = 0.3                                                 # the host may set it
    assert adapter.ddcl.beta == 0.3
    with pytest.raises(ValueError, match=r"\(B, C, H, W\) with C=4"):
        adapter(torch.randn(2, 4, 9))
    with pytest.raises(ValueError, match="temp=None"):
        adapter(z, temp=0.5)


class VectorQuantizer(nn.Module):
    """taming's original VectorQuantizer convention (written here: taming is not installed):
    attributes n_e, e_dim, beta, embedding; returns (z_q, loss, (perplexity, one-hot (N, K), indices (N, 1)))."""

    def __init__(self, n_e, e_dim, beta):
        super().__init__()
        self.n_e, self.e_dim, self.beta = n_e, e_dim, beta
        self.embedding = nn.Embedding(n_e, e_dim)

    def forward(self, z):
        z_last = z.permute(0, 2, 3, 1)
        flat = z_last.reshape(-1, self.e_dim)
        idx = torch.cdist(flat, self.embedding.weight).argmin(1, keepdim=True)
        one_hot = torch.zeros(flat.shape[0], self.n_e).to(z).scatter_(1, idx, 1)
        z_q = (one_hot @ self.embedding.weight).view(z_last.shape)
        loss = ((z_q.detach() - z_last) ** 2).mean() + self.beta * ((z_q - z_last.detach()) ** 2).mean()
        p = one_hot.mean(0)
        perplexity = torch.exp(-(p * torch.log(p + 1e-10)).sum())
        z_q = (z_last + (z_q - z_last).detach()).permute(0, 3, 1, 2).contiguous()
        return z_q, loss, (perplexity, one_hot, idx)


def test_taming_v1_convention_returns_perplexity_and_one_hot():
    torch.manual_seed(0)
    host = nn.Sequential()
    host.add_module("quantize", VectorQuantizer(32, 4, 0.25))
    host.eval()
    original = host.quantize
    [(name, old, adapter)] = swap_quantizer(host, **SAME_AS_HOST)
    assert (name, old, host.quantize) == ("quantize", original, adapter) and adapter.taming_v1_outputs
    z = torch.randn(2, 4, 3, 5)
    expected, got = original(z), adapter(z)
    assert_same_structure(expected, got)
    assert torch.equal(got[2][2], expected[2][2]) and torch.equal(got[2][1], expected[2][1])
    assert torch.allclose(got[2][0], expected[2][0]) and torch.allclose(got[0], expected[0], atol=1e-6)


# ---------------------------------------------------------------- vector-quantize-pytorch

class VQAutoencoder(nn.Module):
    """An autoencoder built around VectorQuantize on image feature maps (8x8 latents, D = 8)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 8, 4, 2, 1))
        self.vq = VectorQuantize(dim=8, codebook_size=64, accept_image_fmap=True)
        self.decoder = nn.Sequential(nn.ConvTranspose2d(8, 16, 4, 2, 1), nn.ReLU(),
                                     nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, x):
        quantized, indices, commit_loss = self.vq(self.encoder(x))
        return self.decoder(quantized), indices, commit_loss

    def decode_from_indices(self, indices):
        return self.decoder(self.vq.get_output_from_indices(indices))


def test_vqp_autoencoder_swap_trains_decodes_and_round_trips(fashion):
    torch.manual_seed(0)
    model = VQAutoencoder()
    old = model.vq
    old_codebook = old.codebook.detach().clone()
    [(name, swapped_old, adapter)] = swap_quantizer(model, temperature=0.01)
    assert (name, swapped_old, model.vq) == ("vq", old, adapter) and isinstance(adapter, VQPAdapter)
    assert torch.equal(adapter.codebook.detach(), old_codebook)
    assert (adapter.dim, adapter.codebook_size, adapter.accept_image_fmap, adapter.channel_last) == (8, 64, True, True)
    assert adapter.commitment_weight == old.commitment_weight
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x in batches(fashion):
        recon, _, commit_loss = model(x)                             # the host's loop, unchanged
        loss = F.mse_loss(recon, x) + commit_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    print(f"VectorQuantize autoencoder + DDCL: loss {first:.4f} (first 5 steps) -> {last:.4f} (last 5 steps)")
    assert last < 0.6 * first, losses
    assert not torch.equal(adapter.codebook.detach(), old_codebook)

    model.eval()
    x = fashion[:8]
    with torch.no_grad():
        recon, indices, _ = model(x)
        assert indices.shape == (8, 8, 8) and indices.dtype == torch.long
        assert torch.equal(model.decode_from_indices(indices), recon)
        assert torch.equal(adapter.get_codes_from_indices(indices), adapter.get_output_from_indices(indices))

    resumed = VQAutoencoder()
    swap_quantizer(resumed, temperature=0.01)
    resumed.load_state_dict(model.state_dict())                       # strict
    with torch.no_grad():
        assert torch.equal(resumed.eval()(x)[0], recon)


VQP_LAYOUTS = [
    (dict(accept_image_fmap=True), (2, 8, 3, 5)),
    (dict(accept_3d_fmap=True), (2, 8, 2, 3, 4)),
    (dict(), (2, 7, 8)),                                  # channel-last sequence
    (dict(channel_last=False), (2, 8, 7)),                # channel-first sequence
    (dict(), (5, 8)),                                     # one token per row
    (dict(codebook_dim=4), (2, 7, 8)),                    # projected codebook
]


@pytest.mark.parametrize("options,shape", VQP_LAYOUTS)
def test_vqp_adapter_speaks_the_vector_quantize_convention(options, shape):
    torch.manual_seed(0)
    peer = VectorQuantize(dim=8, codebook_size=32, **options)
    adapter = VQPAdapter.from_quantizer(peer)
    x = torch.randn(*shape)
    expected, got = peer.eval()(x), adapter.eval()(x)
    assert_same_structure(expected, got)
    assert torch.equal(got[1], expected[1])                          # same codebook -> same indices
    assert torch.allclose(got[0], expected[0], atol=1e-6)
    assert torch.allclose(adapter.get_output_from_indices(got[1]), got[0], atol=1e-6)
    if "codebook_dim" not in options:
        assert torch.equal(adapter.get_output_from_indices(got[1]), peer.get_output_from_indices(expected[1]))
        assert torch.equal(adapter.get_codes_from_indices(got[1]), peer.get_codes_from_indices(expected[1]))
    # training mode (the peer then moves its EMA codebook, so only the structure is compared)
    assert_same_structure(peer.train()(x), adapter.train()(x))


def test_vqp_adapter_masks_padding_like_the_peer():
    torch.manual_seed(0)
    peer = VectorQuantize(dim=8, codebook_size=32).eval()
    adapter = VQPAdapter.from_quantizer(peer)
    x, lens = torch.randn(3, 6, 8), torch.tensor([6, 4, 1])
    expected, got = peer(x, lens=lens), adapter(x, lens=lens)
    assert_same_structure(expected, got)
    assert torch.equal(got[1], expected[1]) and (got[1][1, 4:] == -1).all()
    assert torch.allclose(got[0], expected[0], atol=1e-6) and (got[0][2, 1:] == 0).all()
    adapter.train()(x, lens=lens)
    assert adapter.last_output.indices.shape == (6 + 4 + 1,)           # padding never reached the codebook
    with pytest.raises(ValueError, match="topk"):
        adapter(x, topk=2)


def test_vqp_swap_of_a_pending_kmeans_codebook_uses_ddcl_kmeans():
    host = nn.Sequential(VectorQuantize(dim=4, codebook_size=8, kmeans_init=True))
    [(_, _, adapter)] = swap_quantizer(host)
    assert not bool(adapter.ddcl.initialized)
    adapter.train()(torch.randn(2, 64, 4) + 10.0)
    assert bool(adapter.ddcl.initialized) and (adapter.codebook.detach() - 10.0).abs().max() < 5


# ---------------------------------------------------------------- the VQ-VAE notebook convention

class NotebookStyleVectorQuantizer(nn.Module):
    """The notebook convention (written here; the notebook is not a package): attributes
    _embedding, _num_embeddings, _embedding_dim, _commitment_cost; returns
    (loss, quantized (B, C, H, W), perplexity, one-hot encodings (N, K))."""

    def __init__(self, num_embeddings, embedding_dim, commitment_cost):
        super().__init__()
        self._num_embeddings, self._embedding_dim = num_embeddings, embedding_dim
        self._commitment_cost = commitment_cost
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.uniform_(-1 / num_embeddings, 1 / num_embeddings)

    def forward(self, inputs):
        z = inputs.permute(0, 2, 3, 1)
        flat = z.reshape(-1, self._embedding_dim)
        idx = torch.cdist(flat, self._embedding.weight).argmin(1)
        encodings = F.one_hot(idx, self._num_embeddings).float()
        quantized = (encodings @ self._embedding.weight).view(z.shape)
        loss = F.mse_loss(quantized, z.detach()) + self._commitment_cost * F.mse_loss(quantized.detach(), z)
        quantized = z + (quantized - z).detach()
        p = encodings.mean(0)
        perplexity = torch.exp(-(p * torch.log(p + 1e-10)).sum())
        return loss, quantized.permute(0, 3, 1, 2).contiguous(), perplexity, encodings


class NotebookModel(nn.Module):
    def __init__(self):
        super().__init__()
        self._encoder = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 8, 4, 2, 1))
        self._vq_vae = NotebookStyleVectorQuantizer(64, 8, 0.25)
        self._decoder = nn.Sequential(nn.ConvTranspose2d(8, 16, 4, 2, 1), nn.ReLU(),
                                      nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, x):
        loss, quantized, perplexity, _ = self._vq_vae(self._encoder(x))
        return loss, self._decoder(quantized), perplexity


def test_notebook_adapter_speaks_the_convention_and_trains(fashion):
    torch.manual_seed(0)
    model = NotebookModel().eval()
    original = model._vq_vae
    [(name, _, adapter)] = swap_quantizer(model, **SAME_AS_HOST)
    assert name == "_vq_vae" and model._vq_vae is adapter and isinstance(adapter, NotebookQuantizerAdapter)
    assert adapter._embedding.weight is adapter.ddcl.weight
    assert torch.equal(adapter._embedding.weight, original._embedding.weight)
    assert (adapter._num_embeddings, adapter._embedding_dim, adapter._commitment_cost) == (64, 8, 0.25)
    z = torch.randn(2, 8, 3, 5)
    expected, got = original(z), adapter(z)
    assert_same_structure(expected, got)
    assert torch.equal(got[3], expected[3]) and torch.allclose(got[1], expected[1], atol=1e-6)
    assert torch.allclose(got[2], expected[2])
    assert list(model.state_dict()) == list(NotebookModel().state_dict())

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)   # the M-step codebook: requires_grad=False
    codebook = adapter.ddcl.weight.detach().clone()
    recon_errors = []
    for x in batches(fashion, steps=20):
        vq_loss, recon, _ = model(x)                                   # the notebook's loop, unchanged
        recon_error = F.mse_loss(recon, x)
        loss = recon_error + vq_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        recon_errors.append(recon_error.item())
        assert np.isfinite(loss.item())
    assert np.mean(recon_errors[-5:]) < 0.8 * np.mean(recon_errors[:5]), recon_errors
    assert not torch.equal(adapter.ddcl.weight.detach(), codebook)     # the M-step moved the codes


# ---------------------------------------------------------------- swap_quantizer edge cases

def test_swap_quantizer_without_a_quantizer_names_what_it_looked_for():
    with pytest.raises(ValueError) as err:
        swap_quantizer(nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU()))
    message = str(err.value)
    for looked_for in ("VectorQuantizer2", "VectorQuantize ", "vq_embed_dim", "_commitment_cost"):
        assert looked_for in message
    # (ResidualVQ is swapped since issue 59: ResidualSimVQ, a composite without an adapter, stands in for it)
    from vector_quantize_pytorch import ResidualSimVQ
    with pytest.raises(ValueError, match=r"unsupported quantizer-like modules seen: rvq \(ResidualSimVQ\)"):
        swap_quantizer(nn.ModuleDict({"rvq": ResidualSimVQ(dim=8, num_quantizers=2, codebook_size=16)}))
    host = nn.Sequential(VectorQuantize(dim=4, codebook_size=8))
    swap_quantizer(host)
    with pytest.raises(ValueError, match="already DDCL adapters: 0"):
        swap_quantizer(host)


def test_swap_quantizer_rejects_bad_calls_and_shares_one_adapter_per_quantizer():
    shared = VectorQuantize(dim=4, codebook_size=8)
    host = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    with pytest.raises(ValueError, match="temperatur"):
        swap_quantizer(host, temperatur=0.1)
    assert host["a"] is shared                                         # nothing touched
    [(name, old, new)] = swap_quantizer(host)
    assert (name, old) == ("a", shared) and host["a"] is new and host["b"][0] is new


def test_swap_quantizer_on_a_bare_quantizer_returns_its_adapter():
    torch.manual_seed(0)
    vq = VectorQuantize(dim=4, codebook_size=8).eval()
    adapter = swap_quantizer(vq, temperature=0.05)
    assert isinstance(adapter, VQPAdapter) and adapter.ddcl.temperature == 0.05 and not adapter.training
    assert torch.equal(adapter.codebook.detach(), vq.codebook.detach())
    x = torch.randn(2, 5, 4)
    assert torch.equal(adapter(x)[1], vq(x)[1])                        # same codebook -> same indices


def test_cosine_similarity_is_refused_not_dropped():
    """DDCL has no cosine mode: a VectorQuantize(use_cosine_sim=True) is refused, never swapped silently."""
    host = nn.Sequential(VectorQuantize(dim=4, codebook_size=8, use_cosine_sim=True))
    for make in (lambda: swap_quantizer(host), lambda: VQPAdapter.from_quantizer(host[0]),
                 lambda: VQPAdapter(4, 8, use_cosine_sim=True)):
        with pytest.raises(ValueError, match="use_cosine_sim=True: DDCL has no cosine mode"):
            make()
    assert isinstance(host[0], VectorQuantize)                          # nothing touched


def test_ddcl_vq_imports_no_host_library():
    code = ("import sys, ddcl_vq; bad = [m for m in ('diffusers', 'vector_quantize_pytorch', 'torchvision') "
            "if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- the DDCL options, declared once

def test_ddcl_options_are_the_quantizers_keyword_arguments_shared_by_every_adapter():
    import dataclasses
    import inspect

    from ddcl_vq import DDCLQuantizer
    from ddcl_vq.adapters import DDCL_OPTIONS, DDCLOptions

    params = inspect.signature(DDCLQuantizer.__init__).parameters
    expected = {n: p.default for n, p in params.items() if n not in ("self", "num_codes", "dim", "channel_dim")}
    assert {f.name: f.default for f in dataclasses.fields(DDCLOptions)} == expected
    assert set(DDCL_OPTIONS) == set(expected)
    assert {"temperature", "mode", "beta", "codebook_init", "implementation", "chunk_size"} <= set(DDCL_OPTIONS)
    options = dict(temperature=0.05, mode="soft", codebook_init="normal", implementation="reference", chunk_size=16)
    adapters = [TamingQuantizerAdapter(8, 4, 0.5, **options), NotebookQuantizerAdapter(8, 4, 0.5, **options),
                VQPAdapter(4, 8, commitment_weight=0.5, **options)]
    for adapter in adapters:
        q = adapter.ddcl
        assert (q.temperature, q.mode, q.codebook_init, q.implementation, q.chunk_size, q.beta) == (
            0.05, "soft", "normal", "reference", 16, 0.5)
    for make in (lambda: TamingQuantizerAdapter(8, 4, temperatur=0.1), lambda: NotebookQuantizerAdapter(8, 4, moed="x"),
                 lambda: VQPAdapter(4, 8, chunk=3)):
        with pytest.raises(ValueError, match="expected DDCL options among"):
            make()
    with pytest.raises(ValueError, match="commitment weight once, as commitment_cost"):
        NotebookQuantizerAdapter(8, 4, 0.5, beta=0.3)
    with pytest.raises(ValueError, match="commitment weight once, as commitment_weight"):
        VQPAdapter(4, 8, beta=0.3)


# ---------------------------------------------------------------- residual hosts (issue 59)

class RVQAutoencoder(nn.Module):
    """A sequence autoencoder built on vector-quantize-pytorch's ResidualVQ, the way its README uses it."""

    def __init__(self, **rvq):
        super().__init__()
        self.encoder = nn.Linear(16, 8)
        self.rvq = ResidualVQ(dim=8, num_quantizers=3, codebook_size=32, **rvq)
        self.decoder = nn.Linear(8, 16)

    def forward(self, x):
        quantized, indices, losses = self.rvq(self.encoder(x))
        return self.decoder(quantized), indices, losses


def sequences(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(24, 16, generator=torch.Generator().manual_seed(7)) * 2
    return centres[torch.randint(0, 24, (n, 12), generator=g)] + 0.3 * torch.randn(n, 12, 16, generator=g)


def test_residual_vq_swap_keeps_outputs_index_shapes_decoding_and_state_dict_keys():
    from ddcl_vq.adapters import ResidualVQAdapter
    torch.manual_seed(0)
    model = RVQAutoencoder()
    host_keys = sorted(model.state_dict())
    x = sequences(16)
    with torch.no_grad():
        _, host_indices, host_losses = model.eval()(x)
    model.train()
    [(name, old, adapter)] = swap_quantizer(model)
    assert name == "rvq" and isinstance(adapter, ResidualVQAdapter) and adapter.ddcl.num_levels == 3
    assert torch.equal(adapter.codebooks.detach(), old.codebooks.detach())
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(30):                                            # the host's loop, unchanged
        recon, indices, losses = model(sequences(16, seed=step))
        loss = F.mse_loss(recon, sequences(16, seed=step)) + losses.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert indices.shape == host_indices.shape == (16, 12, 3) and losses.shape == host_losses.shape == (3,)
    model.eval()
    with torch.no_grad():
        recon, indices, losses = model(x)
        quantized, _, _, all_codes = model.rvq(model.encoder(x), return_all_codes=True)
        assert all_codes.shape == (3, 16, 12, 8)
        assert torch.allclose(all_codes.sum(0), quantized, atol=1e-6)
        assert torch.allclose(model.rvq.get_output_from_indices(indices), quantized, atol=1e-6)
        coarse = model.rvq.get_codes_from_indices(indices[..., :2])           # a prefix: the last level is zero
        assert coarse.shape == (3, 16, 12, 8) and not coarse[2].any() and torch.equal(coarse[:2], all_codes[:2])
    state = model.state_dict()
    assert sorted(state) == host_keys                                  # the host's own keys
    plain = RVQAutoencoder()
    plain.load_state_dict(state)                                       # adapter -> host (strict)
    with torch.no_grad():
        assert torch.equal(plain.eval()(x)[1], indices)                # the host decodes the same codes
    again = RVQAutoencoder()
    swap_quantizer(again)
    again.load_state_dict(plain.state_dict())                          # host -> adapter (strict)
    with torch.no_grad():
        assert torch.equal(again.eval()(x)[0], recon)


def test_residual_vq_swap_keeps_projections_dropout_shared_codebooks_and_masks():
    torch.manual_seed(0)
    host = ResidualVQ(dim=8, num_quantizers=3, codebook_size=16, codebook_dim=4, quantize_dropout=True,
                      shared_codebook=True)
    adapter = swap_quantizer(host)
    assert adapter.ddcl.shared_codebook and adapter.ddcl.quantize_dropout and adapter.has_projections
    assert sorted(adapter.state_dict()) == sorted(host.state_dict())
    x = torch.randn(32, 10, 8)
    quantized, indices, losses = adapter(x)
    assert quantized.shape == x.shape and indices.shape == (32, 10, 3) and (indices == -1).any()
    adapter.eval()
    assert (adapter(x)[1] >= 0).all()                                  # dropout only in training
    mask = torch.arange(10)[None] < torch.tensor([10, 4])[:, None]
    quantized, indices, _ = adapter(x[:2], mask=mask)
    assert (indices[1, 4:] == -1).all() and not quantized[1, 4:].any() and (indices[mask] >= 0).all()


def test_grouped_residual_vq_swap_keeps_the_grouped_convention():
    from vector_quantize_pytorch import GroupedResidualVQ

    from ddcl_vq.adapters import GroupedResidualVQAdapter
    torch.manual_seed(0)
    host = GroupedResidualVQ(dim=8, groups=2, num_quantizers=3, codebook_size=16)
    x = torch.randn(4, 6, 8)
    _, host_indices, host_losses = host(x)
    adapter = swap_quantizer(host)
    assert isinstance(adapter, GroupedResidualVQAdapter) and sorted(adapter.state_dict()) == sorted(host.state_dict())
    quantized, indices, losses = adapter(x)
    assert quantized.shape == x.shape and indices.shape == host_indices.shape == (2, 4, 6, 3)
    assert losses.shape == host_losses.shape == (2, 3)
    adapter.eval()
    quantized, indices, _ = adapter(x)
    assert torch.allclose(adapter.get_output_from_indices(indices), quantized, atol=1e-6)
    assert adapter.get_codes_from_indices(indices).shape == host.get_codes_from_indices(indices).shape
    host.load_state_dict(adapter.state_dict())                         # strict
    assert torch.equal(host.eval()(x)[1], indices)


def test_residual_hosts_without_learned_or_with_unit_codes_are_refused_in_one_line():
    from vector_quantize_pytorch import ResidualFSQ, ResidualLFQ
    cases = [
        (ResidualFSQ(dim=8, levels=[8, 5, 5], num_quantizers=2), r"cannot swap ResidualFSQ: its codes are a fixed"),
        (nn.Sequential(ResidualLFQ(dim=8, codebook_size=16, num_quantizers=2)),
         r"cannot swap ResidualLFQ: its codes are fixed sign patterns .* \(at 0\)"),
        (ResidualVQ(dim=8, num_quantizers=2, codebook_size=16, use_cosine_sim=True),
         r"cannot swap ResidualVQ: its codes are l2-normalised"),
        (ResidualVQ(dim=8, num_quantizers=2, codebook_size=16, orthogonal_reg_weight=1.0),
         r"cannot swap ResidualVQ with orthogonal_reg_weight"),
        (ResidualVQ(dim=8, num_quantizers=2, codebook_size=16, quantize_dropout=True,
                    quantize_dropout_cutoff_index=1), r"quantize_dropout_cutoff_index"),
    ]
    for host, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            swap_quantizer(host)
        assert "\n" not in str(err.value)
    # a VectorQuantize with cosine codes inside a model is refused too, and the model is left as it was
    model = nn.Sequential(VectorQuantize(dim=4, codebook_size=8, use_cosine_sim=True))
    with pytest.raises(ValueError, match="use_cosine_sim=True"):
        swap_quantizer(model)
    assert isinstance(model[0], VectorQuantize)


def test_vqvae2_quantize_and_encodec_residual_hosts_swap_with_their_keys():
    """Small re-implementations of VQ-VAE-2 Quantize and EnCodec ResidualVectorQuantization (attributes, buffers, keys)."""
    from torch import nn
    from ddcl_vq import swap_quantizer
    class Quantize(nn.Module):
        def __init__(self, dim, n_embed, decay=0.99, eps=1e-5):
            super().__init__(); self.dim, self.n_embed, self.decay, self.eps = dim, n_embed, decay, eps
            embed = torch.randn(dim, n_embed)
            self.register_buffer("embed", embed); self.register_buffer("cluster_size", torch.zeros(n_embed)); self.register_buffer("embed_avg", embed.clone())
        def embed_code(self, i): return F.embedding(i, self.embed.transpose(0, 1))
    class EuclideanCodebook(nn.Module):
        def __init__(self, dim, K):
            super().__init__(); self.register_buffer("inited", torch.Tensor([True])); self.register_buffer("cluster_size", torch.zeros(K))
            e = torch.randn(K, dim); self.register_buffer("embed", e); self.register_buffer("embed_avg", e.clone())
    class VectorQuantization(nn.Module):
        def __init__(self, dim, K):
            super().__init__(); self.project_in = nn.Identity(); self.project_out = nn.Identity(); self._codebook = EuclideanCodebook(dim, K); self.commitment_weight = 1.0
    class ResidualVectorQuantization(nn.Module):
        def __init__(self, n, dim, K):
            super().__init__(); self.layers = nn.ModuleList([VectorQuantization(dim, K) for _ in range(n)])
    class ResidualVectorQuantizer(nn.Module):
        def __init__(self): super().__init__(); self.vq = ResidualVectorQuantization(3, 8, 16)
    m = nn.ModuleDict({"q": Quantize(8, 16), "rvq": ResidualVectorQuantizer()})
    keys = sorted(m.state_dict())
    assert [(s.name, type(s.new).__name__) for s in swap_quantizer(m)] == [("q", "VQVAE2QuantizeAdapter"), ("rvq.vq", "EncodecRVQAdapter")]
    q, d, i = m["q"](torch.randn(2, 4, 4, 8)); assert q.shape == (2, 4, 4, 8) and d.dim() == 0 and i.shape == (2, 4, 4)
    enc = m["rvq"].vq; x = torch.randn(2, 8, 10)
    qo, idx, l = enc(x); assert qo.shape == x.shape and idx.shape == (3, 2, 10) and l.shape == (3, 1)
    qo, idx, l = enc(x, n_q=2); assert idx.shape == (2, 2, 10) and l.shape == (2, 1)
    enc.eval(); qo, idx, l = enc(x); assert torch.allclose(enc.decode(idx), qo, atol=1e-6) and enc.encode(x, 2).shape == (2, 2, 10)
    m["q"].eval(); q, d, i = m["q"](torch.randn(2, 4, 4, 8)); assert torch.allclose(m["q"].embed_code(i), q)
    assert sorted(m.state_dict()) == keys
    m2 = nn.ModuleDict({"q": Quantize(8, 16), "rvq": ResidualVectorQuantizer()}); m2.load_state_dict(m.state_dict()); swap_quantizer(m2); m2.load_state_dict(m.state_dict())
