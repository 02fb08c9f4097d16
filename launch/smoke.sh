#!/usr/bin/env bash
# The first run on a new TPU host or GPU node (docs/first_run.md): python -m delta_jax.smoke,
# its JSON and printed table kept side by side as runs/smoke/<host>-<UTC time>.{json,txt}, the
# files to send back. Exit status: the smoke run's (0 agree, 1 a kernel disagrees, 2 bad input).
#   launch/smoke.sh [--config FILE] [--variants ...] [--steps N] [section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
name="runs/smoke/$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p runs/smoke
python -m delta_jax.smoke --json "$name.json" "$@" | tee "$name.txt"
