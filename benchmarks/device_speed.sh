#!/usr/bin/env bash
# benchmarks/device_speed.py (issues 51 and 60: every number of a GPU run in at most 5 minutes) in one call on a machine
# without network: the bf16 gradient test of the kernels, prefill against SDPA and fla, a profiler pass, per-layer and
# whole-model decode against a static KV cache, the 8B-shaped stages, then the gpu-marked tests. The wheels that
# `make gpu-wheels` put into .whl/ (fla-core among them) are installed into /tmp/site first, as
# benchmarks/gpu_check.sh does.
#
#   here:            make gpu-wheels
#   on the device:   bash benchmarks/device_speed.sh          (device tool: run, carry [".whl"], timeout_s 340)
#
# Writes device_speed.md, device_speed.json, device_speed_children.log and device_speed.log (this output) into $OUT
# when set, else docs/results/. No part or row starts DEVICE_SPEED_DEADLINE (285) s after this script's start; the
# row running then ends (the child processes are cut at it). Arguments go to device_speed.py; DEVICE_SPEED_PARTS,
# _BUDGETS, _TILES, _FLA_CONFIGS change it (benchmarks/device/settings.py). Exit status: 0 when every part ran and the
# gradient check and the tests passed, 1 when not, 2 without a GPU, 3 when the wheels could not be installed.
set -uo pipefail
export DEVICE_SPEED_STARTED="${DEVICE_SPEED_STARTED:-$(date +%s)}"  # DEVICE_SPEED_DEADLINE counts from here
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-docs/results}"
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf /tmp/site  # (a warm machine's earlier install: pip --target leaves other versions' metadata behind)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_speed.sh: installing .whl/*.whl into /tmp/site failed" >&2; exit 3; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  echo "device_speed.sh: installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
else
  echo "device_speed.sh: no .whl/ here (make gpu-wheels; carry .whl): using the Python environment as it is"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"
export DEVICE_SPEED_COMMAND="${DEVICE_SPEED_COMMAND:-bash benchmarks/device_speed.sh $*}"
{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "device_speed.sh: $("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(torch|triton|transformers|peft|deepspeed|fla.core|einops)==' | tr '\n' ' ')"
  "$PY" -m benchmarks.device_speed "$@"
} 2>&1 | tee "$OUT_DIR/device_speed.log"
exit "${PIPESTATUS[0]}"
