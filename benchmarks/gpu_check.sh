#!/usr/bin/env bash
# GPU check of disttensor / disttensor_nn on a machine with an NVIDIA GPU, in under 8 minutes.
#
#   VENV=/path/to/venv OUT=/tmp/gpu_out benchmarks/gpu_check.sh
#
# Uses $VENV/bin/python if VENV is set, else `python3` on PATH; installs
# nothing from the internet (only `pip install cupy-cuda12x` from the
# configured index when CuPy is missing, unless GPU_CHECK_NO_INSTALL is set). Stages, each
# bounded by a timeout and by the overall deadline (GPU_CHECK_SECONDS, default 450 s):
#
#   1. nvidia-smi                          -> $OUT/nvidia-smi.txt
#   2. CuPy (and cuDNN frontend, torch) import check
#   3. tests/test_gpu_core.py and tests/test_gpu_nn.py at 1 rank and at 2 ranks
#      (mpiexec -n 2; both ranks share the GPU)  -> $OUT/<stage>.log, .xml
#   4. the planner on the GPU: its GPU test, `disttensor-plan --calibrate --device gpu` on
#      2 ranks, then a plan from that profile   -> $OUT/plan_gpu.json
#   5. benchmarks/gpu_train_check.py: mesh-demo trained 20 steps on the GPU at 1 rank and
#      at 2 ranks sharing it, against the same run on the CPU (losses within float32
#      tolerance; ms per step of each)  -> $OUT/gpu_train_1ranks.json, gpu_train_2ranks.json
#   6. benchmarks/bench_gpu.py (conv fwd+bwd: CuPy cuDNN / im2col vs torch)
#                                          -> $OUT/bench_gpu.json
#
# Every stage appends its outcome (exit status, seconds, last output line) to
# $OUT/gpu_check.json as soon as it ends, so a failing or hanging stage never
# loses the results of the others. The exit status is 0 only if every stage passed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/benchmarks/results/gpu_check}"
mkdir -p "$OUT"
export OUT
if [[ -n "${VENV:-}" ]]; then PY="$VENV/bin/python"; else PY="$(command -v python3)"; fi
MPIEXEC="$(dirname "$PY")/mpiexec"
[[ -x "$MPIEXEC" ]] || MPIEXEC="$(command -v mpiexec || echo mpiexec)"
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-450}))
SUMMARY="$OUT/gpu_check.json"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
FAILED=0

"$PY" - "$SUMMARY" <<'EOF'
import json, platform, sys, time
json.dump({"host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "stages": []}, open(sys.argv[1], "w"), indent=2)
EOF

record() {  # record NAME RC SECONDS LOG
    "$PY" - "$SUMMARY" "$@" <<'EOF'
import json, sys
path, name, rc, secs, log = sys.argv[1:6]
last = ""
try:
    lines = [l.strip() for l in open(log, errors="replace") if l.strip()]
    last = lines[-1] if lines else ""
except OSError:
    pass
data = json.load(open(path))
data["stages"].append({"stage": name, "rc": int(rc), "seconds": int(secs), "log": log,
                       "last_line": last[-300:]})
json.dump(data, open(path, "w"), indent=2)
EOF
}

stage() {  # stage NAME LIMIT_SECONDS COMMAND...
    local name="$1" limit="$2"
    shift 2
    local left=$((DEADLINE - SECONDS))
    local log="$OUT/$name.log"
    if ((left < 20)); then
        echo "skipped: out of time" >"$log"
        record "$name" 124 0 "$log"
        FAILED=1
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc=0
    MPIEXEC_TIMEOUT="$limit" timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    tail -n 15 "$log"
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    record "$name" "$rc" "$((SECONDS - t0))" "$log"
    # pytest: 5 means no test of this size was collected
    if ((rc != 0 && rc != 5)); then FAILED=1; fi
    return 0
}

stage nvidia-smi 30 nvidia-smi
cp "$OUT/nvidia-smi.log" "$OUT/nvidia-smi.txt" 2>/dev/null || true

IMPORTS='
import importlib
for name in ("cupy", "cudnn", "torch"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "NOT IMPORTABLE:", exc)
import cupy
print("GPUs:", cupy.cuda.runtime.getDeviceCount())
'
if [[ -z "${GPU_CHECK_NO_INSTALL:-}" ]] && ! "$PY" -c "import cupy" >/dev/null 2>&1; then
    echo "CuPy is not importable with $PY; trying pip install cupy-cuda12x from the configured index"
    stage install-cupy 120 "$PY" -m pip install --disable-pip-version-check cupy-cuda12x
fi
stage imports 60 "$PY" -c "$IMPORTS"
if ! "$PY" -c "import cupy" >/dev/null 2>&1; then
    echo "CuPy is missing: the GPU tests and the benchmark cannot run (see $OUT/imports.log)" >&2
    exit 2
fi

TESTS=()
for t in tests/test_gpu_core.py tests/test_gpu_nn.py; do
    if [[ -f "$t" ]]; then TESTS+=("$t"); else echo "note: $t not found, not run"; fi
done
for t in "${TESTS[@]}"; do
    base="$(basename "$t" .py)"
    stage "${base}_1rank" 90 "$PY" -m pytest -q -p no:cacheprovider -m "parallel[1]" \
        --junitxml="$OUT/${base}_1rank.xml" "$t"
    stage "${base}_2ranks" 90 "$MPIEXEC" -n 2 "$PY" -m pytest -q -p no:cacheprovider \
        -m "parallel[2]" "$t"
done

# the planner on the GPU: twins timed on the device, the machine calibrated with device buffers,
# then a plan for a 2-rank job from that calibration
PLAN=(-c "from disttensor_nn.training.cli import plan_main; raise SystemExit(plan_main())")
stage plan_gpu_twins 60 "$PY" -m pytest -q -p no:cacheprovider -m "parallel[1]" \
    tests/test_plan.py -k gpu
stage calibrate_gpu 60 "$MPIEXEC" -n 2 "$PY" "${PLAN[@]}" --calibrate --device gpu
stage plan_gpu 60 "$MPIEXEC" -n 2 "$PY" "${PLAN[@]}" mesh-small --batch 4 --size 256x256 \
    --machine this-gpu --json "$OUT/plan_gpu.json"

stage train_gpu_1rank 90 "$PY" benchmarks/gpu_train_check.py --steps 20 \
    --out "$OUT/gpu_train_1ranks.json"
stage train_gpu_2ranks 120 "$MPIEXEC" -n 2 "$PY" benchmarks/gpu_train_check.py --steps 20 \
    --out "$OUT/gpu_train_2ranks.json"

stage bench_gpu 180 "$PY" benchmarks/bench_gpu.py --reps 10 --batch 32 --out "$OUT/bench_gpu.json"

echo "summary: $SUMMARY"
cat "$SUMMARY"
exit "$FAILED"
