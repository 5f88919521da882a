#!/usr/bin/env bash
# The GPU check, unattended, on a machine with an NVIDIA GPU (docs/cuda.md):
#
#   1. builds holo-runtime with `--features cuda` for this GPU's compute capability;
#   2. runs the transformers / TRL parity tests on the GPU (HOLO_TEST_DEVICE=cuda:0; f32, the fixtures'
#      precision): local_parity, grpo_parity, sft_parity;
#   3. samples the Qwen2.5-0.5B-shaped model at batch 64 in bf16 against transformers `generate` on the same
#      GPU (benches/sample_compare.py --device cuda): new tokens per second, peak GPU memory;
#   4. runs GRPO steps on the 0.5B-shaped model in bf16 against TRL's GRPOTrainer on the same GPU
#      (benches/grpo_compare.py --device cuda): seconds per step, peak GPU memory, rewards.
#
#     bash scripts/gpu-check.sh [OUT_DIR]        # default: gpu-check-<date> in the current folder
#
# Writes OUT_DIR/figures.md (the summary), figures.json, and each stage's log and JSON. Exits 1 when a parity
# test fails (the benchmarks still run, so the figures are there), 2 when the machine lacks what it needs,
# 3 when a benchmark fails.
#
# What it needs: `nvidia-smi` and the driver; cargo; the CUDA toolkit, either `nvcc` on PATH (the
# system's) or PyPI to install it (scripts/cuda-build.sh, CUDA 13.0, which needs driver 580 or later);
# the Python peers' venv with torch (CUDA build), transformers and TRL: $PEER_PYTHON, else
# ~/.cache/holo-peers/venv/bin/python, made by ../shared/peers/setup.sh when that script is there (PyPI
# again); GNU time (/usr/bin/time). Settings: SAMPLE_NEW (128 new tokens per row), GRPO_STEPS (6),
# GRPO_BATCH (32), GRPO_GENERATIONS (8), GRPO_COMPLETION (64 tokens).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SAMPLE_NEW="${SAMPLE_NEW:-128}"
GRPO_STEPS="${GRPO_STEPS:-6}"
GRPO_BATCH="${GRPO_BATCH:-32}"
GRPO_GENERATIONS="${GRPO_GENERATIONS:-8}"
GRPO_COMPLETION="${GRPO_COMPLETION:-64}"
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
command -v cargo >/dev/null || missing "no cargo"
[ -x /usr/bin/time ] || missing "no GNU time (/usr/bin/time; Debian package \`time\`)"

# ---- the CUDA toolkit: the system's nvcc, else the pinned one from PyPI ----------------------------------
if command -v nvcc >/dev/null; then
    log "using the system's $(nvcc --version | grep -o 'release [0-9.]*')"
else
    environment="$(bash "$ROOT/scripts/cuda-build.sh" --env)" ||
        missing "no nvcc on PATH and scripts/cuda-build.sh could not install CUDA from PyPI"
    eval "$environment"
fi

# ---- the Python peer ----------------------------------------------------------------------------------------
PY="${PEER_PYTHON:-$HOME/.cache/holo-peers/venv/bin/python}"
if [ ! -x "$PY" ] && [ -f "$ROOT/../shared/peers/setup.sh" ]; then
    log "making the peer venv with ../shared/peers/setup.sh"
    bash "$ROOT/../shared/peers/setup.sh" 2>&1 | tee -a "$OUT/gpu-check.log" >&2 || missing "peer setup failed"
fi
[ -x "$PY" ] || missing "no peer Python at $PY (set PEER_PYTHON, or run ../shared/peers/setup.sh)"
"$PY" -c 'import torch, transformers, trl; assert torch.cuda.is_available(), "torch sees no GPU"' \
    2>>"$OUT/gpu-check.log" || missing "the peer Python lacks torch with CUDA, transformers or TRL (see $OUT/gpu-check.log)"
export PYTHONUNBUFFERED=1

cd "$ROOT"
# ---- 1. build ----------------------------------------------------------------------------------------------
log "building with --features cuda for compute capability $CUDA_COMPUTE_CAP"
start=$SECONDS
cargo build --release -p holo-runtime --features cuda --bin holo --example sample_bench >"$OUT/build.log" 2>&1 ||
    missing "the cuda build failed (see $OUT/build.log)"
