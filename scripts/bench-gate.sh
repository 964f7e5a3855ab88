#!/usr/bin/env bash
# The default gate's speed benchmark on one GPU machine: the bare `python -m repro gate` run cold (an empty cache
# folder of its own) and then warm (the same folder), recorded under results/NAME-cold and results/NAME-warm (each
# with the run's terminal output as terminal.log), then compared with earlier records by
# `records --speed ... --timeline`: wall, forkserver wait, median phases, every process's timeline, and what the
# scheduler would make of each record's processes.
#   bash scripts/bench-gate.sh NAME [PREVIOUS ...] [-- gate flags]
# e.g. bash scripts/bench-gate.sh h100-gate-default-2 h100-gate-default-cold
#      bash scripts/bench-gate.sh h100-gate-sm-2 -- --modes audit,plain,sm_margin:16,mps:16
# BENCH_KEEP=S adds a third run, NAME-kept: the warm run is given --keep-forkserver S (its forkserver, started as
# the warm run's is, then outlives it) and the kept run, the same command again, forks its cases from that forkserver
# with no import of its own (a runner that keeps its processes between jobs); the forkserver ends S seconds idle.
# The gate's own exit code (0 PASS, 1 AFFECTED, ...) is printed, not this script's: a benchmark measures time. A run
# that leaves no record (refused, or no GPU here) stops it there, with that run's exit code.
# It refuses a NAME whose records exist (it never writes over one) and removes only the cache folder it made.
set -u
name=${1:?usage: bench-gate.sh NAME [PREVIOUS ...] [-- gate flags]}
shift
case $name in  # a record's name: results/NAME-cold and the rest, never a path out of results/ nor an option
  [!A-Za-z0-9]* | *[!A-Za-z0-9._-]* | *..*)
    echo "bench-gate: NAME $name: letters, digits, '.', '_' and '-', beginning with a letter or digit" >&2; exit 2;;
esac
previous=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do previous+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
py=$(command -v python3 || command -v python)
runs="cold warm"
keep=${BENCH_KEEP:-}
if [ -n "$keep" ]; then
  case $keep in *[!0-9]* | 0*) keep_bad=1;; *) [ ${#keep} -le 6 ] && [ "$keep" -le 604800 ] || keep_bad=1;; esac
  if [ -n "${keep_bad:-}" ]; then  # the gate's own bound (a week), checked before the cold run spends minutes
    echo "bench-gate: BENCH_KEEP=$keep: a whole number of seconds, 1 to 604800 (a week)" >&2
    exit 2
  fi
  runs="cold warm kept"
fi
for run in $runs; do
  if [ -e "results/$name-$run" ] || [ -e "results/$name-$run.tar.xz" ]; then
    echo "bench-gate: results/$name-$run exists: choose another NAME" >&2
    exit 2
  fi
done
cache=$(mktemp -d "${TMPDIR:-/tmp}/bench-gate-cache.XXXX")
said=$(mktemp -d "${TMPDIR:-/tmp}/bench-gate-said.XXXX")  # the terminal output, moved in after (--out must be empty)
trap 'rm -rf "$cache" "$said"' EXIT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "bench-gate: $name on ${gpu:-an unknown GPU}, $(nproc) CPU cores; cache folder $cache (empty)"
for run in $runs; do
  out="results/$name-$run"
  kept=()
  [ "$run" != cold ] && [ -n "$keep" ] && kept=(--keep-forkserver "$keep")
  start=$(date +%s%N)
  "$py" -m repro gate --cache-dir "$cache" --out "$out" ${kept[@]+"${kept[@]}"} "$@" 2>&1 | tee "$said/$run.log"
  rc=${PIPESTATUS[0]}
  ms=$((($(date +%s%N) - start) / 1000000))
  [ -d "$out" ] && mv "$said/$run.log" "$out/terminal.log"
  echo "bench-gate: $run: exit $rc in $((ms / 1000)).$((ms % 1000 / 100)) s (the shell's clock)"
  if [ ! -e "$out/results.json" ]; then  # refused, or could not run here: nothing to measure warm either
    echo "bench-gate: the $run run left no record (exit $rc): stopping" >&2
    exit "$rc"
  fi
done
records=()
for run in $runs; do records+=("$name-$run"); done
"$py" -m repro records --speed ${previous[@]+"${previous[@]}"} "${records[@]}" --timeline
