"""Performance only: the attention's registry of shapes and backends (registry.py) and its runner (run.py, `python -m
benchmarks.run`), the memory benchmarks (memory/), the device harness (device/, driven by device.sh: the speed
benchmark, device_speed.sh, and the pipeline check, gpu_check.sh) and the metrics' overhead (metrics_overhead.py).
Every module runs from the repository root as `python -m benchmarks.NAME`; tests/unit/test_layout.py fails when one is
not run by a test or a make target."""
