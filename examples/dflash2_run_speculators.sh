#!/usr/bin/env bash
# speculators' own training command, with dflash2_kernels in every process it starts
# (no code changes; docs/integration.md, "Without code changes").
#
#   examples/dflash2_run_speculators.sh CONFIG.yaml [GPUS]
#
# CONFIG.yaml: a `speculators train` config. One GPU: `speculators train`; several:
# torchrun, one worker per GPU, each patched. Drop --fused-head for the conv and
# selector kernels alone. In a SLURM script, instead:
#   export DFLASH2_PATCH=kernels,fused_head
#   srun torchrun --nproc-per-node 8 -m speculators.train --config CONFIG.yaml
set -euo pipefail
config=${1:?usage: $0 CONFIG.yaml [GPUS]}
gpus=${2:-1}
if [ "$gpus" -eq 1 ]; then
  exec dflash2-run --fused-head -- speculators train --config "$config"
fi
exec dflash2-run --fused-head -- torchrun --nproc-per-node "$gpus" -m speculators.train --config "$config"
