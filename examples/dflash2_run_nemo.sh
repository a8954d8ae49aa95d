#!/usr/bin/env bash
# NeMo Automodel's own training command for a DFlash 2 recipe, with dflash2_kernels in
# every process it starts (no code changes; docs/integration.md, "Without code changes").
#
#   examples/dflash2_run_nemo.sh CONFIG.yaml [GPUS]
#
# CONFIG.yaml: a NeMo recipe config (`recipe: TrainDFlash2Recipe`, its recipe_args).
# `automodel` runs the recipe in-process on one GPU and starts torchrun workers for
# several; every one of them is patched. Drop --fused-head for the conv and selector
# kernels alone. With NeMo's SLURM script or NeMo-Run, export the switch instead:
#   export DFLASH2_PATCH=kernels,fused_head
set -euo pipefail
config=${1:?usage: $0 CONFIG.yaml [GPUS]}
gpus=${2:-1}
exec dflash2-run --fused-head -- automodel "$config" --nproc-per-node "$gpus"
