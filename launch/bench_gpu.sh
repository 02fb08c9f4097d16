#!/usr/bin/env bash
# One-GPU benchmark of every variant at the paper's 220M and 533M shapes, bf16 compute
# (configs/220m.yaml, configs/533m.yaml), 8 x 2048 tokens a step; about 6 minutes on an H100.
#   launch/bench_gpu.sh [OUT_DIR]     (needs jax[cuda12]==0.10.2 in the environment)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench_gpu}
mkdir -p "$out"
for size in 220m 533m; do
  python -m delta_jax.bench --config "configs/$size.yaml" --steps 10 --warmup 3 \
    --json "$out/$size.json" train.batch_size=8 train.seq_len=2048 mesh.data=1 \
    | tee "$out/$size.txt"
done
