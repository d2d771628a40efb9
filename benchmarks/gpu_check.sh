#!/usr/bin/env bash
# The CUDA paths of lmlab in one prepared run (issue 14, "GPU"), for a lent GPU machine.
#
#   bash benchmarks/gpu_check.sh                     # on the GPU machine, from the repo root
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh # here: the same parts on the CPU, tiny sizes
#
# Parts, in this order, each under its own time limit (seconds; GPU_CHECK_<PART>_S overrides):
#   env         nvidia-smi, Python, torch, CUDA, cuDNN, the GPU's name and bf16/flash support  20
#   setup       installs .whl/*.whl (carried wheels) into /tmp/lmlab-site if there; checks every
#               import lmlab and its tests need                                               40
#   gpu_tests   tests/gpu on CUDA (bf16 autocast vs fp32, KV cache vs full pass, SDPA flash and
#               memory-efficient kernels vs math, 20 training steps with precision auto = bf16);
#               a skipped test counts as a failure on the GPU                                 90
#   train       benchmarks/train_speed.py on cuda (Mini-GPT, batch 16 and 128, fp32 and bf16,
#               eager) and the default `lmlab train --config configs/minigpt.yaml` on cuda    100
#   decode      benchmarks/smollm2_decode.py on cuda, SmolLM2-135M shapes, random weights,
#               lmlab vs transformers, fp32 and bf16                                          60
#   compile     train_speed.py: bf16 eager vs torch.compile at batch 128                      70
#   suite       the whole test suite with LMLAB_TEST_DEVICE=cuda (the tiny shared runs train on
#               the GPU; CLI runs pick cuda through device auto), 14 xdist workers; last, as
#               its time is the least known                                                  150
# 530 s at most (the device tool stops a command at 600 s; the script refuses limits summing
# past 570); GPU_CHECK_PARTS="gpu_tests train" runs only those parts.
#
# Output: one log per part and summary.txt under $OUT (the device tool's folder; default
# runs/gpu_check, or runs/gpu_check_dry): 8 files, what the device tool brings back at most.
# Every part runs even when an earlier one fails; the script then exits 1 and prints which
# parts failed. Exit 0 only when every part passed.
set -euo pipefail

cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY_RUN:-0}
PY=${PYTHON:-python3}
PARTS=${GPU_CHECK_PARTS:-env setup gpu_tests train decode compile suite}
# (part, default limit in seconds), in the order they run
LIMITS=(env 20 setup 40 gpu_tests 90 train 100 decode 60 compile 70 suite 150)
if [[ $DRY == 1 ]]; then
    OUT=${OUT:-runs/gpu_check_dry}
    DEV=cpu
else
    OUT=${OUT:-runs/gpu_check}
    DEV=cuda
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/lmlab-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# lmlab from this checkout, then wheels the setup part installs (carried in .whl/)
export PYTHONPATH="$PWD/src:/tmp/lmlab-site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
export LMLAB_TEST_DEVICE=$DEV DRY PY DEV WORK OUT
if [[ $DRY == 1 ]]; then
    export OMP_NUM_THREADS=1  # the shared CPU machine: one thread
fi

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=()

# part NAME DEFAULT_LIMIT_S CMD...: runs CMD under `timeout`, output to $OUT/NAME.log and the tail
# to stdout; records PASS/FAIL, the exit code and the seconds in summary.txt
part() {
    local name=$1 limit=$2
    shift 2
    if [[ " $PARTS " != *" $name "* ]]; then
        return 0
    fi
    local log="$OUT/$name.log" start rc=0
    start=$(date +%s)
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    # a fresh bash, so that `timeout` can run the part's function (exported below)
    timeout --kill-after=5 "$limit" bash -c 'set -euo pipefail; "$@"' "$name" "$@" \
        >"$log" 2>&1 || rc=$?
    local took=$(($(date +%s) - start))
    tail -n 30 "$log"
    if [[ $rc == 0 ]]; then
        echo "PASS  $name  ${took}s" | tee -a "$SUMMARY"
    else
        local why="exit $rc"
        [[ $rc == 124 || $rc == 137 ]] && why="TIMED OUT after ${limit}s"
        echo "FAIL  $name  ${took}s  ($why; log: $name.log)" | tee -a "$SUMMARY"
        FAILED+=("$name")
    fi
}

env_info() {
    echo "date: $(date -u)  host: $(hostname)  nproc: $(nproc)  load: $(cat /proc/loadavg)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($(git status --short 2>/dev/null | wc -l || true) changed files)"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    elif [[ $DRY == 1 ]]; then
        echo "nvidia-smi: not here (dry run)"
    else
        echo "error: nvidia-smi not found: this is not a GPU machine" >&2
        return 1
    fi
    "$PY" - "$DEV" <<'EOF'
import sys, platform, torch
dev = sys.argv[1]
print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
if dev == "cuda":
    if not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
          f"{p.multi_processor_count} SMs; bf16 supported: {torch.cuda.is_bf16_supported()}")
    print(f"SDPA flash enabled: {torch.backends.cuda.flash_sdp_enabled()}, mem-efficient: "
          f"{torch.backends.cuda.mem_efficient_sdp_enabled()}; TF32 matmul: "
          f"{torch.backends.cuda.matmul.allow_tf32}")
EOF
}

setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing carried wheels: $(ls .whl)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/lmlab-site .whl/*.whl
    fi
    "$PY" - <<'EOF'
import importlib
need = ["torch", "numpy", "yaml", "tokenizers", "safetensors", "matplotlib", "tensorboard",
        "tqdm", "gguf", "jinja2", "pytest", "xdist", "hypothesis", "transformers"]
missing = []
for name in need:
    try:
        mod = importlib.import_module(name)
        print(f"{name:<13}{getattr(mod, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        missing.append(f"{name} ({type(e).__name__}: {e})")
import lmlab, lmlab.cli  # noqa: E401,F401  (from src/, through PYTHONPATH)
print(f"lmlab from {lmlab.__file__}")
if missing:
    raise SystemExit("error: missing on this machine: " + "; ".join(missing)
                     + " (carry wheels in .whl/: see benchmarks/README.md, gpu_check.sh)")
EOF
}

gpu_tests() {
    "$PY" -m pytest -p no:cacheprovider -v -rs tests/gpu | tee "$WORK/gpu_tests.out"
    if [[ $DEV == cuda ]] && grep -qE "^SKIPPED|[0-9]+ skipped" "$WORK/gpu_tests.out"; then
        echo "error: a GPU test skipped on the GPU machine (see SKIPPED above)" >&2
        return 1
    fi
}

suite() {
    if [[ $DRY == 1 ]]; then  # the mechanics only: one module, one worker
        "$PY" -m pytest -p no:cacheprovider -q -x tests/unit/test_decode_fast.py
    else
        "$PY" -m pytest -p no:cacheprovider -q -n 14 --dist loadscope --maxfail=200 -rfE \
            --durations=15 tests
    fi
}

train() {
    local steps=20 default_run=()
    if [[ $DRY == 1 ]]; then
        "$PY" benchmarks/train_speed.py --device cpu --steps 1 --batch-size 2 --no-compile
        default_run=(--max-steps 3 --set train.eval_every=3 --set train.eval_batches=1)
    else
        "$PY" benchmarks/train_speed.py --device cuda --steps $steps --batch-size 16 --no-compile
        "$PY" benchmarks/train_speed.py --device cuda --steps $steps --batch-size 128 --no-compile
    fi
    # the default run (`make run`'s recipe) on the device: tokens/s, MFU and val loss in its log
    "$PY" -m lmlab train --config configs/minigpt.yaml --device "$DEV" --out "$WORK/minigpt" \
        --no-progress "${default_run[@]}"
}

compile() {  # torch.compile's first steps can take a minute
    if [[ $DRY == 1 ]]; then
        "$PY" benchmarks/train_speed.py --device cpu --steps 1 --batch-size 2 --only bf16-eager
    else
        "$PY" benchmarks/train_speed.py --device cuda --steps 20 --batch-size 128 \
            --only bf16-eager,bf16-compiled
    fi
}

decode() {
    local args=(--random-weights --device "$DEV" --threads 1)
    if [[ $DRY == 1 ]]; then
        args+=(--rounds 1 --prompt-tokens 8 --new-tokens 4)
    else
        args+=(--rounds 2)
    fi
    "$PY" benchmarks/smollm2_decode.py "${args[@]}" --dtype fp32
    "$PY" benchmarks/smollm2_decode.py "${args[@]}" --dtype bf16
}

# limit NAME: the part's limit, GPU_CHECK_<NAME>_S or its default
limit() {
    local i var
    for ((i = 0; i < ${#LIMITS[@]}; i += 2)); do
        if [[ ${LIMITS[i]} == "$1" ]]; then
            var="GPU_CHECK_${1^^}_S"
            # the dry run on a shared CPU gets three times as long (no device-tool limit there)
            echo "${!var:-$((LIMITS[i + 1] * (DRY == 1 ? 3 : 1)))}"
            return
        fi
    done
    echo "error: no part named $1" >&2
    return 1
}
TOTAL=0
for p in $PARTS; do
    lim=$(limit "$p") || exit 2
    TOTAL=$((TOTAL + lim))
done
if [[ $DRY != 1 ]] && ((TOTAL > 570)); then
    echo "error: the parts' limits sum to ${TOTAL}s: past 570 s, the device tool's 600 s command" \
        "limit would cut the run before its summary; lower some GPU_CHECK_<PART>_S" >&2
    exit 2
fi

export -f env_info setup gpu_tests suite train decode compile
echo "gpu_check: device $DEV, dry run $DRY, parts: $PARTS (at most ${TOTAL}s), logs: $OUT"
part env "$(limit env)" env_info
if [[ $DRY != 1 && " ${FAILED[*]} " == *" env "* ]]; then
    echo "GPU CHECK FAILED: no usable CUDA GPU here (env.log); nothing else was run" | tee -a "$SUMMARY" >&2
    exit 1
fi
part setup "$(limit setup)" setup
part gpu_tests "$(limit gpu_tests)" gpu_tests
part train "$(limit train)" train
part decode "$(limit decode)" decode
part compile "$(limit compile)" compile
part suite "$(limit suite)" suite

echo "=== summary ($(date -u +%H:%M:%S))"
cat "$SUMMARY"
if ((${#FAILED[@]})); then
    echo "GPU CHECK FAILED: ${FAILED[*]} (logs under $OUT)" | tee -a "$SUMMARY" >&2
    exit 1
fi
echo "gpu check passed: every part" | tee -a "$SUMMARY"
