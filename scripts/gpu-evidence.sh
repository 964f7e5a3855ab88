#!/usr/bin/env bash
# The GPU evidence runs recorded under results/, one step per call on the device machine (run from the repository
# root, with the FA3 bundles in .gpu/ when present). Each step writes its reports under $OUT/<step>.
#   bash scripts/gpu-evidence.sh executors|default|served|memcheck|spec|mps-probe|ci-line|launch-sweep [extra flags]
# The device brings back at most 8 files from $OUT per call: executors writes 7, default/served/memcheck/spec 3 each, the
# probe 1. Plan a call's steps within that (a step whose files are cut is lost with the machine).
set -u
step=${1:?usage: gpu-evidence.sh executors|default|served|memcheck|spec|mps-probe [matrix flags]}
shift
OUT=${OUT:-out}
export PYTHONUNBUFFERED=1
if [ -d .gpu ] && [ -z "${FA3_UPSTREAM_PATH:-}" ]; then eval "$(bash .gpu/unpack.sh .gpu)"; fi
py=$(command -v python3 || command -v python)
work=$(mktemp -d /tmp/evidence.XXXX)

keep() {  # copy a run's reports (not its logs) to $OUT/<step>
  mkdir -p "$OUT/$step"
  for f in verdicts.md results.json heatmap.png executors.md; do [ -e "$work/$f" ] && cp "$work/$f" "$OUT/$step/"; done
  for d in old new served; do
    [ -d "$work/$d" ] || continue
    mkdir -p "$OUT/$step/$d"
    cp "$work/$d"/verdicts.md "$work/$d"/results.json "$OUT/$step/$d/" 2>/dev/null
  done
}

case $step in
  executors)  # #12: the old, new and served execution paths side by side on the default matrix
    timeout 580 "$py" -m repro matrix --quiet --compare-executors --jobs 8 --out "$work" \
      --title 'Default matrix, old and new execution paths, H200' "$@"; rc=$?; keep ;;
  default)  # the default matrix with the default execution path
    timeout 580 "$py" -m repro matrix --quiet --gate --jobs 8 --out "$work" --title 'Default matrix, H200' "$@"
    rc=$?; keep ;;
  served)  # #12: the default matrix, its cases forked by a repro server started before it (`repro serve`)
    "$py" -m repro serve --idle 600 || exit 1
    timeout 580 "$py" -m repro matrix --quiet --gate --jobs 8 --out "$work" \
      --title 'Default matrix, cases forked by a running repro server, H200' "$@"; rc=$?
    "$py" -m repro serve --stop; keep ;;
  memcheck)  # the default matrix under compute-sanitizer memcheck
    timeout 580 "$py" -m repro matrix --quiet --gate --sanitizer --jobs 12 --out "$work" \
      --title 'Default matrix under compute-sanitizer memcheck, H200' "$@"; rc=$?; keep ;;
  spec)  # spec-decode models, draft warmup and graph replay
    timeout 580 "$py" -m repro matrix --quiet --scenario spec-decode --modes eager,graph --splits 32 \
      --sms sm_margin:16,full --jobs 8 --timeout 240 --out "$work" --title 'Spec-decode models, H200' "$@"
    rc=$?; keep ;;
  ci-line)  # the README's CI-gate pytest line, every GPU case, with its JUnit XML and the gate's own report
    mkdir -p "$OUT/$step"
    t0=$(date +%s)
    REPRO_LOG_DIR="$work/logs" timeout 580 "$py" -m pytest -m gpu -k stale_metadata -n "${WORKERS:-8}" --gate \
      -q -p no:cacheprovider --gate-report="$OUT/$step" --junitxml="$OUT/$step/junit.xml" "$@" >"$OUT/$step/pytest.txt" 2>&1
    rc=$?
    echo "wall: $(($(date +%s) - t0)) s, exit $rc" >>"$OUT/$step/pytest.txt"
    "$py" -m repro redact "$OUT/$step"/* >/dev/null; tail -n 25 "$OUT/$step/pytest.txt" ;;
  launch-sweep)  # stale vs fresh across speculative tokens x page size x SM count: where do launches fail?
    for k in ${SWEEP_K:-1 2 5 7}; do for page in ${SWEEP_PAGE:-16 64}; do
      timeout 200 "$py" -m repro matrix --quiet --jobs 8 --modes eager --splits 0,32 \
        --sms sm_margin:16,sm_margin:26,sm_margin:60,full --spec-tokens "$k" --page-size "$page" \
        --out "$work/k$k-page$page" --title "Launch-failure sweep k=$k page=$page, H200" "$@" >/dev/null 2>&1
      echo "k=$k page=$page: exit $?"
    done; done
    mkdir -p "$OUT/$step"
    "$py" scripts/sweep-summary.py "$work" >"$OUT/$step/summary.md"; rc=$?
    "$py" -m repro redact "$work"/*/logs/*.log >/dev/null
    (cd "$work" && tar czf "$OUT/$step/runs.tar.gz" --exclude='*.vllm-cache' .)
    cat "$OUT/$step/summary.md" ;;
  mps-probe)  # can an MPS client and a plain CUDA process use the GPU at the same time?
    timeout 120 "$py" -m repro.run.smcontrol --probe-coexistence | tee "$OUT/mps-probe.txt"; rc=${PIPESTATUS[0]} ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
rm -rf "$work"
exit $rc
