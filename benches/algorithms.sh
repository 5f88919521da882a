#!/usr/bin/env bash
# GRPO against PPO against GRPO with a curriculum and dynamic sampling, on `holo demo`'s task (#17): the same
# warmed-up model, problems, rollouts per step (64), steps, learning rate and seed. Prints each run's held-out
# accuracy (at the first and the last evaluation) and its training time (the sum of `step_time`: sampling
# and updates; evaluations excluded), then the means over seeds.
#
#   cargo build --release -p holo-runtime --bin holo
#   benches/algorithms.sh [OUT_DIR]        # SEEDS="0 1 2" STEPS=300 by default
#
# GRPO is `holo demo` itself (hol/arithmetic.hol, G = 8 × 8 rows per step); its run folder holds the
# warmed-up model (`warmup/`), the problems and its options (`config.toml`), which the other runs reuse:
# - ppo: `--algorithm ppo`, one rollout per row (64 rows per step; evaluated with G = 8 as the others), 4 PPO
#   epochs, kl_coef = the demo's beta;
# - grpo-curriculum: the training rows get a `difficulty` column (1: the ones digits do not carry, 2: they
#   do), served easiest first (the carries join when the mean reward of 8 groups reaches 1.1, about 90%
#   right: the reward is math_answer + 0.2 × format), with DAPO's dynamic sampling; CURRICULUM_FLAGS adds
#   options (`--curriculum-cumulative false` serves the carries alone once they start).
# Accuracy is `eval/rewards/math_answer/mean` (held-out problems, the demo's G samples each).
set -euo pipefail
cd "$(dirname "$0")/.."
HOLO=${HOLO:-target/release/holo}
OUT=${1:-runs/algorithms}
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
    python3 - "$base/grpo/problems/train.jsonl" "$base/levels.jsonl" <<'PY'
import json, re, sys
with open(sys.argv[1]) as rows, open(sys.argv[2], "w") as out:
    for line in rows:
        row = json.loads(line)
        a, b = map(int, re.search(r"(\d+)\s*\+\s*(\d+)", row["question"]).groups())
        row["difficulty"] = 2 if a % 10 + b % 10 >= 10 else 1
        out.write(json.dumps(row) + "\n")
PY
    for variant in ppo grpo-curriculum; do
        [ -f "$base/$variant/metrics.jsonl" ] && continue
        data="$base/grpo/problems/train.jsonl"
        case $variant in
            ppo) flags=(--algorithm ppo --num-generations 1 --num-generations-eval 8 --num-ppo-epochs 4
                        --kl-coef 0.04) ;;
            grpo-curriculum)
                data="$base/levels.jsonl"
                flags=(--difficulty-column difficulty --curriculum-window 8 --curriculum-threshold 1.1
                       --dynamic-sampling --max-num-gen-batches 3 ${CURRICULUM_FLAGS:-}) ;;
        esac
        echo "seed $seed: $variant (log: $base.$variant.log)" >&2
        "$HOLO" train hol/arithmetic.hol --model "$base/grpo/warmup" --data "$data" \
            --eval-data "$base/grpo/problems/heldout.jsonl" --config "$base/grpo/config.toml" \
            --out "$base/$variant" "${flags[@]}" >"$base.$variant.log" 2>&1
    done
done

python3 - "$OUT" $SEEDS <<'PY'
import json, sys, statistics
out, seeds = sys.argv[1], sys.argv[2:]
key = "eval/rewards/math_answer/mean"
print(f"{'run':<16} {'seed':>4} {'start':>7} {'end':>7} {'train s':>8}")
summary = {}
for name in ("grpo", "ppo", "grpo-curriculum"):
    for seed in seeds:
        lines = [json.loads(l) for l in open(f"{out}/seed-{seed}/{name}/metrics.jsonl")]
        evals = [l for l in lines if key in l]
        train = sum(l.get("step_time", 0.0) for l in lines)
        print(f"{name:<16} {seed:>4} {evals[0][key]:>7.3f} {evals[-1][key]:>7.3f} {train:>8.0f}")
        summary.setdefault(name, []).append((evals[-1][key], train))
print()
for name, values in summary.items():
    accuracy = statistics.mean(v[0] for v in values)
    seconds = statistics.mean(v[1] for v in values)
    print(f"{name:<16} mean held-out accuracy {accuracy:.3f}, mean training time {seconds:.0f} s")
PY
