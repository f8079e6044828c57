#!/usr/bin/env bash
# One host with 8 GPUs: one process sees all eight devices; parameters and optimizer
# moments are split over them (fsdp=8), the lanes too.
#   CONFIG=atom_1b WORKDIR=runs/atom_1b scripts/launch_1host_8gpu.sh [--set key=value ...]
# Plan the memory first:  python -m fractus_jax.plan --config atom_1b --devices 8
set -euo pipefail
CONFIG=${CONFIG:-atom_1b}
WORKDIR=${WORKDIR:-runs/$CONFIG}
DATA=${DATA:-1}
FSDP=${FSDP:-8}
# Let XLA take most of each GPU up front instead of growing (fragmentation hurts 1B runs).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
exec python -m fractus_jax.train --config "$CONFIG" --workdir "$WORKDIR" \
    --set "mesh.data=$DATA" --set "mesh.fsdp=$FSDP" "$@"
