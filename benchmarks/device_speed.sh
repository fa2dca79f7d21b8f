#!/usr/bin/env bash
# The device harness's speed benchmark (issues 51, 60 and 67: parts whose budgets add up to its 285 s deadline; see
# benchmarks/device.sh and benchmarks/device/speed.py): `bash benchmarks/device_speed.sh` on the device (device tool:
# run, carry [".whl"] after `make gpu-wheels`, timeout_s 340); arguments go to `python -m benchmarks.device speed`.
export DEVICE_COMMAND="${DEVICE_COMMAND:-bash benchmarks/device_speed.sh $*}"
exec bash "$(dirname "$0")/device.sh" speed "$@"
