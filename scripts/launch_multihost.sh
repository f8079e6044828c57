#!/usr/bin/env bash
# N hosts x 8 GPUs: run this same script on every host, with the host's rank.
#   COORDINATOR=host0:12355 NNODES=4 NODE_RANK=0 WORKDIR=/shared/runs/atom_1b \
#     scripts/launch_multihost.sh [--set key=value ...]
# WORKDIR is an s3:// URL (no disk shared between hosts: each process stages the run on
# its own disk and uploads its own shards; docs/training.md, A run on object storage) or a
# path on a filesystem every host sees (Orbax writes each process's shards there and
# process 0 writes the manifest). The corpus path must exist on every host; each process
# reads only the lanes of its own devices.
# The mesh is data=NNODES (across hosts, gradients only) x fsdp=8 (within a host, where
# NVLink carries the parameter all-gathers).
set -euo pipefail
: "${COORDINATOR:?host:port of the rank-0 host}"
: "${NNODES:?number of hosts}"
: "${NODE_RANK:?the rank of this host, 0..NNODES-1}"
CONFIG=${CONFIG:-atom_1b}
WORKDIR=${WORKDIR:?an s3:// URL, or a directory on a filesystem shared by all hosts}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec python -m fractus_jax.train --config "$CONFIG" --workdir "$WORKDIR" \
    --coordinator "$COORDINATOR" --num-processes "$NNODES" --process-id "$NODE_RANK" \
    --set "mesh.data=$NNODES" --set "mesh.fsdp=$GPUS_PER_NODE" "$@"
