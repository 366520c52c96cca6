#!/usr/bin/env bash
# Several nodes from one login node: deepspeed ssh-es (pdsh) into every host of the hostfile.
#   HOSTFILE=launch/hostfile.example CONFIG=configs/my_run.yaml launch/deepspeed_hostfile.sh
# Needs passwordless ssh to every host. A hostfile with only "localhost slots=N" still probes ssh:
# pass --no_ssh_check --master_addr 127.0.0.1 (as deepspeed_local.sh does) for one node.
# Variables the ranks need (NCCL_*, HF_HOME...) go into ./.deepspeed_env, one KEY=VALUE per line.
set -euo pipefail
HOSTFILE=${HOSTFILE:-launch/hostfile.example}
CONFIG=${CONFIG:?set CONFIG to the run YAML}
MASTER_ADDR=${MASTER_ADDR:-$(awk '!/^#/ && NF {print $1; exit}' "$HOSTFILE")}
MASTER_PORT=${MASTER_PORT:-29500}
exec deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --module ds_capture run -c "$CONFIG" "$@"
