#!/usr/bin/env bash
# The device harness's pipeline check (the whole toolkit on cuda/bfloat16 against cpu/float32, the gpu-marked tests
# first; see benchmarks/device.sh and benchmarks/device/check.py): `bash benchmarks/gpu_check.sh` on the device (device
# tool: run, carry [".whl"] after `make gpu-wheels`, timeout_s 600); arguments go to `python -m benchmarks.device check`.
export DEVICE_COMMAND="${DEVICE_COMMAND:-bash benchmarks/gpu_check.sh $*}"
exec bash "$(dirname "$0")/device.sh" check "$@"
