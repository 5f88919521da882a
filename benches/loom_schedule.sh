#!/usr/bin/env bash
# Rollouts/s of hol/tool.hol multi-turn rollouts with the local model: this checkout's `holo` against one
# built before continuous batching (the Loom's lock-step ticks), on the same model, data and seed.
#
#     benches/loom_schedule.sh MODEL [BEFORE_HOLO]
#
# MODEL: a model folder or a Qwen2/Llama .gguf (scripts/fetch_smollm2.py gets SmolLM2-135M-Instruct).
# BEFORE_HOLO: a `holo` binary from before the scheduler; without it the script builds commit
# ab92f72^ in a temporary worktree (release, its own target folder: several minutes).
# Rollouts are sampled at temperature 1 with up to 8 turns each, so their lengths differ: a tool call and
# its answer, or an answer at once, short or long. Prints rollouts/s of both and the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."

model=${1:?usage: benches/loom_schedule.sh MODEL [BEFORE_HOLO]}
before=${2:-}
rows=${ROWS:-examples/data/wordproblems/train.jsonl}
generations=${G:-4}
concurrency=${CONCURRENCY:-64}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cargo build -q --release -p holo-runtime --bin holo
after=target/release/holo
if [[ -z "$before" ]]; then
    git worktree add -q "$work/before" ab92f72^
    (cd "$work/before" && CARGO_TARGET_DIR="$work/target" cargo build -q --release -p holo-runtime --bin holo)
    before="$work/target/release/holo"
fi
# Samples capped at 96 tokens, so that a run takes minutes; otherwise hol/tool.hol as it is.
python3 - "$work/tool.hol" <<'HOL'
import sys
text = open("hol/tool.hol").read()
capped = text.replace('<|@_@:turn stop="</tool>"|>', '<|@_@:turn stop="</tool>" max_tokens=96|>')
assert capped != text, "hol/tool.hol changed: update benches/loom_schedule.sh"
open(sys.argv[1], "w").write(capped)
HOL
# tool.hol asks `query`; the word problems say `question`.
head -n "${LIMIT:-8}" "$rows" | python3 -c '
import json, sys
for line in sys.stdin:
    row = json.loads(line)
    row["query"] = row.pop("question", row.get("query"))
    print(json.dumps(row))' > "$work/rows.jsonl"

run() {
    local holo=$1 out=$2
    local started ended
    started=$(date +%s.%N)
    "$holo" eval "$work/tool.hol" --data "$work/rows.jsonl" -n "$generations" --sampler local --model "$model" \
        --concurrency "$concurrency" --seed 0 --out "$out" > "$out.summary"
    ended=$(date +%s.%N)
    local rollouts
    rollouts=$(wc -l < "$out")
    python3 -c "print(f'{$rollouts / ($ended - $started):.3f}')"
}

echo "tool.hol, $(wc -l < "$work/rows.jsonl") rows x $generations rollouts, concurrency $concurrency, model $model"
rate_before=$(run "$before" "$work/before.jsonl")
echo "before (lock-step ticks): $rate_before rollouts/s"
rate_after=$(run "$after" "$work/after.jsonl")
echo "after (continuous batching): $rate_after rollouts/s"
python3 - "$work/before.jsonl" "$work/after.jsonl" <<'EOF'
import json, sys
for name, path in (("before", sys.argv[1]), ("after", sys.argv[2])):
    records = [json.loads(line) for line in open(path)]
    samples = [r["samples"] for r in records]
    print(f"{name}: {len(records)} rollouts, samples per rollout {min(samples)}..{max(samples)} "
          f"(mean {sum(samples) / len(samples):.2f}), mean reward {sum(r['reward'] for r in records) / len(records):.3f}")
EOF
python3 -c "print(f'continuous / lock-step = {$rate_after / $rate_before:.2f}x')"
if [[ -d "$work/before" ]]; then git worktree remove --force "$work/before"; fi
