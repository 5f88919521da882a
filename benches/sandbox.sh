#!/usr/bin/env bash
# The sandbox's cost per run of model-written code: `print(1)` through the sandbox against today's
# `unshare -rn` path and a bare interpreter, and sandboxed runs per second on every core.
#   bash benches/sandbox.sh [RUNS]     (default 50 runs per figure)
# On 2 cores, timings collapse when anything else runs: measure on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# The dev profile builds dependencies optimised; the sandbox itself is system calls.
cargo run -q -p holo-runtime --example sandbox_bench -- "${1:-50}"
