#!/bin/sh
# Item 2's evaluation (window 64, trained at 1024 tokens): passkey at 128-512 tokens, with and without the cache
# (32 keys per KV head, attention selection), against swa_sinks (+cache) and the base.
# usage: sh experiments/cache_training/eval_w64.sh RUN_DIR [extra overrides]
RUN=$1; shift
exec /work/main/.venv/bin/python -m hybrid_scale evaluate configs/quickstart.yaml run_dir=$RUN attention.window=64 \
  eval.out_dir=$RUN/eval 'eval.tasks=[]' 'eval.modes=[base,hybrid,hybrid+cache,swa_sinks,swa_sinks+cache]' \
  'eval.passkey_modes=[base,hybrid,hybrid+cache,swa_sinks,swa_sinks+cache]' \
  'eval.passkey_distances=[128,256,512]' eval.passkey_trials=20 eval.recall_pairs=0 eval.cache=32 \
  eval.ppl_sequences=0 eval.progress=false "$@"
