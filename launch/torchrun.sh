#!/usr/bin/env bash
# torchrun, one node or several (run it on every node with the same RDZV_ENDPOINT).
#   NPROC=8 CONFIG=configs/my_run.yaml launch/torchrun.sh
#   NNODES=2 NPROC=8 RDZV_ENDPOINT=node001:29500 CONFIG=configs/my_run.yaml launch/torchrun.sh   # on each node
set -euo pipefail
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-127.0.0.1:29500}
CONFIG=${CONFIG:?set CONFIG to the run YAML}
# torchrun through ds_capture's wrapper: the same arguments, but when every rank of this node stopped with 75
# (SIGTERM to the job, e.g. preemption) it exits 75 (slurm.sbatch requeues on 75), where torchrun exits 1.
exec python -m ds_capture.parallel.torchrun_exit --nnodes "$NNODES" --nproc_per_node "$NPROC" \
    --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" -m ds_capture run -c "$CONFIG" "$@"
