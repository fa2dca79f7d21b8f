#!/usr/bin/env bash
# The device harness (benchmarks/device/) in one call on a machine without network: HARNESS is `speed` (issues 51 and
# 60's speed benchmark, benchmarks/device/speed.py: under 5 minutes) or `check` (the pipeline check,
# benchmarks/device/check.py: about 7 minutes on one H200); the other arguments go to
# `python -m benchmarks.device HARNESS`. The wheels that `make gpu-wheels` put into .whl/ (fla-core among them) are
# installed into /tmp/site first.
#
#   here:            make gpu-wheels
#   on the device:   bash benchmarks/device.sh speed    (device tool: run, carry [".whl"], timeout_s 340)
#                    bash benchmarks/device.sh check    (device tool: run, carry [".whl"], timeout_s 600)
#   (benchmarks/device_speed.sh and benchmarks/gpu_check.sh are these two)
#
# Writes NAME.md (the tables), NAME.json (every figure), NAME_children.log (every subprocess's output) and NAME.log
# (this output), NAME device_speed or gpu_check, into $OUT when set (the device tool brings those back), else
# docs/results/. Each harness's deadline (DEVICE_SPEED_DEADLINE, GPU_CHECK_DEADLINE) counts from this script's start
# (DEVICE_STARTED); the environment that changes them: benchmarks/device/settings.py. Exit status: 0 when every part
# ran and every check and test passed, 1 when not, 2 without a GPU (speed), 3 when the wheels could not be installed.
set -uo pipefail
export DEVICE_STARTED="${DEVICE_STARTED:-$(date +%s)}"  # the harness's deadline counts from here
HARNESS="${1:-}"
case "$HARNESS" in
  speed) NAME=device_speed ;;
  check) NAME=gpu_check ;;
  *) echo "usage: bash benchmarks/device.sh speed|check [arguments of python -m benchmarks.device]" >&2; exit 64 ;;
esac
shift
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-docs/results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/$NAME.log"
if compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf /tmp/site  # (a warm machine's earlier install: pip --target leaves other versions' metadata behind)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device.sh: installing .whl/*.whl into /tmp/site failed" >&2; exit 3; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  echo "device.sh: installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  (cd /tmp && "$PY" -c "import hybrid_scale; print('device.sh: the wheel of hybrid_scale imports:', hybrid_scale.__file__)") \
    || echo "device.sh: the wheel of hybrid_scale does not import (the harness runs the checkout's code anyway)"
else
  echo "device.sh: no .whl/ here (make gpu-wheels; carry .whl): using the Python environment as it is"
fi
export DEVICE_COMMAND="${DEVICE_COMMAND:-bash benchmarks/device.sh $HARNESS $*}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"  # DeepSpeed's CPU op (the check's reference)
{  # the machine, at the top of the log too (the device tool's output tail drops it on a long run)
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # the check's reference stage 2 JIT-builds DeepSpeed's CPU shared-memory op: a C++ compiler, ninja and Python.h
  echo "device.sh: $(for c in c++ g++ nvcc ninja; do printf '%s=%s ' "$c" "$(command -v "$c" || echo none)"; done)" \
    "Python.h: $("$PY" -c 'import os, sysconfig; print(os.path.isfile(sysconfig.get_paths()["include"] + "/Python.h"))')"
  echo "device.sh: $("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(torch|transformers|tokenizers|safetensors|accelerate|huggingface.hub|peft|deepspeed|datasets|pyarrow|fsspec|numpy|typing.extensions|triton|fla.core|einops)==' \
    | tr '\n' ' ')"
  "$PY" -m benchmarks.device "$HARNESS" "$@"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
