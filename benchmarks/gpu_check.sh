#!/usr/bin/env bash
# zplan GPU check (issue 9): one command, one report, ready for the first GPU it meets.
#
# NEEDS on the GPU machine: Linux x86_64, the NVIDIA driver, Python 3.12 (another: set
#   FETCH_PYTHON_VERSION for --fetch) and a CUDA build of torch >= 2.6 (2.11's API). No package
#   registry is needed there: everything else zplan imports (typer, rich, psutil,
#   nvidia-ml-py, numpy, safetensors; pytest for the GPU tests) travels as wheels in .whl/ and is
#   installed offline into a private folder when the machine lacks it.
#   1. on a machine with a registry:  bash benchmarks/gpu_check.sh --fetch   (py3.12 wheels -> .whl/)
#   2. on the GPU machine, carrying .whl/ (it is gitignored: the device tool carries it only where
#      named, carry [".whl"]):  bash benchmarks/gpu_check.sh
#   rehearsal on CPU ranks (tiny model, 2 ranks, same steps):  bash benchmarks/gpu_check.sh --cpu-dry
# DOES, each step under its own timeout (limits and kill grace add up to 515 s, under the 600 s
#   a device command may run; about 4 minutes expected on one H200): environment -> zplan detect
#   -> the GPU tests (tests/test_gpu_cuda.py, test_gpu_path.py) -> zplan calibrate -> plan
#   llama-3.2-1b zero3 on 1 GPU (and its estimate with the calibrated preset) -> train it (the
#   report: predicted, preset and calibrated, against measured; --no-save, a 1B checkpoint is
#   15 GB to write) -> a checkpoint and a resume from it, on the tiny model (DCP over the group).
# WRITES benchmarks/gpu_check/out/ ($GPU_CHECK_RESULTS, if set; report.txt, summary.json, logs, plans, run reports; the
#   checkpoints are deleted at the end). With $OUT set (the device tool) it refreshes, after
#   every step, $OUT/report.txt, summary.json, steps.tsv and gpu_check.tar.gz (every result but
#   the checkpoints): four files, all there even if the command is killed mid-way. Exit 0 when
#   every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
MODE=gpu
case "${1:-}" in
  --fetch) MODE=fetch ;;
  --cpu-dry) MODE=cpu ;;
  "") ;;
  -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
  *) echo "gpu_check.sh: unknown option '$1': use --fetch, --cpu-dry or nothing" >&2; exit 2 ;;
esac

WHEELS="typer rich psutil nvidia-ml-py numpy safetensors pytest pytest-timeout"
if [ "$MODE" = fetch ]; then
  # Wheels for CPython 3.12 on manylinux x86_64, with their dependencies, for an offline install.
  ver=${FETCH_PYTHON_VERSION:-3.12}
  $PY -m pip download -q --only-binary=:all: --python-version "$ver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS || { echo "gpu_check.sh: pip download failed (is a registry reachable?)" >&2; exit 1; }
  echo "gpu_check.sh: $(ls .whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1)); carry .whl to the GPU machine"
  exit 0
fi

RES=${GPU_CHECK_RESULTS:-$ROOT/benchmarks/gpu_check/out}  # another folder: the tests' rehearsal
rm -rf "$RES"
mkdir -p "$RES"
: > "$RES/steps.tsv"
export PYTHONUNBUFFERED=1

# Offline install of what this Python lacks (import name:wheel name), into a private folder.
missing=""
for pair in typer:typer rich:rich psutil:psutil pynvml:nvidia-ml-py numpy:numpy \
            safetensors:safetensors pytest:pytest pytest_timeout:pytest-timeout; do
  $PY -c "import ${pair%%:*}" 2>/dev/null || missing="$missing ${pair#*:}"
done
if [ -n "$missing" ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check.sh: this Python lacks:$missing; run 'bash benchmarks/gpu_check.sh --fetch' where a registry is reachable and carry .whl/" >&2
    exit 1
  fi
  $PY -m pip install -q --no-index --find-links .whl --no-compile --target /tmp/zplan-site $missing \
    || { echo "gpu_check.sh: offline install of$missing from .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/zplan-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$ROOT:${PYTHONPATH:-}

# bundle: the results so far into $OUT (when set), at most four files: the device tool returns
# what is under $OUT even when it kills the command, and no more than eight files
bundle() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  $PY benchmarks/gpu_check/summarize.py "$RES" > /dev/null 2>&1
  for f in report.txt summary.json steps.tsv; do [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/$f"; done
  tar -czf "$OUT/.gpu_check.tar.gz" -C "$RES" --exclude='step_*' --exclude='.tmp-step_*' . 2>/dev/null \
    && mv "$OUT/.gpu_check.tar.gz" "$OUT/gpu_check.tar.gz"
}

# step NAME SECONDS CMD...: run CMD with a timeout, its output in $RES/NAME.log; record the exit code
SCALE=1  # CPU ranks on a shared machine are slow: --cpu-dry triples every limit
step() {
  local name=$1 limit=$(($2 * SCALE)); shift 2
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" > "$RES/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$RES/steps.tsv"
  case "$name:$rc" in
    plan:0|plan-small:0|calibrate:0|estimate-calibrated:0) ;;  # the report has their figures
    *) tail -n 15 "$RES/$name.log" ;;
  esac
  [ "$rc" = 0 ] || echo "   $name failed (exit $rc): see $RES/$name.log"
  bundle
  return $rc
}

