#!/bin/sh
# Item 1's evaluation of one stage-2 run (window 16): hybrid and hybrid+cache (32 keys per KV head, attention selection)
# usage: sh experiments/cache_training/eval_w16.sh RUN_DIR [extra overrides]
RUN=$1; shift
exec /work/main/.venv/bin/python -m hybrid_scale evaluate configs/quickstart.yaml run_dir=$RUN eval.out_dir=$RUN/eval \
  'eval.tasks=[]' 'eval.modes=[hybrid,hybrid+cache]' 'eval.passkey_modes=[hybrid,hybrid+cache]' \
  'eval.passkey_distances=[32,64,128,256]' eval.passkey_trials=20 eval.recall_pairs=4 eval.cache=32 \
  eval.ppl_sequences=2 eval.ppl_seq_len=1024 eval.progress=false "$@"
