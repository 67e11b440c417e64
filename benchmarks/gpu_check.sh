#!/usr/bin/env bash
# GPU check for fastload's GPU engines: nvJPEG decode rate, images/s of engine=gpu / engine=dali at 640
# with full scratch-high augmentation from lmdb, ram and store=gpu, the CPU engine for comparison, and the
# data-wait fraction of a few YOLOv9 training steps. Installs nothing from the network.
#
#   bash benchmarks/gpu_check.sh                 # synthetic data (fastload.data.synthetic)
#   COCO128=/path/to/coco128 bash benchmarks/gpu_check.sh
#
# Knobs (env): IMGSZ (640) BATCH (64) BATCHES (10 timed per run) IMAGES (256 synthetic) WORKERS
# TRAIN_STEPS_IMAGES (images for the training probe, 128) SKIP_TRAIN=1. Small wheels brought in .whl/
# (lmdb, msgpack...) are installed offline into /tmp/site. Without a GPU it prints CPU figures and exits 0.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONPATH="$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
start=$(date +%s)

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing local wheels from .whl/ into /tmp/site (offline)"
  $PY -m pip install --quiet --no-index --find-links .whl --target /tmp/site .whl/*.whl || echo "   (some wheels did not install)"
fi

echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
  echo "nvidia-smi not found"
fi
if ! $PY -c "import torch, torchvision" 2>/dev/null; then
  echo "PyTorch/torchvision not importable with $PY: nothing to measure"; exit 0
fi
GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
[ "$GPU" = "1" ] || echo "NO CUDA GPU visible to torch: printing CPU-only figures (GPU figures are not measured)"

echo "== decode and engines"
timeout 240 $PY benchmarks/gpu_engines.py || echo "gpu_engines.py failed or timed out (rc $?)"

echo "== data-wait fraction of training steps"
if [ "${SKIP_TRAIN:-0}" = "1" ]; then
  echo "skipped (SKIP_TRAIN=1)"
elif [ "$GPU" != "1" ]; then
  echo "skipped: needs a CUDA GPU"
elif ! $PY -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('yolov9.train') is None)" 2>/dev/null; then
  echo "skipped: python -m yolov9.train is not available"
else
  work=$(mktemp -d /tmp/fastload-train-XXXX)
  left=$(( 290 - ($(date +%s) - start) ))
  if [ "$left" -lt 40 ]; then
    echo "skipped: not enough of the 5-minute budget left (${left}s)"
  else
    yaml=$($PY - "$work" <<'PYEOF'
import os, sys
from pathlib import Path
from fastload.data.synthetic import make_synthetic_dataset
from fastload.store.convert import convert
work = Path(sys.argv[1])
c = os.environ.get("COCO128")
src = Path(c) / "coco128.yaml" if c else make_synthetic_dataset(work / "synth", n_train=int(os.environ.get("TRAIN_STEPS_IMAGES", 128)), n_val=8, nc=3)
print(convert(src, to="lmdb", out=work / "stores", imgsz=int(os.environ.get("IMGSZ", 640)), progress=False, log=lambda *_: None).yaml_path)
PYEOF
)
    for eng in cpu gpu dali; do
      if [ "$eng" = "dali" ] && ! $PY -c "import nvidia.dali" 2>/dev/null; then echo "loader=dali: skipped (DALI not installed)"; continue; fi
      per=$(( (left - 10) / 3 ))
      out=$(timeout "$per" $PY -m yolov9.train --data "$yaml" --cfg yolov9-s --epochs 1 --batch-size 16 --imgsz "${IMGSZ:-640}" \
            --noval --nosave --loader "$eng" --store lmdb --device 0 --workers "${WORKERS:-8}" \
            --project "$work/runs" --name "$eng" --exist-ok 2>&1)
      wait_line=$(printf '%s\n' "$out" | grep -o 'data wait [0-9.]*%' | tail -1)
      ips=$(printf '%s\n' "$out" | grep -o '[0-9.]* img/s' | tail -1)
      if [ -n "$wait_line" ]; then echo "loader=$eng: $wait_line, $ips (YOLOv9-s, batch 16, AMP)";
      else echo "loader=$eng: no data-wait figure (run ended early or failed):"; printf '%s\n' "$out" | tail -3; fi
    done
  fi
  rm -rf "$work"
fi
echo "== done in $(( $(date +%s) - start )) s"
exit 0
