#!/usr/bin/env bash
# OpenMPI: mpirun starts the ranks; ds_capture reads OMPI_COMM_WORLD_* (MPICH / Intel MPI: PMI_*).
#   NPROC=16 HOSTS=node001:8,node002:8 MASTER_ADDR=node001 CONFIG=configs/my_run.yaml launch/mpirun.sh
# MASTER_ADDR is required once ranks span hosts (rank 0's host); on one host it defaults to 127.0.0.1.
# Drop --allow-run-as-root unless you run as root (containers).
set -euo pipefail
NPROC=${NPROC:-2}
HOSTS=${HOSTS:-localhost:$NPROC}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:?set CONFIG to the run YAML}
exec mpirun --allow-run-as-root -np "$NPROC" -H "$HOSTS" --bind-to none \
    -x MASTER_ADDR="$MASTER_ADDR" -x MASTER_PORT="$MASTER_PORT" -x PATH -x PYTHONPATH \
    python -m ds_capture run -c "$CONFIG" "$@"
# Alternative through DeepSpeed's own MPI runner:
#   deepspeed --launcher openmpi --launcher_args=--allow-run-as-root --force_multi \
#       --hostfile launch/hostfile.example --master_addr node001 --module ds_capture run -c "$CONFIG"
