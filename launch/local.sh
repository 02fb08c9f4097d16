#!/usr/bin/env bash
# launch/local.sh NPROC [--config FILE] [section.key=value ...]
# launch/local.sh NPROC --module delta_jax.eval|generate|analyze|convert [ARGS ...]
#
# Runs NPROC processes of `python -m delta_jax.train` (or of --module) on this machine, joined by
# jax.distributed through a coordinator on localhost (CPU collectives over gloo): the trainer
# gets distributed.* overrides, another module `--distributed localhost:PORT,NPROC,I`. The CPU
# devices are split among them: CPU_DEVICES (default 8) fake devices in all, CPU_DEVICES/NPROC
# per process, so a mesh spans processes exactly as it would span hosts. Each output line is
# prefixed with its process, [p0] [p1] ...
#
# Exit status, as a cluster scheduler would see it:
# - every process exited 0: 0;
# - a process was preempted (exit 75: it got SIGTERM/SIGINT, and all processes agree to save the
#   same step): the others get STOP_GRACE seconds to do the same; 75 if they all did;
# - a process failed or was killed: the others get SIGTERM, then SIGKILL after KILL_AFTER
#   seconds (a process blocked in a collective with a dead peer never reads its SIGTERM); the
#   failed process's status.
# SIGTERM or SIGINT to this script is passed to every process (which then checkpoints).
#
# Environment: CPU_DEVICES (default 8), PORT (default: a free one), PYTHON (default: .venv's),
# STOP_GRACE (default 120), KILL_AFTER (default 10).
set -euo pipefail

usage="usage: launch/local.sh NPROC [--module MODULE] [ARGS ...]"
if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "$usage" >&2
  exit 2
fi
nproc=$1
shift
module=delta_jax.train
if [[ ${1:-} == --module ]]; then
  if [[ $# -lt 2 ]]; then
    echo "$usage" >&2
    exit 2
  fi
  module=$2
  shift 2
fi
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
stop_all() {  # SIGTERM, then SIGKILL what is left after KILL_AFTER seconds
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for ((t = 0; t < ${KILL_AFTER:-10} * 10; t++)); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}
forward() { kill -"$1" "${pids[@]}" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'kill -KILL "${pids[@]}" 2>/dev/null || true' EXIT
join() {  # the arguments that make process $1 join the others
  if [[ $module == delta_jax.train ]]; then
    echo distributed.enabled=true distributed.coordinator_address="localhost:$port" \
      distributed.num_processes="$nproc" distributed.process_id="$1"
  else
    echo --distributed "localhost:$port,$nproc,$1"
  fi
}
for ((i = 0; i < nproc; i++)); do
  # Process substitution keeps $! the Python process itself, so signals reach it.
  # shellcheck disable=SC2046  # join's words are meant to split
  PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu \
  XLA_FLAGS="$xla_flags --xla_force_host_platform_device_count=$((devices / nproc))" \
    "$python" -m "$module" "$@" $(join "$i") > >(sed -u "s/^/[p$i] /") 2>&1 &
  pids+=($!)
done

# Poll rather than wait on one process: a failure anywhere stops the rest at once instead of
# leaving them blocked in a collective.
failed=0 preempted=0 deadline=0
running=("${pids[@]}")
while (( ${#running[@]} )); do
  alive=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      alive+=("$pid")
      continue
    fi
    rc=0
    wait "$pid" || rc=$?
    if (( rc == 75 )); then
      preempted=1
    elif (( rc != 0 && failed == 0 )); then
      failed=$rc
    fi
  done
  running=("${alive[@]}")
  if (( failed )); then
    echo "launch/local.sh: a process exited with status $failed; stopping the others" >&2
    stop_all
    break
  fi
  if (( preempted && ${#running[@]} )); then
    (( deadline )) || deadline=$((SECONDS + ${STOP_GRACE:-120}))
    if (( SECONDS > deadline )); then
      echo "launch/local.sh: a process was preempted and the others did not stop within" \
           "${STOP_GRACE:-120} s; stopping them" >&2
      failed=1
      stop_all
      break
    fi
  fi
  sleep 0.5
done
wait  # let the output filters drain
(( failed )) && exit "$failed"
(( preempted )) && exit 75
exit 0
