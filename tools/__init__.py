"""The maintained tools, each run by a make target or a test, from the repository root as `python -m tools.NAME`:
the Triton compile gate (kernel_compile.py), the planted faults (planted_faults.py), the GPU machine's wheels
(gpu_wheels.py), the test suite's timing (test_time.py), two runs compared (compare_runs.py) and the kernels' gradient
precision against the spec (kernel_grad_precision.py)."""
