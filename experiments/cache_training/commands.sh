#!/bin/sh
# The exact commands behind results.md (commit 2650bc4; 2 shared CPU cores; run from the repository root).
# PYTHONPATH=$PWD:$PWD/kernels OMP_NUM_THREADS=1, python = the project's venv.
set -e
PY=/work/main/.venv/bin/python

# --- 1. stage 2 with the cache on or off (window 16, configs/quickstart.yaml) ---------------------------------------
# stage 1: configs/quickstart.yaml as it is (attention.cache=0), reused from another run of the same config: copied
# into runs/ct_false/stage1 and runs/ct_true/stage1 (equivalently: $PY -m hybrid_scale distill configs/quickstart.yaml
# run_dir=runs/ct_false). With cache_train=false stage 2 trains with the cache off whatever attention.cache says
# (finetune/stage.py: set_cache(model, 0)), so runs/ct_false/stage2 is that run's stage 2 of configs/quickstart.yaml,
# copied too (equivalently: $PY -m hybrid_scale finetune configs/quickstart.yaml run_dir=runs/ct_false).
$PY -m hybrid_scale finetune configs/quickstart.yaml run_dir=runs/ct_true attention.cache=32 attention.cache_train=true
sh experiments/cache_training/eval_w16.sh runs/ct_false
sh experiments/cache_training/eval_w16.sh runs/ct_true attention.cache=32 attention.cache_train=true
$PY experiments/cache_training/summarize.py w16 runs/ct_false runs/ct_true

# --- 2. window 64, trained at 1024 tokens ----------------------------------------------------------------------------
$PY -m hybrid_scale distill configs/quickstart.yaml run_dir=runs/w64 attention.window=64
$PY -m hybrid_scale finetune configs/quickstart.yaml run_dir=runs/w64 attention.window=64
sh experiments/cache_training/eval_w64.sh runs/w64                       # seed 0: 20 prompts a distance, 5 modes
sh experiments/cache_training/eval_w64.sh runs/w64_s1 seed=1 eval.model=$PWD/runs/w64/stage2/final \
  'eval.modes=[hybrid+cache,swa_sinks+cache]' 'eval.passkey_modes=[hybrid+cache,swa_sinks+cache]'  # 20 more prompts
# diagnostics past the budget / other selection (10 prompts at 256 and 512)
sh experiments/cache_training/eval_w64.sh runs/w64_c64 eval.model=$PWD/runs/w64/stage2/output eval.cache=64 \
  'eval.modes=[hybrid+cache]' 'eval.passkey_modes=[hybrid+cache]' 'eval.passkey_distances=[256,512]' eval.passkey_trials=10
sh experiments/cache_training/eval_w64.sh runs/w64_sr eval.model=$PWD/runs/w64/stage2/output attention.cache_select=self_recall \
  'eval.modes=[hybrid+cache]' 'eval.passkey_modes=[hybrid+cache]' 'eval.passkey_distances=[256,512]' eval.passkey_trials=10
$PY experiments/cache_training/summarize.py w64 runs/w64 runs/w64_s1
$PY experiments/cache_training/summarize.py w64 runs/w64_c64 runs/w64_sr