if [ "$MODE" = cpu ]; then
  export CUDA_VISIBLE_DEVICES=""
  SCALE=3
  PLAN=(--model tiny --gpu cpu --cluster cpu-local --gpus 2 --global-batch 4 --seq-len 64
        --context-gib 0 --fragmentation 0)
  SMALL=("${PLAN[@]}")
  STEPS=6; CAL=(--max-mb 1 --ranks 2)
else
  # --headroom 0.2: the run must not die of a miss inside the planner's own spread (the memory
  # error's 90% band, which estimate prints): an OOM would lose the check's whole comparison
  PLAN=(--model llama-3.2-1b --gpu auto --gpus 1 --cluster hgx-h200 --global-batch 8 --seq-len 2048
        --checkpointing none --headroom 0.2)
  SMALL=(--model tiny --gpu auto --gpus 1 --cluster hgx-h200 --global-batch 8 --seq-len 256)
  STEPS=20; CAL=()
fi

# env: 40 s, a fresh machine's first import of torch and CUDA initialisation can take tens of seconds
step env 40 $PY -c "
import platform, torch
print('python', platform.python_version(), '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('gpu 0:', p.name, f'{p.total_memory / 2**30:.1f} GiB', '| devices', torch.cuda.device_count())
"
cp "$RES/env.log" "$RES/env.txt"
if [ "$MODE" = gpu ] && ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check.sh: torch sees no CUDA GPU here; use --cpu-dry for the CPU rehearsal" >&2
  exit 1
fi
step detect 15 $PY -m zplan detect
# the torch.cuda tests (skipped on CPU ranks), then the fast CPU ones of the GPU path
# a hung test (an NCCL wait) gets its own verdict at 90 s (60 the CPU ones), inside the step's limit
step gpu-tests 120 bash -c "$PY -m pytest -q -p no:cacheprovider --timeout 90 tests/test_gpu_cuda.py; a=\$?; [ \$a = 5 ] && a=0
  $PY -m pytest -q -p no:cacheprovider --timeout 60 -m 'not slow' tests/test_gpu_path.py && exit \$a"
# calibrate's JSON on stdout alone (a warning on stderr goes to the log, not into the JSON)
step calibrate 75 bash -c '$1 -m zplan calibrate --output "$2/presets" --name measured --json "${@:3}" > "$2/calibrate.json"' \
  _ "$PY" "$RES" "${CAL[@]}"
step plan 20 $PY -m zplan recommend "${PLAN[@]}" --layout torch --strategy zero3 --write "$RES/plan.json" --top 1
if [ -f "$RES/presets/gpus/measured.toml" ] && [ -f "$RES/plan.json" ]; then
  # the run's own configuration, estimated with the measured GPU and link
  CPLAN=(); skip=""
  for a in "${PLAN[@]}"; do
    if [ -n "$skip" ]; then
      [ "$skip" = swap ] && CPLAN+=(measured)
      skip=""; continue
    fi
    case "$a" in --gpu|--cluster) CPLAN+=("$a"); skip=swap ;; --checkpointing|--global-batch) skip=drop ;;
                 *) CPLAN+=("$a") ;; esac
  done
  read -r -a SAME < <($PY -c "import json, sys; t = json.load(open(sys.argv[1]))['train']
print('--micro-batch', t['micro_batch'], '--grad-accum', t['grad_accum'], '--checkpointing', t['checkpointing'],
      '--blocks-per-unit', t['blocks_per_unit'], '--param-dtype', t['precision']['param'])" "$RES/plan.json")
  step estimate-calibrated 15 bash -c '$1 -m zplan estimate "${@:3}" --presets "$2/presets" --layout torch \
    --strategy zero3 --json > "$2/estimate-calibrated.json"' _ "$PY" "$RES" "${CPLAN[@]}" "${SAME[@]}"
fi
if [ -f "$RES/plan.json" ]; then
  step train 75 $PY -m zplan launch --plan "$RES/plan.json" --run-dir "$RES/run" --steps $STEPS --no-save
fi
# a checkpoint and a resume from it over the GPU group, on the tiny model
step plan-small 15 $PY -m zplan recommend "${SMALL[@]}" --layout torch --strategy zero3 --write "$RES/plan-small.json" --top 1
if [ -f "$RES/plan-small.json" ]; then
  # the run report copied inside the step, so that the step's bundle holds it (paths as arguments)
  step save 45 bash -c '$1 -m zplan launch --plan "$2/plan-small.json" --run-dir "$2/run-small" --steps 6 \
    --save-every 6 && cp "$2/run-small/run_report.json" "$2/first.json"' _ "$PY" "$RES"
  step resume 45 bash -c '$1 -m zplan launch --plan "$2/plan-small.json" --run-dir "$2/run-small" --steps 12 \
    --resume && cp "$2/run-small/run_report.json" "$2/resumed.json"' _ "$PY" "$RES"
fi
rm -rf "$RES"/run/step_* "$RES"/run/.tmp-step_* "$RES"/run-small/step_* "$RES"/run-small/.tmp-step_*  # checkpoints: not results
$PY benchmarks/gpu_check/summarize.py "$RES"
rc=$?
bundle
exit $rc
