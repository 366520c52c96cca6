#!/usr/bin/env bash
# Several nodes without ssh: run this once on every node, each with its own NODE_RANK.
#   node001$ NODE_RANK=0 MASTER_ADDR=node001 CONFIG=configs/my_run.yaml launch/deepspeed_no_ssh.sh
#   node002$ NODE_RANK=1 MASTER_ADDR=node001 CONFIG=configs/my_run.yaml launch/deepspeed_no_ssh.sh
# The hostfile fixes the world (its first NUM_NODES hosts and their slots); ranks on node k follow
# those of nodes 0..k-1. ds_capture switches off DeepSpeed's CPU shm all-reduce across nodes itself.
set -euo pipefail
HOSTFILE=${HOSTFILE:-launch/hostfile.example}
NUM_NODES=${NUM_NODES:-$(grep -cv '^\s*\(#\|$\)' "$HOSTFILE")}
NODE_RANK=${NODE_RANK:?set NODE_RANK to this node index 0..NUM_NODES-1}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first host}
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:?set CONFIG to the run YAML}
exec deepspeed --hostfile "$HOSTFILE" --no_ssh --num_nodes "$NUM_NODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --module ds_capture run -c "$CONFIG" "$@"
