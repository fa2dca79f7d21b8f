"""The device harness: everything that runs on a GPU machine in one call of the device tool, as one package with one
driver (benchmarks/device.sh; benchmarks/device_speed.sh and gpu_check.sh name its two harnesses), one entry point
(`python -m benchmarks.device speed|check`, __main__.py), one settings module (settings.py), one Run and part runner
(run.py: the deadline, the budgets, the guarded parts, the child processes) and one report writer (report.py).

Its two harnesses, each a list of parts run in order (one module each, whose docstrings say what they measure):
  speed (speed.py; issues 51, 60 and 67, 285 s): grad (the bf16 gradient test, a gpu-marked test of
      tests/unit/test_triton_kernels_bf16.py run by tests.py), delta.py, prefill.py, decode.py, profile.py, tests
      (the gpu-marked tests); named only: tiles.py, generate.py, big.py (the 8B-shaped stages, through stages.py);
      device_speed.md;
  check (check.py; the pipeline on a GPU against the CPU, about 7 minutes): tests (the gpu-marked tests), build.py
      (a), pipeline.py (b), stages.py (c), attention.py (d), kernel_bench.py (e); gpu_check.md.
machine.py holds what the parts share about the machine (the byte-level tokenizer, versions, the device), timing.py
the decode parts' clocks and the profiler pass, make_text.py writes the check's text.jsonl. Every part's section of
its report is the `section` of its module."""
