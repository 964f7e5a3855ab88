#!/usr/bin/env bash
# GPU evidence for `repro audit` and `pytest --repro-audit` on an installed vLLM 0.34.0 (run from the checkout, in the
# environment that runs vLLM, after `pip install -e .`, which registers both plugins):
#     bash scripts/audit_examples/run-all.sh SITE OUT
# SITE: the folder holding the installed vllm/ (its site-packages); OUT: a new folder for every report.
# Expected: the clean release 0 for every method and layout; each mutant 1 on its own capture path (its methods'
# stale-descriptor fields named per descriptor) and 0 elsewhere; the pytest file's per-method tests fail on a mutant
# only for its methods. Every command's exit code is printed beside its name and kept in OUT/exit-codes.txt.
set -u
SITE=${1:?the folder holding the installed vllm/}
OUT=${2:?a new folder for the reports}
mkdir "$OUT" || exit 2
HERE=$(cd "$(dirname "$0")" && pwd)
S="$HERE/user_script.py"
run() {  # NAME, then the command (PYTHONPATH may be set in front of it by the caller)
    local name=$1; shift
    "$@"; echo "$name $?" | tee -a "$OUT/exit-codes.txt"
}
for m in eagle eagle3 draft_model mtp dflash; do
    run "clean-$m" python -m repro audit --out "$OUT/clean-$m" --expect-method "$m" -- python "$S" --method "$m"
done
run clean-k1 python -m repro audit --out "$OUT/clean-k1" -- python "$S" --k 1
run clean-k5-mha128 python -m repro audit --out "$OUT/clean-k5-mha128" -- python "$S" --k 5 --head-dim 128 --heads 8 --kv-heads 8
run clean-sizes python -m repro audit --out "$OUT/clean-sizes" -- python "$S" --capture-sizes 1,2,4,8,16,24 --max-num-seqs 16
run clean-spawn python -m repro audit --out "$OUT/clean-spawn" -- python "$S" --spawn
run clean-twice python -m repro audit --out "$OUT/clean-twice" -- python "$S" --twice --second-method draft_model
run clean-inproc python -m repro audit --out "$OUT/clean-inproc" -- python "$S" --mp off
run clean-serve python -m repro audit --out "$OUT/clean-serve" --expect-method eagle -- python "$HERE/serve_driver.py"
run clean-pytest python -m repro audit --out "$OUT/clean-pytest" -- python -m pytest -v --repro-audit --repro-audit-dir "$OUT/clean-pytest-tests" "$HERE/test_spec_methods.py"
run overhead python "$HERE/overhead.py" --runs 3 --out "$OUT/overhead" -- python "$S" --method eagle
declare -A HIT=([target-dependent-wrong-descriptor]=eagle [standalone-wrong-descriptor]=draft_model
                [dflash-wrong-descriptor]=dflash)  # a method on each mutant's capture path (scripts/mutate_vllm.py)
for mutant in "${!HIT[@]}"; do
    M="$OUT/prefix-$mutant"
    python scripts/mutate_vllm.py "$SITE" "$M" --mutant "$mutant" || continue
    for m in eagle draft_model mtp dflash; do
        run "$mutant-$m" env PYTHONPATH="$M" python -m repro audit --out "$OUT/$mutant-$m" --expect-method "$m" -- python "$S" --method "$m"
    done
    run "$mutant-pytest" env PYTHONPATH="$M" python -m repro audit --out "$OUT/$mutant-pytest" -- python -m pytest -v --repro-audit --repro-audit-dir "$OUT/$mutant-pytest-tests" "$HERE/test_spec_methods.py"
    run "$mutant-strict" env PYTHONPATH="$M" python -m repro audit --strict --out "$OUT/$mutant-strict" -- python "$S" --method "${HIT[$mutant]}"
done
