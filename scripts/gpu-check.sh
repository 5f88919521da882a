#!/usr/bin/env bash
# The GPU check, unattended, on a machine with an NVIDIA GPU (docs/cuda.md):
#
#   1. the cuda binaries: built here (cargo), or unpacked from a bundle made beforehand on another machine by
#      scripts/gpu-bundle.sh (--prebuilt: no cargo, no network; TRL comes as wheels in the bundle);
#   2. runs the transformers / TRL parity tests on the GPU (HOLO_TEST_DEVICE=cuda:0; f32, the fixtures'
#      precision): local_parity, grpo_parity, sft_parity; and precision, the trainers in bf16;
#   3. samples the Qwen2.5-0.5B-shaped model at batch 64 in bf16 against transformers `generate` on the same
#      GPU (benches/sample_compare.py --device cuda): new tokens per second, peak GPU memory;
#   4. runs GRPO steps on the 0.5B-shaped model in bf16 against TRL's GRPOTrainer on the same GPU
#      (benches/grpo_compare.py --device cuda): seconds per step, peak GPU memory, rewards.
#
#     bash scripts/gpu-check.sh [OUT_DIR]                    # default: gpu-check-<date> in the current folder
#     bash scripts/gpu-check.sh --prebuilt DIR [OUT_DIR]     # DIR: made by scripts/gpu-bundle.sh
#
# Writes OUT_DIR/figures.md (the summary) and figures.json after every stage, each stage's log as it runs, and
# sample.json / grpo.json when a benchmark ends: a check killed part way leaves what it had. Exits 1 when a
# parity test fails or runs out of time (the benchmarks still run, so the figures are there), 2 when the
# machine lacks what it needs (said first), 3 when a benchmark fails or runs out of time.
#
# Time: stages 2-4 share CHECK_BUDGET_S (420 s) from the end of step 1; each has its own bound as well
# (PARITY_S 150, SAMPLE_S 150, GRPO_S 210), after which it is stopped (SIGTERM, SIGKILL 10 s later).
#
# What it needs: `nvidia-smi` and the driver; a Python with torch (CUDA build) and transformers ($PEER_PYTHON).
# With --prebuilt: ldd, and CUDA 13's libraries (cuBLAS, cuRAND, the runtime) where the loader finds them, or
# in PyTorch's nvidia-* wheels, or beside nvcc; TRL from the bundle; PEER_PYTHON defaults to python3; the
# tests' build path (the bundle's manifest.txt) must be absent or a link, as it is linked to this copy (root).
# Without: cargo; the CUDA toolkit, either `nvcc` on PATH (the system's) or PyPI to install it
# (scripts/cuda-build.sh, CUDA 13.0, which needs driver 580 or later); TRL in the peers' venv ($PEER_PYTHON,
# else ~/.cache/holo-peers/venv/bin/python, made by ../shared/peers/setup.sh when that script is there, from
# PyPI again); GNU time (/usr/bin/time). Settings: SAMPLE_NEW (128 new tokens per row), GRPO_STEPS (6),
# GRPO_BATCH (32), GRPO_GENERATIONS (8), GRPO_COMPLETION (64 tokens).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { echo "usage: bash scripts/gpu-check.sh [--prebuilt DIR] [OUT_DIR]" >&2; exit 2; }
PREBUILT=""
if [ "${1:-}" = --prebuilt ]; then
    [ $# -ge 2 ] || usage
    PREBUILT="$2"
    shift 2
fi
[ $# -le 1 ] || usage
OUT="${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SAMPLE_NEW="${SAMPLE_NEW:-128}"
GRPO_STEPS="${GRPO_STEPS:-6}"
GRPO_BATCH="${GRPO_BATCH:-32}"
GRPO_GENERATIONS="${GRPO_GENERATIONS:-8}"
GRPO_COMPLETION="${GRPO_COMPLETION:-64}"
CHECK_BUDGET_S="${CHECK_BUDGET_S:-420}"
PARITY_S="${PARITY_S:-150}"
SAMPLE_S="${SAMPLE_S:-150}"
GRPO_S="${GRPO_S:-210}"
THREADS="$(nproc)"

log() { printf '[gpu-check %(%H:%M:%S)T] %s\n' -1 "$*" | tee -a "$OUT/gpu-check.log" >&2; }
missing() { log "cannot run: $*"; exit 2; }

# ---- the machine ------------------------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || missing "no nvidia-smi: this check needs an NVIDIA GPU and its driver"
GPU="$(nvidia-smi --id=0 --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader)" ||
    missing "nvidia-smi sees no GPU"
log "GPU 0: $GPU"
# "9.0" -> 90: candle's kernels are compiled for exactly this GPU.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$(echo "$GPU" | awk -F', ' '{ gsub(/\./, "", $4); print $4 }')}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
TESTS=(local_parity grpo_parity sft_parity precision)
# The binaries (links to them when built here), the bundle's wheels, the cargo messages; emptied on each run.
WORK="${TMPDIR:-/tmp}/holo-gpu-check"
BIN="$WORK/bin"
HOLO="$BIN/holo"
SAMPLE_BENCH="$BIN/sample_bench"
rm -rf "$WORK"
mkdir -p "$BIN"

# ---- 1a. prebuilt: unpack the bundle, install its wheels, find CUDA's libraries ------------------------------
# The binaries need libcuda.so.1 (the driver) and CUDA 13's libcublas (and libcublasLt), libcurand and
# libcudart at start: the loader's own, else the first of these folders that holds one.
library_folders() {
    "$PY" -c 'import os, nvidia; print(*(os.path.join(p, "cu13", "lib") for p in nvidia.__path__), sep="\n")' \
        2>/dev/null || true
    if command -v nvcc >/dev/null; then dirname "$(dirname "$(command -v nvcc)")"/lib64; fi
    echo /usr/local/cuda/lib64
    echo /usr/local/nvidia/lib64
}
unresolved() { ldd "$1" | awk '$2 == "=>" && $3 == "not" { print $1 }' | sort -u; }
find_libraries() {
    local folders wanted folder binary
    mapfile -t folders < <(library_folders)
    for binary in "$@"; do
        while wanted="$(unresolved "$binary" | head -n 1)" && [ -n "$wanted" ]; do
            for folder in "${folders[@]}" ""; do
                [ -n "$folder" ] ||
                    missing "$(basename "$binary") needs $wanted: not on the loader's path, nor in ${folders[*]}"
                case ":${LD_LIBRARY_PATH:-}:" in *":$folder:"*) continue ;; esac
                if [ -e "$folder/$wanted" ]; then
                    export LD_LIBRARY_PATH="$folder${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                    log "$wanted from $folder"
                    break
                fi
            done
        done
    done
}

# The test executables read their fixtures below the path they were compiled in (env!("CARGO_MANIFEST_DIR")):
# that path, if absent or a link, becomes a link to this copy.
link_build_root() {
    local built here
    built="$(manifest build_root)"
    here="$(cd "$ROOT" && pwd -P)"
    [ "$built" != "$here" ] || return 0
    if [ -e "$built" ] && [ ! -L "$built" ]; then
        missing "the tests read their fixtures in $built, which exists here and is not this copy ($here)"
    fi
    if ! { mkdir -p "$(dirname "$built")" && ln -sfn "$here" "$built"; }; then
        missing "cannot link $built to $here, where the tests read their fixtures (run as root, or make the link)"
    fi
    log "linked $built -> $here (the tests' fixtures)"
}

manifest() { sed -n "s/^$1=//p" "$PREBUILT/manifest.txt"; }

prepare_prebuilt() {
    if [ ! -f "$PREBUILT/manifest.txt" ] || [ ! -f "$PREBUILT/bin.tar.xz" ]; then
        missing "$PREBUILT is not a bundle (no manifest.txt or bin.tar.xz): make one with scripts/gpu-bundle.sh"
    fi
    PREBUILT="$(cd "$PREBUILT" && pwd)"
    log "bundle: commit $(manifest commit), made $(manifest made), CUDA $(manifest cuda)," \
        "compute capability $(manifest compute_cap)"
    [ "$(manifest compute_cap)" = "$CUDA_COMPUTE_CAP" ] ||
        missing "the bundle's kernels are for compute capability $(manifest compute_cap), this GPU's is" \
            "$CUDA_COMPUTE_CAP (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP bash scripts/gpu-bundle.sh DIR)"
    read -r -a TESTS <<<"$(manifest tests)"
    PY="${PEER_PYTHON:-python3}"
    command -v "$PY" >/dev/null || missing "no Python at $PY (set PEER_PYTHON)"
    command -v ldd >/dev/null || missing "no ldd"
    log "unpacking the binaries into $BIN"
    timeout 120 "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
        "$PREBUILT/bin.tar.xz" "$BIN" 2>>"$OUT/gpu-check.log" || missing "could not unpack $PREBUILT/bin.tar.xz"
    log "installing $(cd "$PREBUILT" && echo ./*.whl) into $WORK/site"
    timeout 120 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --target "$WORK/site" "$PREBUILT"/*.whl >>"$OUT/gpu-check.log" 2>&1 ||
        missing "could not install the bundle's wheels (see $OUT/gpu-check.log)"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    if [ -x /usr/bin/time ]; then export GNU_TIME=/usr/bin/time; else export GNU_TIME="$BIN/time"; fi
    find_libraries "$HOLO" "$SAMPLE_BENCH" "${TESTS[@]/#/$BIN/}"
    link_build_root
    MODELS="$WORK/models"
    BINARIES="prebuilt: commit $(manifest commit), made $(manifest made)"
}

# ---- 1b. cargo: build here ---------------------------------------------------------------------------------------
prepare_cargo() {
    command -v cargo >/dev/null || missing "no cargo (or use --prebuilt DIR, made by scripts/gpu-bundle.sh)"
    [ -x /usr/bin/time ] || missing "no GNU time (/usr/bin/time; Debian package \`time\`)"
    if command -v nvcc >/dev/null; then
        log "using the system's $(nvcc --version | grep -o 'release [0-9.]*')"
    else
        local environment
        environment="$(bash "$ROOT/scripts/cuda-build.sh" --env)" ||
            missing "no nvcc on PATH and scripts/cuda-build.sh could not install CUDA from PyPI"
        eval "$environment"
    fi
    PY="${PEER_PYTHON:-$HOME/.cache/holo-peers/venv/bin/python}"
    if [ ! -x "$PY" ] && [ -f "$ROOT/../shared/peers/setup.sh" ]; then
        log "making the peer venv with ../shared/peers/setup.sh"
        bash "$ROOT/../shared/peers/setup.sh" 2>&1 | tee -a "$OUT/gpu-check.log" >&2 || missing "peer setup failed"
    fi
    [ -x "$PY" ] || missing "no peer Python at $PY (set PEER_PYTHON, or run ../shared/peers/setup.sh)"
    log "building with --features cuda for compute capability $CUDA_COMPUTE_CAP"
    local start=$SECONDS tests=() test
    for test in "${TESTS[@]}"; do tests+=(--test "$test"); done
    (cd "$ROOT" && cargo build --release -p holo-runtime --features cuda --bin holo --example sample_bench \
        "${tests[@]}" --message-format=json-render-diagnostics) >"$WORK/messages.json" 2>"$OUT/build.log" ||
        missing "the cuda build failed (see $OUT/build.log)"
    log "built in $((SECONDS - start)) s"
    local name path
    while read -r name path; do ln -s "$path" "$BIN/$name"; done < <(
        "$PY" "$ROOT/scripts/cargo_executables.py" "$WORK/messages.json" holo sample_bench "${TESTS[@]}")
    MODELS="$HOME/.cache/holo-peers/bench-models"
    BINARIES="built here in $((SECONDS - start)) s"
}

if [ -n "$PREBUILT" ]; then prepare_prebuilt; else prepare_cargo; fi
versions="$("$PY" -c 'import sys, torch, transformers, datasets, trl
from trl import GRPOConfig, GRPOTrainer
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "datasets", datasets.__version__, "trl", trl.__version__)
assert torch.cuda.is_available(), "torch sees no GPU"' 2>>"$OUT/gpu-check.log")" ||
    missing "$PY lacks torch with CUDA, transformers or TRL: $(tail -n 1 "$OUT/gpu-check.log") (see $OUT/gpu-check.log)"
log "$versions"

# ---- stages: each bounded by its own limit and by what is left of the budget ----------------------------------
DEADLINE=$((SECONDS + CHECK_BUDGET_S))
# allowance LIMIT_S: LIMIT_S, or what is left of the budget when that is less.
allowance() {
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# bounded LIMIT_S COMMAND...: COMMAND for at most its allowance of LIMIT_S seconds; 124 when stopped.
bounded() {
    local limit
    limit="$(allowance "$1")"
    shift
    if [ "$limit" -lt 10 ]; then
        log "skipped: no time left for it"
        return 124
    fi
    timeout -k 10 "$limit" "$@"
}
# A stage's outcome from its exit status: 0 passed, 124/137 out of time, else failed.
outcome() { case "$1" in 0) echo "$2" ;; 124|137) echo "out of time" ;; *) echo failed ;; esac; }

PARITY="not run" SAMPLE="not run" GRPO="not run"
figures() {
    "$PY" - "$OUT" "$GPU" "$BINARIES" "$PARITY" "$SAMPLE" "$GRPO" <<'PY' || log "could not write the figures"
import json, os, sys
out, gpu, binaries, parity, sample_status, grpo_status = sys.argv[1:7]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.isfile(path) else None
sample, grpo = load("sample.json"), load("grpo.json")
figures = {"gpu": gpu, "binaries": binaries, "parity": parity, "sampling_status": sample_status,
           "grpo_status": grpo_status}
lines = ["# GPU check", "", f"GPU: {gpu}", f"cuda binaries: {binaries}", f"parity tests on cuda:0: {parity}", ""]
if sample:
    (row,) = sample
    t, h = row["transformers"], row["holo"]
    figures["sampling"] = {"holo_tokens_per_s": h["new_tokens_per_s"],
                           "transformers_tokens_per_s": t["new_tokens_per_s"], "ratio": row["ratio"], "holo_peak_gpu_mib": h["peak_gpu_mib"],
                           "transformers_peak_gpu_mib": t["peak_gpu_mib"]}
    lines += ["## Sampling (Qwen2.5-0.5B shapes, batch 64, bf16)", "",
              "| | new tokens/s | peak GPU MiB |", "|---|---|---|",
              f"| transformers generate | {t['new_tokens_per_s']:.0f} | {t['peak_gpu_mib']:.0f} |",
              f"| holo | {h['new_tokens_per_s']:.0f} | {h['peak_gpu_mib']:.0f} |",
              f"| holo / transformers | {row['ratio']:.2f}× | |", ""]
else:
    lines += [f"## Sampling: {sample_status}, no figures (see sample.log)", ""]
if grpo:
    (row,) = grpo["results"]
    t, h = row["trl"], row["holo"]
    figures["grpo"] = {"trl_s_per_step": t["median_step_s"], "holo_s_per_step": h["median_step_s"],
                       "speedup": row["speedup"], "trl_peak_gpu_mib": t["peak_gpu_mib"],
                       "holo_peak_gpu_mib": h["peak_gpu_mib"], "trl_reward": t["last_reward"],
                       "holo_reward": h["last_reward"]}
    lines += [f"## GRPO (0.5B shapes, {row['steps']} steps, bf16)", "",
              "| | s/step | peak GPU MiB | reward (last steps) |", "|---|---|---|---|",
              f"| TRL | {t['median_step_s']:.3f} | {t['peak_gpu_mib']:.0f} | {t['last_reward']:+.3f} |",
              f"| holo | {h['median_step_s']:.3f} | {h['peak_gpu_mib']:.0f} | {h['last_reward']:+.3f} |",
              f"| TRL / holo | {row['speedup']:.2f}× | | |", ""]
else:
    lines += [f"## GRPO: {grpo_status}, no figures (see grpo.log)", ""]
open(os.path.join(out, "figures.md"), "w").write("\n".join(lines))
json.dump(figures, open(os.path.join(out, "figures.json"), "w"), indent=2)
PY
}
figures

cd "$ROOT"
# ---- 2. parity on the GPU ------------------------------------------------------------------------------------
log "transformers / TRL parity tests on cuda:0 (at most $(allowance "$PARITY_S") s)"
PARITY=passed
failing=()
: >"$OUT/parity.log"
parity_end=$((SECONDS + PARITY_S))
for test in "${TESTS[@]}"; do
    echo "==== $test" >>"$OUT/parity.log"
    status=0
    # From the package's folder, as cargo test runs them.
    (cd holo-runtime && HOLO_TEST_DEVICE=cuda:0 bounded $((parity_end - SECONDS)) "$BIN/$test") \
        >>"$OUT/parity.log" 2>&1 || status=$?
    result="$(outcome "$status" passed)"
    log "$test: $result"
    [ "$result" = passed ] || failing+=("$test $result")
done
if [ ${#failing[@]} -gt 0 ]; then
    PARITY="$(printf '%s, ' "${failing[@]}")"
    PARITY="not passed: ${PARITY%, }"
fi
grep -E '^test result:|FAILED|panicked' "$OUT/parity.log" | tee -a "$OUT/gpu-check.log" >&2 || true
log "parity: $PARITY"
figures

# ---- 3. sampling at batch 64 --------------------------------------------------------------------------------
log "sampling: Qwen2.5-0.5B shapes, batch 64, $SAMPLE_NEW new tokens, bf16, holo vs transformers generate" \
    "(at most $(allowance "$SAMPLE_S") s)"
status=0
bounded "$SAMPLE_S" "$PY" benches/sample_compare.py --which qwen05b --device cuda --dtype bf16 --batch 64 \
    --prompt-len 32 --new "$SAMPLE_NEW" --repeats 3 --threads "$THREADS" --work-dir "$MODELS" \
    --holo-bin "$HOLO" --sample-bench-bin "$SAMPLE_BENCH" --json "$OUT/sample.json" 2>&1 |
    tee "$OUT/sample.log" >&2 || status=$?
SAMPLE="$(outcome "$status" ok)"
log "sampling: $SAMPLE"
figures

# ---- 4. GRPO steps --------------------------------------------------------------------------------------------
log "GRPO: 0.5B shapes, $GRPO_STEPS steps of $GRPO_BATCH completions (G $GRPO_GENERATIONS), bf16, holo vs TRL" \
    "(at most $(allowance "$GRPO_S") s)"
status=0
bounded "$GRPO_S" "$PY" benches/grpo_compare.py --which qwen05b --device cuda --idle-wait 0 --seeds-05b 0 \
    --steps-05b "$GRPO_STEPS" --batch-05b "$GRPO_BATCH" --num-generations-05b "$GRPO_GENERATIONS" \
    --max-completion-length "$GRPO_COMPLETION" --threads "$THREADS" --work-dir "$MODELS" \
    --holo-bin "$HOLO" --json "$OUT/grpo.json" 2>&1 | tee "$OUT/grpo.log" >&2 || status=$?
GRPO="$(outcome "$status" ok)"
log "GRPO: $GRPO"
figures
cat "$OUT/figures.md" >&2

log "figures in $OUT/figures.md"
[ "$PARITY" = passed ] || { log "parity on the GPU: $PARITY (see $OUT/parity.log)"; exit 1; }
if [ "$SAMPLE" != ok ] || [ "$GRPO" != ok ]; then
    log "a benchmark did not finish (see $OUT/sample.log, $OUT/grpo.log)"
    exit 3
fi
