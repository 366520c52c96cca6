#!/usr/bin/env bash
# One node, N ranks through the deepspeed launcher (no ssh, no hostfile).
#   NPROC=2 CONFIG=configs/demo.yaml launch/deepspeed_local.sh
# On a CPU-only box LOCAL_SIZE decides the "device" count; --num_accelerators caps it.
set -euo pipefail
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-configs/demo.yaml}
MASTER_PORT=${MASTER_PORT:-29500}
exec deepspeed --num_accelerators "$NPROC" --no_ssh_check --master_addr 127.0.0.1 --master_port "$MASTER_PORT" \
    --module ds_capture run -c "$CONFIG" "$@"
