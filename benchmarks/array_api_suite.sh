#!/usr/bin/env bash
# The official array API test suite (data-apis/array-api-tests) against disttensor's namespace,
# at 1 rank and under mpiexec, next to array_api_strict as the reference.
#
#   benchmarks/array_api_suite.sh /path/to/array-api-tests [SIZES] [-- PYTEST ARGS...]
#
# /path/to/array-api-tests is a checkout of the suite with its `array-api` submodule
# (git clone --recursive https://github.com/data-apis/array-api-tests); SIZES are the world
# sizes to run (default "1 2"). The suite needs pytest, hypothesis and ndindex in the Python
# that runs it ($VENV/bin/python if VENV is set, else the repository's .venv, else python3);
# this script installs nothing. Not part of the test suite's time budget: a full run takes
# tens of minutes per world size on two cores.
#
# Every run uses version 2023.12 with every extension the namespace has (linalg, fft), the
# same Hypothesis seed on every rank (so that all ranks draw the same examples and make the
# same collective calls) and a Hypothesis database of each rank's own. Under mpiexec the
# disttensor pytest plugin makes the ranks agree on each test's outcome and reports rank 0's.
# Results go to $OUT (default benchmarks/results/array_api_suite): junit XML per run and
# summary.txt. The exit status is 0 only if every test that array_api_strict passes passes
# at every world size.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || ! -d "$1/array_api_tests" ]]; then
    echo "usage: $0 /path/to/array-api-tests [SIZES] [-- PYTEST ARGS...]" >&2
    echo "(the path must hold the suite's array_api_tests/ folder)" >&2
    exit 2
fi
SUITE="$(cd "$1" && pwd)"
shift
SIZES="1 2"
if [[ $# -gt 0 && "$1" != "--" ]]; then
    SIZES="$1"
    shift
fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
EXTRA=("$@")

if [[ -n "${VENV:-}" ]]; then
    PY="$VENV/bin/python"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3)"
fi
MPIEXEC="$(dirname "$PY")/mpiexec"
[[ -x "$MPIEXEC" ]] || MPIEXEC="$(command -v mpiexec || true)"
OUT="${OUT:-$ROOT/benchmarks/results/array_api_suite}"
mkdir -p "$OUT"
"$PY" -c "import pytest, hypothesis, ndindex" || {
    echo "the suite needs pytest, hypothesis and ndindex in $PY" >&2
    exit 2
}

export ARRAY_API_TESTS_VERSION=2023.12
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(-q -rfE -p no:cacheprovider -p no:randomly --hypothesis-seed=0
        --max-examples="${MAX_EXAMPLES:-20}" array_api_tests/)

# one rank's pytest, with a Hypothesis database of its own (MPICH, Open MPI or one process)
RANK_RUN='rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
export HYPOTHESIS_STORAGE_DIRECTORY="$HYPOTHESIS_BASE/rank$rank"
exec "$@"'

run() {  # run NAME MODULE NPROCS
    local name=$1 module=$2 n=$3 base
    base="$(mktemp -d)"
    local cmd=(env ARRAY_API_TESTS_MODULE="$module" HYPOTHESIS_BASE="$base"
               bash -c "$RANK_RUN" rank "$PY" -m pytest --junitxml="$OUT/$name.xml")
    echo "== $name: $module at $n rank(s)"
    set +e
    (cd "$SUITE" && if [[ $n -eq 1 ]]; then
        "${cmd[@]}" "${COMMON[@]}" "${EXTRA[@]}"
    else
        "$MPIEXEC" -n "$n" "${cmd[@]}" -p disttensor.testing.pytest_plugin \
            "${COMMON[@]}" "${EXTRA[@]}"
    fi) > "$OUT/$name.log" 2>&1
    echo "   exit $? ($(tail -n 1 "$OUT/$name.log"))"
    set -e
    rm -rf "$base"
}

run strict array_api_strict 1
for n in $SIZES; do
    run "disttensor_$n" disttensor.ops.namespace "$n"
done

# the tests that fail here but pass with array_api_strict
"$PY" - "$OUT" $SIZES <<'EOF'
import sys
import xml.etree.ElementTree as ET

out, sizes = sys.argv[1], sys.argv[2:]


def outcomes(name):
    tree = ET.parse(f"{out}/{name}.xml")
    result = {}
    for case in tree.iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        result[test] = "failed" if bad else "skipped" if skipped else "passed"
    return result


strict = outcomes("strict")
lines, worse = [], 0
for n in sizes:
    ours = outcomes(f"disttensor_{n}")
    count = {k: sum(v == k for v in ours.values()) for k in ("passed", "failed", "skipped")}
    regressions = sorted(t for t, v in ours.items() if v == "failed" and strict.get(t) == "passed")
    worse += len(regressions)
    lines.append(f"{n} rank(s): {count['passed']} passed, {count['failed']} failed, "
                 f"{count['skipped']} skipped; failing where array_api_strict passes: "
                 f"{len(regressions)}")
    lines += [f"    {t}" for t in regressions]
strict_failed = sorted(t for t, v in strict.items() if v == "failed")
lines.append(f"array_api_strict fails {len(strict_failed)} test(s):")
lines += [f"    {t}" for t in strict_failed]
text = "\n".join(lines)
print(text)
with open(f"{out}/summary.txt", "w") as f:
    f.write(text + "\n")
sys.exit(1 if worse else 0)
EOF
