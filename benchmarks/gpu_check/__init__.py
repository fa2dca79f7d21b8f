"""The GPU check: the whole toolkit on one GPU in one call, with its figures in one table.

Steps (each guarded: a failing step is reported with its traceback and FAILED in the table, the others still run):
  a. build: a tiny random Llama with a byte-level tokenizer made here (no download), briefly pretrained on
     benchmarks/gpu_check/text.jsonl (generated prose) so that its attention is not uniform, and two small synthetic
     task datasets (PIQA- and ARC-Easy-shaped) for the evaluation;
  b. pipeline: distill -> finetune -> evaluate -> export through the CLI (one subprocess per stage) on the checked
     device/dtype (default cuda/bfloat16) and on the reference (default cpu/float32; the GPU is hidden from it);
     every output finite, the stage-1 final losses, stage-2 held-out losses, perplexities by mode and bucket, task
     log-likelihoods and the export's held-out loss compared within stated relative tolerances (TOL), and the
     export's cached decode checked against its full forward; both runs under tests/collectives' checker (every
     torch.distributed collective recorded, one on another device than the run's reported). The reference starts
     in the background when step a is done; on the GPU, steps c, d and e run meanwhile (one at a time), then b's GPU
     run, which then joins it;
  c. big: a Llama-3.2-1B-shaped random model (hidden 2048, 32 heads, 8 KV heads, head_dim 64, intermediate 8192; 4
     layers by default) in the checked dtype on the checked device: seconds per stage-1 layer and per stage-2 step;
  d. attention: hybrid attention (every registered backend, the Triton kernels on CUDA only; naive only up to
     GPU_CHECK_NAIVE_MAX) vs SDPA (is_causal, GQA) at 4k and 16k tokens, batch 1, the 1B head shape: forward and
     forward+backward time (CUDA events, after warm-up) and peak memory, with the ratios to SDPA;
  e. kernels: benchmarks/attention/kernels.py (the Triton kernels vs SDPA, FlashAttention if importable and the
     torch path, T = 1k..64k, SmolLM2 and Llama-3-8B head shapes; decode at 1k/8k/32k context vs a KV-cache decode)
     within GPU_CHECK_KERNEL_BUDGET seconds; its kernel_speed.md/json land beside the report;
  f. the table (gpu_check.md) and every figure (gpu_check.json) in GPU_CHECK_OUT (default $OUT, else docs/results),
     rewritten after each step; printed at the end with a one-line summary; exit status 1 if any check failed.

Run on the GPU machine: `bash benchmarks/gpu_check.sh` (installs the carried wheels of `make gpu-wheels` first).
Environment (defaults in brackets):
  GPU_CHECK_DEVICE [cuda], GPU_CHECK_DTYPE [bfloat16]            the checked run (b, c, d)
  GPU_CHECK_REF_DEVICE [cpu], GPU_CHECK_REF_DTYPE [float32]      the reference of step b
  GPU_CHECK_SMALL [0]             1 = toy sizes (the CPU dry run of tests/integration/test_gpu_check.py)
  GPU_CHECK_STEPS [a,b,c,d,e]     the steps to run
  GPU_CHECK_LENGTHS [4096,16384], GPU_CHECK_NAIVE_MAX [8192]     step d
  GPU_CHECK_KERNEL_BUDGET [100]   step e: seconds after which `benchmarks.run kernels` starts no measurement
  GPU_CHECK_BIG_LAYERS [4]        depth of the 1B-shaped model of step c (16 = Llama-3.2-1B's)
  GPU_CHECK_PRETRAIN_STEPS [300]  pretraining of the tiny model (step a)
  GPU_CHECK_CLI [stages]          one CLI process per stage; `pipeline` = one `hybrid-scale pipeline` per run
  GPU_CHECK_PARALLEL [0]          1 = steps b, c, d at once (the CPU dry run: its timings mean nothing anyway)
  GPU_CHECK_TIMEOUT [240]         seconds per subprocess
  GPU_CHECK_DEADLINE [450]        seconds, from gpu_check.sh's start (its wheel installation included), after
                                  which no subprocess runs on (each is cut to what is left) and no step starts;
                                  step b's stages end 30 s before it (its export check runs after them), steps c
                                  and d 150 s before it (step b's GPU run comes after them): the report is complete
                                  inside an 8-minute call of the device tool
  GPU_CHECK_WORK [a temporary folder], GPU_CHECK_OUT [$OUT, else docs/results]
(GPU_CHECK_SMALL=1 switches the defaults of GPU_CHECK_CLI to pipeline and of GPU_CHECK_PARALLEL to 1.)
"""
