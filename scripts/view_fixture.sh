#!/bin/sh
# Writes holo-runtime/tests/fixtures/view/run/, the run folder `holo-runtime/tests/cli/view_cli.rs` views: two
# GRPO steps of the tiny Qwen2 (tests/fixtures/models/qwen2) on tests/fixtures/view/view.hol, 2 rows x 4
# rollouts a step, replies capped at 12 tokens (so some are truncated), one row without `expected` (so its
# rollouts fail), evaluated on 2 held-out rows at steps 0 and 2. Kept: the rollouts, eval_rollouts,
# metrics and config (a few tens of KB); not the checkpoints, TensorBoard events, plots or run.json (which
# names this machine's model path). Deterministic: the same build writes the same rollouts.
#
# From the repository root (honours CARGO_TARGET_DIR):
#
#     sh scripts/view_fixture.sh
set -eu
cd "$(dirname "$0")/.."
FIXTURES=holo-runtime/tests/fixtures
OUT=$FIXTURES/view/run
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cargo run -q -p holo-runtime --bin holo -- train "$FIXTURES/view/view.hol" \
    --model "$FIXTURES/models/qwen2" \
    --data "$FIXTURES/view/rows.jsonl" \
    --eval-data "$FIXTURES/view/eval.jsonl" \
    --out "$WORK/run" \
    --max-steps 2 --num-generations 4 --per-device-train-batch-size 8 \
    --num-generations-eval 2 --eval-steps 2 --eval-on-start true \
    --max-completion-length 12 --save-steps 100 --seed 3

rm -rf "$OUT"
mkdir -p "$OUT"
for file in rollouts.jsonl eval_rollouts.jsonl metrics.jsonl config.toml; do
    cp "$WORK/run/$file" "$OUT/$file"
done
# Wall-clock times differ from run to run; the viewer shows them when present, the fixture needs none.
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ["rollouts.jsonl", "eval_rollouts.jsonl"]:
    path = out / name
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:
        record.pop("timing", None)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
metrics = out / "metrics.jsonl"
rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
for row in rows:
    row.pop("step_time", None)
metrics.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
PY
du -sh "$OUT"
