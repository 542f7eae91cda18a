#!/usr/bin/env bash
# Run the fault suite N times in a row on a loaded machine: a failure that shows only under CPU
# load is a race (in the code or in the test), and this is how to find one and to show it gone.
#
#   tests/stress_faults.sh [N] [pytest arguments ...]
#
# N (default 20) consecutive runs of the given tests (default: the fault suite, test_faults_s3.py,
# test_faults_crash.py and test_faults_disk.py) while BUSY (default 2) processes spin on the CPU.
# Stops at the first failing run unless KEEP_GOING=1. Every failing run's output is kept in
# $LOGS (default: a new directory under /tmp); the last line says "N/N runs passed" or what failed.
# PYTHON (default .venv/bin/python, else python3) runs pytest. The busy loops are killed on exit.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=20
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    runs=$1
    shift
fi
if [[ $# -eq 0 ]]; then
    set -- tests/test_faults_s3.py tests/test_faults_crash.py tests/test_faults_disk.py
fi
python=${PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
busy=${BUSY:-2}
logs=${LOGS:-$(mktemp -d /tmp/ckptkeeper-stress.XXXXXX)}
mkdir -p "$logs"

spinners=()
stop_spinners() {
    for pid in "${spinners[@]}"; do
        kill "$pid" 2>/dev/null
    done
    wait "${spinners[@]}" 2>/dev/null
}
trap stop_spinners EXIT
trap 'exit 130' INT TERM
for ((i = 0; i < busy; i++)); do
    (while :; do :; done) &
    spinners+=($!)
done

passed=0
failed=0
for ((n = 1; n <= runs; n++)); do
    log="$logs/run-$n.log"
    started=$SECONDS
    if "$python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1; then
        passed=$((passed + 1))
        echo "run $n/$runs: passed ($((SECONDS - started)) s, load $(cut -d' ' -f1 /proc/loadavg)): $(tail -n 1 "$log")"
        rm -f "$log"
    else
        failed=$((failed + 1))
        echo "run $n/$runs: FAILED ($((SECONDS - started)) s), output in $log"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
        if [[ ${KEEP_GOING:-0} != 1 ]]; then
            break
        fi
    fi
done
echo "$passed/$((passed + failed)) runs passed under $busy busy loops: $*"
[[ $failed -eq 0 ]]
