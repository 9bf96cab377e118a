import pytest

from ddcl_vq.train.config import load_config

TINY = [
    "model.channels=16", "model.res_hidden=8", "model.num_res_blocks=1", "model.latent_dim=8",
    "quantizer.num_codes=32", "data.batch_size=32", "train.steps=6", "train.eval_images=256",
    "train.log_every=2", "train.checkpoint_every=3", "train.usage_window=3", "train.image_every=3",
]


@pytest.fixture
def tiny_config(tmp_path):
    """A tiny, fast config on real Fashion-MNIST, writing into a temporary run directory."""

    def make(*overrides, config="configs/fashion_ddcl.yaml", run_dir=None):
        run_dir = run_dir or tmp_path / "run"
        return load_config(config, TINY + [f"run.dir={run_dir}"] + list(overrides))

    return make
