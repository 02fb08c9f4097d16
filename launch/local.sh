#!/usr/bin/env bash
# launch/local.sh NPROC [--config FILE] [section.key=value ...]
#
# Runs NPROC processes of `python -m delta_jax.train` on this machine, joined by
# jax.distributed through a coordinator on localhost (CPU collectives over gloo). The CPU
# devices are split among them: CPU_DEVICES (default 8) fake devices in all, CPU_DEVICES/NPROC
# per process, so a mesh spans processes exactly as it would span hosts. Each output line is
# prefixed with its process, [p0] [p1] ...; if one process fails, the others are stopped.
#
# Environment: CPU_DEVICES (default 8), PORT (default: a free one), PYTHON (default: .venv's).
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/local.sh NPROC [--config FILE] [section.key=value ...]" >&2
  exit 2
fi
nproc=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
devices=${CPU_DEVICES:-8}
if (( devices % nproc )); then
  echo "launch/local.sh: CPU_DEVICES=$devices does not split over $nproc processes" >&2
  exit 2
fi
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}

# Our device count replaces any in XLA_FLAGS; other XLA flags pass through.
xla_flags=$(sed 's/--xla_force_host_platform_device_count=[0-9]*//g' <<< "${XLA_FLAGS:-}")

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for ((i = 0; i < nproc; i++)); do
  # Process substitution keeps $! the Python process itself, so cleanup reaches it.
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu \
  XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$((devices / nproc))" \
    "$python" -m delta_jax.train "$@" distributed.enabled=true \
      distributed.coordinator_address="localhost:$port" distributed.num_processes="$nproc" \
      distributed.process_id="$i" > >(sed -u "s/^/[p$i] /") 2>&1 &
  pids+=($!)
done

# Poll rather than wait on one process: a failure anywhere stops the rest at once instead of
# leaving them blocked in a collective.
status=0
running=("${pids[@]}")
while (( ${#running[@]} )); do
  alive=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      alive+=("$pid")
    elif ! wait "$pid"; then
      status=1
    fi
  done
  if (( status )); then
    cleanup
    break
  fi
  running=("${alive[@]}")
  sleep 0.5
done
wait  # let the output filters drain
exit $status
