#!/usr/bin/env bash
# The GPU checks of ddcl-vq in one command (written to finish in under ~8 minutes on one H200):
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: $OUT if set, else gpu_check/
#
# 1. prints and saves the machine: GPU model, driver, torch/CUDA versions, date (gpu_info.json);
# 2. runs tests/test_cuda.py (fused = chunked = reference on CUDA in values and gradients for every
#    mode, soft_statistics, bf16/fp16 autocast indices, a few training steps of the default config
#    through the real train entry, torch.compile of the default model, bench --device cuda rows)
#    and the device-independent block-policy and fused-path tests (pytest.log);
# 3. runs `ddcl-vq bench --quick --device cuda` (bench_cuda.json, bench_cuda.txt): every quantizer
#    implementation at N = 8192, D = 64, K in {1024, 8192}, the six-matmul floor, and one training
#    step of the default VQ-VAE, DDCL vs HardVQ;
# 4. trains a tiny VQGAN (configs/vqgan_photos64.yaml at ch 8 on Fashion-MNIST at 32x32: diffusers'
#    encoder/decoder, L1 + LPIPS (when its weights are found) + PatchGAN hinge loss, the discriminator
#    on from step 2) for 4 steps on CUDA through the real train entry (vqgan_train.log, vqgan_run/).
#
# Python: the repository's .venv when its torch sees a GPU; else the machine's python3 with its own
# torch and packages (nothing is installed into it or downloaded: this checkout goes on PYTHONPATH
# through a folder of links laid out as the installed package). Wheels in .whl/ go into that folder
# when present (e.g. vector-quantize-pytorch for the `vqp` rows, lpips, and diffusers, which
# the bench test's VQGAN rows and step 4 need and the H200 image lacks).
# Data: the training check needs Fashion-MNIST: /usr/share/datasets/fashion-mnist, $DDCL_VQ_FASHION_DIR,
# or a folder .gpu_data/ in the checkout holding the four *-ubyte.gz files (copy them there and carry
# it to a machine without internet).
# GPU_CHECK_DRY=1: exercise this script on a machine without a GPU (tests skip, tiny CPU bench).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
start=$(date +%s)

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

PY=""
if [ -x .venv/bin/python ] && { has_cuda .venv/bin/python || [ "${GPU_CHECK_DRY:-0}" = 1 ]; }; then
  PY=.venv/bin/python
elif command -v python3 >/dev/null && has_cuda python3; then
  # the machine's python3 and its torch, untouched: this checkout is laid out as the installed
  # package (ddcl_vq/ with models, train, eval under it, as pyproject.toml maps them) in a folder
  # of links put first on PYTHONPATH
  site=${TMPDIR:-/tmp}/ddcl_vq_gpu_site
  rm -rf "$site" && mkdir -p "$site/ddcl_vq"
  for f in "$PWD"/ddcl_vq/*; do ln -s "$f" "$site/ddcl_vq/"; done
  for d in models train eval; do ln -s "$PWD/$d" "$site/ddcl_vq/$d"; done
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  PY=python3
else
  echo "gpu_check: no Python here whose torch sees a CUDA device (torch.cuda.is_available() is False);" \
       "nothing to check. GPU_CHECK_DRY=1 exercises the script without a GPU." >&2
  exit 2
fi
if [ -z "${DDCL_VQ_FASHION_DIR:-}" ] && [ -f .gpu_data/train-images-idx3-ubyte.gz ]; then
  export DDCL_VQ_FASHION_DIR=$PWD/.gpu_data
fi

"$PY" - "$OUT_DIR/gpu_info.json" <<'EOF'
import datetime, json, platform, subprocess, sys
import torch
info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count,
                capability=f"{p.major}.{p.minor}", devices=torch.cuda.device_count())
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
open(sys.argv[1], "w").write(json.dumps(info, indent=1) + "\n")
print("gpu_check:", ", ".join(f"{k}={v}" for k, v in info.items()))
EOF

set +e
timeout 330 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_cuda.py tests/test_blocks.py tests/test_fused.py \
  2>&1 | tee "$OUT_DIR/pytest.log"
tests_rc=${PIPESTATUS[0]}
if [ "${GPU_CHECK_DRY:-0}" = 1 ] && ! has_cuda "$PY"; then
  bench_args=(--shapes 256,16,64 --no-e2e --device cpu)
else
  bench_args=(--quick --device cuda)
fi
timeout 240 "$PY" -m ddcl_vq bench "${bench_args[@]}" --no-progress --json "$OUT_DIR/bench_cuda.json" \
  2>&1 | tee "$OUT_DIR/bench_cuda.txt"
bench_rc=${PIPESTATUS[0]}
# a few VQGAN steps on CUDA: GroupNorm/attention blocks, the LPIPS loss and the discriminator step on
# the device; LPIPS only when its real weights are found (else perceptual_weight=0, said in the log)
if [ "${GPU_CHECK_DRY:-0}" = 1 ] && ! has_cuda "$PY"; then vqgan_device=cpu; else vqgan_device=cuda; fi
perceptual=1.0
if ! "$PY" -c 'import sys; from ddcl_vq.common.lpips_weights import build_lpips; m, note = build_lpips("cpu", "alex"); print("gpu_check:", note); sys.exit(0 if m is not None else 1)' \
    2>&1 | tee "$OUT_DIR/vqgan_train.log"; then
  perceptual=0
fi
rm -rf "$OUT_DIR/vqgan_run"
timeout 240 "$PY" -m ddcl_vq train --config configs/vqgan_photos64.yaml run.dir="$OUT_DIR/vqgan_run" \
  data.name=fashion_mnist data.image_size=32 data.batch_size=8 model.ch=8 model.z_channels=8 model.latent_dim=8 \
  quantizer.num_codes=64 loss.perceptual_weight=$perceptual loss.disc_start=2 loss.disc_channels=16 \
  train.steps=4 train.log_every=1 train.checkpoint_every=4 train.image_every=4 train.eval_images=64 \
  train.device=$vqgan_device 2>&1 | tee -a "$OUT_DIR/vqgan_train.log"
vqgan_rc=${PIPESTATUS[0]}
set -e
echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc, vqgan rc=$vqgan_rc, $(( $(date +%s) - start )) s;" \
     "files in $OUT_DIR/"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$vqgan_rc" = 0 ]
