#!/usr/bin/env bash
# launch/tpu_pod.sh setup|smoke|train TPU_NAME ZONE [--config FILE] [section.key=value ...]
#
# Runs on every worker of a Cloud TPU VM pod slice through
# `gcloud compute tpus tpu-vm ssh --worker=all`; each worker is one JAX process and
# jax.distributed.initialize() finds the others from the TPU metadata.
#   setup  copy this repository to ~/delta_jax on every worker and install jax[tpu] there
#   smoke  the first run on a new slice (docs/first_run.md): `python -m delta_jax.smoke ARGS`
#          on every worker, its JSON in ~/delta_jax/runs/smoke/ on worker 0
#   train  start `python -m delta_jax.train ARGS` on every worker; pass
#          checkpoint.directory=gs://BUCKET/RUN so that all workers write one checkpoint
#          (metrics, TensorBoard events and plots stay in output_dir on worker 0)
# Environment: PROJECT (gcloud --project, optional).
set -euo pipefail

if [[ $# -lt 3 || ( $1 != setup && $1 != smoke && $1 != train ) ]]; then
  echo "usage: launch/tpu_pod.sh setup|smoke|train TPU_NAME ZONE [--config FILE] [key=value ...]" >&2
  exit 2
fi
command=$1 tpu=$2 zone=$3
shift 3
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gcloud_args=(--zone "$zone" ${PROJECT:+--project "$PROJECT"})

on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$1"
}

case $command in
  setup)
    tar -C "$root" --exclude=.venv --exclude=runs --exclude=data -czf /tmp/delta_jax.tgz .
    gcloud compute tpus tpu-vm scp /tmp/delta_jax.tgz "$tpu":/tmp/delta_jax.tgz \
      "${gcloud_args[@]}" --worker=all
    on_all_workers "mkdir -p ~/delta_jax && tar -C ~/delta_jax -xzf /tmp/delta_jax.tgz && \
      cd ~/delta_jax && python3 -m venv .venv && \
      sed 's/jax\[cpu\]/jax[tpu]/' requirements.txt > /tmp/requirements-tpu.txt && \
      .venv/bin/pip install -q -r /tmp/requirements-tpu.txt gcsfs"  # gcsfs: gs:// paths
    ;;
  smoke)
    on_all_workers "cd ~/delta_jax && .venv/bin/python -m delta_jax.smoke \
      --json runs/smoke/\$(hostname).json $(printf '%q ' "$@") distributed.enabled=true"
    ;;
  train)
    # Quote the arguments once for the remote shell.
    on_all_workers "cd ~/delta_jax && .venv/bin/python -m delta_jax.train $(printf '%q ' "$@") \
      distributed.enabled=true"
    ;;
esac
