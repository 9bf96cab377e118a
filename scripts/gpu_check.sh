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
#    step of the default VQ-VAE, DDCL vs HardVQ.
#
# Python: the repository's .venv when its torch sees a GPU; else the machine's python3 with its own
# torch and packages (nothing is installed into it or downloaded: this checkout goes on PYTHONPATH
# through a folder of links laid out as the installed package). Wheels in .whl/ go into that folder
# when present (e.g. vector-quantize-pytorch for the `vqp` rows, lpips).
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
timeout 240 "$PY" -m ddcl_vq.eval.bench "${bench_args[@]}" --no-progress --json "$OUT_DIR/bench_cuda.json" \
  2>&1 | tee "$OUT_DIR/bench_cuda.txt"
bench_rc=${PIPESTATUS[0]}
set -e
echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc, $(( $(date +%s) - start )) s; files in $OUT_DIR/"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
