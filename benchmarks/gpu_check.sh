#!/usr/bin/env bash
# The GPU check in one call (benchmarks/gpu_check/: the pipeline on cuda/bfloat16 checked against cpu/float32, a
# 1B-shaped stage-1 layer and stage-2 step, hybrid attention vs SDPA at 4k and 16k tokens, the fused Triton kernels
# through benchmarks/attention/kernels.py), on a machine without network: the wheels that `make gpu-wheels` put into .whl/
# are installed into /tmp/site first.
#
#   here:            make gpu-wheels
#   on the device:   bash benchmarks/gpu_check.sh          (device tool: run, carry [".whl"], timeout_s 600)
#
# Writes gpu_check.md (the table), gpu_check.json (every figure), gpu_check.log (this output) and
# gpu_check_children.log (every subprocess's output) into $OUT when set (the device tool brings those back), else
# into docs/results/. Sized for about 7 minutes on one H200 (GPU_CHECK_DEADLINE, 450 s, caps it); GPU_CHECK_*
# variables (see benchmarks/gpu_check/__init__.py) change it.
# It runs the gpu-marked tests (the compiled kernels against the spec) first, then the check.
# Exit status: 0 when every check and test passed, 1 when one failed, 3 when the wheels could not be installed.
set -uo pipefail
export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s)}"  # GPU_CHECK_DEADLINE counts from here
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${GPU_CHECK_OUT:-${OUT:-docs/results}}"
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf /tmp/site  # (a warm machine's earlier install: pip --target leaves other versions' metadata behind)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check.sh: installing .whl/*.whl into /tmp/site failed" >&2; exit 3; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check.sh: installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  (cd /tmp && "$PY" -c "import hybrid_scale; print('gpu_check.sh: the wheel of hybrid_scale imports:', hybrid_scale.__file__)") \
    || echo "gpu_check.sh: the wheel of hybrid_scale does not import (the check runs the checkout's code anyway)"
else
  echo "gpu_check.sh: no .whl/ here (make gpu-wheels; carry .whl): using the Python environment as it is"
fi
export GPU_CHECK_OUT="$OUT_DIR" GPU_CHECK_COMMAND="${GPU_CHECK_COMMAND:-bash benchmarks/gpu_check.sh}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"  # DeepSpeed's CPU op (reference run)
{  # the machine, also at the top of gpu_check.log (the device tool's output tail drops it on a long run)
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # the reference run's stage 2 JIT-builds DeepSpeed's CPU shared-memory op: a C++ compiler, ninja and Python.h
  echo "gpu_check.sh: $(for c in c++ g++ nvcc ninja; do printf '%s=%s ' "$c" "$(command -v "$c" || echo none)"; done)" \
    "Python.h: $("$PY" -c 'import os, sysconfig; print(os.path.isfile(sysconfig.get_paths()["include"] + "/Python.h"))')"
  echo "gpu_check.sh: $("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(torch|transformers|tokenizers|safetensors|accelerate|huggingface.hub|peft|deepspeed|datasets|pyarrow|fsspec|numpy|typing.extensions|triton|fla.core|einops)==' \
    | tr '\n' ' ')"
} 2>&1 | tee "$OUT_DIR/gpu_check.log"
# first what only a GPU can check: the compiled kernels against the spec (tests marked gpu, each printing its errors
# with -rP; at most 4 minutes)
timeout 240 "$PY" -m pytest -q -rP -p no:cacheprovider -m gpu tests/unit/test_triton_kernels_bf16.py tests/unit/test_chunk_prefill.py 2>&1 \
  | tee -a "$OUT_DIR/gpu_check.log"
tests=${PIPESTATUS[0]}
echo "gpu_check.sh: gpu-marked tests exit status $tests" | tee -a "$OUT_DIR/gpu_check.log"
"$PY" -m benchmarks.gpu_check 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ] && [ "$tests" -ne 0 ]; then status=1; fi
exit "$status"
