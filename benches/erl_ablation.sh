#!/usr/bin/env bash
# ERL ablation on `holo demo`'s task (#12): GRPO against ERL, with and without its memory and its
# internalization, from the same warmed-up model, on the same problems, with the same options, budget and
# seed. Prints each run's held-out first-attempt accuracy (at the first and the last evaluation) and its
# training time (the sum of `step_time`: sampling, updates; evaluations excluded).
#
#   cargo build --release -p holo-runtime --bin holo
#   benches/erl_ablation.sh [OUT_DIR]        # SEEDS="0 1 2" STEPS=300 by default
#
# GRPO is `holo demo` itself (hol/arithmetic.hol); its run folder holds the warmed-up model
# (`warmup/`), the problems (`problems/train.jsonl`, `problems/heldout.jsonl`) and its options (`config.toml`), which the
# ERL runs reuse with benches/erl_arithmetic.hol and `--erl true`. Accuracy is
# `eval/rewards/math_answer/mean` for GRPO and `eval/rewards/first/mean` (the first attempt, without
# reflection or retry: what the model does when deployed) for ERL.
set -euo pipefail
cd "$(dirname "$0")/.."
HOLO=${HOLO:-target/release/holo}
OUT=${1:-runs/erl-ablation}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-300}
[ -x "$HOLO" ] || { echo "build it first: cargo build --release -p holo-runtime --bin holo" >&2; exit 2; }

for seed in $SEEDS; do
    base="$OUT/seed-$seed"
    mkdir -p "$base"
    if [ ! -f "$base/grpo/metrics.jsonl" ]; then
        echo "seed $seed: holo demo (log: $base.grpo.log)" >&2
        "$HOLO" demo --seed "$seed" --grpo-steps "$STEPS" --out "$base/grpo" >"$base.grpo.log" 2>&1
    fi
    for variant in erl erl-no-memory erl-no-internalization; do
        [ -f "$base/$variant/metrics.jsonl" ] && continue
        case $variant in
            erl) flags=() ;;
            erl-no-memory) flags=(--enable-memory false) ;;
            erl-no-internalization) flags=(--enable-internalization false) ;;
        esac
        echo "seed $seed: $variant (log: $base.$variant.log)" >&2
        "$HOLO" train benches/erl_arithmetic.hol --model "$base/grpo/warmup" \
            --data "$base/grpo/problems/train.jsonl" --eval-data "$base/grpo/problems/heldout.jsonl" \
            --config "$base/grpo/config.toml" --out "$base/$variant" --erl true "${flags[@]}" \
            >"$base.$variant.log" 2>&1
    done
done

python3 - "$OUT" $SEEDS <<'PY'
import json, sys, statistics
out, seeds = sys.argv[1], sys.argv[2:]
runs = [("grpo", "eval/rewards/math_answer/mean"), ("erl", "eval/rewards/first/mean"),
        ("erl-no-memory", "eval/rewards/first/mean"), ("erl-no-internalization", "eval/rewards/first/mean")]
print(f"{'run':<24} {'seed':>4} {'start':>7} {'end':>7} {'train s':>8}  extra")
summary = {}
for name, key in runs:
    for seed in seeds:
        lines = [json.loads(l) for l in open(f"{out}/seed-{seed}/{name}/metrics.jsonl")]
        evals = [l for l in lines if key in l]
        train = sum(l.get("step_time", 0.0) for l in lines)
        extra = ""
        if name != "grpo":
            last = [l for l in lines if "erl/retry_ratio" in l][-1]
            extra = (f"retry {last['erl/retry_ratio']:.2f}, improved {last['erl/improved_ratio']:.2f}, "
                     f"memory {last.get('erl/memory_size', 0):.0f}, internalized {last['erl/internalized']:.0f}, "
                     f"eval retry accuracy {evals[-1].get('eval/rewards/second/mean', float('nan')):.3f}")
        print(f"{name:<24} {seed:>4} {evals[0][key]:>7.3f} {evals[-1][key]:>7.3f} {train:>8.0f}  {extra}")
        summary.setdefault(name, []).append((evals[-1][key], train))
print()
for name, values in summary.items():
    accuracy = statistics.mean(v[0] for v in values)
    seconds = statistics.mean(v[1] for v in values)
    print(f"{name:<24} mean held-out first-attempt accuracy {accuracy:.3f}, mean training time {seconds:.0f} s")
PY
