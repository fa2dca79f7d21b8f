#!/usr/bin/env bash
# Start a hybrid_scale stage on this node: launch.procs_per_node processes under torchrun (launch/torchrun.sh) or the
# DeepSpeed launcher in its --no_ssh mode (launch/deepspeed.sh, a link to this file). On a multi-node allocation run
# one per node, e.g. `srun --ntasks-per-node=1 launch/torchrun.sh finetune my.yaml launch.nodes=4`.
# Rendezvous comes from the Slurm environment: the first host of SLURM_JOB_NODELIST, port launch.master_port +
# SLURM_JOB_ID % 1000, node rank SLURM_NODEID (outside Slurm: localhost, port launch.master_port, node 0).
#
#   launch/torchrun.sh STAGE [CONFIG] [key=value ...]     STAGE: distill | finetune | evaluate | export | pipeline
#
# The interpreter is $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
launcher=$(basename "$0" .sh)
python=${PYTHON:-$( [ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3 )}
if [ $# -lt 1 ]; then sed -n '2,10p' "$0" >&2; exit 2; fi
if [ "$1" = "-h" ] || [ "$1" = "--help" ]; then sed -n '2,10p' "$0"; exit 0; fi
stage=$1
shift
exec "$python" -m hybrid_scale.cli launch "$stage" "$@" "launch.launcher=$launcher"
