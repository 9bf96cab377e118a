"""Shared test settings: the tiny model every fast test trains on real Fashion-MNIST.

Test modules import the constants (``from conftest import TINY``; pytest puts this folder on
``sys.path``) and add what they change: an override given later wins, so
``TINY + ["train.eval_images=0"]`` is TINY with the end-of-run evaluation off.
"""
import pytest

from ddcl_vq.tokenizer.config import load_config

#: the tiny VQ-VAE (16 channels, one residual block, D = 8): every fast training test's model
TINY_MODEL = ["model.channels=16", "model.res_hidden=8", "model.num_res_blocks=1", "model.latent_dim=8"]
#: TINY_MODEL with K = 32, batch 32, 6 steps, logging, checkpoints, usage windows and images every 2-3 steps
TINY = TINY_MODEL + ["quantizer.num_codes=32", "data.batch_size=32", "train.steps=6", "train.log_every=2",
                     "train.checkpoint_every=3", "train.usage_window=3", "train.image_every=3"]


@pytest.fixture
def tiny_config(tmp_path):
    """A tiny, fast config on real Fashion-MNIST (TINY, 256 test images at the end), writing into a
    temporary run directory; ``make(*overrides, config=..., run_dir=...)``."""

    def make(*overrides, config="configs/fashion_ddcl.yaml", run_dir=None):
        run_dir = run_dir or tmp_path / "run"
        return load_config(config, TINY + ["train.eval_images=256", f"run.dir={run_dir}"] + list(overrides))

    return make
