#!/usr/bin/env bash
# The GPU check (issue 4): a ~1B model (llama-3.2-1b) under zero3 at N=1 on one GPU for a few
# dozen steps; prints measured against predicted peak memory, step time and MFU. Runs
# `zplan calibrate` first when this zplan has it. Finishes well within 8 minutes on one H200.
#
# The H200 image has torch, typer, rich, psutil and nvidia-ml-py but not pydantic, and reaches
# no registry. So, here first:   bash benchmarks/gpu_check.sh --fetch
# (downloads the pydantic wheels for Python 3.12 into .whl/, git-ignored), then on the device,
# carrying .whl:                  bash benchmarks/gpu_check.sh
# Results land in $OUT (the device tool's output folder) or /tmp/zplan-gpu-check.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  ls .whl
  exit 0
fi
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/zplan-site .whl/*.whl
  export PYTHONPATH=/tmp/zplan-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
RES=${OUT:-/tmp/zplan-gpu-check}
mkdir -p "$RES"
$PY -c "import torch, zplan; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
$PY -m zplan detect
if $PY -m zplan calibrate --help >/dev/null 2>&1; then
  timeout 120 $PY -m zplan calibrate --output "$RES/calibrated.toml" || echo "calibrate failed (continuing)"
fi
$PY -m zplan recommend --model llama-3.2-1b --gpu auto --gpus 1 --cluster hgx-h200 --layout torch \
  --strategy zero3 --global-batch 8 --seq-len 2048 --checkpointing none --write "$RES/plan.json" --top 0
timeout 400 $PY -m zplan launch --plan "$RES/plan.json" --run-dir "$RES/run" --steps 30 2>&1 | tee "$RES/launch.log"
cp "$RES/run/run_report.json" "$RES/run_report.json" 2>/dev/null || true
