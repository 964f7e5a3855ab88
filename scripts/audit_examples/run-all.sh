#!/usr/bin/env bash
# GPU evidence for `repro audit` and `pytest --repro-audit` on an installed vLLM 0.34.0 (run from the checkout, in the
# environment that runs vLLM, after `pip install -e .`, which registers both plugins):
#     JOBS=7 bash scripts/audit_examples/run-all.sh SITE OUT
# SITE: the folder holding the installed vllm/ (its site-packages); OUT: a new folder for every report.
# JOBS commands run at once (default 1), each example engine taking AUDIT_EXAMPLE_GPU_MEMORY of the GPU (default
# 0.5, or 0.09 when JOBS > 1); every `repro audit` stops its command after TIMEOUT seconds (default 400: CANNOT VOUCH).
# Expected: the clean release 0 for every method and layout; the method asked for and another one run: 4 (both
# named); each mutant 1 on its own capture path (its methods' stale-descriptor fields named per descriptor) and 0
# elsewhere; the pytest file's per-method tests fail on a mutant only for its methods. Every command's exit code is
# printed beside its name and kept in OUT/exit-codes.txt; the auditor's overhead runs last, alone on the GPU.
set -u
SITE=${1:?the folder holding the installed vllm/}
OUT=${2:?a new folder for the reports}
mkdir "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
JOBS=${JOBS:-1}
[ "$JOBS" -gt 1 ] && export AUDIT_EXAMPLE_GPU_MEMORY=${AUDIT_EXAMPLE_GPU_MEMORY:-0.09}
export OUT HERE S="$HERE/user_script.py" A="python -m repro audit --timeout ${TIMEOUT:-400}"
run() {  # NAME, then the command
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/exit-codes.txt"
}
export -f run
declare -A HIT=([target-dependent-wrong-descriptor]=eagle3 [standalone-wrong-descriptor]=draft_model
                [dflash-wrong-descriptor]=dflash)  # a method on each mutant's capture path (scripts/mutate_vllm.py)
PT="python -m pytest -v -p no:cacheprovider --repro-audit"
{
    for m in eagle eagle3 draft_model mtp dflash; do
        echo "run clean-$m \$A --out \$OUT/clean-$m --expect-method $m -- python \$S --method $m"
    done
    echo "run clean-k1 \$A --out \$OUT/clean-k1 -- python \$S --k 1"
    echo "run clean-k5-mha128 \$A --out \$OUT/clean-k5-mha128 -- python \$S --k 5 --head-dim 128 --heads 8 --kv-heads 8"
    echo "run clean-k2-gqa4-hd128 \$A --out \$OUT/clean-k2-gqa4-hd128 -- python \$S --method eagle3 --k 2 --head-dim 128 --heads 8 --kv-heads 2"
    echo "run clean-sizes \$A --out \$OUT/clean-sizes -- python \$S --capture-sizes 1,2,4,8,16,24 --max-num-seqs 16"
    echo "run clean-spawn \$A --out \$OUT/clean-spawn -- python \$S --spawn"
    echo "run clean-twice \$A --out \$OUT/clean-twice -- python \$S --twice --second-method draft_model"
    echo "run clean-inproc \$A --out \$OUT/clean-inproc -- python \$S --mp off"
    echo "run clean-serve \$A --out \$OUT/clean-serve --expect-method eagle -- python \$HERE/serve_driver.py"
    echo "run clean-asked-eagle-ran-eagle3 \$A --out \$OUT/clean-asked-eagle-ran-eagle3 --expect-method eagle -- python \$S --method eagle3"
    echo "run clean-pytest \$A --out \$OUT/clean-pytest -- $PT --repro-audit-dir \$OUT/clean-pytest-tests \$HERE/test_spec_methods.py"
    for mutant in "${!HIT[@]}"; do
        M="$OUT/prefix-$mutant"
        python "$HERE/../mutate_vllm.py" "$SITE" "$M" --mutant "$mutant" > "$OUT/mutate-$mutant.log" 2>&1 || continue
        for m in eagle draft_model mtp dflash; do
            echo "PYTHONPATH=$M\${PYTHONPATH:+:\$PYTHONPATH} run $mutant-$m \$A --out \$OUT/$mutant-$m --expect-method $m -- python \$S --method $m"
        done
        echo "PYTHONPATH=$M\${PYTHONPATH:+:\$PYTHONPATH} run $mutant-pytest \$A --out \$OUT/$mutant-pytest -- $PT --repro-audit-dir \$OUT/$mutant-pytest-tests \$HERE/test_spec_methods.py"
        echo "PYTHONPATH=$M\${PYTHONPATH:+:\$PYTHONPATH} run $mutant-strict \$A --strict --out \$OUT/$mutant-strict -- python \$S --method ${HIT[$mutant]}"
    done
} > "$OUT/jobs.txt"
xargs -P "$JOBS" -d '\n' -I{} bash -c '{}' < "$OUT/jobs.txt"
AUDIT_EXAMPLE_GPU_MEMORY=0.5 run overhead python "$HERE/overhead.py" --runs 3 --out "$OUT/overhead" -- python "$S" --method eagle
