#!/usr/bin/env bash
# The slow run of the kill-at-any-moment harness (holo-runtime/tests/kill/): TRIALS trials per trainer
# (default 50; `cargo test` runs 3) of `holo train` (GRPO, PPO, ERL) and `holo sft` killed at random
# instants and at the kill points inside checkpoint writes, resumed until they finish, each compared with
# the uninterrupted run. Built in release. Prints per trainer: trials, kills that landed (and those inside
# a checkpoint write), resumes, failures; exits non-zero when a trial failed (its plan is in the log).
#
#     bash scripts/kill-trials.sh [TRIALS]
set -euo pipefail
cd "$(dirname "$0")/.."
trials="${1:-50}"
case "$trials" in
'' | *[!0-9]*)
    echo "usage: bash scripts/kill-trials.sh [TRIALS]  (a number of trials per trainer)" >&2
    exit 2
    ;;
esac
log="${CARGO_TARGET_DIR:-target}/tmp/kill-trials.log"
mkdir -p "$(dirname "$log")"
started=$SECONDS
status=0
HOLO_KILL_TRIALS="$trials" cargo test --release -p holo-runtime --test kill -- --nocapture >"$log" 2>&1 ||
    status=$?
echo "kill trials, $trials per trainer, release build ($((SECONDS - started)) s with the build; the whole output is in $log):"
if ! grep '^kill-trials ' "$log"; then
    tail -n 40 "$log" >&2
fi
grep -E '^test .* \.\.\. FAILED$|^test result:' "$log" || true
exit "$status"