BUILD_S=$((SECONDS - start))
log "built in $BUILD_S s"

# ---- 2. parity on the GPU ------------------------------------------------------------------------------------
log "transformers / TRL parity tests on cuda:0"
PARITY=passed
HOLO_TEST_DEVICE=cuda:0 cargo test --release -p holo-runtime --features cuda \
    --test local_parity --test grpo_parity --test sft_parity >"$OUT/parity.log" 2>&1 || PARITY=failed
grep -E '^test result:|FAILED|panicked' "$OUT/parity.log" | tee -a "$OUT/gpu-check.log" >&2
log "parity: $PARITY"

# ---- 3. sampling at batch 64 --------------------------------------------------------------------------------
BENCH=ok
log "sampling: Qwen2.5-0.5B shapes, batch 64, $SAMPLE_NEW new tokens, bf16, holo vs transformers generate"
"$PY" benches/sample_compare.py --which qwen05b --device cuda --dtype bf16 --batch 64 --prompt-len 32 \
    --new "$SAMPLE_NEW" --repeats 3 --threads "$THREADS" --json "$OUT/sample.json" 2>&1 |
    tee "$OUT/sample.log" >&2 || BENCH=failed

# ---- 4. GRPO steps --------------------------------------------------------------------------------------------
log "GRPO: 0.5B shapes, $GRPO_STEPS steps of $GRPO_BATCH completions (G $GRPO_GENERATIONS), bf16, holo vs TRL"
"$PY" benches/grpo_compare.py --which qwen05b --device cuda --idle-wait 0 --seeds-05b 0 \
    --steps-05b "$GRPO_STEPS" --batch-05b "$GRPO_BATCH" --num-generations-05b "$GRPO_GENERATIONS" \
    --max-completion-length "$GRPO_COMPLETION" --threads "$THREADS" --json "$OUT/grpo.json" 2>&1 |
    tee "$OUT/grpo.log" >&2 || BENCH=failed

# ---- figures ------------------------------------------------------------------------------------------------------
"$PY" - "$OUT" "$GPU" "$PARITY" "$BUILD_S" <<'PY'
import json, os, sys
out, gpu, parity, build_s = sys.argv[1:5]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.isfile(path) else None
sample, grpo = load("sample.json"), load("grpo.json")
figures = {"gpu": gpu, "parity": parity, "build_s": int(build_s)}
lines = [f"# GPU check", "", f"GPU: {gpu}", f"cuda build: {build_s} s", f"parity tests on cuda:0: {parity}", ""]
if sample:
    (row,) = sample
    t, h = row["transformers"], row["holo"]
    figures["sampling"] = {"holo_tokens_per_s": h["new_tokens_per_s"], "transformers_tokens_per_s": t["new_tokens_per_s"],
                           "ratio": row["ratio"], "holo_peak_gpu_mib": h["peak_gpu_mib"],
                           "transformers_peak_gpu_mib": t["peak_gpu_mib"]}
    lines += ["## Sampling (Qwen2.5-0.5B shapes, batch 64, bf16)", "",
              "| | new tokens/s | peak GPU MiB |", "|---|---|---|",
              f"| transformers generate | {t['new_tokens_per_s']:.0f} | {t['peak_gpu_mib']:.0f} |",
              f"| holo | {h['new_tokens_per_s']:.0f} | {h['peak_gpu_mib']:.0f} |",
              f"| holo / transformers | {row['ratio']:.2f}× | |", ""]
else:
    lines += ["## Sampling: no figures (see sample.log)", ""]
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
    lines += ["## GRPO: no figures (see grpo.log)", ""]
open(os.path.join(out, "figures.md"), "w").write("\n".join(lines))
json.dump(figures, open(os.path.join(out, "figures.json"), "w"), indent=2)
print("\n".join(lines))
PY

log "figures in $OUT/figures.md"
[ "$PARITY" = passed ] || { log "a parity test failed on the GPU (see $OUT/parity.log)"; exit 1; }
[ "$BENCH" = ok ] || { log "a benchmark failed (see $OUT/sample.log, $OUT/grpo.log)"; exit 3; }
