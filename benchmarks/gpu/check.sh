#!/usr/bin/env bash
# Every GPU check of the CUDA backend in one run of at most 8 minutes, on a
# machine with one NVIDIA GPU, PyTorch, Triton and transformers but no package
# registry. Results (results.jsonl) and the log (check.log) go to OUTDIR.
#
#   benchmarks/gpu/check.sh OUTDIR [SECTION...]
#
# Brought along, in the repository root: .whl/ (the tokenloom wheel, built with
# TOKENLOOM_BUILD_VARIANTS=none, and the dependencies the machine lacks: see
# benchmarks/gpu/README.md) and .gpu/tokenizer/ (the default model's tokenizer
# files). SECTIONs: env correctness features kernels decode workload hf
# (default: all); features runs tests/engine/test_features_by_device.py on the GPU.
set -u
OUT=${1:?usage: benchmarks/gpu/check.sh OUTDIR [SECTION...]}
shift
SECTIONS=${*:-env correctness features kernels decode workload hf}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
LOG=$OUT/check.log
DEADLINE=$((SECONDS + ${CHECK_SECONDS:-470}))

SITE=/tmp/tokenloom-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl >>"$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1

# NAME LIMIT_S COMMAND...: run one part with what is left of the deadline.
run_part() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "== $name skipped: out of time" | tee -a "$LOG"
        return
    fi
    echo "== $name (limit ${limit}s) $*" | tee -a "$LOG"
    local part=/tmp/check-$name.log
    timeout "$limit" "$@" >"$part" 2>&1
    local status=$?
    cat "$part" >>"$LOG"
    grep '^RESULT' "$part" | cut -c1-600
    # A failure shows its traceback here; the whole log is in check.log.
    ((status != 0)) && grep -v '^RESULT' "$part" | tail -25
    echo "== $name exit $status" | tee -a "$LOG"
}
# SECTION LIMIT_S [ARGS...]: one section of check.py.
run() {
    local name=$1 limit=$2
    shift 2
    run_part "$name" "$limit" python3 benchmarks/gpu/check.py "$name" --out "$OUT" "$@"
}
for section in $SECTIONS; do
    case $section in
        env) run env 60 ;;
        correctness) run correctness 120 ;;
        # The CUDA cases of the device-parametrised feature tests (pytest's summary
        # line is the RESULT).
        features)
            TOKENLOOM_TEST_TOKENIZER=.gpu/tokenizer run_part features 100 \
                sh -c 'python3 -m pytest -q -p no:cacheprovider -k cuda \
                    tests/engine/test_features_by_device.py >/tmp/features.out 2>&1; s=$?
                    cat /tmp/features.out; echo "RESULT features exit $s: $(grep -E "passed|failed|error" /tmp/features.out | tail -1)"
                    exit $s'
            ;;
        kernels) run kernels 120 ;;
        decode) run decode 180 ;;
        workload)
            run workload 120 --shapes llama-3.2-1b
            run workload 180 --shapes llama-3.1-8b
            ;;
        # The 8B shape's batch of 128 alone outlasts what the budget leaves.
        hf)
            run hf 100 --shapes llama-3.2-1b --hf-batches 32,128
            run hf 80 --shapes llama-3.1-8b --hf-batches 32
            ;;
        *) echo "unknown section $section" ;;
    esac
done
