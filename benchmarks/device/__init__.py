"""The parts of benchmarks/device_speed.py (issue 60, item 3: every number of a GPU run in at most 5 minutes), one
module each, in the order they run: gradients.py (bf16 gradients of the kernels against the fp32 chunked path),
prefill.py (fwd and fwd+bwd against SDPA and fla), profile.py (per-kernel microseconds of a fwd+bwd and a decode
step), tiles.py (DEVICE_SPEED_TILES: tile variants of the chunked prefill), decode.py (one layer's step against a
static KV cache, both in CUDA graphs), generate.py (`generate`, with its recompiles and CUDA-graph skips counted),
big.py (the 8B-shaped stage 1 and stage 2), tests.py (the gpu-marked tests, chunked path first). settings.py holds
the sizes, budgets and targets; run.py the Run every part writes into; report.py the tables
(benchmarks/report_table.py writes them)."""
